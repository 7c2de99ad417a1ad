"""A deterministic, realistic ShareGPT demo dataset with real media.

``generate(out_dir, samples, seed)`` writes:

    out_dir/media/images/*.jpg|png     Pillow-drawn images, many sizes and aspect ratios
    out_dir/media/videos/*.mp4|avi     short OpenCV-written clips
    out_dir/media/bad/...              corrupt, truncated, bomb and frameless media; empty,
                                       cut, endless and undecodable audio
    out_dir/media/sounds/*.wav         a real clip (tones), for the audio samples
    out_dir/outside/secret.jpg         a file outside the media root (symlink target)
    out_dir/data/sharegpt.jsonl        ``conversations``/``from``/``value`` dialect
    out_dir/data/openai.json           ``messages``/``role``/``content`` dialect, JSON array
                                       (openai-NNNNN.json of 25,000 records each when larger)
    out_dir/data/custom.parquet        custom column and role names (needs a mapping)
    out_dir/mmpack.yaml                a config naming the three datasets

About 3 % of the records are bad, covering every quarantine reason code, and about
2 % are exact duplicates. The same (samples, seed) always gives the same records.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image, ImageDraw

WORDS = """
the model image video frame shows a person red blue green car street tree house what
where when why how is are was were describe explain count find list compare left
right top bottom center background foreground small large bright dark object scene
moment camera light shadow color shape text sign window door road sky cloud water
dog cat bird table chair screen answer question detail reason because first then
finally step number two three several many each every other same different data
training token sequence pack bin length budget attention layer vision language
""".split()

IMAGE_SIZES = [
    (32, 32),
    (64, 48),
    (160, 120),
    (224, 224),
    (320, 240),
    (448, 448),
    (512, 384),
    (640, 480),
    (800, 600),
    (1024, 768),
    (1280, 720),
    (1920, 1080),
    (300, 1200),
    (1600, 200),
    (96, 1024),
    (2048, 512),
    (12, 900),
]
VIDEO_SIZES = [(96, 64), (160, 120), (224, 160), (320, 240), (128, 256)]
JSON_FILE_RECORDS = 25_000  # records per JSON array file (one task reads a file)


@dataclass(frozen=True)
class DemoData:
    root: Path
    config: Path
    records: int
    bad_records: int
    duplicates: int
    # valid samples a default tokenize quarantines (too long, panorama, 1 frame, audio)
    tokenize_rejects: int


def generate(
    out_dir: str | os.PathLike,
    samples: int = 2000,
    seed: int = 0,
    media_pool: int | None = None,
    media_reuse: float | None = None,
) -> DemoData:
    """Write the demo dataset under ``out_dir``; return where things are and what to expect.

    Media come from a pool of ``media_pool`` images (default ``samples / 8``, at most 1500)
    drawn uniformly, so each is used many times; with ``media_reuse`` (0 ≤ r < 1) instead,
    each media reference is a new file except a fraction ``r`` that repeat one already used,
    as in real datasets where most images appear once."""
    root = Path(out_dir).resolve()
    rng = random.Random(seed)
    if media_reuse is None:
        n_images = media_pool or min(max(samples // 8, 24), 1500)
        media = MediaSource(root, rng, n_images, max(n_images // 12, 4))
    else:
        if not 0 <= media_reuse < 1:
            raise ValueError(f"media_reuse must be in [0, 1), not {media_reuse}")
        media = MediaSource(root, random.Random(seed + 1), 24, 4, media_reuse)
    images, videos = media.images, media.videos
    bad = _write_bad_media(root)

    good = [_conversation(rng, media) for _ in range(samples - 3)]
    good += _tokenize_edge_records(rng, bad)
    n_dups = max(samples // 50, 1)
    good += [dict(good[rng.randrange(samples)]) for _ in range(n_dups)]
    bad_records = _bad_records(rng, images, videos, bad)
    rng.shuffle(good)

    thirds = [good[0::3], good[1::3], good[2::3]]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    _write_jsonl(data / "sharegpt.jsonl", thirds[0], bad_records["sharegpt"], rng, _audio_records(bad))
    openai = [_to_openai(r, form=i % 3) for i, r in enumerate(thirds[1])]
    json_paths = _write_json(data, "openai", openai + bad_records["openai"], rng)
    _write_parquet(data / "custom.parquet", [_to_custom(r) for r in thirds[2]] + bad_records["custom"])
    config = _write_config(root, json_paths)
    n_bad = sum(len(v) for v in bad_records.values()) + AUDIO_BAD_RECORDS
    n_audio = len(_audio_records(bad)) - AUDIO_BAD_RECORDS
    # the audio samples are valid; a vision-language model's tokenize quarantines them
    return DemoData(root, config, len(good) + n_audio + n_bad, n_bad, n_dups, tokenize_rejects=3 + n_audio)


# --- media ---------------------------------------------------------------------------


class MediaSource:
    """The media files records refer to: a fixed pool drawn uniformly (``reuse`` None), or a
    new file per reference except a ``reuse`` fraction that repeat one already written."""

    def __init__(
        self, root: Path, rng: random.Random, n_images: int, n_videos: int, reuse: float | None = None
    ) -> None:
        self.root, self.rng, self.reuse = root, rng, reuse
        self.images = [_write_image(root, i, rng) for i in range(n_images)]
        self.videos = [_write_video(root, i, rng) for i in range(n_videos)]

    def image(self, rng: random.Random) -> str:
        """An image reference (``rng`` draws from the fixed pool; the source's own rng otherwise)."""
        return self._reference(rng, self.images, _write_image)

    def video(self, rng: random.Random) -> str:
        return self._reference(rng, self.videos, _write_video)

    def _reference(self, rng: random.Random, files: list[str], write: Callable) -> str:
        if self.reuse is None:
            return rng.choice(files)
        if self.rng.random() >= self.reuse:
            files.append(write(self.root, len(files), self.rng))
            return files[-1]
        return self.rng.choice(files)


def _write_image(root: Path, index: int, rng: random.Random) -> str:
    width, height = rng.choice(IMAGE_SIZES)
    ext = "png" if index % 4 == 0 else "jpg"
    rel = f"images/img_{index:05d}.{ext}"
    path = root / "media" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    image = _drawing(width, height, rng)
    image.save(path, **({"quality": 85} if ext == "jpg" else {}))
    return rel


def _drawing(width: int, height: int, rng: random.Random) -> Image.Image:
    base = tuple(rng.randrange(256) for _ in range(3))
    image = Image.new("RGB", (width, height), base)
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, width + 1), y0 + rng.randrange(1, height + 1)
        color = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    return image


def _write_video(root: Path, index: int, rng: random.Random) -> str:
    width, height = rng.choice(VIDEO_SIZES)
    frames, fps = rng.randrange(8, 49), rng.choice([4.0, 8.0, 12.0, 24.0, 30.0])
    ext, codec = ("mp4", "mp4v") if index % 2 == 0 else ("avi", "MJPG")
    rel = f"videos/vid_{index:04d}.{ext}"
    path = root / "media" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    _encode_video(path, codec, width, height, frames, fps, rng.randrange(1 << 30))
    return rel


def _encode_video(
    path: Path, codec: str, width: int, height: int, frames: int, fps: float, seed: int
) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*codec), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {codec} video to {path}")
    base = np.random.default_rng(seed).integers(0, 256, size=3)
    y, x = np.mgrid[0:height, 0:width]
    for t in range(frames):
        frame = np.empty((height, width, 3), np.uint8)
        for c in range(3):
            frame[..., c] = (base[c] + x * (c + 1) + y + 8 * t) % 256
        writer.write(frame)
    writer.release()


def _write_bad_media(root: Path) -> dict[str, str]:
    """Corrupt and hostile media, one of each kind; returns references by purpose."""
    bad = root / "media" / "bad"
    bad.mkdir(parents=True, exist_ok=True)
    buffer = _drawing(64, 64, random.Random(1))
    buffer.save(bad / "whole.jpg", quality=90)
    data = (bad / "whole.jpg").read_bytes()
    (bad / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (bad / "not_an_image.png").write_bytes(b"this is plain text, not a PNG\n" * 4)
    (bad / "bomb.png").write_bytes(_png_with_header_size(40000, 40000))
    _encode_video(bad / "tmp.avi", "MJPG", 96, 64, 8, 8.0, 7)
    video = bytearray((bad / "tmp.avi").read_bytes())
    start = 0
    while (start := video.find(b"00dc", start)) >= 0:  # blank every MJPEG frame payload
        payload = start + 8
        video[payload : payload + 2000] = bytes(min(2000, len(video) - payload))
        start = payload
    (bad / "frameless.avi").write_bytes(bytes(video))
    (bad / "tmp.avi").unlink()
    _drawing(2000, 8, random.Random(2)).save(bad / "panorama.png")  # aspect ratio 250
    _encode_video(bad / "one_frame.avi", "MJPG", 96, 64, 1, 8.0, 3)
    writer = cv2.VideoWriter(str(bad / "empty.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 8.0, (96, 64))
    writer.release()
    (bad / "garbage.mp4").write_bytes(b"\x00\x01garbage" * 64)
    outside = root / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    buffer.save(outside / "secret.jpg")
    link = bad / "link_out.jpg"
    if not link.is_symlink():
        link.symlink_to(Path("..", "..", "outside", "secret.jpg"))
    return {
        "truncated": "bad/truncated.jpg",
        "not_image": "bad/not_an_image.png",
        "bomb": "bad/bomb.png",
        "frameless": "bad/frameless.avi",
        "empty_video": "bad/empty.avi",
        "garbage_video": "bad/garbage.mp4",
        "symlink": "bad/link_out.jpg",
        "panorama": "bad/panorama.png",
        "one_frame": "bad/one_frame.avi",
        **_write_audio(root),
    }


AUDIO_RATE = 16_000


def _wav(samples: np.ndarray, rate: int = AUDIO_RATE, fmt_tag: int = 1) -> bytes:
    """A 16-bit PCM WAV file of ``samples`` (float in [-1, 1]); ``fmt_tag``: its codec tag."""
    data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", fmt_tag, 1, rate, 2 * rate, 2, 16)
    body = (
        b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _tones(seconds: float, rate: int = AUDIO_RATE, pitch: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * pitch * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))


def _write_audio(root: Path) -> dict[str, str]:
    """Two real clips and one bad audio file per audio reason code; references by purpose."""
    sounds, bad = root / "media" / "sounds", root / "media" / "bad"
    sounds.mkdir(parents=True, exist_ok=True)
    (sounds / "chime.wav").write_bytes(_wav(_tones(1.3)))
    (sounds / "hum.wav").write_bytes(_wav(_tones(1.1, 22_050, 220.0), 22_050))
    whole = _wav(_tones(1.0))
    (bad / "empty.wav").write_bytes(b"")
    (bad / "cut.wav").write_bytes(whole[: len(whole) // 2])
    (bad / "unknown_codec.wav").write_bytes(_wav(_tones(0.1), fmt_tag=0x1234))
    # longer than normalize.max_audio_seconds (1200 s): 1201 s of 1 kHz silence, 2.4 MB
    (bad / "endless.wav").write_bytes(_wav(np.zeros(1201 * 1000), rate=1000))
    return {
        "audio": "sounds/chime.wav",
        "audio_22k": "sounds/hum.wav",
        "empty_audio": "bad/empty.wav",
        "cut_audio": "bad/cut.wav",
        "unknown_codec_audio": "bad/unknown_codec.wav",
        "endless_audio": "bad/endless.wav",
    }


AUDIO_BAD_RECORDS = 6  # the first records of ``_audio_records``


def _audio_records(bad: dict) -> list[dict]:
    """Audio records, at the end of the JSONL file: one per audio reason code (and one audio part
    of a kind no model reads), then valid samples in each form audio comes in."""

    def sound(text: str, audios: list, answer: str = "A tone.") -> dict:
        turns = [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]
        return {"conversations": turns, "audios": audios}

    def parts(*content: dict) -> dict:
        return {
            "conversations": [{"from": "human", "value": list(content)}, {"from": "gpt", "value": "A tone."}]
        }

    return [
        sound("<audio> What is this?", [bad["empty_audio"]]),
        sound("<audio> What is this?", [bad["cut_audio"]]),
        sound("<audio> What is this?", [bad["unknown_codec_audio"]]),
        sound("<audio> What is this?", [bad["endless_audio"]]),
        sound("<audio> Any sound here?", [bad["one_frame"]]),  # a video without audio
        parts({"type": "hologram", "url": "h.bin"}, {"type": "text", "text": "What is it?"}),
        sound("<audio> What do you hear?", [bad["audio"]], "A chime that swells and fades."),
        sound("Compare <audio> and <audio>.", [bad["audio"], bad["audio_22k"]], "The second is lower."),
        # a content part by path (inline bytes, OpenAI's input_audio, would put the output root in the
        # sample's media uri: tests/mmpack_udfs/normalize/test_audio.py covers them)
        parts({"type": "audio", "audio": bad["audio_22k"]}, {"type": "text", "text": "Describe the sound."}),
    ]


def _png_with_header_size(width: int, height: int) -> bytes:
    """A small valid PNG whose header claims ``width`` × ``height`` (a decompression bomb)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    pixels = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


# --- conversations -------------------------------------------------------------------


def sentence(rng: random.Random, long: bool = False) -> str:
    n = int(rng.paretovariate(1.2) * (60 if long else 8))
    words = [rng.choice(WORDS) for _ in range(min(n, 3000 if long else 400))]
    return " ".join(words).capitalize() + "."


def _conversation(rng: random.Random, source: MediaSource) -> dict:
    """One ShareGPT record (sharegpt dialect); converted to others by _to_openai/_to_custom."""
    n_images = rng.choices([0, 1, 2, 3, 5], weights=[35, 40, 12, 8, 5])[0]
    n_videos = 1 if rng.random() < 0.12 else 0
    rounds = rng.choices([1, 2, 3, 5], weights=[50, 25, 15, 10])[0]
    media = ["<image>"] * n_images + ["<video>"] * n_videos
    rng.shuffle(media)
    turns = []
    for r in range(rounds):
        placeholders = media if r == 0 else []
        question = " ".join([*placeholders, sentence(rng)])
        turns.append({"from": "human", "value": question})
        turns.append({"from": "gpt", "value": sentence(rng, long=rng.random() < 0.3)})
    record: dict = {"conversations": turns}
    if rng.random() < 0.3:
        record["system"] = "You are a helpful assistant. " + sentence(rng)
    record["images"] = [source.image(rng) for _ in range(n_images)]
    if n_videos:
        record["videos"] = [source.video(rng) for _ in range(n_videos)]
    return record


def _tokenize_edge_records(rng: random.Random, bad: dict) -> list[dict]:
    """Valid records that a default tokenize run quarantines: one per tokenize reason."""
    long_answer = " ".join(rng.choice(WORDS) for _ in range(24000))
    return [
        {
            "conversations": [
                {"from": "human", "value": "Summarize everything."},
                {"from": "gpt", "value": long_answer},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "<image> What is this strip?"},
                {"from": "gpt", "value": "A very wide banner."},
            ],
            "images": [bad["panorama"]],
        },
        {
            "conversations": [
                {"from": "human", "value": "<video> What happens?"},
                {"from": "gpt", "value": "Nothing much."},
            ],
            "videos": [bad["one_frame"]],
        },
    ]


def _to_openai(record: dict, form: int = 0) -> dict:
    """OpenAI messages; ``form`` 1: content parts, media from the images/videos lists;
    2: content parts with each media reference inline (the same sample either way)."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    media = {"image": iter(record.get("images", [])), "video": iter(record.get("videos", []))}
    for turn in record["conversations"]:
        text = turn["value"]
        content = _content_parts(text, media if form == 2 else None) if form else text
        messages.append({"role": roles[turn["from"]], "content": content})
    if form == 2:
        return {"messages": messages}
    out = {"messages": messages, "images": record.get("images", [])}
    if record.get("videos"):
        out["videos"] = record["videos"]
    return out


def _content_parts(text: str, media: dict | None) -> list[dict]:
    """``text`` as content parts: text and media in order (inline references from ``media``)."""
    parts = []
    for piece in re.split(r"(<image>|<video>)", text):
        if piece in ("<image>", "<video>"):
            kind = piece[1:-1]
            parts.append({"type": kind, kind: next(media[kind])} if media else {"type": kind})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _to_custom(record: dict) -> dict:
    """Custom names: ``dialog`` of ``speaker``/``text`` with USER/BOT, media as JSON columns."""
    roles = {"human": "USER", "gpt": "BOT"}
    return {
        "dialog": [{"speaker": roles[t["from"]], "text": t["value"]} for t in record["conversations"]],
        "sys": record.get("system"),
        "pictures": record.get("images", []),
        "clips": record.get("videos", []),
    }


def _bad_records(rng: random.Random, images: list[str], videos: list[str], bad: dict) -> dict:
    """At least one record per reason code per dataset where the format allows it."""
    img, vid = images[0], videos[0]

    def sg(turns, **extra):
        return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}

    ok_q, ok_a = ("human", "<image> What is this?"), ("gpt", "A picture.")
    sharegpt = [
        "{not valid json",
        '{"conversations": [{"from": "human", "value": "hi"}, ',
        sg([], images=[]),
        {"id": 7},
        "[1, 2, 3]",
        sg([("human", "hi"), ("wizard", "abracadabra")]),
        sg([("human", "hi"), ("human", "again"), ("gpt", "ok")]),
        sg([("human", "hi"), ("gpt", "hello"), ("human", "bye")]),
        sg([("human", "hi"), ("system", "late system"), ("gpt", "ok")]),
        sg([("human", "hi"), ("gpt", "  \n")]),
        {"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "n"}]},
        {
            "conversations": [
                {"from": "human", "value": ["<image>", "list"]},
                {"from": "gpt", "value": "x"},
            ]
        },
        sg([("human", "<image><image> two?"), ok_a], images=[img]),
        sg([("human", "no placeholder"), ok_a], images=[img]),
        sg([("human", "<video> clip"), ok_a], videos=[]),
        sg([ok_q, ok_a], images=["images/does_not_exist.jpg"]),
        sg([ok_q, ok_a], images=[bad["truncated"]]),
        sg([ok_q, ok_a], images=[bad["not_image"]]),
        sg([ok_q, ok_a], images=["../outside/secret.jpg"]),
        sg([ok_q, ok_a], images=["/etc/passwd"]),
        sg([ok_q, ok_a], images=[bad["symlink"]]),
        sg([ok_q, ok_a], images=[bad["bomb"]]),
        sg([("human", "<video> what happens?"), ok_a], videos=[bad["frameless"]]),
        sg([("human", "<video> what happens?"), ok_a], videos=[bad["empty_video"]]),
        sg([("human", "<video> what happens?"), ok_a], videos=[bad["garbage_video"]]),
        sg([ok_q, ok_a], images=[{"width": 3}]),
        sg([ok_q, ok_a], images=["https://example.com/cat.jpg"]),
        sg([("human", "<audio> What is this sound?"), ok_a], audios=["sounds/glass.wav"]),
        {"conversations": ["just a string"]},
        sg([ok_q, ok_a], images=[img], system=["not", "a", "string"]),
        sg([ok_q, ok_a], images=[img], weight="heavy"),
    ]
    openai = [
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
        {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "audio", "audio": "a.wav"}, {"type": "text", "text": "hm?"}],
                },
                {"role": "assistant", "content": "It is the sound of glass shattering."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "<image>"},
                {"role": "assistant", "content": "x"},
            ],
            "images": [img, img],
        },
        {
            "messages": [
                {"role": "user", "content": "<video>"},
                {"role": "assistant", "content": "x"},
            ],
            "videos": ["../../" + vid],
        },
        {
            "messages": [
                {"role": "user", "content": "<image>"},
                {"role": "assistant", "content": "x"},
            ],
            "images": ["images/missing_too.png"],
        },
    ]
    custom = [
        {"dialog": [], "sys": None, "pictures": [], "clips": []},
        {
            "dialog": [{"speaker": "USER", "text": "hi"}, {"speaker": "ALIEN", "text": "x"}],
            "sys": None,
            "pictures": [],
            "clips": [],
        },
        {
            "dialog": [{"speaker": "USER", "text": "<image> see"}, {"speaker": "BOT", "text": "x"}],
            "sys": None,
            "pictures": [bad["bomb"]],
            "clips": [],
        },
    ]
    return {"sharegpt": sharegpt, "openai": openai, "custom": custom}


# --- writers -------------------------------------------------------------------------


def _write_jsonl(path: Path, records: list[dict], bad: list, rng: random.Random, tail: list[dict]) -> None:
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    for item in bad:
        lines.insert(rng.randrange(len(lines) + 1), item if isinstance(item, str) else json.dumps(item))
    lines.insert(len(lines) // 2, "")  # a blank line is not a record
    lines += [json.dumps(r) for r in tail]
    path.write_text("\n".join(lines) + "\n")


def _write_json(data: Path, stem: str, records: list[dict], rng: random.Random) -> list[str]:
    """``stem.json``, or ``stem-NNNNN.json`` files of ``JSON_FILE_RECORDS`` records each when
    there are more (one task reads a JSON array); their paths under the root."""
    records = list(records)
    rng.shuffle(records)
    if len(records) <= JSON_FILE_RECORDS:
        (data / f"{stem}.json").write_text(json.dumps(records, ensure_ascii=False, indent=1))
        return [f"data/{stem}.json"]
    paths = []
    for part, first in enumerate(range(0, len(records), JSON_FILE_RECORDS)):
        chunk = records[first : first + JSON_FILE_RECORDS]
        (data / f"{stem}-{part:05d}.json").write_text(json.dumps(chunk, ensure_ascii=False, indent=1))
        paths.append(f"data/{stem}-{part:05d}.json")
    return paths


def _write_parquet(path: Path, records: list[dict]) -> None:
    schema = pa.schema(
        [
            ("dialog", pa.list_(pa.struct([("speaker", pa.string()), ("text", pa.string())]))),
            ("sys", pa.string()),
            ("pictures", pa.list_(pa.string())),
            ("clips", pa.list_(pa.string())),
        ]
    )
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=2000)


def _write_config(root: Path, json_paths: list[str]) -> Path:
    config = {
        "datasets": [
            {"name": "sharegpt_jsonl", "paths": ["data/sharegpt.jsonl"], "media_root": "media"},
            {
                "name": "openai_json",
                "paths": json_paths,
                "media_root": "media",
                "dialect": "openai",
            },
            {
                "name": "custom_parquet",
                "paths": ["data/*.parquet"],
                "media_root": "media",
                "dialect": "sharegpt",
                "columns": {
                    "messages": "dialog",
                    "system": "sys",
                    "images": "pictures",
                    "videos": "clips",
                },
                "tags": {
                    "role_key": "speaker",
                    "content_key": "text",
                    "user": "USER",
                    "assistant": "BOT",
                },
            },
        ]
    }
    path = root / "mmpack.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
