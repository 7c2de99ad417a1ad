"""Qwen2-Audio (``model_type: qwen2_audio``) from its model directory, against transformers on the
same files: the demo's audio samples (16 kHz and 22.05 kHz WAV, two clips in a turn, an
``audios`` column and an audio content part) and its text-only samples get the ids, labels and
tokens per clip that Qwen2AudioProcessor and the published chat template give; its image and
video samples are quarantined (``media_unsupported``); the loader's features are the processor's;
and a tiny random Qwen2AudioForConditionalGeneration gives each packed sample the logits and loss
it gets alone with the processor's features (SDPA, eager, mmpack_varlen), and a batch without its
boundaries fails that comparison."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from loader import PackedDataset, audio, collate_packed
from loader.attention import VARLEN, reference_varlen_attn, register_varlen
from mmpack_udfs.io import tables
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.validate import stage as validate
from tests.conftest import PARITY_BUDGET, repacked
from tests.integration.test_family_tokens import oracle_references
from tests.loader.test_model_parity import assert_each_sample_alone, with_attention
from tests.models.build import tiny_models
from tests.oracles import qwen2_audio as oracle

pytestmark = pytest.mark.spark

AUDIO = 151646  # <|AUDIO|>


@pytest.fixture(scope="module")
def qwen2_audio(family_run, tmp_path_factory):
    """The run, its tokenized rows and transformers' reference of every row."""
    run = family_run("qwen2_audio")
    rows, refs, _ = oracle_references(run, oracle, tmp_path_factory.mktemp("qwen2_audio"))
    return run, rows, refs


def test_every_sample_has_the_ids_labels_and_tokens_transformers_gives(qwen2_audio):
    run, rows, refs = qwen2_audio
    assert (run.ctx.config.profile.kind, run.ctx.config.profile.chat) == ("qwen2_audio", "qwen2_audio")
    clips = 0
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        assert [m["num_tokens"] for m in row["media"]] == ref["tokens"], row["sample_id"]
        if row["media"]:
            assert [m["grid_t"] for m in row["media"]] == ref["feature_attention_mask"].sum(-1).tolist()
        clips += len(row["media"])
    assert clips == 4 and any(len(r["media"]) == 2 for r in rows)
    assert len(rows) >= 10  # the text-only samples too


def test_image_and_video_samples_are_quarantined(qwen2_audio):
    run, _, _ = qwen2_audio
    quarantined = tables.read_arrow(table_uri(str(run.output), "tokenize_quarantine")).to_pylist()
    unsupported = [q for q in quarantined if q["reason"] == "media_unsupported"]
    assert len(unsupported) >= 30
    assert all(q["detail"].startswith(("image: ", "video: ")) for q in unsupported)


@functools.cache
def audio_bins(packed: str) -> list[dict]:
    """The pack's bins holding a clip."""
    return [b for b in PackedDataset(packed, shuffle=False) if "input_features" in b]


def test_the_loaders_features_are_the_processors(family_run, qwen2_audio):
    _, _, refs = qwen2_audio
    small = family_run("qwen2_audio", PARITY_BUDGET)
    seen = 0
    for bin_ in audio_bins(str(small.output / "packed")):
        clips = [refs[s] for s in bin_["sample_ids"] if refs[s]["input_features"] is not None]
        expected = np.concatenate([r["input_features"] for r in clips])
        np.testing.assert_array_equal(bin_["input_features"].numpy(), expected)
        masks = np.concatenate([r["feature_attention_mask"] for r in clips])
        np.testing.assert_array_equal(bin_["feature_attention_mask"].numpy(), masks)
        seen += len(expected)
    assert seen == 4  # the demo's clips, each once


@pytest.fixture(scope="module")
def varlen_reference():
    register_varlen(kernel=reference_varlen_attn)


def clip_inputs(ref: dict) -> dict:
    """One sample's own audio inputs, as the processor gives them."""
    if ref["input_features"] is None:
        return {}
    return {
        "input_features": torch.from_numpy(ref["input_features"]),
        "feature_attention_mask": torch.from_numpy(ref["feature_attention_mask"]),
    }


def alone_with(model):
    def alone(ids, labels, mine):
        return model(input_ids=ids, labels=labels, use_cache=False, **mine)

    return alone


@pytest.mark.parametrize("attention", ["sdpa", "eager", VARLEN])
def test_packed_equals_each_sample_alone(family_run, qwen2_audio, varlen_reference, attention):
    _, _, refs = qwen2_audio
    small = family_run("qwen2_audio", PARITY_BUDGET)
    model = with_attention(tiny_models().tiny_model("qwen2_audio", seed=5), attention)
    reference = with_attention(tiny_models().tiny_model("qwen2_audio", seed=5), "sdpa")
    checked = 0
    for bin_ in audio_bins(str(small.output / "packed")):
        batch = collate_packed([bin_])
        with torch.no_grad():
            packed = model(**batch)
        media = [clip_inputs(refs[s]) for s in batch.meta["sample_ids"]]
        checked += assert_each_sample_alone(batch, packed, media, alone_with(reference))
    bins = audio_bins(str(small.output / "packed"))
    assert checked > len(bins) and any(len(b["sample_ids"]) > 1 for b in bins)  # clips beside other samples


def test_without_boundaries_samples_leak_and_the_comparison_catches_it(family_run, qwen2_audio):
    """The mutant: the bin's positions counted over the whole row and no boundaries, as a
    collator that concatenates samples without them gives; later samples then see earlier ones."""
    _, _, refs = qwen2_audio
    small = family_run("qwen2_audio", PARITY_BUDGET)
    model = with_attention(tiny_models().tiny_model("qwen2_audio", seed=5), "sdpa")
    batch = collate_packed(
        [next(b for b in audio_bins(str(small.output / "packed")) if len(b["sample_ids"]) > 1)]
    )
    mutant = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    mutant["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    with torch.no_grad():
        packed = model(**mutant)
    media = [clip_inputs(refs[s]) for s in batch.meta["sample_ids"]]
    with pytest.raises(AssertionError, match="differs by"):
        assert_each_sample_alone(batch, packed, media, alone_with(model))


def test_validate_accepts_the_shards(spark, qwen2_audio):
    summary = validate.run(spark, qwen2_audio[0].ctx)
    assert summary["ok"], summary["problems"]


def test_a_second_budget_on_audio_tokens_bounds_each_bins_clips(spark, family_demo, qwen2_audio, tmp_path):
    """``pack.second_budget_by=audio_tokens``: at 40, a bin holds one of the demo's clips (27 and
    32 tokens) at most; the sample with two clips is over it and skipped with its reason, and
    every other sample is packed."""
    run, rows, _ = qwen2_audio
    audio = {r["sample_id"]: sum(m["num_tokens"] for m in r["media"] if m["kind"] == "audio") for r in rows}
    ctx = repacked(
        spark, family_demo, run.output, tmp_path, f"tokenize.model={run.model_dir}",
        "pack.second_budget_by=audio_tokens", "pack.second_budget=40",
    )  # fmt: skip
    out = Path(ctx.output)
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    assert manifest["config"]["pack"]["second_budget_by"] == "audio_tokens"
    packed = set()
    for shard in manifest["shards"]:
        table = pq.read_table(out / "packed" / shard["path"], columns=["sample_ids", "media"])
        for ids, media in zip(table["sample_ids"].to_pylist(), table["media"].to_pylist(), strict=True):
            assert sum(m["num_tokens"] for m in media if m["kind"] == "audio") <= 40
            packed.update(ids)
    skipped = json.loads((out / "report" / "pack_skipped.json").read_text())
    over = {s: n for s, n in audio.items() if n > 40}
    assert len(over) == 1 and max(audio.values()) < 2 * 40  # the two-clip sample, and no single clip over
    assert {s["sample_id"]: s["reason"] for s in skipped} == dict.fromkeys(over, "over_audio_tokens_budget")
    assert packed == set(audio) - set(over)


def test_the_manifest_names_the_decoder_and_another_is_refused(qwen2_audio, tmp_path):
    """The clips were counted with loader.audio's FFmpeg; a loader decoding with another build
    refuses the pack before a clip's features could differ from the plan."""
    packed = qwen2_audio[0].output / "packed"
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["audio_decoder"] == audio.decoder() and audio.decoder().startswith("pyav-")
    copy = tmp_path / "packed"
    shutil.copytree(packed, copy)
    (copy / "manifest.json").write_text(
        json.dumps({**manifest, "audio_decoder": "pyav-0.0.0/libavcodec-1.0.0"})
    )
    with pytest.raises(ValueError, match=r"planned with pyav-0\.0\.0.*install the PyAV"):
        PackedDataset(str(copy))
    PackedDataset(str(copy), with_media=False)  # token counts alone need no decoder
