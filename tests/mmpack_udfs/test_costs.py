"""Per-bin cost figures from hand-made bins (pure pyarrow, no Spark)."""

from __future__ import annotations

import pyarrow as pa

from mmpack_udfs import costs, schemas

MEDIA = pa.struct([(name, pa.int32()) for name in costs.MEDIA_FIELDS])


def bins(media: list[list[dict]]) -> pa.Table:
    n = len(media)
    return pa.table(
        {
            "num_tokens": pa.array([100 * (i + 1) for i in range(n)], pa.int32()),
            "sum_sq_lengths": pa.array([1000 * (i + 1) for i in range(n)], pa.int64()),
            "vision_patches": pa.array(
                [4 * sum(m["num_tokens"] for m in items) for items in media], pa.int64()
            ),
            "supervised_tokens": pa.array([7] * n, pa.int32()),
            "media": pa.array(media, pa.list_(MEDIA)),
        }
    )


def test_qwen2_vl_attends_per_temporal_patch():
    image = {"grid_t": 1, "grid_h": 4, "grid_w": 6, "num_tokens": 6}
    video = {"grid_t": 3, "grid_h": 2, "grid_w": 2, "num_tokens": 3}
    index = costs.bin_costs(bins([[image, video], []]), shard=5, profile={"kind": "qwen2_vl"})
    assert index.schema.equals(schemas.COST_INDEX)
    assert index.to_pylist() == [
        {"shard": 5, "row": 0, "tokens": 100, "sum_sq_lengths": 1000, "media_items": 2,
         "vision_patches": 36, "vision_sq_patches": 1 * 24**2 + 3 * 4**2, "supervised_tokens": 7},
        {"shard": 5, "row": 1, "tokens": 200, "sum_sq_lengths": 2000, "media_items": 0,
         "vision_patches": 0, "vision_sq_patches": 0, "supervised_tokens": 7},
    ]  # fmt: skip


def test_internvl_attends_per_tile():
    profile = {"kind": "internvl", "image": {"tokens_per_tile": 256}}
    three_tiles = {"grid_t": 1, "grid_h": 1, "grid_w": 2, "num_tokens": 3 * 256}  # 1 × 2 + thumbnail
    index = costs.bin_costs(bins([[three_tiles]]), shard=0, profile=profile)
    assert index.column("vision_sq_patches").to_pylist() == [3 * 1024**2]
    assert index.column("media_items").to_pylist() == [1]
