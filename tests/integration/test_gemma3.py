"""Gemma 3 (``model_type: gemma3``) from its model directory, against transformers on the same
files: every tokenized sample's ids, labels and tokens per image (Gemma3Processor with its PIL
image processor, the chat template of the real Gemma 3 tokenizer_config.json); every packed
sample's pixels and image tokens (the processor's ``token_type_ids``); the packed masks keep
each image's tokens bidirectional and samples apart; and a tiny random
Gemma3ForConditionalGeneration (one sliding-window layer with a window shorter than a sample,
one full layer) gives each packed sample the logits and loss it gets alone (SDPA, eager) —
while transformers' own packed path (``token_type_ids`` and position ids, its masks) does not,
so the comparison fails when a mask leaks. Gemma 3 takes no videos: those samples are
quarantined as ``media_unsupported``.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed, normalize_pixel_values
from loader.attention import with_model_masks
from mmpack_udfs.io import tables
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.validate import stage as validate
from tests.integration.test_family_tokens import oracle_references
from tests.loader.test_model_parity import assert_each_sample_alone, with_attention
from tests.models.build import tiny_models
from tests.oracles import gemma3 as oracle

pytestmark = pytest.mark.spark

SOFT = 262144  # <image_soft_token>
PER_IMAGE = 256


@pytest.fixture(scope="module")
def gemma3(family_run, tmp_path_factory):
    """The run, its tokenized rows and transformers' reference of every row."""
    run = family_run("gemma3")
    rows, refs, _ = oracle_references(run, oracle, tmp_path_factory.mktemp("gemma3"))
    return run, rows, refs


def test_every_sample_has_the_ids_labels_and_tokens_transformers_gives(gemma3):
    run, rows, refs = gemma3
    assert (run.ctx.config.profile.kind, run.ctx.config.profile.chat) == ("gemma3", "gemma3")
    assert len(rows) >= 40
    images = 0
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        assert [m["num_tokens"] for m in row["media"]] == ref["tokens"], row["sample_id"]
        images += len(row["media"])
    assert images >= 40 and any(len(r["media"]) > 1 for r in rows)


def test_samples_with_videos_are_quarantined_as_unsupported(gemma3):
    run, rows, _ = gemma3
    samples = tables.read_arrow(table_uri(str(run.output), "samples")).to_pylist()
    quarantined = tables.read_arrow(table_uri(str(run.output), "tokenize_quarantine")).to_pylist()
    with_video = {s["sample_id"] for s in samples if any(m["kind"] == "video" for m in s["media"])}
    assert with_video and {q["sample_id"] for q in quarantined} >= with_video
    assert {q["reason"] for q in quarantined if q["sample_id"] in with_video} == {"media_unsupported"}
    assert len(samples) == len({r["sample_id"] for r in rows}) + len({q["sample_id"] for q in quarantined})


def test_packed_samples_have_transformers_pixels_image_tokens_and_masks(gemma3):
    """Per sample: its squares (≤ 1e-6), its image tokens where the processor's token_type_ids are
    1, positions from 0; the masks: every image token sees its whole image (later ones too),
    nothing of another sample, no text token a later token."""
    run, _, refs = gemma3
    checked = 0
    for bin_ in itertools.islice(PackedDataset(str(run.output / "packed"), shuffle=False), 40):
        batch = collate_packed([bin_])
        cu, image = batch.meta["cu_seq_lens"], 0
        allowed = batch["attention_mask"]["full_attention"][0, 0]
        assert allowed.dtype == torch.bool  # SDPA's form (attention.with_model_masks: eager's)
        ids = batch["input_ids"][0]
        for (a, b), sample_id in zip(itertools.pairwise(cu), bin_["sample_ids"], strict=True):
            ref = refs[sample_id]
            assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
            assert (ids[a:b] == SOFT).long().tolist() == ref["token_type_ids"]
            n = len(ref["pixel_values"])
            if n:
                got = batch["pixel_values"][image : image + n].numpy()
                np.testing.assert_allclose(got, np.stack(ref["pixel_values"]), rtol=0, atol=1e-6)
                image += n
                checked += 1
            mine = allowed[a:b, a:b]
            assert not allowed[a:b, :a].any() and not allowed[a:b, b:].any()  # samples apart
            soft = ids[a:b] == SOFT
            blocks = torch.cumsum(soft & ~torch.nn.functional.pad(soft[:-1], (1, 0)), 0)
            same_image = (blocks[:, None] == blocks[None, :]) & soft[:, None] & soft[None, :]
            causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            assert torch.equal(mine, causal | same_image)
        assert image == len(batch.get("pixel_values", ()))
    assert checked >= 20


def test_uint8_pixels_normalized_on_the_model_side_equal_the_float_pixels(gemma3):
    packed = str(gemma3[0].output / "packed")
    floats = itertools.islice(PackedDataset(packed, shuffle=False), 6)
    raw = itertools.islice(PackedDataset(packed, shuffle=False, pixel_dtype="uint8"), 6)
    seen = 0
    for f, u in zip(floats, raw, strict=True):
        if "pixel_values" in f:
            norm = collate_packed([u]).meta["pixel_norm"]["pixel_values"]
            assert u["pixel_values"].dtype == torch.uint8
            assert torch.equal(
                normalize_pixel_values(u["pixel_values"], torch.float32, *norm), f["pixel_values"]
            )
            seen += 1
    assert seen >= 3


def alone_bin(bin_: dict, index: int) -> dict:
    """The ``index``-th sample of ``bin_`` as a bin of its own (the parity batches are made of
    short samples: whole 4,096-token bins would take gigabytes of the tiny model's 262,208-entry
    logits)."""
    cu, ids = bin_["cu_seqlens"].tolist(), bin_["input_ids"]
    a, b = cu[index], cu[index + 1]
    first = int((ids[:a] == SOFT).sum()) // PER_IMAGE
    count = int((ids[a:b] == SOFT).sum()) // PER_IMAGE
    out = {
        **{k: v for k, v in bin_.items() if k != "pixel_values"},
        **{k: bin_[k][a:b] for k in ("input_ids", "labels", "position_ids", "media_token_mask")},
        "cu_seqlens": torch.tensor([0, b - a], dtype=torch.int32),
        "max_seqlen": b - a,
        "sample_ids": [bin_["sample_ids"][index]],
    }
    if count:
        out["pixel_values"] = bin_["pixel_values"][first : first + count]
    return out


@pytest.fixture(scope="module")
def micro_batches(gemma3) -> list[list[dict]]:
    """Two rows of the shortest samples longer than the tiny model's sliding window: two
    one-image samples and a text sample; a multi-image sample and a one-image sample."""
    found: dict[int, list[tuple[int, dict]]] = {0: [], 1: [], 2: []}  # by image count (2: several)
    for bin_ in PackedDataset(str(gemma3[0].output / "packed"), shuffle=False):
        cu, ids = bin_["cu_seqlens"].tolist(), bin_["input_ids"]
        for i, (a, b) in enumerate(itertools.pairwise(cu)):
            if 64 < b - a < 900:
                images = min(int((ids[a:b] == SOFT).sum()) // PER_IMAGE, 2)
                found[images].append((b - a, alone_bin(bin_, i)))
    shortest = {k: [sample for _, sample in sorted(v, key=lambda s: s[0])] for k, v in found.items()}
    return [[shortest[1][0], shortest[1][1], shortest[0][0]], [shortest[2][0], shortest[1][2]]]


def sample_media(batch, cu: list[int]) -> list[dict]:
    """Each sample's own squares and token types, as the processor gives them for it alone."""
    ids, image, out = batch["input_ids"][0], 0, []
    for a, b in itertools.pairwise(cu):
        n = int((ids[a:b] == SOFT).sum()) // PER_IMAGE
        mine = {"token_type_ids": (ids[a:b] == SOFT).long()[None]}
        if n:
            mine["pixel_values"] = batch["pixel_values"][image : image + n]
        image += n
        out.append(mine)
    return out


def alone(model, ids: torch.Tensor, labels: torch.Tensor, media: dict):
    """One sample as a user runs it unpacked: the processor's outputs (with token_type_ids, which
    make transformers' masks bidirectional over each image)."""
    return model(input_ids=ids, labels=labels, use_cache=False, **media)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_equals_each_sample_alone(micro_batches, attention):
    model = with_attention(tiny_models().tiny_model("gemma3", seed=3), attention)
    checked = 0
    for bins in micro_batches:
        batch = collate_packed(bins)
        assert min(batch.meta["bin_tokens"]) > model.config.text_config.sliding_window
        with torch.no_grad():
            packed = model(**with_model_masks(batch, model))
        media = sample_media(batch, batch.meta["cu_seq_lens"])
        checked += assert_each_sample_alone(batch, packed, media, functools.partial(alone, model))
    assert checked == 5


def test_transformers_own_packed_masks_leak_and_the_comparison_catches_it(micro_batches):
    """Without mmpack's masks (token_type_ids and restarting positions: transformers' own packed
    path, 5.24) the sliding-window layer gives later samples the first sample's image blocks."""
    model = with_attention(tiny_models().tiny_model("gemma3", seed=3), "sdpa")
    batch = collate_packed(micro_batches[0])
    own = {k: v for k, v in batch.items() if k != "attention_mask"}
    own["token_type_ids"] = (batch["input_ids"] == SOFT).long()
    with torch.no_grad():
        packed = model(**own)
    media = sample_media(batch, batch.meta["cu_seq_lens"])
    with pytest.raises(AssertionError, match="differs by"):
        assert_each_sample_alone(batch, packed, media, functools.partial(alone, model))


def test_a_training_step_on_a_packed_batch_has_each_samples_gradients(micro_batches):
    """``loader.summed_loss`` on a packed batch moved with ``.to()`` (masks included) has the
    gradients of the summed losses of its samples run alone."""
    from loader.training import summed_loss

    model = tiny_models().tiny_model("gemma3", seed=3).train()
    batch = collate_packed(micro_batches[1]).to("cpu")
    summed_loss(model, batch).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    labels = batch["labels"][0]
    for (a, b), mine in zip(
        itertools.pairwise(batch.meta["cu_seq_lens"]),
        sample_media(batch, batch.meta["cu_seq_lens"]),
        strict=True,
    ):
        supervised = int((labels[a + 1 : b] != -100).sum())
        alone(model, batch["input_ids"][:, a:b], batch["labels"][:, a:b], mine).loss.mul(
            supervised
        ).backward()
    assert len(packed) > 20 and packed["model.vision_tower.embeddings.patch_embedding.weight"].abs().max() > 0
    # float32 sums of gradients up to ~10⁴: each parameter's error relative to its largest gradient;
    # a key bias's gradient is zero but for rounding (softmax ignores it): not compared
    for name, param in model.named_parameters():
        if name in packed and not name.endswith("k_proj.bias"):
            worst = (packed[name] - param.grad).abs().max() / param.grad.abs().max()
            assert worst <= 1e-4, (name, worst.item())


def test_validate_accepts_the_shards(spark, gemma3):
    summary = validate.run(spark, gemma3[0].ctx)
    assert summary["ok"], summary["problems"]
