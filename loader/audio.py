"""Audio bytes → waveforms, one way for every stage: FFmpeg's decoders and resampler (PyAV).

normalize probes each audio with ``probe``: it decodes every frame (a cut or corrupt file is
found there, not in training) and counts the samples of the 16 kHz waveform that tokenize
plans tokens from; the loader computes features from ``decode``'s waveform of the same clip
(``whisper_features``: transformers' own WhisperFeatureExtractor, imported only there), so
every stage sees the same waveform.

Why FFmpeg: transformers 5.24 (``audio_utils.load_audio``) decodes with torchcodec, which is
FFmpeg's decoders and ``swresample`` too, and falls back to soundfile + soxr without it.
soundfile cannot read m4a/AAC or a video's audio track, and soxr resamples differently
(log-mel values differ by up to ~1 after resampling; none on 16 kHz input, where no stage
resamples). A processor sees mmpack's features when it is given ``decode``'s waveform, or
decodes with torchcodec (``docs/models/qwen2_audio.md``). ``decoder()`` names the decoder: pack
records it in the manifest (``audio_decoder``), a loader decoding with another build refuses
the pack, and a clip whose feature frames differ from the plan is refused too. PyAV is imported
on first use: a loader of packs without audio never loads FFmpeg's libraries.
"""

from __future__ import annotations

import functools
import io
import math
import os
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack_udfs.constants import AUDIO_SAMPLE_RATE

if TYPE_CHECKING:
    import av

SAMPLE_RATE = AUDIO_SAMPLE_RATE
# a file is cut when it decodes to less than its header's duration by more than this (seconds,
# or this share of it): codecs' priming and padding differ by a few milliseconds
CUT_TOLERANCE_S, CUT_TOLERANCE_SHARE = 0.1, 0.05

Source = str | bytes  # a local path or the file's bytes


@functools.cache
def decoder() -> str:
    """The FFmpeg build that decodes here: PyAV's version and its libavcodec's."""
    import av

    return f"pyav-{av.__version__}/libavcodec-{'.'.join(map(str, av.library_versions['libavcodec']))}"


def require_decoder(planned: str | None, where: str) -> None:
    """Refuse to decode a pack's audio with another FFmpeg build than the one its clips were
    counted with (``planned``: the manifest's ``audio_decoder``; None for a pack without audio):
    the waveforms, and so the features, could differ from the plan by a resampler's change."""
    if planned is not None and planned != decoder():
        raise ValueError(
            f"{where}: its audio was planned with {planned}, and this loader decodes with {decoder()}: "
            "install the PyAV the pack was made with (mmpack pins av), or re-run normalize, tokenize "
            "and pack with this one"
        )


class AudioProblem(ValueError):
    """Why an audio cannot be used: ``kind`` is one of ``unreadable``, ``no_audio_stream``,
    ``codec_unsupported``, ``empty``, ``cut``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What a probe read: the stream as stored, and its length as decoded."""

    sample_rate: int
    channels: int
    samples: int  # per channel, as decoded (not as the header claims)
    codec: str
    container: str
    samples_16k: int = 0  # of the 16 kHz mono waveform ``decode`` gives: what feature frames count

    @property
    def duration(self) -> float:
        return self.samples / self.sample_rate


@contextmanager
def _opened(source: Source) -> Iterator[tuple[av.container.InputContainer, av.audio.stream.AudioStream]]:
    """The container and its first audio stream; AudioProblem when there is none or it has no decoder."""
    import av

    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else source, "r")
    except (av.FFmpegError, OSError, ValueError) as err:
        raise AudioProblem("unreadable", f"FFmpeg cannot open it: {_reason(err)}") from err
    try:
        if not container.streams.audio:
            raise AudioProblem("no_audio_stream", f"no audio stream in this {container.format.name} file")
        stream = container.streams.audio[0]
        if stream.codec_context is None:
            raise AudioProblem(
                "codec_unsupported",
                f"FFmpeg has no decoder for this {container.format.name} file's audio codec",
            )
        stream.thread_type = "NONE"  # one thread: normalize's tasks already use every core
        yield container, stream
    finally:
        container.close()


def _reason(err: Exception) -> str:
    return getattr(err, "strerror", None) or str(err)


def _frames(container, stream, started: list[int]) -> Iterator[av.AudioFrame]:
    """The stream's decoded frames; AudioProblem ``cut`` when decoding fails after some samples
    (``started[0]``: samples so far), ``unreadable`` when it fails before any."""
    import av

    try:
        yield from container.decode(stream)
    except av.FFmpegError as err:
        if started[0]:
            raise AudioProblem("cut", f"decoding stops after {started[0]} samples: {_reason(err)}") from err
        raise AudioProblem("unreadable", f"no frame decodes: {_reason(err)}") from err


def probe(source: Source) -> AudioInfo:
    """Decode every frame of the first audio stream: its rate, channels, decoded length and the
    length of its 16 kHz waveform. AudioProblem when it cannot be used (no stream, no decoder,
    nothing decodes, cut short)."""
    if _head(source, 1)[1] == 0:
        raise AudioProblem("empty", "the file is empty (0 bytes)")
    with _opened(source) as (container, stream):
        ctx, decoded = stream.codec_context, [0]
        resampled = sum(len(part) for part in _resampled(container, stream, SAMPLE_RATE, decoded))
        info = AudioInfo(
            ctx.sample_rate, ctx.channels, decoded[0], ctx.name, container.format.name, resampled
        )
        declared = float(stream.duration * stream.time_base) if stream.duration else None
    if info.samples == 0 or info.sample_rate <= 0:
        raise AudioProblem("empty", "the audio stream holds no samples")
    tolerance = max(CUT_TOLERANCE_S, CUT_TOLERANCE_SHARE * (declared or 0.0))
    if declared is not None and info.duration < declared - tolerance:
        raise AudioProblem(
            "cut", f"decodes to {info.duration:.3f} s of the {declared:.3f} s its header declares"
        )
    _check_wav_data(source, info)
    return info


def _resampled(container, stream, sample_rate: int, decoded: list[int]) -> Iterator[np.ndarray]:
    """The stream as float32 mono chunks at ``sample_rate`` (FFmpeg's ``swresample``, its default
    filter and downmix); ``decoded[0]`` counts the samples decoded at the stream's own rate."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    for frame in _frames(container, stream, decoded):
        decoded[0] += frame.samples
        yield from (out.to_ndarray()[0] for out in resampler.resample(frame))
    yield from (out.to_ndarray()[0] for out in resampler.resample(None))


def _check_wav_data(source: Source, info: AudioInfo) -> None:
    """A WAV file whose data chunk claims more bytes than the file holds is cut (FFmpeg quietly
    takes the length from the file size)."""
    if info.container != "wav":
        return
    head, size = _head(source, 4096)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return
    pos = 12
    while pos + 8 <= len(head):
        chunk, length = head[pos : pos + 4], struct.unpack("<I", head[pos + 4 : pos + 8])[0]
        if chunk == b"data":
            streaming = length in (0, 0xFFFFFFFF)  # written before its length was known
            if not streaming and pos + 8 + length > size:
                raise AudioProblem(
                    "cut", f"its data chunk declares {length} bytes, the file holds {size - pos - 8}"
                )
            return
        pos += 8 + length + (length & 1)


def _head(source: Source, count: int) -> tuple[bytes, int]:
    if isinstance(source, bytes):
        return source[:count], len(source)
    with open(source, "rb") as f:
        return f.read(count), os.fstat(f.fileno()).st_size


def decode(source: Source, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The first audio stream as one float32 mono waveform at ``sample_rate``: FFmpeg's
    ``swresample`` with its default filter and downmix, as torchcodec's ``AudioDecoder(source,
    sample_rate=..., num_channels=1)`` gives transformers."""
    with _opened(source) as (container, stream):
        parts = list(_resampled(container, stream, sample_rate, [0]))
    if not parts:
        raise AudioProblem("empty", "the audio stream holds no samples")
    return np.concatenate(parts).astype(np.float32, copy=False)


@functools.lru_cache(maxsize=4)
def _extractor(feature_size: int, hop_length: int, n_fft: int, n_samples: int, padding_value: float):
    # transformers' own WhisperFeatureExtractor: the features are the processor's by construction
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=feature_size,
        sampling_rate=SAMPLE_RATE,
        hop_length=hop_length,
        chunk_length=n_samples // SAMPLE_RATE,
        n_fft=n_fft,
        padding_value=padding_value,
    )


def whisper_features(
    waveform: np.ndarray, settings: Mapping[str, Any], padding: str = "chunk", pad_to: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One clip's log-mel features [feature_size, frames] and their mask [frames], as the
    processor computes them for the clip alone (``settings``: the profile's ``audio`` section),
    by ``padding`` (``Family.audio_features``):

    - ``chunk``: padded with zeros (or cut) to ``n_samples`` (Qwen2-Audio);
    - ``frames``: only the clip's own ``ceil(samples / hop_length)`` frames of that chunk, all kept:
      the same values (to float32 rounding: a matrix product over fewer frames may round an element
      two units in the last place apart), computed from just enough of the zero padding for the last
      frame's window
      (Qwen2.5-Omni's encoder reads no frame past a clip's mask, and a 300 s chunk per clip would be
      15 MB of features);
    - ``clip``: the clip zero-padded to ``pad_to`` samples (its sample's longest clip; itself by
      default), uncut, as Qwen3-Omni's processor pads a call's clips to its longest only: the
      padded waveform's features, the STFT reflecting at its end, of which the frames its mask
      keeps, ``min(ceil(samples / hop_length), pad_to // hop_length)``.
    """
    keys = ("feature_size", "hop_length", "n_fft", "n_samples", "padding_value")
    extractor = _extractor(*(settings[k] for k in keys))
    call = {"sampling_rate": SAMPLE_RATE, "return_attention_mask": True, "return_tensors": "np"}
    hop, n_samples = int(settings["hop_length"]), int(settings["n_samples"])
    if padding == "clip":
        padded = np.pad(waveform, (0, (pad_to or len(waveform)) - len(waveform)))
        out = extractor(padded, padding="longest", truncation=False, **call)
        kept = min(-(-len(waveform) // hop), len(padded) // hop)
        return out["input_features"][0][:, :kept], np.ones(kept, out["attention_mask"].dtype)
    frames = math.ceil(len(waveform) / hop)
    # past the last frame's centre, a zero tail longer than half its window (n_fft ≤ 2 hops here)
    whole = padding == "chunk"
    length = n_samples if whole else min(n_samples, (frames + 2 + int(settings["n_fft"]) // hop) * hop)
    out = extractor(waveform, padding="max_length", max_length=length, truncation=True, **call)
    features, mask = out["input_features"][0], out["attention_mask"][0]
    if not whole:
        return features[:, :frames], mask[:frames]
    return features, mask
