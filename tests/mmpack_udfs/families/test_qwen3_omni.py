"""Qwen3-Omni without Spark: its clips' token counts against transformers' own rule; its float
positions against the thinker's ``get_rope_index`` on token layouts of every shape (videos at rates
whose time positions are fractional, clips, images, text between and after them); the loader's
features against the feature extractor called as ``Qwen3OmniMoeProcessor`` calls it on a sample's
clips; what is refused (clips the extractor cannot take, an encoder window the processor does not
count with); audio inside video, merged by time as the processor and the model merge it; its chat
template's quirk (reasoning kept only after a last query written as a string); and a whole
checkpoint's config.json read as its thinker's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
    Qwen3OmniMoeProcessor,
    _get_feat_extract_output_lengths,
)

from loader import audio
from mmpack_udfs.families import make_family
from mmpack_udfs.families.model_dir import chat_template, load_tokenizer
from mmpack_udfs.families.qwen_omni import qwen3_omni_audio_tokens
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from mmpack_udfs.tokenize.template_check import template_ids
from tests.mmpack_udfs.families.test_gemma3 import sample
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.mmpack_udfs.families.test_qwen2_audio import write_clip
from tests.mmpack_udfs.families.test_qwen_omni import (
    AUDIO_IN_VIDEO,
    Tokens,
    assert_audio_in_video_is_transformers,
    layout,
)
from tests.models.build import build_model_dir, tiny_models

VIDEO, AUDIO = 151656, 151675
TOKENS = Tokens(audio=AUDIO, audio_start=151669, audio_end=151670, clip_tokens=qwen3_omni_audio_tokens)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return build_model_dir("qwen3_omni", tmp_path_factory.mktemp("qwen3_omni") / "model")


@pytest.fixture(scope="module")
def run(published):
    return load_run(None, [f"tokenize.model={published}", "tokenize.max_tokens=400000"])


@pytest.fixture(scope="module")
def thinker():
    return tiny_models().tiny_model("qwen3_omni_moe_thinker", seed=0)


def test_a_clips_tokens_are_transformers_count():
    frames = torch.arange(0, 3001)
    expected = _get_feat_extract_output_lengths(frames, 50).tolist()
    assert [qwen3_omni_audio_tokens(n) for n in frames.tolist()] == expected


LAYOUTS = [  # seconds per temporal patch 2 / fps: fps 1.5, 3, 2.5 and 0.7 give fractional times
    [("text", 5), ("image", 1, 4, 6), ("text", 3)],
    [("text", 2), ("video", 6, 4, 4, 2 / 1.5), ("text", 1), ("audio", 301), ("text", 4)],
    [("audio", 3), ("image", 1, 2, 2), ("video", 10, 2, 6, 2 / 3), ("video", 4, 8, 2, 2 / 2.5), ("text", 2)],
    [("text", 1), ("video", 8, 2, 2, 2 / 0.7), ("image", 1, 20, 2), ("audio", 997), ("audio", 45)],
    [("audio", 250), ("text", 3)],  # no grids: the model counts every token
]


@pytest.mark.parametrize("items", LAYOUTS)
def test_positions_are_the_thinkers_float_get_rope_index(run, thinker, items):
    family = make_family("model", run.config.profile.model_dump())
    ids, media, inputs = layout(items, TOKENS)
    input_ids = torch.tensor([ids])
    expected, _ = thinker.model.get_rope_index(
        input_ids,
        inputs["image_grid_thw"],
        inputs["video_grid_thw"],
        torch.ones_like(input_ids),
        False,
        inputs["audio_seqlens"],
        inputs["second_per_grids"],
    )
    got = family.positions(len(ids), media)
    assert got.dtype == np.float32 == expected.numpy().dtype
    np.testing.assert_array_equal(got, expected[:, 0].numpy())
    if inputs["second_per_grids"] is not None and any(s != 1.0 for s in inputs["second_per_grids"]):
        assert (got % 1).any()  # fractional, kept as the model computes them


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("clips")
    out = {}
    for name, spec in {
        "a.wav": (16000, 1.3037, 1, "pcm_s16le"),
        "b.mp3": (24000, 7.45, 1, "libmp3lame"),
        "c.flac": (44100, 0.0151, 2, "flac"),  # 241 samples at 16 kHz: one frame alone
    }.items():
        write_clip(root / name, *spec)
        out[name] = str(root / name)
    return out


def test_the_loaders_features_are_the_processors_for_the_sample_alone(run, published, clips):
    """``Qwen3OmniMoeProcessor`` pads a call's clips to its longest and cuts none: alone, a clip is
    its own ``samples // 160`` frames, the last ones computed from its reflected end; beside a
    longer clip of its sample, ``ceil(samples / 160)`` frames computed from its zero padding (the
    reference is the processor called on the sample, not on each clip nor on a batch)."""
    settings = json.loads((published / "preprocessor_config.json").read_text())
    extractor = WhisperFeatureExtractor(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )
    call = {**Qwen3OmniMoeProcessor.audio_kwargs, "return_tensors": "np"}
    profile = run.config.profile.audio.model_dump()
    family = make_family("model", run.config.profile.model_dump())
    waveforms = [audio.decode(uri) for uri in clips.values()]
    longest = max(len(w) for w in waveforms)
    assert sum(len(w) % 160 != 0 for w in waveforms if len(w) < longest) == 2  # ending within a frame
    together = extractor(waveforms, **call)  # one sample's three clips, in one call
    plans = family.plans([{"kind": "audio", "frames": len(w)} for w in waveforms])
    for index, waveform in enumerate(waveforms):
        alone = extractor(waveform, **call)
        frames = int(alone["attention_mask"][0].sum())
        features, mask = audio.whisper_features(waveform, profile, "clip")
        assert features.shape[-1] == frames == int(mask.sum()) == family.plan_audio(len(waveform)).grid[0]
        np.testing.assert_array_equal(features, alone["input_features"][0])
        frames = int(together["attention_mask"][index].sum())
        features, mask = audio.whisper_features(waveform, profile, "clip", pad_to=longest)
        assert features.shape[-1] == frames == int(mask.sum()) == plans[index].grid[0]
        np.testing.assert_array_equal(features, together["input_features"][index][:, :frames])
        if len(waveform) < longest:  # its last frame: the zero padding's, not its reflected end
            assert not np.array_equal(features[:, -1], alone["input_features"][0][:, -1])


def test_what_the_feature_extractor_cannot_take_is_refused_and_long_clips_are_kept(run):
    tokenizer = SampleTokenizer(TokenizeSettings.from_config(run.config))

    def clip(samples: int) -> dict:
        return {
            "kind": "audio",
            "uri": "x.wav",
            "frames": samples,
            "width": None,
            "height": None,
            "fps": None,
        }

    done, quarantined = tokenizer.tokenize([sample([("user", "<audio>"), ("assistant", "x")], [clip(200)])])
    assert not done and quarantined[0]["reason"] == "media_unsupported"
    assert "needs a sample's longest clip to have more than 200" in quarantined[0]["detail"]
    (row,), _ = tokenizer.tokenize(  # beside a longer clip, padded to it: 2 frames
        [sample([("user", "<audio><audio>"), ("assistant", "x")], [clip(200), clip(480)])]
    )
    assert [m["grid_t"] for m in row.media] == [2, 3]
    long = 400 * 16000 + 7  # past Qwen2.5-Omni's 300 s: this processor cuts nothing
    (row,), _ = tokenizer.tokenize([sample([("user", "<audio>"), ("assistant", "x")], [clip(long)])])
    assert [m["num_tokens"] for m in row.media] == [qwen3_omni_audio_tokens(long // 160)] == [5200]


def test_reasoning_is_kept_only_after_a_last_query_written_as_a_string(run, published):
    """The published template finds the last user query among turns whose content is a string:
    after a text-only question the answers keep their reasoning (a final one an empty think block);
    after one holding an image none does (its think block dropped, as the template drops it)."""
    tokenizer = SampleTokenizer(TokenizeSettings.from_config(run.config))
    hf, template = load_tokenizer(str(published)), chat_template(str(published))
    image = make_family("model", run.config.profile.model_dump()).plan_image(64, 64)
    for turns, thought, kept in (
        ([("user", "Why?"), ("assistant", "<think>\nR\n</think>\n\nA")], "<think>\nR\n</think>", True),
        ([("user", "<image>Why?"), ("assistant", "<think>\nR\n</think>\n\nA")], "<think>", False),
        (
            [("user", "Hi"), ("assistant", "<think>P</think>Q"), ("user", "<image>And?"), ("assistant", "B")],
            "<think>\nP\n</think>\n\nQ",
            True,
        ),
    ):
        turns = [{"role": r, "text": t} for r, t in turns]
        plans = [image] if any("<image>" in t["text"] for t in turns) else []
        (ours,) = tokenizer.encode([tokenizer.render(None, turns, plans, as_template=True)])
        expected = template_ids(hf, template, None, turns)
        assert ours.ids.tolist() == expected
        assert (thought in hf.decode(expected)) == kept


def test_a_whole_checkpoints_config_reads_as_its_thinkers(published, run, tmp_path):
    """Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json: ``model_type: qwen3_omni_moe``, the
    thinker's settings under ``thinker_config`` (the talker's and code2wav's beside them)."""
    whole = tmp_path / "model"
    shutil.copytree(published, whole)
    thinker_config = json.loads((published / "config.json").read_text())
    config = {"model_type": "qwen3_omni_moe", "thinker_config": thinker_config, "talker_config": {}}
    (whole / "config.json").write_text(json.dumps(config))
    assert load_run(None, [f"tokenize.model={whole}"]).config.profile == run.config.profile


def audio_config(published, **changes) -> dict:
    config = json.loads((published / "config.json").read_text())
    return {"audio_config": {**config["audio_config"], **changes}}


@pytest.mark.parametrize(
    ("file", "changes", "words"),
    [
        ("preprocessor_config.json", {"sampling_rate": 24000}, "sampling_rate 24000"),
        ("config.json", {"audio_token_id": 151646}, "audio_token_id 151646 is not the tokenizer's"),
        ("config.json", {"audio_start_token_id": 151647}, "audio_start_token_id 151647"),
        ("config.json", "window", "audio_config.n_window 100, but Qwen3OmniMoeProcessor counts"),
    ],
)
def test_settings_mmpack_does_not_reproduce_are_refused(
    published, tmp_path, capsys, monkeypatch, file, changes, words
):
    changes = audio_config(published, n_window=100) if changes == "window" else changes
    assert words in refusal(published, file, changes, tmp_path, capsys, monkeypatch)


@pytest.fixture(scope="module")
def sounding(tmp_path_factory, clips) -> dict[str, dict]:
    """Probed media rows with each video's track counted (``use_audio_in_video``), by name: videos
    whose 1.5 fps patches (4/3 s, 17.33… time positions) fall between the track's tokens."""
    from mmpack_udfs.normalize import media
    from tests.mmpack_udfs.families.test_qwen_omni import write_video

    root = tmp_path_factory.mktemp("videos")
    settings = media.ProbeSettings(video_audio=True)
    out = {}
    for name, seconds, fps in (("long.mp4", 6.0, 8), ("short.mp4", 1.7, 10)):
        write_video(root / name, seconds, sound=True, fps=fps)
        out[name] = media.probe("video", str(root / name), settings).as_row()
    out["a.wav"] = media.probe("audio", clips["a.wav"], settings).as_row()
    return out


@pytest.mark.parametrize(("turns", "names"), AUDIO_IN_VIDEO)
def test_audio_in_video_is_the_processors_and_the_thinkers(
    published, sounding, thinker, tmp_path, turns, names
):
    """``tokenize.use_audio_in_video``: ids, labels, grids, the tracks' frames (after each video,
    in text order, padded with the sample's clips to the longest) against
    ``Qwen3OmniMoeProcessor`` with ``load_audio_from_video``, and positions against
    ``get_rope_index(use_audio_in_video=True)``: video and track tokens merged by time."""
    items = [sounding[n] for n in names]
    ids, positions = assert_audio_in_video_is_transformers(
        published, thinker, turns, items, tmp_path, "qwen3_omni"
    )
    assert (positions % 1).any()
    ids = np.array(ids)
    changes = np.flatnonzero(np.diff(ids[np.isin(ids, [VIDEO, AUDIO])]))
    assert len(changes) > 4  # the merge alternates between the video's tokens and the track's
