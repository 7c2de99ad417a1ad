"""The Qwen-Omni thinkers (Qwen2.5-Omni, ``qwen2_5_omni_thinker``; Qwen3-Omni,
``qwen3_omni_moe_thinker``) from their model directories, against transformers on the same files:
every sample of the families' demo (images, several images, videos, audio clips, text only) gets
the ids, labels, grids and clip frames that the line's processor and chat template give it alone;
every packed sample the thinker's own ``get_rope_index`` positions (Qwen3-Omni's fractional
ones at the test directory's 1.5 frames a second) and the processor's pixel values and audio
features; and a tiny random thinker gives each packed sample the logits and loss it gets alone
(SDPA, eager, mmpack_varlen) with the processor's inputs and the model's own positions, and a batch
without its restarting text positions (the boundaries dropped) fails that comparison. Audio inside
video, for both lines: a small dataset of videos with sound, the same checks."""

from __future__ import annotations

import functools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from loader import PackedDataset, collate_packed
from loader.attention import VARLEN, reference_varlen_attn, register_varlen
from mmpack_udfs.io import tables
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.validate import stage as validate
from tests.conftest import PARITY_BUDGET
from tests.integration.test_family_tokens import VIDEO_ORACLE
from tests.loader.test_model_parity import assert_each_sample_alone, with_attention
from tests.models.build import tiny_models
from tests.oracles import qwen_omni as oracle

pytestmark = pytest.mark.spark

MODEL_TYPE = "qwen2_5_omni_thinker"
# the test model directory (tests/models/build.py) -> its tiny thinker's model_type, its renderer
LINES = {
    "qwen2_5_omni": ("qwen2_5_omni_thinker", "chatml"),
    "qwen3_omni": ("qwen3_omni_moe_thinker", "qwen3_omni"),
}


@pytest.fixture(scope="module", params=sorted(LINES))
def omni(request, family_run, tmp_path_factory):
    """The line's run (``request.param``: its model directory), its tokenized rows and
    transformers' reference of every row (by sample id)."""
    from mmpack_udfs.families.model_dir import load_tokenizer

    run = family_run(request.param)
    samples = {
        s["sample_id"]: s for s in tables.read_arrow(table_uri(str(run.output), "samples")).to_pylist()
    }
    rows = tables.read_arrow(table_uri(str(run.output), "tokenized")).to_pylist()
    refs = oracle.references(
        run.model_dir,
        load_tokenizer(str(run.model_dir)),
        [samples[r["sample_id"]] for r in rows],
        VIDEO_ORACLE.ask,
        tmp_path_factory.mktemp("omni"),
        processor=request.param,
    )
    return run, rows, refs


@functools.cache
def thinker(model_type: str = MODEL_TYPE, seed: int = 3):
    return tiny_models().tiny_model(model_type, seed=seed)


def test_every_sample_has_the_ids_labels_grids_and_frames_transformers_gives(omni):
    run, rows, refs = omni
    assert (run.ctx.config.profile.kind, run.ctx.config.profile.chat) == (run.name, LINES[run.name][1])
    kinds = {"image": 0, "video": 0, "audio": 0}
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        for kind, key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            grids = [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in row["media"] if m["kind"] == kind]
            assert grids == ref[key], row["sample_id"]
        videos = [m["second_per_grid_t"] for m in row["media"] if m["kind"] == "video"]
        # stored as float32, the precision the thinker reads them at
        assert videos == [float(np.float32(s)) for s in ref["video_second_per_grid"]]
        assert [m["grid_t"] for m in row["media"] if m["kind"] == "audio"] == ref["feature_frames"]
        for m in row["media"]:
            kinds[m["kind"]] += 1
    assert kinds["image"] >= 20 and kinds["video"] >= 3 and kinds["audio"] == 4, kinds
    quarantined = tables.read_arrow(table_uri(str(run.output), "tokenize_quarantine")).to_pylist()
    unsupported = sorted(q["detail"] for q in quarantined if q["reason"] == "media_unsupported")
    assert [d.split(":")[0] for d in unsupported] == ["2000x8", "video of 1 frames is too short to sample"]


@functools.cache
def parity_bins(packed: str) -> list[dict]:
    return list(PackedDataset(packed, shuffle=False))


def test_packed_samples_have_the_processors_inputs_and_the_models_positions(family_run, omni):
    """Per bin: the pixel values, the audio features of each clip's frames (the processor pads to
    300 s; the thinker reads only the masked frames) and the positions of every sample."""
    run, _, refs = omni
    small = family_run(run.name, PARITY_BUDGET)
    model = thinker(LINES[run.name][0])
    checked = {"pixel_values": 0, "pixel_values_videos": 0, "input_features": 0, "positions": 0}
    fractional = 0
    for bin_ in parity_bins(str(small.output / "packed")):
        batch = collate_packed([bin_])
        cu = batch.meta["cu_seq_lens"]
        mine = [refs[s] for s in batch.meta["sample_ids"]]
        for key in ("pixel_values", "pixel_values_videos"):
            expected = [r[key] for r in mine if key in r]
            if expected:
                np.testing.assert_allclose(batch[key].numpy(), np.concatenate(expected), atol=1e-6)
                checked[key] += 1
        clips = [(r["input_features"], r["feature_frames"]) for r in mine if "input_features" in r]
        row = 0
        for features, frames in clips:
            for clip, count in zip(features, frames, strict=True):
                assert int(batch["feature_attention_mask"][row].sum()) == count
                got = batch["input_features"][row][:, :count].numpy()
                np.testing.assert_allclose(got, clip[:, :count], atol=1e-6)
                row, checked["input_features"] = row + 1, checked["input_features"] + 1
        for s, ref in enumerate(mine):
            positions = batch["position_ids"][1:, 0, cu[s] : cu[s + 1]].numpy()
            expected = oracle.rope_index(model, ref)
            assert positions.dtype == expected.dtype, (positions.dtype, expected.dtype)
            np.testing.assert_array_equal(positions, expected)
            checked["positions"] += 1
            fractional += bool((expected % 1).any())
    assert min(checked.values()) > 0 and checked["input_features"] == 4, checked
    assert fractional > 0 if run.name == "qwen3_omni" else fractional == 0, fractional


def alone_inputs(ref: dict) -> dict:
    """One sample's own model inputs, as the processor gives them (features padded to 300 s)."""
    inputs = {}
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in ref:
            inputs[key] = torch.from_numpy(ref[key])
    for key in ("image_grid_thw", "video_grid_thw"):
        if ref[key]:
            inputs[key] = torch.tensor(ref[key])
    if ref["video_second_per_grid"]:
        inputs["video_second_per_grid"] = torch.tensor(ref["video_second_per_grid"])
    if ref["feature_frames"]:
        width = inputs["input_features"].shape[-1]
        inputs["feature_attention_mask"] = torch.tensor(
            [[1] * n + [0] * (width - n) for n in ref["feature_frames"]]
        )
    return inputs


@pytest.fixture(scope="module")
def varlen_reference():
    register_varlen(kernel=reference_varlen_attn)


def alone_with(model):
    def alone(ids, labels, mine):
        mask = torch.ones_like(ids)  # the model computes the sample's positions itself
        return model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False, **mine)

    return alone


def shared_bins(packed: str) -> list[dict]:
    """The parity pack's bins of two samples or more."""
    return [b for b in parity_bins(packed) if len(b["sample_ids"]) > 1]


@pytest.mark.parametrize("attention", ["sdpa", "eager", VARLEN])
def test_packed_equals_each_sample_alone(family_run, omni, varlen_reference, attention):
    """The packed bin's logits and summed loss are each sample's alone, from the processor's own
    inputs; one micro-batch holds clips of two samples (the audio encoder keeps them apart): a bin
    where the pack put two together, else two bins with clips collated as one micro-batch.
    SDPA on every bin of two samples or more; eager and mmpack_varlen on those with videos or clips
    (a forward costs its tokens × the real vocabulary)."""
    run, _, refs = omni
    small = family_run(run.name, PARITY_BUDGET)
    model_type = LINES[run.name][0]
    model = with_attention(tiny_models().tiny_model(model_type, seed=5), attention)
    reference = with_attention(tiny_models().tiny_model(model_type, seed=5), "sdpa")
    bins = shared_bins(str(small.output / "packed"))
    if attention != "sdpa":
        bins = [b for b in bins if "pixel_values_videos" in b or "input_features" in b]
    batches = [[b] for b in bins]
    if not any(sum("input_features" in refs[s] for s in b["sample_ids"]) > 1 for b in bins):
        with_clips = [b for b in parity_bins(str(small.output / "packed")) if "input_features" in b]
        batches.append(with_clips[:2])
    checked, kinds, clip_samples = 0, set(), 0
    for micro_batch in batches:
        batch = collate_packed(micro_batch)
        with torch.no_grad():
            packed = model(**batch)
        media = [alone_inputs(refs[s]) for s in batch.meta["sample_ids"]]
        kinds |= {k for m in media for k in m}
        clip_samples = max(clip_samples, sum("input_features" in m for m in media))
        checked += assert_each_sample_alone(batch, packed, media, alone_with(reference))
    assert checked >= 8 and clip_samples >= 2, (checked, clip_samples)
    assert {"pixel_values", "pixel_values_videos", "input_features"} <= kinds, kinds


def test_without_the_text_position_row_samples_leak_and_the_comparison_catches_it(family_run, omni):
    """The mutant: the batch's three TMRoPE rows without the restarting text row (and no
    boundaries); transformers then builds one causal mask over the whole row."""
    run, _, refs = omni
    small = family_run(run.name, PARITY_BUDGET)
    model = with_attention(tiny_models().tiny_model(LINES[run.name][0], seed=5), "sdpa")
    batch = collate_packed([shared_bins(str(small.output / "packed"))[0]])
    mutant = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    mutant["position_ids"] = batch["position_ids"][1:]
    with torch.no_grad():
        packed = model(**mutant)
    media = [alone_inputs(refs[s]) for s in batch.meta["sample_ids"]]
    with pytest.raises(AssertionError, match="differs by"):
        assert_each_sample_alone(batch, packed, media, alone_with(model))


def test_validate_accepts_the_shards(spark, omni):
    summary = validate.run(spark, omni[0].ctx)
    assert summary["ok"], summary["problems"]


# --- audio in video (tokenize.use_audio_in_video) ----------------------------------------------


@pytest.fixture(scope="module", params=sorted(LINES))
def audio_in_video(request, spark, tmp_path_factory, family_run):
    """A small dataset of videos with sound (one silent), a clip and an image, run through
    normalize, tokenize and pack with ``tokenize.use_audio_in_video`` on the line's directory
    (``request.param``); its name, rows and transformers' references (``load_audio_from_video``)."""
    from PIL import Image

    from mmpack_udfs.families.model_dir import load_tokenizer
    from tests.integration.test_input_forms import config_file, run
    from tests.mmpack_udfs.families.test_qwen2_audio import write_clip
    from tests.mmpack_udfs.families.test_qwen_omni import write_video

    root = tmp_path_factory.mktemp("audio-in-video")
    media = root / "media"
    media.mkdir()
    write_video(media / "long.mp4", 5.0, sound=True)
    write_video(media / "short.mp4", 1.5, sound=True, fps=10, rate=16000)
    write_video(media / "silent.mp4", 1.0, sound=False)
    write_clip(media / "clip.wav", 16000, 1.3, 1, "pcm_s16le")
    Image.new("RGB", (120, 90), (200, 40, 40)).save(media / "red.png")

    def record(question: str, answer: str, **items) -> dict:
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        return {"conversations": turns, **items}

    records = [
        record("<video> What do you hear?", "A swelling tone.", videos=["long.mp4"]),
        record(
            "<image> and <video>, then <audio>.",
            "Red, a tone, a tone.",
            images=["red.png"],
            videos=["short.mp4"],
            audios=["clip.wav"],
        ),
        record("<audio> before <video>", "Same tone.", audios=["clip.wav"], videos=["short.mp4"]),
        record("<video> Anything?", "Silence.", videos=["silent.mp4"]),
        record("Hello?", "Hi."),
    ]
    (root / "av.json").write_text(json.dumps(records))
    config = config_file(root, [{"name": "av", "paths": ["av.json"], "media_root": "media"}])
    model = family_run(request.param).model_dir
    overrides = (f"tokenize.model={model}", "tokenize.use_audio_in_video=true", *PACKED_SETTINGS)
    out = root / "out"
    summaries = run(spark, config, out, "normalize", "tokenize", "pack", overrides=overrides)
    samples = tables.read_arrow(table_uri(str(out), "samples")).to_pylist()
    rows = tables.read_arrow(table_uri(str(out), "tokenized")).to_pylist()
    by_id = {s["sample_id"]: s for s in samples}
    refs = oracle.references(
        model,
        load_tokenizer(str(model)),
        [by_id[r["sample_id"]] for r in rows],
        VIDEO_ORACLE.ask,
        root,
        True,
        request.param,
    )
    return request.param, out, summaries, rows, refs


PACKED_SETTINGS = ("pack.budget=4096", "pack.oversize=skip")


def test_a_silent_video_is_quarantined_and_rows_reconcile(audio_in_video):
    _, out, summaries, rows, _ = audio_in_video
    assert summaries[0]["datasets"]["av"] == {
        "read": 5, "samples": 4, "quarantined": 1, "duplicates": 0, "reasons": {"audio_no_stream": 1}
    }  # fmt: skip
    quarantined = tables.read_arrow(table_uri(str(out), "quarantine")).to_pylist()
    assert ["silent.mp4" in q["detail"] for q in quarantined] == [True]
    assert len(rows) == 4


def test_audio_in_video_is_the_processors_and_the_thinkers(audio_in_video):
    """ids, labels, grids and each track's frames (after its video, in text order) against the
    line's processor with ``load_audio_from_video``; in the packed bin, every sample's positions
    against ``get_rope_index(use_audio_in_video=True)`` and its features against the processor's."""
    line, out, _, rows, refs = audio_in_video
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"] and row["labels"] == ref["labels"], row["sample_id"]
        assert [m["grid_t"] for m in row["media"] if m["kind"] == "audio"] == ref["feature_frames"]
    model, checked = thinker(LINES[line][0]), 0
    for bin_ in PackedDataset(str(out / "packed"), shuffle=False):
        batch = collate_packed([bin_])
        cu, row = batch.meta["cu_seq_lens"], 0
        for s, sample_id in enumerate(batch.meta["sample_ids"]):
            ref = refs[sample_id]
            positions = batch["position_ids"][1:, 0, cu[s] : cu[s + 1]].numpy()
            np.testing.assert_array_equal(positions, oracle.rope_index(model, ref, audio_in_video=True))
            for clip, count in zip(ref.get("input_features", []), ref["feature_frames"], strict=True):
                got = batch["input_features"][row][:, :count].numpy()
                np.testing.assert_allclose(got, clip[:, :count], atol=1e-6)
                row, checked = row + 1, checked + 1
    assert checked == 5  # two tracks of short.mp4, long.mp4's, two clips
    manifest = json.loads((out / "packed" / "manifest.json").read_text())
    media = pq.read_table(out / "packed" / manifest["shards"][0]["path"], columns=["media"])
    for items in media.column("media").to_pylist():  # a video's file once, not again for its track
        tracks = [m for m in items if m["kind"] == "audio" and m["uri"].endswith(".mp4")]
        assert tracks and all(m["data"] is None for m in tracks)
        embedded = [m["uri"] for m in items if m["data"] is not None]
        assert sorted(embedded) == sorted({m["uri"] for m in items})


def test_audio_in_video_packed_equals_each_sample_alone(audio_in_video):
    line, out, _, _, refs = audio_in_video
    model = with_attention(tiny_models().tiny_model(LINES[line][0], seed=5), "sdpa")
    (bin_,) = PackedDataset(str(out / "packed"), shuffle=False)
    batch = collate_packed([bin_])
    with torch.no_grad():
        packed = model(**batch)
    media = [{**alone_inputs(refs[s]), "use_audio_in_video": True} for s in batch.meta["sample_ids"]]
    assert assert_each_sample_alone(batch, packed, media, alone_with(model)) == 4
