"""The Qwen-Omni thinkers in transformers: Qwen2.5-Omni (``model_type: qwen2_5_omni`` or
``qwen2_5_omni_thinker``, ``Qwen2_5OmniThinkerForConditionalGeneration``, ``Qwen2_5OmniProcessor``).

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
    audio_padded_to_chunk = False  # its encoder reads each clip's own frames only

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
        (``MediaPlan.audio``: the samples normalize counted, ``audio_samples``)."""
        plans = super().plans(media)
        if not self.audio_in_video:
            return plans
        return [
            dataclasses.replace(plan, audio=self.plan_audio(item["audio_samples"]))
            if plan.kind == "video"
            else plan
            for plan, item in zip(plans, media, strict=True)
        ]

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        """A video with its track: ``<|vision_bos|><|audio_bos|>``, then video and audio tokens in
        2 s chunks (video chunk j, audio chunk j, … as ``Qwen2_5OmniProcessor.replace_video_with_
        audio_token`` interleaves them), ``<|audio_eos|><|vision_eos|>``."""
        if plan.audio is None:
            return super().media_layout(plan)
        video, audio = self.media_tokens["video"], self.media_tokens["audio"]
        chunks: list[LayoutElement] = []
        video_runs, audio_runs = self._chunks(plan.grid, plan.second_per_grid_t, plan.audio.num_tokens, True)
        for j in range(max(len(video_runs), len(audio_runs))):
            if j < len(video_runs):
                chunks.append(("pad", video_runs[j]))
            if j < len(audio_runs):
                chunks.append(("track", audio_runs[j]))
        return [
            ("token", video.before[0]), ("token", audio.before[0]), *chunks,
            ("token", audio.after[0]), ("token", video.after[0]),
        ]  # fmt: skip

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
        """Qwen-VL's idle image and video, and one silent clip of the fewest frames that give a token (3)."""
        vision = super().idle_media(config)
        mel = int(config.audio_config.num_mel_bins)
        frames = next(n for n in range(1, 100) if audio_tokens(n) == 1)
        clip = IdleMedia(
            "audio", "input_features", (1, mel, frames), int(config.audio_token_id), 1,
            {"feature_attention_mask": [[1] * frames]},
        )  # fmt: skip
        return [*vision, clip]


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
