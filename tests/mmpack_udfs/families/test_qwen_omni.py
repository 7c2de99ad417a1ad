"""Qwen2.5-Omni without Spark: TMRoPE positions against the thinker's own ``get_rope_index`` on
token layouts of every shape (images, videos at sampling rates whose seconds per patch are not
whole, clips, text between and after them); the loader's features (each clip's own frames) against
the feature extractor's for the clip padded to 300 s; what is refused (clips over 300 s or under
one token); a whole checkpoint's config.json read as its thinker's; and the directory settings
mmpack refuses (exit 2)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from loader import audio
from mmpack_udfs.families import make_family
from mmpack_udfs.families.qwen2_audio import audio_tokens
from mmpack_udfs.normalize import media
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from tests.mmpack_udfs.families.test_gemma3 import sample
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.mmpack_udfs.families.test_qwen2_audio import write_clip
from tests.models.build import build_model_dir, tiny_models

IMAGE, VIDEO, AUDIO = 151655, 151656, 151646
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = 151652, 151653, 151647, 151648


@dataclass(frozen=True)
class Tokens:
    """A thinker's media token ids and its clips' token count."""

    image: int = IMAGE
    video: int = VIDEO
    audio: int = AUDIO
    vision_start: int = VISION_BOS
    vision_end: int = VISION_EOS
    audio_start: int = AUDIO_BOS
    audio_end: int = AUDIO_EOS
    clip_tokens: Callable[[int], int] = audio_tokens


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return build_model_dir("qwen2_5_omni", tmp_path_factory.mktemp("qwen2_5_omni") / "model")


@pytest.fixture(scope="module")
def run(published):
    return load_run(None, [f"tokenize.model={published}", "tokenize.max_tokens=400000"])


@pytest.fixture(scope="module")
def thinker():
    return tiny_models().tiny_model("qwen2_5_omni_thinker", seed=0)


def layout(items: list[tuple], tokens: Tokens = Tokens()) -> tuple[list[int], list[dict], dict]:
    """Token ids of text runs and media items — ("text", n), ("image", t, h, w),
    ("video", t, h, w, seconds), ("audio", frames) — their media rows as tokenize writes them, and
    the model inputs of get_rope_index (``tokens``: the thinker's)."""
    ids, media = [], []
    grids = {"image": [], "video": []}
    seconds, frames = [], []
    for item in items:
        if item[0] == "text":
            ids += [100 + i for i in range(item[1])]
            continue
        kind = item[0]
        if kind == "audio":
            ids.append(tokens.audio_start)
            media.append(
                {"kind": "audio", "token_offset": len(ids), "grid_t": item[1], "grid_h": 1, "grid_w": 1}
            )
            ids += [tokens.audio] * tokens.clip_tokens(item[1]) + [tokens.audio_end]
            frames.append(item[1])
            continue
        t, h, w = item[1:4]
        ids.append(tokens.vision_start)
        row = {"kind": kind, "token_offset": len(ids), "grid_t": t, "grid_h": h, "grid_w": w}
        row["second_per_grid_t"] = item[4] if kind == "video" else None
        media.append(row)
        ids += [tokens.image if kind == "image" else tokens.video] * (t * h * w // 4) + [tokens.vision_end]
        grids[kind].append([t, h, w])
        if kind == "video":
            seconds.append(item[4])
    inputs = {
        "image_grid_thw": torch.tensor(grids["image"]) if grids["image"] else None,
        "video_grid_thw": torch.tensor(grids["video"]) if grids["video"] else None,
        "audio_seqlens": torch.tensor(frames) if frames else None,
        "second_per_grids": torch.tensor(seconds) if seconds else None,
    }
    return ids, media, inputs


LAYOUTS = [
    [("text", 5), ("image", 1, 4, 6), ("text", 3)],
    [("text", 2), ("video", 6, 4, 4, 1.0), ("text", 1), ("audio", 301), ("text", 4)],
    [("audio", 3), ("image", 1, 2, 2), ("video", 10, 2, 6, 2 / 3), ("video", 4, 8, 2, 2 / 2.5), ("text", 2)],
    [("text", 1), ("video", 8, 2, 2, 2 / 3), ("image", 1, 20, 2), ("audio", 997), ("audio", 45)],
]


@pytest.mark.parametrize("items", LAYOUTS)
def test_positions_are_the_thinkers_get_rope_index(run, thinker, items):
    family = make_family("model", run.config.profile.model_dump())
    ids, media, inputs = layout(items)
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
    np.testing.assert_array_equal(family.positions(len(ids), media), expected[:, 0].numpy())


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("clips")
    out = {}
    for name, spec in {
        "a.wav": (16000, 1.3, 1, "pcm_s16le"),
        "b.mp3": (24000, 7.45, 1, "libmp3lame"),
        "c.flac": (44100, 0.02, 2, "flac"),
    }.items():
        write_clip(root / name, *spec)
        out[name] = str(root / name)
    return out


def test_the_loaders_features_are_the_extractors_for_the_clip_padded_to_300_s(run, published, clips):
    """The processor pads every clip to 300 s (30,000 frames); the loader computes each clip's own
    frames, the same values (the thinker reads only those) up to float32 rounding: the mel
    matrix product over 30,000 frames and over a clip's own may round an element two units in the
    last place apart (2 of 256 on an AVX-512 machine; none on others)."""
    settings = json.loads((published / "preprocessor_config.json").read_text())
    extractor = WhisperFeatureExtractor(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )
    profile = run.config.profile.audio.model_dump()
    for uri in clips.values():
        waveform = audio.decode(uri)
        full = extractor(  # as Qwen2_5OmniProcessor calls it
            waveform,
            sampling_rate=16000,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="np",
        )
        frames = int(full["attention_mask"][0].sum())
        assert full["input_features"].shape[-1] == 30000
        features, mask = audio.whisper_features(waveform, profile, "frames")
        assert features.shape[-1] == frames == int(mask.sum()) == len(mask)
        np.testing.assert_array_max_ulp(features, full["input_features"][0][:, :frames], maxulp=2)


def test_a_clip_the_processor_would_cut_or_that_gives_no_token_is_refused(run):
    tokenizer = SampleTokenizer(TokenizeSettings.from_config(run.config))
    for samples, words in ((300 * 16000 + 1, "keeps the first 300 s"), (320, "gives 0 <|AUDIO|> token(s)")):
        clip = {
            "kind": "audio",
            "uri": "x.wav",
            "width": None,
            "height": None,
            "frames": samples,
            "fps": None,
        }
        done, quarantined = tokenizer.tokenize([sample([("user", "<audio>"), ("assistant", "x")], [clip])])
        assert not done and quarantined[0]["reason"] == "media_unsupported"
        assert words in quarantined[0]["detail"]
    clip = {
        "kind": "audio",
        "uri": "x.wav",
        "width": None,
        "height": None,
        "frames": 300 * 16000,
        "fps": None,
    }
    (done,), _ = tokenizer.tokenize([sample([("user", "<audio>"), ("assistant", "x")], [clip])])
    assert [m["num_tokens"] for m in done.media] == [7500]


def test_a_whole_checkpoints_config_reads_as_its_thinkers(published, run, tmp_path):
    """Qwen/Qwen2.5-Omni-7B's config.json: ``model_type: qwen2_5_omni``, the thinker's settings
    under ``thinker_config`` (the talker's and token2wav's beside them)."""
    whole = tmp_path / "model"
    shutil.copytree(published, whole)
    thinker_config = json.loads((published / "config.json").read_text())
    config = {
        "model_type": "qwen2_5_omni",
        "thinker_config": thinker_config,
        "talker_config": {},
        "enable_audio_output": True,
    }
    (whole / "config.json").write_text(json.dumps(config))
    assert load_run(None, [f"tokenize.model={whole}"]).config.profile == run.config.profile


@pytest.mark.parametrize(
    ("file", "changes", "words"),
    [
        ("preprocessor_config.json", {"sampling_rate": 24000}, "sampling_rate 24000"),
        ("preprocessor_config.json", {"feature_size": 80}, "feature_size 80"),
        ("config.json", {"audio_token_index": 151000}, "audio_token_index 151000 is not the tokenizer's"),
        ("config.json", {"vision_start_token_id": 151644}, "vision_start_token_id 151644"),
    ],
)
def test_settings_mmpack_does_not_reproduce_are_refused(
    published, tmp_path, capsys, monkeypatch, file, changes, words
):
    assert words in refusal(published, file, changes, tmp_path, capsys, monkeypatch)


def write_video(path, seconds: float, sound: bool, fps: int = 8, rate: int = 22050) -> None:
    """An MP4 of moving colour (MPEG-4 Part 2) and, with ``sound``, an AAC tone track."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        track = out.add_stream("aac", rate=rate, layout="mono") if sound else None
        for i in range(round(seconds * fps)):
            frame = np.zeros((64, 96, 3), np.uint8)
            frame[:, :, 0], frame[: i % 64, :, 1] = (i * 20) % 255, 200
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode(None))
        if track is not None:
            t = np.arange(round(seconds * rate)) / rate
            tone = (0.3 * np.sin(2 * np.pi * 330 * t) * np.sin(2 * np.pi * 0.4 * t)).astype(np.float32)
            for start in range(0, len(tone), 1024):
                piece = av.AudioFrame.from_ndarray(
                    tone[None, start : start + 1024], format="fltp", layout="mono"
                )
                piece.sample_rate = rate
                out.mux(track.encode(piece))
            out.mux(track.encode(None))


@pytest.fixture(scope="module")
def sounding(tmp_path_factory, clips) -> dict[str, dict]:
    """Probed media rows with each video's track counted (``use_audio_in_video``), by name."""
    root = tmp_path_factory.mktemp("videos")
    settings = media.ProbeSettings(video_audio=True)
    out = {}
    for name, seconds in (("long.mp4", 5.0), ("short.mp4", 1.5)):
        write_video(root / name, seconds, sound=True)
        out[name] = media.probe("video", str(root / name), settings).as_row()
    write_video(root / "silent.mp4", 1.0, sound=False)
    out["silent.mp4"] = str(root / "silent.mp4")
    out["a.wav"] = media.probe("audio", clips["a.wav"], settings).as_row()
    return out


AUDIO_IN_VIDEO = [
    ([("user", "<video> What do you hear?"), ("assistant", "A tone.")], ["long.mp4"]),
    (
        [
            ("user", "<audio> first, then <video>"),
            ("assistant", "Both hum."),
            ("user", "<video>"),
            ("assistant", "x"),
        ],
        ["a.wav", "short.mp4", "long.mp4"],
    ),
]


@pytest.mark.parametrize(("turns", "names"), AUDIO_IN_VIDEO)
def test_audio_in_video_is_the_processors_and_the_thinkers(
    published, sounding, thinker, tmp_path, turns, names
):
    """``tokenize.use_audio_in_video``: ids, labels, grids, the tracks' frames (after each
    video, in text order) against ``Qwen2_5OmniProcessor`` with ``load_audio_from_video``, and
    positions against ``get_rope_index(use_audio_in_video=True)``, over videos of several 2 s chunks."""
    assert_audio_in_video_is_transformers(published, thinker, turns, [sounding[n] for n in names], tmp_path)


def assert_audio_in_video_is_transformers(
    published, thinker, turns, items, tmp_path, processor: str = "qwen2_5_omni"
) -> tuple[list[int], np.ndarray]:
    """One sample of ``turns`` and media ``items`` tokenized with ``use_audio_in_video`` against
    the ``processor`` of the ``published`` directory (ids, labels, grids, the tracks' frames) and
    the ``thinker``'s positions; its ids and positions."""
    from mmpack_udfs.families.model_dir import load_tokenizer
    from tests.integration.test_family_tokens import VIDEO_ORACLE
    from tests.oracles import qwen_omni as oracle

    run = load_run(None, [f"tokenize.model={published}", "tokenize.use_audio_in_video=true"])
    row = sample(turns, items)
    (got,), quarantined = SampleTokenizer(TokenizeSettings.from_config(run.config)).tokenize([row])
    assert not quarantined
    tokenizer = load_tokenizer(str(published))
    refs = oracle.references(published, tokenizer, [row], VIDEO_ORACLE.ask, tmp_path, True, processor)
    ref = refs[row["sample_id"]]
    assert got.input_ids.tolist() == ref["input_ids"]
    assert got.labels.tolist() == ref["labels"]
    videos = [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in got.media if m["kind"] == "video"]
    assert videos == ref["video_grid_thw"]
    assert [m["grid_t"] for m in got.media if m["kind"] == "audio"] == ref["feature_frames"]
    family = make_family("model", run.config.profile.model_dump())
    positions = family.positions(len(got.input_ids), got.media)
    expected = oracle.rope_index(thinker, ref, audio_in_video=True)
    np.testing.assert_array_equal(positions, expected)
    return ref["input_ids"], expected


def test_a_video_without_sound_is_quarantined_when_its_audio_is_asked_for(sounding):
    with pytest.raises(Rejected) as rejected:
        media.probe("video", sounding["silent.mp4"], media.ProbeSettings(video_audio=True))
    assert rejected.value.reason == Reason.AUDIO_NO_STREAM
    assert "tokenize.use_audio_in_video" in str(rejected.value)
    assert media.probe("video", sounding["silent.mp4"], media.ProbeSettings()).audio_samples is None


def test_audio_in_video_is_refused_for_a_family_without_it(capsys, tmp_path):
    from mmpack_udfs import cli

    code = cli.main(["tokenize", "--out", str(tmp_path), "--set", "tokenize.use_audio_in_video=true"])
    assert code == cli.EXIT_BAD_CONFIG
    assert "takes no audio from videos" in capsys.readouterr().err


def test_a_template_that_writes_clips_otherwise_is_refused(published, tmp_path, capsys, monkeypatch):
    """The template check probes the directory's template with clips too (a family that encodes
    images, videos and audio): a newline after each clip is a difference, and the run exits 2."""
    from mmpack_udfs import cli

    variant = tmp_path / "model"
    shutil.copytree(published, variant)
    template = (variant / "chat_template.jinja").read_text()
    span = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    (variant / "chat_template.jinja").write_text(template.replace(span, span + "\n"))
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: pytest.fail("Spark started"))
    code = cli.main(["tokenize", "--out", str(tmp_path / "out"), "--set", f"tokenize.model={variant}"])
    assert code == cli.EXIT_BAD_CONFIG
    assert "renders conversations in a way mmpack does not reproduce" in capsys.readouterr().err
