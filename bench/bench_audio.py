"""Audio decoding and Whisper features per core (issue 57): mmpack's audio path beside the
decoder alone, on real clips this script writes (a tone under noise as WAV, FLAC, MP3 and
Ogg Opus; 16 kHz and 22.05 kHz mono, 44.1 kHz stereo), one core.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_audio.py --seconds 5 30

Paths, each over the clip's bytes in memory:

- **decoder alone**: PyAV opens the bytes and decodes every frame (no resampling), the floor
  any FFmpeg-based decoder pays;
- **probe** (normalize, per clip): ``loader.audio.probe``, a whole decode that counts the
  16 kHz mono samples tokenize plans from;
- **decode** (the loader): ``loader.audio.decode``, the 16 kHz mono float32 waveform;
- **decode + features** (the loader, Qwen2-Audio): ``decode`` then ``whisper_features``
  (transformers' WhisperFeatureExtractor, 128 mel bins, padded to 30 s);
- **decode + clip features** (the loader, Qwen3-Omni): ``decode`` then the features of the clip
  alone, unpadded (``whisper_features(..., "clip")``).

Each pass runs every path on every clip in turn for ``--min-pass`` seconds; a figure is the
fastest call of ``--passes`` passes (this machine's other processes slow calls, never speed one
up, and a burst of them spoils a figure only when it lasts through every pass). Opus decodes
at 48 kHz whatever its input's rate; a format whose encoder this FFmpeg build lacks is skipped,
and the output says so. torch (WhisperFeatureExtractor computes with it) runs on one thread
while timing. Results: OUT/bench_audio.json and a Markdown table on stdout (ms per clip, audio
seconds per second of one core, time over the decoder alone's).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import av
import numpy as np
import transformers
from common import OUT, machine, parse_with_smoke

from loader import audio
from mmpack_udfs.config.model import Qwen3OmniProfile, WhisperFeatures

FEATURES = WhisperFeatures().model_dump()
CLIP_FEATURES = Qwen3OmniProfile().audio.model_dump()
LAYOUTS = {1: "mono", 2: "stereo"}
SOURCES = ((16_000, 1), (22_050, 1), (44_100, 2))  # (rate, channels) of the clips written
# name: (container, encoder, sources it encodes); libopus takes 8/12/16/24/48 kHz only
FORMATS = {
    "wav": ("wav", "pcm_s16le", SOURCES),
    "flac": ("flac", "flac", SOURCES),
    "mp3": ("mp3", "libmp3lame", SOURCES),
    "opus": ("ogg", "libopus", ((16_000, 1), (48_000, 2))),
}


def clip(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """A 440 Hz tone, slowly modulated, under noise: [channels, samples] int16."""
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.25 * np.sin(2 * np.pi * 440 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    noise = 0.05 * np.random.default_rng(seed).standard_normal((channels, t.size))
    return (np.clip(tone + noise, -1, 1) * 32767).astype(np.int16)


def encoded(samples: np.ndarray, rate: int, container: str, encoder: str) -> bytes:
    """``samples`` encoded by FFmpeg (PyAV) with ``encoder`` into a ``container`` file."""
    out, layout = io.BytesIO(), LAYOUTS[samples.shape[0]]
    with av.open(out, "w", format=container) as output:
        stream = output.add_stream(encoder, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            output.mux(packet)
    return out.getvalue()


def missing_encoders() -> dict[str, str]:
    """The formats this FFmpeg build cannot write, and why."""
    missing = {}
    for name, (container, encoder, (source, *_)) in FORMATS.items():
        try:
            encoded(clip(0.05, *source), source[0], container, encoder)
        except (av.FFmpegError, ValueError) as err:
            missing[name] = f"{encoder}: {err}"
    return missing


def decoder_alone(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        stream.thread_type = "NONE"  # as loader.audio decodes
        return sum(frame.samples for frame in container.decode(stream))


def features(data: bytes) -> np.ndarray:
    return audio.whisper_features(audio.decode(data), FEATURES)[0]


def clip_features(data: bytes) -> np.ndarray:
    return audio.whisper_features(audio.decode(data), CLIP_FEATURES, "clip")[0]


PATHS: dict[str, Callable[[bytes], object]] = {
    "decoder alone": decoder_alone,
    "probe": audio.probe,
    "decode": audio.decode,
    "decode + features": features,
    "decode + clip features": clip_features,
}


@dataclass(frozen=True)
class Clip:
    label: str  # its length, format, decoded rate and layout
    seconds: float
    data: bytes


def clips(seconds: float, missing: dict[str, str]) -> Iterator[Clip]:
    """Each format's clips of ``seconds``, but those of formats it cannot write."""
    for name, (container, encoder, sources) in FORMATS.items():
        if name in missing:
            continue
        for rate, channels in sources:
            data = encoded(clip(seconds, rate, channels), rate, container, encoder)
            info = audio.probe(data)
            layout = LAYOUTS[info.channels]
            yield Clip(f"{seconds:g} s {name} {info.sample_rate / 1000:g} kHz {layout}", seconds, data)


def calls_per_pass(path: Callable[[bytes], object], data: bytes, min_pass: float) -> int:
    """How many calls of ``path`` on ``data`` last ``min_pass`` s (timed on one that warms it)."""
    started = time.perf_counter()
    path(data)
    return max(1, math.ceil(min_pass / (time.perf_counter() - started)))


def fastest_call(path: Callable[[bytes], object], data: bytes, calls: int) -> float:
    best = math.inf
    for _ in range(calls):
        started = time.perf_counter()
        path(data)
        best = min(best, time.perf_counter() - started)
    return best


def timings(every: list[Clip], passes: int, min_pass: float) -> list[dict[str, float]]:
    """Each clip's fastest call per path, in seconds. Each pass runs every clip and path in turn
    for ``min_pass`` s: a burst of other work on the machine spoils a figure only when it lasts
    through every pass (the fastest call is the one nothing slowed)."""
    calls = [{p: calls_per_pass(path, c.data, min_pass) for p, path in PATHS.items()} for c in every]
    best = [dict.fromkeys(PATHS, math.inf) for _ in every]
    for _ in range(passes):
        for c, counts, fastest in zip(every, calls, best, strict=True):
            for p, path in PATHS.items():
                fastest[p] = min(fastest[p], fastest_call(path, c.data, counts[p]))
    return best


@contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """torch on one thread while timing, if it is imported; its thread count restored after
    (the smoke runner runs the other benchmarks in this process)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else 0
    if torch:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch:
            torch.set_num_threads(threads)


def row(clip: Clip, seconds: dict[str, float]) -> dict:
    """One clip's figures: per path, ms per clip, audio s per s and time over the decoder alone's."""
    floor = seconds["decoder alone"]
    return {
        "clip": clip.label,
        "bytes": len(clip.data),
        **{f"{p} ms": round(t * 1e3, 2) for p, t in seconds.items()},
        **{f"{p} audio s/s": round(clip.seconds / t) for p, t in seconds.items()},
        **{f"{p} / decoder": round(t / floor, 1) for p, t in seconds.items()},
    }


def table(rows: list[dict]) -> str:
    lines = ["| clip | " + " | ".join(PATHS) + " |", "|---|" + "---:|" * len(PATHS)]
    for r in rows:
        cells = [
            f"{r[f'{p} ms']:,.1f} ms, {r[f'{p} audio s/s']:,} s/s ({r[f'{p} / decoder']}×)" for p in PATHS
        ]
        lines.append(f"| {r['clip']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[5.0, 30.0], help="clip lengths")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--min-pass", type=float, default=0.3, help="s per path and clip in a pass")
    args = parse_with_smoke(parser, seconds=[0.5], passes=1, min_pass=0.0)
    features(encoded(clip(0.1, 16_000, 1), 16_000, "wav", "pcm_s16le"))  # imports torch: one thread below
    missing = missing_encoders()
    every = [c for seconds in args.seconds for c in clips(seconds, missing)]
    with torch_on_one_thread():
        rows = list(map(row, every, timings(every, args.passes, args.min_pass)))
    versions = {"decoder": audio.decoder(), "transformers": transformers.__version__}
    result = {"machine": machine(), **versions, "skipped": missing, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_audio.json").write_text(json.dumps(result, indent=2))
    print(f"{machine()}; {audio.decoder()}; transformers {transformers.__version__}; one core\n")
    print(table(rows))
    for name, why in missing.items():
        print(f"\nskipped {name}: no encoder in this FFmpeg build ({why})")


if __name__ == "__main__":
    main()
