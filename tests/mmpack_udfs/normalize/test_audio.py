"""Audio as users ship it: the forms records carry it in, probing real files of every common
container, each bad file's reason, and the waveform every stage decodes."""

import base64
import hashlib
import io
import json

import av
import numpy as np
import pytest
from transformers.audio_utils import load_audio

from loader import audio
from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import media, records
from mmpack_udfs.normalize.records import parse_record
from mmpack_udfs.normalize.sharegpt import BLOB_KEY, Blob, DatasetSpec
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import ROW_KIND_QUARANTINE, ROW_KIND_SAMPLE

SPEC = DatasetSpec(name="d", paths=("x.jsonl",), media_root="/media")


def encode(codec: str, container: str, rate: int, seconds: float, layout: str = "mono") -> bytes:
    """A tone encoded by FFmpeg's own encoders (PyAV), as recorders and converters write files."""
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        to_codec = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=rate)
        for start in range(0, len(tone), 1024):
            chunk = np.stack([tone[start : start + 1024]] * (2 if layout == "stereo" else 1))
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            frame.sample_rate = rate
            for converted in to_codec.resample(frame):
                out.mux(stream.encode(converted))
        out.mux(stream.encode(None))
    return buffer.getvalue()


FILES = {  # name → (codec, container, rate, seconds, layout)
    "speech.wav": ("pcm_s16le", "wav", 16000, 1.5, "mono"),
    "music.flac": ("flac", "flac", 44100, 2.0, "stereo"),
    "voice.mp3": ("libmp3lame", "mp3", 22050, 2.0, "mono"),
    "call.ogg": ("libopus", "ogg", 48000, 1.0, "mono"),
    "memo.m4a": ("aac", "mp4", 24000, 1.0, "mono"),
}


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    bad = demo_data._write_bad_media(root)
    for name, spec in FILES.items():
        (root / "media" / name).write_bytes(encode(*spec))
    flac = (root / "media" / "music.flac").read_bytes()
    (root / "media" / "cut.flac").write_bytes(flac[: len(flac) // 2])
    mp3 = (root / "media" / "voice.mp3").read_bytes()
    (root / "media" / "cut.mp3").write_bytes(mp3[: len(mp3) // 2])
    (root / "media" / "noise.ogg").write_bytes(b"OggS but not really" * 20)
    return root / "media", bad


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_container_probes_to_its_decoded_length(media_root, name):
    root, _ = media_root
    _, _, rate, seconds, layout = FILES[name]
    info = media.probe("audio", str(root / name), media.ProbeSettings())
    assert (info.kind, info.sample_rate, info.channels) == ("audio", rate, 2 if layout == "stereo" else 1)
    assert info.width is None and info.height is None and info.fps is None
    assert info.frames == len(audio.decode(str(root / name)))  # samples of its 16 kHz waveform
    # lossy codecs decode a few ms of priming and padding beyond the samples given
    assert seconds <= info.duration < seconds + 0.1
    assert info.file_bytes == (root / name).stat().st_size


@pytest.mark.parametrize(
    ("ref", "reason"),
    [
        ("bad/empty.wav", Reason.AUDIO_EMPTY),
        ("bad/cut.wav", Reason.AUDIO_CUT),  # the data chunk claims more than the file holds
        ("cut.flac", Reason.AUDIO_CUT),  # decoding stops with an error
        ("cut.mp3", Reason.AUDIO_CUT),  # decodes to half of the duration its header declares
        ("bad/unknown_codec.wav", Reason.AUDIO_CODEC_UNSUPPORTED),
        ("bad/endless.wav", Reason.AUDIO_TOO_LONG),
        ("bad/one_frame.avi", Reason.AUDIO_NO_STREAM),  # a video without an audio track
        ("noise.ogg", Reason.MEDIA_UNREADABLE),
        ("bad/not_an_image.png", Reason.AUDIO_NO_STREAM),  # FFmpeg reads text as a tty file
    ],
)
def test_bad_audio_is_refused_with_its_reason(media_root, ref, reason):
    root, _ = media_root
    with pytest.raises(Rejected) as rejected:
        media.probe("audio", str(root / ref), media.ProbeSettings())
    assert rejected.value.reason == reason
    assert ref.rsplit("/", 1)[-1] in rejected.value.detail


def test_the_length_limit_is_the_configured_one(media_root):
    root, _ = media_root
    short = media.ProbeSettings(max_audio_seconds=1.0)
    with pytest.raises(Rejected) as rejected:
        media.probe("audio", str(root / "speech.wav"), short)
    assert (
        rejected.value.reason == Reason.AUDIO_TOO_LONG
        and "1.5 s > normalize.max_audio_seconds = 1" in str(rejected.value)
    )


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (  # LLaMA-Factory: an audios column and <audio> placeholders, in order with images
            {
                "conversations": [
                    {"from": "human", "value": "<audio><image> and <audio>?"},
                    {"from": "gpt", "value": "ok"},
                ],
                "audios": ["a.wav", "b.mp3"],
                "images": ["i.jpg"],
            },
            [("audio", "a.wav"), ("image", "i.jpg"), ("audio", "b.mp3")],
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "audio", "audio": "a.wav"},
                            {"type": "audio_url", "audio_url": {"url": "b.flac"}},
                            {"type": "audio", "path": "c.ogg"},
                            {"type": "text", "text": "three?"},
                        ],
                    },
                    {"role": "assistant", "content": "ok"},
                ]
            },
            [("audio", "a.wav"), ("audio", "b.flac"), ("audio", "c.ogg")],
        ),
        (  # OpenAI's input_audio: base64 data and its format
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
                        ],
                    },
                    {"role": "assistant", "content": "ok"},
                ]
            },
            [("audio", "data:audio/wav;base64,UklGRg==")],
        ),
        (  # a Hugging Face Audio struct of bytes and a path (Parquet, WebDataset members)
            {
                "conversations": [{"from": "human", "value": "<audio>"}, {"from": "gpt", "value": "ok"}],
                "audios": [{"bytes": {BLOB_KEY: 0}, "path": "x.flac"}],
            },
            [("audio", Blob(0, "x.flac"))],
        ),
    ],
)
def test_audio_comes_in_every_form_users_ship(record, expected):
    conversation = parse_record(record, SPEC)
    assert conversation.media == expected
    assert conversation.turns[0][1].count("<audio>") == sum(kind == "audio" for kind, _ in expected)


def test_a_dataset_placeholder_for_audio_becomes_the_canonical_one():
    spec = DatasetSpec(
        name="d", paths=("x.jsonl",), media_root="/m", tags=(("audio_placeholder", "<sound>"),)
    )
    record = {
        "conversations": [{"from": "human", "value": "<sound> hm"}, {"from": "gpt", "value": "ok"}],
        "audios": "a.wav",
    }
    conversation = parse_record(record, spec)
    assert conversation.turns[0] == ("user", "<audio> hm") and conversation.media == [("audio", "a.wav")]


def raw(record: dict, blobs=None) -> dict:
    return {
        "raw": json.dumps(record),
        "error": None,
        "dataset": "d",
        "source_file": "x.jsonl",
        "source_position": 0,
        "records_read": None,
        "blobs": blobs,
    }


def test_inline_audio_is_kept_content_addressed_and_probed(media_root, tmp_path):
    root, _ = media_root
    settings = records.NormalizeSettings(probe=media.ProbeSettings(), media_dir=str(tmp_path / "out"))
    normalizer = records.RecordNormalizer({"d": SPEC}, settings)
    data = (root / "voice.mp3").read_bytes()
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "mp3"}}
    messages = [{"role": "user", "content": [part]}, {"role": "assistant", "content": "a voice"}]
    row = normalizer(raw({"messages": messages}))
    assert row["kind"] == ROW_KIND_SAMPLE, row.get("detail")
    (item,) = row["media"]
    digest = hashlib.sha256(data).hexdigest()
    assert item["uri"] == str(tmp_path / "out" / digest[:2] / f"{digest}.mp3")
    assert (item["kind"], item["sample_rate"], item["channels"]) == ("audio", 22050, 1)
    with open(item["uri"], "rb") as f:
        assert f.read() == data
    # the same bytes from a Parquet binary column: the same file, the same sample id
    column = {"messages": [{"role": "user", "content": "<audio>"}, messages[1]], "audios": [{BLOB_KEY: 0}]}
    again = normalizer(raw(column, [data]))
    assert again["media"] == row["media"] and again["sample_id"] == row["sample_id"]
    cut = normalizer(raw(column, [data[: len(data) // 2]]))
    assert (cut["kind"], cut["reason"]) == (ROW_KIND_QUARANTINE, "audio_cut")


def test_decoding_is_transformers_own_where_no_resampling_happens(media_root):
    """At 16 kHz mono no stage resamples: FFmpeg's waveform is the one transformers' soundfile
    backend loads, sample for sample."""
    root, _ = media_root
    ours = audio.decode(str(root / "speech.wav"))
    theirs = load_audio(str(root / "speech.wav"), sampling_rate=16000, backend="soundfile")
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_file_decodes_to_16_khz_mono_of_its_length(media_root, name):
    root, _ = media_root
    info = audio.probe(str(root / name))
    waveform = audio.decode((root / name).read_bytes())
    assert waveform.ndim == 1 and waveform.dtype == np.float32
    assert abs(len(waveform) - info.duration * audio.SAMPLE_RATE) <= 32  # the resampler's edges
    assert 0.2 < np.abs(waveform).max() < 0.6  # the tone, neither lost nor clipped (stereo: 0.3·√2)
