"""Per-bin cost figures from hand-made bins (pure pyarrow, no Spark)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from mmpack_udfs import config, schemas
from mmpack_udfs.pack import costs

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


def test_llava_onevision_attends_per_crop():
    profile = {"kind": "llava_onevision", "image": {"tokens_per_crop": 729}}
    anyres = {"grid_t": 1, "grid_h": 2, "grid_w": 3, "num_tokens": 5000}  # the whole image + 2 × 3 tiles
    in_set = {"grid_t": 1, "grid_h": 0, "grid_w": 0, "num_tokens": 730}  # one padded-square crop
    video = {"grid_t": 4, "grid_h": 0, "grid_w": 0, "num_tokens": 4 * 196 + 1}  # a crop per frame
    index = costs.bin_costs(bins([[anyres], [in_set, video]]), shard=0, profile=profile)
    assert index.column("vision_sq_patches").to_pylist() == [7 * 729**2, 5 * 729**2]


MODEL = costs.CostModel(llm_token=2.0, llm_pair=0.5, vision_patch=3.0, vision_pair=0.25)


def test_the_cost_model_prices_both_phases_of_each_bin():
    index = {
        "tokens": [10, 20],
        "sum_sq_lengths": [100, 400],
        "vision_patches": [0, 8],
        "vision_sq_patches": [0, 64],
    }
    vision, llm = MODEL.phases(index)
    assert vision.tolist() == [0.0, 3 * 8 + 0.25 * 64]
    assert llm.tolist() == [2 * 10 + 0.5 * 100, 2 * 20 + 0.5 * 400]


def test_every_profile_has_a_flop_derived_default_model_and_numbers_given_as_text_count():
    defaults = config.load_config()
    qwen = costs.CostModel.for_profile(defaults, "qwen2_vl")
    assert qwen.llm_token == pytest.approx(6 * 6.5e9, rel=0.05)  # 6 × parameters of a 7B LLM
    assert qwen.vision_pair == pytest.approx(12 * 32 * 1280, rel=0.01)  # 12 × layers × width
    overridden = config.load_config(overrides=["balance.cost_model.internvl.vision_patch=1e9"])
    assert costs.CostModel.for_profile(overridden, "internvl").vision_patch == 1e9


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("balance.cost_model.qwen2_vl.llm_token=-1", "llm_token must be a finite number >= 0"),
        ("balance.cost_model.qwen2_vl.llm_token=lots", "llm_token must be a finite number"),
        ("balance.cost_model.mine={llm_token: 1}", "'llm_pair' is required"),
    ],
)
def test_a_bad_cost_model_is_a_config_error_naming_the_key(override, message):
    with pytest.raises(config.ConfigError, match=f"balance.cost_model.(qwen2_vl|mine)[.:] ?{message}"):
        config.load_config(overrides=[override])


def test_the_order_key_keeps_bins_of_similar_cost_in_both_phases_together():
    rng = np.random.default_rng(0)
    vision, llm = rng.lognormal(20, 1, 4000), rng.lognormal(30, 0.3, 4000)
    order = np.argsort(costs.order_key(vision, llm))
    step_vision = np.abs(np.diff(np.log(vision[order])))
    step_llm = np.abs(np.diff(np.log(llm[order])))
    shuffled = rng.permutation(4000)
    assert np.median(step_vision) < 0.1 * np.median(np.abs(np.diff(np.log(vision[shuffled]))))
    assert np.median(step_llm) < 0.1 * np.median(np.abs(np.diff(np.log(llm[shuffled]))))


def test_stratified_row_groups_hold_one_bin_of_every_stratum_and_neighbours_are_alike():
    key = np.random.default_rng(1).permutation(32 * 10 + 5)  # distinct keys: rank = key
    order = costs.stratified_order(key, 32)
    assert sorted(order.tolist()) == list(range(len(key)))  # every bin once
    ranks = np.argsort(np.argsort(key))  # cost rank of each bin
    strata = np.sort(ranks[order[:320]].reshape(10, 32), axis=1)  # full row groups, as written
    steps = np.diff(strata, axis=0)  # row group i+1 vs i, stratum by stratum
    assert ((steps >= 1) & (steps <= 2)).all()  # one rank up (two past a remainder bin)
    assert (strata[:, 0] < 11).all() and (strata[:, -1] > 310).all()  # each spans the range
    assert costs.bit_reversed(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
