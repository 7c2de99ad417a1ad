"""Gemma 4 (``model_type: gemma4``) from its model directory, against transformers on the same
files: every tokenized sample's ids, labels and soft tokens per image and video
(Gemma4Processor with its PIL image processor and its video processor, the published chat
template); every packed sample's pixels, patch positions and token types; the packed masks
keep each image's (frame's) tokens bidirectional on sliding layers only and samples apart; and
tiny random Gemma4ForConditionalGeneration models (gemma-4-31B-it's layout, and
26B-A4B-it's with experts; a sliding window shorter than a sample) give each packed sample the
logits and loss it gets alone under SDPA, eager and ``mmpack_varlen`` (its CPU reference
kernel on the full-attention layers; the sliding layers take their masks), while the masks of
one sample over the whole row (boundaries dropped) do not.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed
from loader.attention import (
    VARLEN,
    media_block_masks,
    reference_varlen_attn,
    register_varlen,
    with_model_masks,
)
from mmpack_udfs.validate import stage as validate
from tests.conftest import PARITY_BUDGET
from tests.integration.test_family_tokens import oracle_references
from tests.loader.test_model_parity import assert_each_sample_alone, with_attention
from tests.models.build import tiny_models
from tests.oracles import gemma4 as oracle

pytestmark = pytest.mark.spark

IMAGE, VIDEO = 258880, 258884  # <|image|>, <|video|>


@pytest.fixture(scope="module")
def gemma4(family_run, tmp_path_factory):
    """The run, its tokenized rows and transformers' reference of every row."""
    run = family_run("gemma4")
    rows, refs, _ = oracle_references(run, oracle, tmp_path_factory.mktemp("gemma4"))
    return run, rows, refs


def test_every_sample_has_the_ids_labels_and_tokens_transformers_gives(gemma4):
    run, rows, refs = gemma4
    assert (run.ctx.config.profile.kind, run.ctx.config.profile.chat) == ("gemma4", "gemma4")
    assert len(rows) >= 40
    kinds = set()
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        images = iter(ref.get("image_tokens", []))
        videos = iter(ref["videos"])
        for m in row["media"]:
            if m["kind"] == "image":
                assert m["num_tokens"] == next(images), row["sample_id"]
            else:
                video = next(videos)
                assert list(m["frame_indices"]) == video["frame_indices"], row["sample_id"]
                assert [m["grid_t"], m["grid_h"], m["grid_w"]] == video["grid"], row["sample_id"]
            kinds.add(m["kind"])
    assert kinds == {"image", "video"} and any(len(r["media"]) > 1 for r in rows)


def per_sample_media(ids: torch.Tensor, cu: list[int], frames_per_video: list[int]) -> list[tuple[int, int]]:
    """(images, videos) of each sample: runs of image tokens, and videos whose frames (runs of video
    tokens) it holds, in order."""
    out, frames = [], iter(frames_per_video)
    for a, b in itertools.pairwise(cu):
        mine = ids[a:b]
        runs = {
            t: int(((mine == t) & ~torch.nn.functional.pad(mine[:-1] == t, (1, 0))).sum())
            for t in (IMAGE, VIDEO)
        }
        videos, left = 0, runs[VIDEO]
        while left > 0:
            left -= next(frames)
            videos += 1
        assert left == 0
        out.append((runs[IMAGE], videos))
    return out


def test_packed_samples_have_transformers_pixels_positions_and_masks(gemma4):
    """Per sample: its images' patches and positions (≤ 1e-6), its videos' frames, its token types
    as the processor marks them, positions from 0; the masks: full-attention layers causal within
    the sample, sliding layers also letting every image (frame) token see its whole image."""
    run, _, refs = gemma4
    checked = {"image": 0, "video": 0}
    for bin_ in itertools.islice(PackedDataset(str(run.output / "packed"), shuffle=False), 60):
        batch = collate_packed([bin_])
        cu, ids = batch.meta["cu_seq_lens"], batch["input_ids"][0]
        full = batch["attention_mask"]["full_attention"][0, 0]
        sliding = batch["attention_mask"]["sliding_attention"][0, 0]
        frames = batch.get("num_frames_per_video", torch.zeros(0, dtype=torch.long)).tolist()
        image = frame = video = 0
        for (a, b), sample_id, (images, videos) in zip(
            itertools.pairwise(cu), bin_["sample_ids"], per_sample_media(ids, cu, frames), strict=True
        ):
            ref = refs[sample_id]
            assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
            types = [1 if i == IMAGE else 2 if i == VIDEO else 0 for i in ids[a:b].tolist()]
            assert types == ref["mm_token_type_ids"]
            if images:
                got = batch["pixel_values"][image : image + images].numpy()
                np.testing.assert_allclose(got, np.stack(ref["pixel_values"]), rtol=0, atol=1e-6)
                where = batch["image_position_ids"][image : image + images].numpy()
                np.testing.assert_array_equal(where, np.stack(ref["image_position_ids"]))
                image += images
                checked["image"] += 1
            for clip in ref["videos"][:videos]:
                n = len(clip["pixels"])
                got = batch["pixel_values_videos"][frame : frame + n].numpy()
                np.testing.assert_allclose(got, clip["pixels"], rtol=0, atol=1e-6)
                assert frames[video] == n
                frame, video = frame + n, video + 1
                checked["video"] += 1
            causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            assert torch.equal(full[a:b, a:b], causal)
            assert not full[a:b, :a].any() and not sliding[a:b, :a].any() and not sliding[a:b, b:].any()
            media = torch.tensor(types) > 0
            blocks = torch.cumsum(media & ~torch.nn.functional.pad(media[:-1], (1, 0)), 0)
            same = (blocks[:, None] == blocks[None, :]) & media[:, None] & media[None, :]
            index = torch.arange(b - a)
            near = index[None, :] > index[:, None] - run.ctx.config.profile.sliding_window
            assert torch.equal(sliding[a:b, a:b], (causal | same) & near)
        assert image == len(batch.get("pixel_values", ())) and frame == len(
            batch.get("pixel_values_videos", ())
        )
    assert checked["image"] >= 20 and checked["video"] >= 3


@pytest.fixture(scope="module")
def micro_batch(family_run) -> list[dict]:
    """The smallest bins of the demo packed into the parity tests' small bins whose samples are all
    longer than the tiny model's sliding window: one with images, one with a video."""
    run = family_run("gemma4", PARITY_BUDGET)
    bins = [b for b in PackedDataset(str(run.output / "packed"), shuffle=False) if len(b["sample_ids"]) > 1]
    bins = [b for b in bins if min(np.diff(b["cu_seqlens"].numpy())) > 64]
    bins.sort(key=lambda b: len(b["input_ids"]))
    video = next(b for b in bins if "pixel_values_videos" in b)
    images = next(b for b in bins if "pixel_values" in b and "pixel_values_videos" not in b)
    return [images, video]


def sample_media(batch) -> list[dict]:
    """Each sample's own inputs as the processor gives them for it alone."""
    cu, ids = batch.meta["cu_seq_lens"], batch["input_ids"][0]
    frames = batch.get("num_frames_per_video", torch.zeros(0, dtype=torch.long)).tolist()
    out, image, frame, video = [], 0, 0, 0
    for (a, b), (images, videos) in zip(
        itertools.pairwise(cu), per_sample_media(ids, cu, frames), strict=True
    ):
        types = torch.where(ids[a:b] == IMAGE, 1, torch.where(ids[a:b] == VIDEO, 2, 0))
        mine: dict = {"mm_token_type_ids": types[None]}
        if images:
            mine["pixel_values"] = batch["pixel_values"][image : image + images]
            mine["image_position_ids"] = batch["image_position_ids"][image : image + images]
            image += images
        if videos:
            n = sum(frames[video : video + videos])
            mine["pixel_values_videos"] = batch["pixel_values_videos"][frame : frame + n]
            mine["video_position_ids"] = batch["video_position_ids"][frame : frame + n]
            mine["num_frames_per_video"] = batch["num_frames_per_video"][video : video + videos]
            frame, video = frame + n, video + videos
        out.append(mine)
    return out


def alone(model, ids: torch.Tensor, labels: torch.Tensor, media: dict):
    """One sample as a user runs it unpacked: the processor's outputs (with mm_token_type_ids,
    which make transformers' sliding masks bidirectional over each image)."""
    return model(input_ids=ids, labels=labels, use_cache=False, **media)


@pytest.fixture(scope="module")
def varlen_reference():
    register_varlen(kernel=reference_varlen_attn)


@pytest.mark.parametrize(
    "model_type,attention",
    [("gemma4", "sdpa"), ("gemma4", "eager"), ("gemma4", VARLEN), ("gemma4_moe", "sdpa")],
)
def test_packed_equals_each_sample_alone(micro_batch, varlen_reference, model_type, attention):
    model = with_attention(tiny_models().tiny_model(model_type, seed=3), attention)
    reference = with_attention(tiny_models().tiny_model(model_type, seed=3), "sdpa")
    batch = collate_packed(micro_batch)
    assert min(np.diff(batch.meta["cu_seq_lens"])) > model.config.text_config.sliding_window
    with torch.no_grad():
        packed = model(**with_model_masks(batch, model))
    run_alone = functools.partial(alone, reference)
    assert assert_each_sample_alone(batch, packed, sample_media(batch), run_alone) >= 4


def test_masks_that_leak_fail_the_comparison(micro_batch):
    """transformers' own packed path (5.24: ``mm_token_type_ids`` and restarting positions, its
    masks) gives a later sample other logits, and so does the mutant: one sample's masks over
    the whole row (boundaries dropped)."""
    model = with_attention(tiny_models().tiny_model("gemma4", seed=3), "sdpa")
    batch = collate_packed(micro_batch)
    ids = batch["input_ids"]
    own = {k: v for k, v in batch.items() if k != "attention_mask"}
    own["mm_token_type_ids"] = torch.where(ids == IMAGE, 1, torch.where(ids == VIDEO, 2, 0))
    whole = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    media = torch.isin(ids[0], torch.tensor([IMAGE, VIDEO]))
    mutant = {**batch, "attention_mask": media_block_masks(whole, media, batch.meta["sliding_window"], False)}
    for leaking in (own, mutant):
        with torch.no_grad():
            packed = model(**leaking)
        with pytest.raises(AssertionError, match="differs by"):
            assert_each_sample_alone(batch, packed, sample_media(batch), functools.partial(alone, model))


def test_validate_accepts_the_shards(spark, gemma4):
    summary = validate.run(spark, gemma4[0].ctx)
    assert summary["ok"], summary["problems"]
