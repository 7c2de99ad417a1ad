"""One packing group, without Spark: the result does not depend on how rows arrive."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mmpack_udfs.config import load_config
from mmpack_udfs.stages import pack
from tests.mmpack_udfs.test_shards import tokenized_rows


def packed(rows: pa.Table, root) -> list[tuple[str, str]]:
    config = load_config(None, ["pack.budget=900", "pack.bins_per_shard=4", "pack.embed_media=false"])
    settings = pack.PackSettings.from_config(config)
    result = pack.pack_group(rows, 7, settings, str(root), "shards/t", None).to_pylist()[0]
    assert result["rows_in"] == rows.num_rows == result["packed_rows"]
    return [(s["path"], s["sha256"]) for s in result["shards"]]


def test_arrival_order_and_batching_do_not_change_the_shards(tmp_path):
    rows = tokenized_rows(120, seed=4)
    reference = packed(rows, tmp_path / "a")
    assert len(reference) > 1
    for seed in (1, 2):
        order = np.random.default_rng(seed).permutation(rows.num_rows)
        shuffled = rows.take(pa.array(order))
        rebatched = pa.Table.from_batches(shuffled.to_batches(max_chunksize=17))
        assert packed(rebatched, tmp_path / f"b{seed}") == reference
