"""Qwen2-Audio without Spark: ids, labels and tokens per clip against transformers'
Qwen2AudioProcessor and the published chat template, on real audio files of every rate and
length that matters (16 kHz, resampled, stereo, lossy, 30 s exactly, a frame past a merge step),
several clips in a turn and across turns; what is refused (longer than 30 s, under 2 tokens,
images); and the directory options mmpack refuses (exit 2)."""

from __future__ import annotations

import io
import shutil

import av
import numpy as np
import pytest

from loader import audio
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.families.qwen2_audio import audio_tokens
from mmpack_udfs.normalize import media
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from tests.mmpack_udfs.families.test_gemma3 import sample
from tests.mmpack_udfs.families.test_model_dir import refusal
from tests.models.build import build_model_dir
from tests.oracles import qwen2_audio as oracle

CLIPS = {  # name → (rate, seconds, channels, container codec)
    "a16k.wav": (16000, 1.3, 1, "pcm_s16le"),
    "b22k.wav": (22050, 2.7, 1, "pcm_s16le"),
    "c44k_stereo.flac": (44100, 0.9, 2, "flac"),
    "d.mp3": (24000, 3.2, 1, "libmp3lame"),
    "e30s.wav": (16000, 30.0, 1, "pcm_s16le"),  # exactly the 30 s the extractor keeps
    "f_odd.wav": (16000, 0.1 + 161 / 16000, 1, "pcm_s16le"),  # a frame past a hop boundary
}
CONTAINERS = {"wav": "wav", "flac": "flac", "mp3": "mp3"}


def write_clip(path, rate: int, seconds: float, channels: int, codec: str) -> None:
    t = np.arange(round(rate * seconds)) / rate
    tone = (0.25 * np.sin(2 * np.pi * 300 * t) * np.sin(2 * np.pi * 0.7 * t)).astype(np.float32)
    layout = "stereo" if channels == 2 else "mono"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=CONTAINERS[path.suffix[1:]]) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        convert = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=rate)
        for start in range(0, len(tone), 4096):
            frame = av.AudioFrame.from_ndarray(
                np.stack([tone[start : start + 4096]] * channels), format="fltp", layout=layout
            )
            frame.sample_rate = rate
            for converted in convert.resample(frame):
                out.mux(stream.encode(converted))
        out.mux(stream.encode(None))
    path.write_bytes(buffer.getvalue())


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return build_model_dir("qwen2_audio", tmp_path_factory.mktemp("qwen2_audio") / "model")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, dict]:
    """Probed media rows (as normalize writes them) of CLIPS, and one of 31 s, by name."""
    root = tmp_path_factory.mktemp("clips")
    out = {}
    for name, spec in {**CLIPS, "long31s.wav": (16000, 31.0, 1, "pcm_s16le")}.items():
        write_clip(root / name, *spec)
        out[name] = media.probe("audio", str(root / name), media.ProbeSettings()).as_row()
    short = root / "blip.wav"
    write_clip(short, 16000, 0.03, 1, "pcm_s16le")  # 480 samples: 3 frames, 1 token
    out["blip.wav"] = media.probe("audio", str(short), media.ProbeSettings()).as_row()
    return out


@pytest.fixture(scope="module")
def tok(published) -> SampleTokenizer:
    run = load_run(None, [f"tokenize.model={published}", "tokenize.max_tokens=100000"])
    assert (run.config.profile.kind, run.config.profile.chat) == ("qwen2_audio", "qwen2_audio")
    return SampleTokenizer(TokenizeSettings.from_config(run.config))


@pytest.fixture(scope="module")
def hf(published):
    return load_tokenizer(str(published))


CONVERSATIONS = [
    ([("user", "<audio>What do you hear?"), ("assistant", "A tone.")], ["a16k.wav"], None),
    (
        [("user", "Compare <audio> and <audio>."), ("assistant", "The second is longer.")],
        ["b22k.wav", "d.mp3"],
        None,
    ),
    (
        [
            ("user", "<audio>\nTranscribe."),
            ("assistant", " Nothing to transcribe.\n"),
            ("user", "And <audio>?"),
            ("assistant", "Music."),
        ],
        ["c44k_stereo.flac", "e30s.wav"],
        "You are a sound expert.",
    ),
    ([("user", "<audio>"), ("assistant", "Short.")], ["f_odd.wav"], None),
    ([("user", "Hi"), ("assistant", "Hello.")], [], None),
]


@pytest.mark.parametrize(("turns", "names", "system"), CONVERSATIONS)
def test_ids_labels_and_tokens_are_the_processors(tok, hf, published, clips, turns, names, system):
    row = sample(turns, [clips[n] for n in names], system)
    done, quarantined = tok.tokenize([row])
    assert not quarantined, quarantined
    (got,) = done
    ref = oracle.reference(published, hf, row)
    assert got.input_ids.tolist() == ref["input_ids"]
    assert got.labels.tolist() == ref["labels"]
    assert [m["num_tokens"] for m in got.media] == ref["tokens"]
    for item, mask in zip(got.media, ref["feature_attention_mask"] if names else [], strict=True):
        assert item["grid_t"] == int(mask.sum())  # the feature frames the loader checks
        assert item["num_tokens"] == audio_tokens(item["grid_t"])


def test_a_clip_the_model_would_cut_or_misread_is_refused(tok, clips):
    for name, words in (("long31s.wav", "keeps the first 30 s"), ("blip.wav", "fewer than 2")):
        done, quarantined = tok.tokenize([sample([("user", "<audio>"), ("assistant", "x")], [clips[name]])])
        assert not done and quarantined[0]["reason"] == "media_unsupported"
        assert words in quarantined[0]["detail"]


def test_images_are_refused(tok, clips):
    image = {"kind": "image", "uri": "x.jpg", "width": 10, "height": 10, "frames": None, "fps": None}
    _, quarantined = tok.tokenize([sample([("user", "<image>"), ("assistant", "x")], [image])])
    assert quarantined[0]["reason"] == "media_unsupported"
    assert quarantined[0]["detail"] == "image: a qwen2_audio model encodes audio only"


def test_the_loaders_features_are_the_processors(published, hf, clips):
    """Per clip, the loader's features and mask are the processor's for the sample alone."""
    settings = load_run(None, [f"tokenize.model={published}"]).config.profile.audio.model_dump()
    for name in ("b22k.wav", "e30s.wav", "f_odd.wav"):
        row = sample([("user", "<audio>"), ("assistant", "x")], [clips[name]])
        ref = oracle.reference(published, hf, row)
        features, mask = audio.whisper_features(audio.decode(clips[name]["uri"]), settings)
        np.testing.assert_array_equal(features, ref["input_features"][0])
        np.testing.assert_array_equal(mask, ref["feature_attention_mask"][0])


@pytest.mark.parametrize(
    ("file", "changes", "words"),
    [
        ("preprocessor_config.json", {"sampling_rate": 24000}, "sampling_rate 24000"),
        ("preprocessor_config.json", {"dither": 1e-5}, "dither"),
        ("preprocessor_config.json", {"chunk_length": 20}, "2000 frames per clip, the encoder takes 3000"),
        ("config.json", {"audio_token_index": 151000}, "audio_token_index 151000 is not the tokenizer's"),
    ],
)
def test_settings_mmpack_does_not_reproduce_are_refused(
    published, tmp_path, capsys, monkeypatch, file, changes, words
):
    assert words in refusal(published, file, changes, tmp_path, capsys, monkeypatch)


HUB_TEST = "{% if 'audio' in content or 'audio_url' in content %}"


def test_the_hub_templates_variant_renders_the_same(published, tmp_path, clips):
    """The template as public code quotes the Hub's (clips found by their key only) resolves to the
    same renderer and ids."""
    variant = tmp_path / "model"
    shutil.copytree(published, variant)
    template = (variant / "chat_template.jinja").read_text()
    old = (
        "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' or "
        "content['type'] == 'audio' %}"
    )
    assert old in template
    (variant / "chat_template.jinja").write_text(template.replace(old, HUB_TEST))
    run = load_run(None, [f"tokenize.model={variant}", "tokenize.max_tokens=100000"])
    assert run.config.profile.chat == "qwen2_audio"
    row = sample(*CONVERSATIONS[1][:1], [clips[n] for n in CONVERSATIONS[1][1]])
    (got,), _ = SampleTokenizer(TokenizeSettings.from_config(run.config)).tokenize([row])
    assert got.input_ids.tolist() == oracle.reference(variant, load_tokenizer(str(variant)), row)["input_ids"]
