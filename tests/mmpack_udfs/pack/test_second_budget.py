"""The second per-bin budget's sizes, per tokenized row: pure Arrow, no Spark."""

from __future__ import annotations

import pyarrow as pa

from mmpack_udfs import schemas
from mmpack_udfs.pack.stage import audio_tokens

MEDIA = pa.list_(schemas.TOKENIZED_MEDIA)


def item(kind: str, tokens: int) -> dict:
    return {"kind": kind, "num_tokens": tokens}


def test_audio_tokens_sum_each_rows_clips_and_nothing_else():
    media = [
        [item("audio", 32), item("image", 64), item("audio", 27)],
        [],
        [item("video", 90)],
        [item("audio", 5)],
    ]
    rows = pa.table({"media": pa.array(media, MEDIA)})
    assert audio_tokens(rows).tolist() == [59, 0, 0, 5]
    # a slice of chunks (Spark's batches): list offsets that do not start at 0
    chunked = pa.table({"media": pa.chunked_array([pa.array(media[:1], MEDIA), pa.array(media, MEDIA)[1:]])})
    assert audio_tokens(chunked.slice(1)).tolist() == [0, 0, 5]
