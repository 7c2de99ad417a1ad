"""The GLM-V line (``glm4v``, ``glm4v_moe``, ``glm46v``, ``glm_ocr``) from its model directories,
against transformers on the same files (tests/oracles/glm_v.py): every tokenized sample's ids,
labels, grids, frame indices and pad counts; every packed sample's pixels (images and video
frames, handed to the vision tower as images in token order) and positions (the model's own
``get_rope_index``); and tiny random GLM-4.1V-style and GLM-4.5V (MoE) models give each packed
sample the logits and loss it gets alone, under SDPA, eager and ``mmpack_varlen``, while the
same batch without its text position row (transformers then finds no sample boundaries) does
not. One Spark run per directory, shared by its tests (tests/conftest.py ``family_run``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed
from mmpack_udfs.validate import stage as validate
from tests.conftest import PARITY_BUDGET
from tests.integration.test_family_tokens import prepared_run, runs_with_references  # noqa: F401 (a fixture)
from tests.loader.test_model_parity import (
    KERNEL_CALLS,
    assert_each_sample_alone,
    register_attentions,
    text_calls,
    vision_boundaries,
    with_attention,
)
from tests.models.build import tiny_models
from tests.oracles import glm_v as oracle

pytestmark = pytest.mark.spark

GLM_MODELS = ("glm46v", "glm4v_moe", "glm_ocr", "glm4v")


@pytest.fixture(scope="module")
def glm(family_run, tmp_path_factory):
    """Per directory: the run, its tokenized rows and transformers' reference of every row."""
    return runs_with_references(family_run, oracle, tmp_path_factory)


@pytest.mark.parametrize("name", GLM_MODELS)
def test_every_sample_has_the_ids_labels_grids_and_frames_transformers_gives(glm, name):
    run, rows, refs, videos = glm(name)
    assert run.ctx.config.profile.kind == "glm4v"
    assert len(rows) >= 40 and any(m["kind"] == "video" for r in rows for m in r["media"])
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        images = [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in row["media"] if m["kind"] == "image"]
        assert images == ref["image_grid_thw"]
        clips = [m for m in row["media"] if m["kind"] == "video"]
        assert [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in clips] == ref["video_grid_thw"]
        for m in clips:
            assert m["frame_indices"] == videos[m["uri"]]["frame_indices"]
    supervised_ends = [r["labels"][-1] for r in rows]
    assert set(supervised_ends) == {rows[0]["input_ids"][-1]}  # every sample closed by a supervised <|user|>


@pytest.mark.parametrize("name", ["glm46v", "glm4v_moe"])
def test_packed_samples_have_transformers_pixels_and_positions(glm, name):
    run, _, refs, _ = glm(name)
    model = tiny_models().tiny_model(name)
    checked = {"image": 0, "video": 0, "positions": 0}
    for bin_ in PackedDataset(str(run.output / "packed"), shuffle=False):
        batch = collate_packed([bin_])
        assert "pixel_values_videos" not in batch  # videos reach the tower as images
        cu, row = batch.meta["cu_seq_lens"], 0
        for s, sample_id in enumerate(bin_["sample_ids"]):
            ref = refs[sample_id]
            ids = batch["input_ids"][0, cu[s] : cu[s + 1]].tolist()
            assert ids == ref["input_ids"]
            positions = batch["position_ids"][1:, 0, cu[s] : cu[s + 1]].numpy()
            np.testing.assert_array_equal(positions, oracle.rope_index(model, ids, ref))
            checked["positions"] += 1
            for kind, pixels, _ in ref["items"]:
                rows = len(pixels)
                np.testing.assert_allclose(
                    batch["pixel_values"][row : row + rows].numpy(), pixels, rtol=0, atol=1e-6
                )
                row += rows
                checked[kind] += 1
        assert "pixel_values" not in batch or row == len(batch["pixel_values"])
    assert checked["image"] >= 20 and checked["video"] >= 3 and checked["positions"] >= 40, checked


@pytest.fixture(scope="module")
def micro_batches(glm, family_run):
    """Per model type: small multi-sample bins (read once for every attention): a bin with a video
    beside one with images, a bin holding a sample with both (which transformers alone cannot
    run: see ``alone``), and one more image bin."""
    cache = {}

    def get(name: str) -> tuple[list[list[dict]], dict]:
        if name not in cache:
            refs = glm(name)[2]
            bins = [
                b
                for b in PackedDataset(str(family_run(name, PARITY_BUDGET).output / "packed"), shuffle=False)
                if len(b["sample_ids"]) > 1
            ]
            bins.sort(key=lambda b: len(b["input_ids"]))

            def kinds(bin_) -> set[str]:
                return {kind for s in bin_["sample_ids"] for kind, _, _ in refs[s]["items"]}

            def mixed(bin_) -> bool:
                return any(len({k for k, _, _ in refs[s]["items"]}) == 2 for s in bin_["sample_ids"])

            video = next(b for b in bins if "video" in kinds(b) and not mixed(b))
            both = next(b for b in bins if mixed(b))
            images = [b for b in bins if kinds(b) == {"image"}][:2]
            cache[name] = ([[images[0], video], [both], [images[1]]], refs)
        return cache[name]

    return get


def alone(model, ids: torch.Tensor, labels: torch.Tensor, ref: dict):
    """One sample as a user runs it unpacked: the processor's inputs, the model computing its own
    mRoPE from ``mm_token_type_ids``. transformers' GLM-V finds image and video features by the same
    token, so a sample with both fails its feature check: that one gets the model's own
    ``get_rope_index`` positions and its video frames as images (what ``get_video_features``
    hands the vision tower)."""
    kinds = {kind for kind, _, _ in ref["items"]}
    if kinds == {"image", "video"}:
        positions = torch.from_numpy(oracle.rope_index(model, ref["input_ids"], ref))[:, None]
        pixels = torch.from_numpy(np.concatenate([p for _, p, _ in ref["items"]]))
        grids = torch.tensor([g for _, _, item in ref["items"] for g in item])
        return model(
            input_ids=ids, labels=labels, position_ids=positions, pixel_values=pixels, image_grid_thw=grids
        )
    media: dict = {"mm_token_type_ids": torch.tensor([ref["mm_token_type_ids"]])}
    if "image" in kinds:
        media.update(
            pixel_values=torch.from_numpy(ref["pixel_values"][0]),
            image_grid_thw=torch.tensor(ref["image_grid_thw"]),
        )
    if "video" in kinds:
        media.update(
            pixel_values_videos=torch.from_numpy(np.concatenate(ref["pixel_values_videos"])),
            video_grid_thw=torch.tensor(ref["video_grid_thw"]),
        )
    return model(input_ids=ids, labels=labels, **media)


@pytest.fixture(scope="module")
def attentions():
    register_attentions()


@pytest.mark.parametrize("name", ["glm4v", "glm4v_moe"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "mmpack_varlen"])
def test_packed_equals_each_sample_alone(attentions, micro_batches, name, attention):
    model = with_attention(tiny_models().tiny_model(name, seed=3), attention)
    batches, refs = micro_batches(name)
    checked = text_layers = 0
    for bins in batches:
        batch = collate_packed(bins)
        KERNEL_CALLS.clear()
        with torch.no_grad():
            packed = model(**batch)
        if attention == "mmpack_varlen":  # the text layers got the batch's sequences, the tower its items
            text_layers += text_calls(batch.meta["cu_seq_lens"], vision_boundaries(batch))
        media = [refs[s] for s in batch.meta["sample_ids"]]
        checked += assert_each_sample_alone(batch, packed, media, functools.partial(alone, model))
    assert checked >= 5
    if attention == "mmpack_varlen":
        assert text_layers == len(batches) * model.config.text_config.num_hidden_layers


def test_without_the_text_position_row_samples_leak_and_the_comparison_catches_it(attentions, micro_batches):
    """The mutant: the batch's three mRoPE rows without the restarting text row; transformers then
    finds no sample boundaries and later samples attend to earlier ones."""
    model = with_attention(tiny_models().tiny_model("glm4v", seed=3), "sdpa")
    batches, refs = micro_batches("glm4v")
    batch = collate_packed(batches[0])
    mutant = {**batch, "position_ids": batch["position_ids"][1:]}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        mutant.pop(key, None)
    with torch.no_grad():
        packed = model(**mutant)
    media = [refs[s] for s in batch.meta["sample_ids"]]
    with pytest.raises(AssertionError, match="differs by"):
        assert_each_sample_alone(batch, packed, media, functools.partial(alone, model))


def test_prepared_media_give_the_same_pixels(glm, prepared_run):  # noqa: F811
    """``pack.media=prepared`` (8-bit patches in the shards): the same pixels, videos' frames too."""
    run = glm("glm46v")[0]
    original = PackedDataset(str(run.output / "packed"), shuffle=False)
    prepared = PackedDataset(str(prepared_run("glm46v") / "packed"), shuffle=False)
    compared = 0
    for bin_, same in zip(original, prepared, strict=True):
        if "pixel_values" in bin_:
            torch.testing.assert_close(same["pixel_values"], bin_["pixel_values"], rtol=0, atol=0)
            assert torch.equal(same["image_grid_thw"], bin_["image_grid_thw"])
            compared += 1
    assert compared >= 10


def test_validate_accepts_the_shards(spark, glm):
    run = glm("glm4v_moe")[0]
    summary = validate.run(spark, run.ctx)
    assert summary["ok"], summary["problems"]
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]


def test_megatron_thd_batches_carry_each_samples_positions_and_the_towers_inputs(micro_batches):
    """``loader.megatron``: a GLM-V bin (GLM's attention is causal: nothing is refused) becomes a
    THD batch whose three position rows are each sample's mRoPE, moved to its padded place, and
    whose vision inputs are the torch loader's (videos as images)."""
    from loader.megatron import megatron_batch

    batches, _ = micro_batches("glm4v_moe")
    (item,) = batches[1]  # the bin with a sample holding images and a video
    torch_batch = collate_packed([item])
    thd = megatron_batch(item, cp_size=2)
    params = thd["packed_seq_params"]
    real, padded = params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded.tolist()
    for i in range(len(real) - 1):
        n = real[i + 1] - real[i]
        mine = thd["position_ids"][:, 0, padded[i] : padded[i] + n]
        assert torch.equal(mine, torch_batch["position_ids"][1:, 0, real[i] : real[i + 1]])
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(thd[key], torch_batch[key])
    assert "pixel_values_videos" not in thd
