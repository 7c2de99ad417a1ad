"""The Qwen-Omni thinkers in transformers: Qwen2.5-Omni (``model_type: qwen2_5_omni`` or
``qwen2_5_omni_thinker``, ``Qwen2_5OmniThinkerForConditionalGeneration``, ``Qwen2_5OmniProcessor``)
and Qwen3-Omni (``qwen3_omni_moe`` or ``qwen3_omni_moe_thinker``,
``Qwen3OmniMoeThinkerForConditionalGeneration``, ``Qwen3OmniMoeProcessor``: ``Qwen3Omni`` below says
what differs).

The thinker is Qwen2.5-VL's vision tower and language model with Qwen2-Audio's audio encoder:

- **Images** are Qwen2-VL's (``smart_resize`` within the image processor's pixel limits).
- **Videos** are Qwen2-VL's frames, resized within the limits the *processor* passes to its video
  processor on every call (``Qwen2_5OmniProcessor.videos_kwargs``: 128 to 768 merged tokens per
  frame), whatever the video processor's own config says. A temporal patch lasts
  ``temporal_patch_size / fps`` seconds, with ``fps`` the rate frames were sampled at (the
  processor's ``video_second_per_grid``).
- **Audio**: every clip is a 16 kHz waveform (``loader.audio.decode``: FFmpeg) and
  ``L = ceil(samples / hop_length)`` Whisper frames; it becomes ``(((L - 1) // 2 + 1) - 2) // 2 + 1``
  ``<|AUDIO|>`` tokens between ``<|audio_bos|>`` and ``<|audio_eos|>``. The processor pads every clip
  to the feature extractor's ``n_samples`` (300 s in the published config) and cuts longer ones,
  so a longer clip is refused rather than trained on sound the model never hears.
- **Positions** (TMRoPE, the thinker's ``get_rope_index``): text and audio spans count up on all
  three rows; an image or video block starting at position p takes
  ``(p + int(i · second_per_grid · position_id_per_seconds), p + row, p + column)`` and the token
  after it the block's largest position + 1 (Qwen2.5-VL's rule is p + max(h, w) instead).
- **Chat**: ChatML with a default system prompt, a message's content parts written in order.

- **Audio in video** (``tokenize.use_audio_in_video``): a video's own track (counted by normalize,
  ``audio_samples``) is planned as a clip; the processor writes ``<|vision_bos|><|audio_bos|>``, the
  video's and the track's tokens in 2 s chunks (``seconds_per_chunk`` × ``position_id_per_seconds``
  time indices each, video chunk first), ``<|audio_eos|><|vision_eos|>``; the tokenized row holds
  the video and, after it, its track (kind ``audio``, the video's uri).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import IdleMedia, LayoutElement, MediaPlan, MediaTokens
from mmpack_udfs.families.qwen2_audio import audio_tokens, clip_plan
from mmpack_udfs.families.qwen_vl import Qwen25VL, block_grid, span_positions
from mmpack_udfs.reasons import Reason, Rejected

# Qwen3OmniMoeProcessor's position_id_per_seconds (transformers 5.24): the time scale of its
# video-and-track merge, whatever the model's config says
PROCESSOR_TIME_SCALE = 13.0


class Qwen25Omni(Qwen25VL):
    """The Qwen2.5-Omni thinker (3B, 7B): images, videos and audio clips of up to ``n_samples``."""

    kind = "qwen2_5_omni"
    rl_prompts = False  # its generation prompt is not verified for RL exports
    modalities: ClassVar[tuple[str, ...]] = ("image", "video", "audio")
    content_parts = True  # its template reads a message's content parts
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|vision_bos|>",), "<|IMAGE|>", ("<|vision_eos|>",)),
        "video": MediaTokens(("<|vision_bos|>",), "<|VIDEO|>", ("<|vision_eos|>",)),
        "audio": MediaTokens(("<|audio_bos|>",), "<|AUDIO|>", ("<|audio_eos|>",)),
    }
    audio_features = "frames"  # its encoder reads each clip's own frames only
    idle_clip_frames = next(n for n in range(1, 100) if audio_tokens(n) == 1)  # 3

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        """Qwen2-VL's frames and grid; a temporal patch lasts temporal patch / the sampling rate."""
        seconds = self.temporal_patch_size / float(self.settings["video"]["fps"])
        return dataclasses.replace(super().plan_video(frames, fps, width, height), second_per_grid_t=seconds)

    def plan_audio(self, samples: int) -> MediaPlan:
        """A clip of ``samples`` 16 kHz samples: grid (feature frames, 1, 1)."""
        return clip_plan(
            self.settings["audio"], samples, "Qwen2.5-Omni", 1, "the encoder gives it no feature"
        )

    @property
    def audio_in_video(self) -> bool:
        """Whether videos bring their own audio track (``tokenize.use_audio_in_video``)."""
        return bool(self.settings.get("use_audio_in_video"))

    def plans(self, media: Sequence[Mapping[str, Any]]) -> list[MediaPlan]:
        """Each item's plan; with audio in video, a video's plan carries its track's
        (``MediaPlan.audio``: the samples normalize counted, ``audio_samples``). A clip's and a
        track's plan may depend on the sample's longest clip or track (``plan_clip``)."""
        tracks = self.audio_in_video
        lengths = [m["frames"] for m in media if m["kind"] == "audio"]
        lengths += [m["audio_samples"] for m in media if m["kind"] == "video" and tracks]
        longest = max(lengths, default=0)
        plans = []
        for item in media:
            if item["kind"] == "audio":
                plans.append(self.plan_clip(item["frames"], longest))
                continue
            plan = self.plan(item)
            if plan.kind == "video" and tracks:
                plan = dataclasses.replace(plan, audio=self.plan_clip(item["audio_samples"], longest))
            plans.append(plan)
        return plans

    def plan_clip(self, samples: int, longest: int) -> MediaPlan:
        """A clip (or track) of ``samples`` in a sample whose longest one has ``longest``: the
        processor pads every clip to its whole chunk, so the longest changes nothing."""
        return self.plan_audio(samples)

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        """A video with its track: its start token and the track's, the video's and the track's
        tokens in the processor's order (``track_runs``), the track's end token and the video's."""
        if plan.audio is None:
            return super().media_layout(plan)
        video, audio = self.media_tokens["video"], self.media_tokens["audio"]
        return [
            ("token", video.before[0]), ("token", audio.before[0]), *self.track_runs(plan),
            ("token", audio.after[0]), ("token", video.after[0]),
        ]  # fmt: skip

    def track_runs(self, plan: MediaPlan) -> list[LayoutElement]:
        """Video and audio tokens in 2 s chunks: video chunk j, audio chunk j, … as
        ``Qwen2_5OmniProcessor.replace_video_with_audio_token`` interleaves them."""
        runs: list[LayoutElement] = []
        video_runs, audio_runs = self._chunks(plan.grid, plan.second_per_grid_t, plan.audio.num_tokens, True)
        for j in range(max(len(video_runs), len(audio_runs))):
            if j < len(video_runs):
                runs.append(("pad", video_runs[j]))
            if j < len(audio_runs):
                runs.append(("track", audio_runs[j]))
        return runs

    def _chunks(
        self, grid: tuple[int, int, int], seconds: float, sound_tokens: int, processor: bool
    ) -> tuple[list[int], list[int]]:
        """Token counts of the 2 s chunks of a video of ``grid`` (patches) and of its track's
        ``sound_tokens``: by the processor's time indices (float64) or the model's
        (``get_rope_index``: float32, truncated)."""
        per_chunk = int(self.settings["position_id_per_seconds"] * self.settings["seconds_per_chunk"])
        per_patch = grid[1] * grid[2] // self.merge_size**2
        times = self._times(grid[0], seconds, exact=processor)
        return chunk_lengths(np.repeat(times, per_patch), per_chunk), chunk_lengths(
            np.arange(sound_tokens), per_chunk
        )

    def _times(self, t: int, seconds: float, exact: bool) -> np.ndarray:
        """Each temporal patch's time index: ``i · seconds · position_id_per_seconds``, in float64
        (the processor's) or float32 truncated (the model's)."""
        per_second = self.settings["position_id_per_seconds"]
        if exact:
            return np.arange(t) * float(seconds) * per_second
        return (np.arange(t, dtype=np.float32) * np.float32(seconds) * np.float32(per_second)).astype(
            np.int64
        )

    def positions(self, length: int, media: Sequence[Mapping[str, Any]]) -> np.ndarray:
        rows = sorted(media, key=lambda m: m["token_offset"])
        spans = []
        for index, item in enumerate(rows):
            if item["kind"] == "audio":  # a clip counts as text (a video's track: with its video)
                continue
            if item["kind"] == "video" and self.audio_in_video:
                spans.append(self._video_with_track(item, rows[index + 1]))
            else:
                spans.append(self._block(item))
        return span_positions(length, spans)

    def _block(self, item: Mapping[str, Any]) -> tuple[int, np.ndarray, int]:
        """An image's or video's block: (offset, positions from 0, advance: largest + 1)."""
        h, w = item["grid_h"] // self.merge_size, item["grid_w"] // self.merge_size
        seconds = item["second_per_grid_t"] if item["kind"] == "video" else 1.0
        grid = block_grid(self._times(item["grid_t"], seconds, exact=False), h, w)
        return item["token_offset"], grid, int(grid.max()) + 1

    def _video_with_track(
        self, video: Mapping[str, Any], track: Mapping[str, Any]
    ) -> tuple[int, np.ndarray, int]:
        """A video with its track, from its ``<|vision_bos|>``: the two bos tokens share a
        position; the video's block and the track's run both start after it and are taken in the
        model's 2 s chunks (video chunk j, then audio chunk j); the two eos tokens share the last
        chunk's largest position + 1 (``get_rope_index`` with ``use_audio_in_video``)."""
        sound = audio_tokens(track["grid_t"])
        grid_thw = (video["grid_t"], video["grid_h"], video["grid_w"])
        _, grid, _ = self._block(video)
        heard = np.broadcast_to(np.arange(sound), (3, sound))
        video_runs, audio_runs = self._chunks(grid_thw, video["second_per_grid_t"], sound, False)
        parts, v, a = [np.zeros((3, 2), np.int64)], 0, 0
        for j in range(max(len(video_runs), len(audio_runs))):
            if j < len(video_runs):
                parts.append(grid[:, v : v + video_runs[j]] + 1)
                v += video_runs[j]
            if j < len(audio_runs):
                parts.append(heard[:, a : a + audio_runs[j]] + 1)
                a += audio_runs[j]
        eos = int(parts[-1].max()) + 1
        parts.append(np.full((3, 2), eos, np.int64))
        return video["token_offset"] - 2, np.concatenate(parts, axis=1), eos + 1

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """Qwen-VL's idle image and video, and one silent clip of the fewest frames that give a
        token (``idle_clip_frames``)."""
        vision = super().idle_media(config)
        mel = int(config.audio_config.num_mel_bins)
        frames = cls.idle_clip_frames
        clip = IdleMedia(
            "audio", "input_features", (1, mel, frames), int(config.audio_token_id), 1,
            {"feature_attention_mask": [[1] * frames]},
        )  # fmt: skip
        return [*vision, clip]


def merged_order(video: np.ndarray, audio: np.ndarray) -> np.ndarray:
    """Which tokens of a video merged with its track are the video's (True), in order: both sorted
    by time, a video token first on a tie (``v <= a``), as the Qwen3-Omni processor and model
    merge them (each in its own arithmetic: pass float64 or float32 times)."""
    before = np.searchsorted(audio, video, side="left")  # track tokens before each video token
    order = np.zeros(len(video) + len(audio), bool)
    order[np.arange(len(video)) + before] = True
    return order


def _run(start: np.float32, count: int) -> np.ndarray:
    """[3, count] float32: ``start``, ``start + 1``, … on all three rows (Qwen3-Omni's text runs)."""
    return np.broadcast_to(np.arange(count, dtype=np.float32) + start, (3, count))


def chunk_lengths(indices: np.ndarray, per_chunk: int) -> list[int]:
    """Token counts of the chunks transformers cuts a run of time indices into
    (``get_chunked_index``): a chunk ends before the first token at or past ``k · per_chunk``,
    k counting up by one per cut."""
    cuts, current = [0], 1
    for i, value in enumerate(indices.tolist()):
        if value >= current * per_chunk:
            cuts.append(i)
            current += 1
    cuts.append(len(indices))
    return [b - a for a, b in itertools.pairwise(cuts)]


def qwen3_omni_audio_tokens(frames: int, window: int = 50) -> int:
    """``<|audio_pad|>`` tokens of ``frames`` feature frames under Qwen3-Omni's audio encoder: 13 per
    whole chunk of ``2 · window`` frames, and the remainder's three stride-2 convolutions
    (``processing_qwen3_omni_moe._get_feat_extract_output_lengths``)."""
    chunk = 2 * window
    rest = (frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


class Qwen3Omni(Qwen25Omni):
    """The Qwen3-Omni thinker (30B-A3B Instruct, Thinking, Captioner): Qwen3-VL's vision tower
    (patch 16) on Qwen2-VL's image and video processors, a chunked audio encoder, a Qwen3-MoE
    language model, and float time positions.

    - **Audio**: the processor pads a call's clips to the longest and cuts none (``padding: True``,
      ``truncation: False``). So, for one sample alone, its longest clip is its own
      ``samples // hop_length`` frames, computed from the clip alone (the STFT reflects at its
      end), and every shorter clip ``ceil(samples / hop_length)`` frames (at most the longest's)
      computed from the clip zero-padded to the longest (``plan_clip``;
      ``loader.audio.whisper_features(..., "clip", pad_to=)``); ``qwen3_omni_audio_tokens`` tokens
      each. A sample whose longest clip has ``n_fft / 2`` samples or fewer is refused: the feature
      extractor raises on it.
    - **Positions** (``Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index``):
      text, a media item's start and end tokens and audio count up on all three rows; an image or
      video block starting at p takes ``(p + i · second_per_grid · position_id_per_seconds, p + row,
      p + column)`` and the next token its largest position + 1. The model computes them in
      float32 and never truncates: a video sampled at a rate that does not divide
      ``temporal_patch_size · position_id_per_seconds`` (13 per second) gets fractional time
      positions, and every position after it is fractional. ``positions`` reproduces them
      operation by operation (``position_dtype`` float32).
    - **Audio in video** (``tokenize.use_audio_in_video``): the processor writes
      ``<|vision_start|><|audio_start|>``, the video's tokens and its track's merged by time (a
      video token at its patch's time ``i · seconds per patch · 13``, the processor's own
      ``position_id_per_seconds``, in float64; a track token at its index; the video token first
      on a tie), then ``<|audio_end|><|vision_end|>``; the track's frames count among the
      sample's clips for the longest. ``get_rope_index`` gives the two start tokens two
      positions, merges the block's and the track's positions by its own float32 values, and the
      two end tokens follow the last merged piece's largest position (``_with_track``): the
      layout is the processor's order, the positions the model's, as transformers pairs them.
    """

    kind = "qwen3_omni"
    chat_modes: ClassVar[tuple[str, ...]] = ("qwen3_omni", "qwen3")
    content_parts = False  # its template reads a string content as it is (and finds queries only there)
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|vision_start|>",), "<|image_pad|>", ("<|vision_end|>",)),
        "video": MediaTokens(("<|vision_start|>",), "<|video_pad|>", ("<|vision_end|>",)),
        "audio": MediaTokens(("<|audio_start|>",), "<|audio_pad|>", ("<|audio_end|>",)),
    }
    audio_features = "clip"  # each clip's features zero-padded to its sample's longest clip
    idle_clip_frames = 1  # one frame gives one token
    position_dtype = np.float32

    def track_runs(self, plan: MediaPlan) -> list[LayoutElement]:
        """Runs of video and track tokens in the processor's merged order (float64 times)."""
        per_patch = plan.grid[1] * plan.grid[2] // self.merge_size**2
        times = np.repeat(np.arange(plan.grid[0]) * plan.second_per_grid_t * PROCESSOR_TIME_SCALE, per_patch)
        order = merged_order(times, np.arange(plan.audio.num_tokens, dtype=np.float64))
        edges = np.flatnonzero(np.diff(order)) + 1
        return [("pad" if run[0] else "track", len(run)) for run in np.split(order, edges)]

    def plan_audio(self, samples: int) -> MediaPlan:
        """A clip of ``samples`` 16 kHz samples alone."""
        return self.plan_clip(samples, samples)

    def plan_clip(self, samples: int, longest: int) -> MediaPlan:
        """A clip of ``samples`` 16 kHz samples in a sample whose longest clip has ``longest``:
        the processor zero-pads it to ``longest`` and keeps ``min(ceil(samples / hop), longest //
        hop)`` frames (its mask, rescaled to frames and cut to the frames the STFT gives); grid
        (frames, 1, 1), uncut however long."""
        features = self.settings["audio"]
        if longest <= int(features["n_fft"]) // 2:
            raise Rejected(
                Reason.MEDIA_UNSUPPORTED,
                f"audio of {samples} samples: Qwen3-Omni's feature extractor needs a sample's longest "
                f"clip to have more than {int(features['n_fft']) // 2} (its STFT reflects half a window "
                "at each end)",
            )
        hop = int(features["hop_length"])
        frames = min(-(-samples // hop), longest // hop)
        return MediaPlan("audio", (frames, 1, 1), self.clip_tokens(frames), (0, 0))

    def clip_tokens(self, frames: int) -> int:
        """``<|audio_pad|>`` tokens of a clip of ``frames`` feature frames."""
        return qwen3_omni_audio_tokens(frames, int(self.settings["audio_window"]))

    def positions(self, length: int, media: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """[3, length] float32: ``get_rope_index``'s arithmetic, span by span, in its order."""
        rows = sorted(media, key=lambda m: m["token_offset"])
        parts: list[np.ndarray] = []
        cursor, last = 0, None  # the next token; the last end token's position
        index = 0
        while index < len(rows):
            item = rows[index]
            with_track = item["kind"] == "video" and self.audio_in_video
            wrappers = 2 if with_track else 1  # start (and end) tokens
            start = np.float32(0) if last is None else last + np.float32(1)
            first = item["token_offset"] - wrappers
            if first > cursor:  # text before the item's start tokens
                parts.append(_run(start, first - cursor))
                start = start + np.float32(first - cursor)
            parts.append(_run(start, wrappers))
            start = start + np.float32(wrappers)
            if with_track:
                pieces = self._with_track(item, rows[index + 1], start)
                index += 1
            elif item["kind"] == "audio":
                pieces = [_run(start, self.clip_tokens(item["grid_t"]))]
            else:
                pieces = [self._block_positions(item) + start]
            parts += pieces
            end = pieces[-1].max() + np.float32(1)
            parts.append(_run(end, wrappers))  # its end tokens
            last = end + np.float32(wrappers - 1)
            cursor = item["token_offset"] + sum(p.shape[1] for p in pieces) + wrappers
            index += 1
        if cursor < length:
            parts.append(_run(np.float32(0) if last is None else last + np.float32(1), length - cursor))
        return np.concatenate(parts, axis=1)

    def _with_track(
        self, video: Mapping[str, Any], track: Mapping[str, Any], start: np.float32
    ) -> list[np.ndarray]:
        """The positions of a video's block and its track from ``start``, as ``get_rope_index``
        appends them: merged by their time rows (float32), one token a piece while both last, then
        the rest of the one left as a last piece (its largest position places the end tokens)."""
        block = self._block_positions(video) + start
        heard = _run(start, self.clip_tokens(track["grid_t"]))
        order = merged_order(block[0], heard[0])
        merged = np.empty((3, len(order)), np.float32)
        merged[:, order] = block
        merged[:, ~order] = heard
        # the side left when the other ran out (the merge's last run) is one piece
        rest = int(np.flatnonzero(order != order[-1])[-1]) + 1
        return [merged[:, :rest], merged[:, rest:]]

    def _block_positions(self, item: Mapping[str, Any]) -> np.ndarray:
        """An image's or video's (time, row, column) from 0, float32: time ``i · seconds per
        temporal patch · position_id_per_seconds`` (an image: 0)."""
        h, w = item["grid_h"] // self.merge_size, item["grid_w"] // self.merge_size
        t = np.arange(item["grid_t"], dtype=np.float32)
        per_second = np.float32(self.settings["position_id_per_seconds"])
        if item["kind"] == "video":
            t = t * np.float32(item["second_per_grid_t"])
        t = t * per_second
        return block_grid(t, h, w).astype(np.float32)
