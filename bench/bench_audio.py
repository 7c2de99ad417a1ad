"""Audio decoding and Whisper features per core (issue 57): mmpack's audio path beside the
decoder alone, on real clips this script writes (tones and noise, WAV and FLAC; 16 kHz and
44.1 kHz, stereo at 44.1 kHz), one core.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_audio.py --seconds 5 30

Paths, each over the clip's bytes in memory, best of three passes:

- **decoder alone**: PyAV opens the bytes and decodes every frame (no resampling), the floor
  any FFmpeg-based decoder pays;
- **probe** (normalize, per clip): ``loader.audio.probe``, a whole decode that counts the
  16 kHz mono samples tokenize plans from;
- **decode** (the loader): ``loader.audio.decode``, the 16 kHz mono float32 waveform;
- **decode + features** (the loader, Qwen2-Audio): ``decode`` then ``whisper_features``
  (transformers' WhisperFeatureExtractor, 128 mel bins, padded to 30 s).

Results: OUT/bench_audio.json and a Markdown table on stdout (audio seconds per second of
one core, and each path's time over the decoder alone's).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable

import av
import numpy as np
from common import OUT, machine, parse_with_smoke

from loader import audio
from mmpack_udfs.config.model import WhisperFeatures

FEATURES = WhisperFeatures().model_dump()
LAYOUTS = {1: "mono", 2: "stereo"}
FORMATS = (("wav", 16_000, 1), ("wav", 44_100, 2), ("flac", 16_000, 1), ("flac", 44_100, 2))


def clip(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """Tones under noise, [channels, samples] int16: what speech-band audio looks like to a codec."""
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.25 * np.sin(2 * np.pi * 440 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    noise = 0.05 * np.random.default_rng(seed).standard_normal((channels, t.size))
    return (np.clip(tone + noise, -1, 1) * 32767).astype(np.int16)


def encoded(samples: np.ndarray, rate: int, container: str) -> bytes:
    """``samples`` written by FFmpeg (PyAV) as a WAV (16-bit PCM) or FLAC file."""
    out = io.BytesIO()
    layout = LAYOUTS[samples.shape[0]]
    with av.open(out, "w", format=container) as output:
        stream = output.add_stream("pcm_s16le" if container == "wav" else "flac", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            output.mux(packet)
        for packet in stream.encode(None):
            output.mux(packet)
    return out.getvalue()


def decoder_alone(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples for frame in container.decode(audio=0))


def features(data: bytes) -> np.ndarray:
    return audio.whisper_features(audio.decode(data), FEATURES)[0]


PATHS: dict[str, Callable[[bytes], object]] = {
    "decoder alone": decoder_alone,
    "probe": audio.probe,
    "decode": audio.decode,
    "decode + features": features,
}


def best_seconds(path: Callable[[bytes], object], data: bytes, passes: int) -> float:
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        path(data)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[5.0, 30.0], help="clip lengths")
    parser.add_argument("--passes", type=int, default=3)
    args = parse_with_smoke(parser, seconds=[0.5], passes=1)
    rows = []
    features(encoded(clip(0.1, 16_000, 1), 16_000, "wav"))  # imports transformers, builds the extractor
    for seconds in args.seconds:
        for container, rate, channels in FORMATS:
            data = encoded(clip(seconds, rate, channels), rate, container)
            timings = {name: best_seconds(path, data, args.passes) for name, path in PATHS.items()}
            floor = timings["decoder alone"]
            rows.append({
                "clip": f"{seconds:g} s {container} {rate / 1000:g} kHz {LAYOUTS[channels]}",
                "bytes": len(data),
                **{f"{name} ms": round(t * 1e3, 2) for name, t in timings.items()},
                **{f"{name} audio s/s": round(seconds / t) for name, t in timings.items()},
                **{f"{name} / decoder": round(t / floor, 1) for name, t in timings.items()},
            })  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "av": av.__version__, "decoder": audio.DECODER, "rows": rows}
    (OUT / "bench_audio.json").write_text(json.dumps(result, indent=2))
    print(f"{machine()}; {audio.DECODER}; one core\n")
    print("| clip | " + " | ".join(f"{p} (audio s/s, × decoder)" for p in PATHS) + " |")
    print("|---|" + "---:|" * len(PATHS))
    for row in rows:
        cells = [f"{row[f'{p} audio s/s']:,} ({row[f'{p} / decoder']}×)" for p in PATHS]
        print(f"| {row['clip']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
