"""The Qwen-VL line: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5.

All of them: dynamic resolution (each side resized to a multiple of patch × merge pixels
within a pixel budget by ``smart_resize``), ``<|vision_start|>`` + pads +
``<|vision_end|>`` per item, ChatML turns, and 3-row mRoPE positions computed per sample
the way the model's ``get_rope_index`` computes them (a vision block of merged grid
t × h × w at position p takes (p + time, p + row, p + column) and the next text token
p + max(h, w)). What differs:

- ``qwen2_vl``: patch 14; frames sampled at ``video.fps`` rounded down to pairs; the video
  pixel limits apply per frame; the time axis counts temporal patches.
- ``qwen2_5_vl``: as Qwen2-VL, and the time axis is scaled: temporal patch i sits at
  ``int(i · tokens_per_second · second_per_grid_t)`` with ``second_per_grid_t`` =
  temporal patch / the sampled frame rate (stored per video).
- ``qwen3_vl`` (and ``qwen3_vl_moe``): patch 16; frames chosen by ``linspace`` over the
  clip; the video pixel budget covers the whole video (``smart_resize`` over frames); an
  odd frame count repeats its last frame; every temporal group is rendered as the text
  ``<{t:.1f} seconds>`` + its own ``<|vision_start|>`` pads ``<|vision_end|>`` inside the
  template's outer wrappers, and is its own mRoPE block of one temporal patch.
- ``qwen3_5`` (and ``qwen3_5_moe``): Qwen3-VL's processor; its language model mixes
  linear-attention (Gated DeltaNet) layers with attention layers (the loader refuses packed
  training where the kernels that keep samples apart are missing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import (
    Family,
    LayoutElement,
    MediaPlan,
    MediaTokens,
    rejected_resize,
    smart_resize,
    torch_arange_int,
)
from mmpack_udfs.reasons import Reason, Rejected


class Qwen2VL(Family):
    kind = "qwen2_vl"
    mrope = True
    rl_prompts = True
    vision_varlen_config = "vision_config"  # its VisionAttention loops over images unless "flash"
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|vision_start|>",), "<|image_pad|>", ("<|vision_end|>",)),
        "video": MediaTokens(("<|vision_start|>",), "<|video_pad|>", ("<|vision_end|>",)),
    }

    def __init__(self, name: str, settings: Mapping[str, Any]) -> None:
        super().__init__(name, settings)
        vision = settings["vision"]
        self.patch_size = vision["patch_size"]
        self.merge_size = vision["merge_size"]
        self.temporal_patch_size = vision["temporal_patch_size"]

    @property
    def factor(self) -> int:
        """Pixels per merged token side."""
        return self.patch_size * self.merge_size

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // (self.merge_size**2)

    def _resize_image(self, width: int, height: int, limits: Mapping[str, Any]) -> tuple[int, int]:
        try:
            return smart_resize(height, width, self.factor, limits["min_pixels"], limits["max_pixels"])
        except ValueError as err:
            raise rejected_resize(err, width, height) from err

    def plan_image(self, width: int, height: int) -> MediaPlan:
        h, w = self._resize_image(width, height, self.settings["image"])
        grid = (1, h // self.patch_size, w // self.patch_size)
        return MediaPlan("image", grid, self._tokens(grid), (h, w))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        indices = self.sample_frames(frames, fps)
        h, w = self._resize_image(width, height, self.settings["video"])
        grid = (len(indices) // self.temporal_patch_size, h // self.patch_size, w // self.patch_size)
        sampled_fps = len(indices) / frames * fps  # transformers' VideoMetadata.sampled_fps
        return MediaPlan(
            "video", grid, self._tokens(grid), (h, w), indices, self.temporal_patch_size / sampled_fps
        )

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """Frame indices as transformers' Qwen2VLVideoProcessor.sample_frames picks them with
        ``fps``. Its ``torch.arange(0, total, step).int()`` is computed without torch (not a
        dependency of the pipeline): positions in float64, rounded to float32, truncated, as
        torch does (a test compares the two)."""
        cfg, t = self.settings["video"], self.temporal_patch_size
        max_frames = math.floor(min(cfg["max_frames"], total) / t) * t
        wanted = total / video_fps * cfg["fps"]
        wanted = min(max(wanted, cfg["min_frames"]), max_frames, total)
        count = math.floor(wanted / t) * t
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames is too short to sample")
        return tuple(torch_arange_int(total, total / count))

    # --- positions (the model's get_rope_index, one sample) --------------------------------

    def positions(self, length: int, media: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return mrope_positions(length, [b for m in media for b in self.vision_blocks(m)])

    def vision_blocks(self, item: Mapping[str, Any]) -> list[tuple[int, int, int, int, float]]:
        """The mRoPE blocks of one media item: (token offset, t, h, w, time interval) in
        merged tokens."""
        h, w = item["grid_h"] // self.merge_size, item["grid_w"] // self.merge_size
        return [(item["token_offset"], item["grid_t"], h, w, 1.0)]


class Qwen25VL(Qwen2VL):
    kind = "qwen2_5_vl"

    def vision_blocks(self, item: Mapping[str, Any]) -> list[tuple[int, int, int, int, float]]:
        ((offset, t, h, w, _),) = super().vision_blocks(item)
        if item["kind"] != "video":
            return [(offset, t, h, w, 1.0)]
        # float32 arithmetic, as the model multiplies its float32 second_per_grid_ts tensor
        interval = np.float32(self.settings["tokens_per_second"]) * np.float32(item["second_per_grid_t"])
        return [(offset, t, h, w, interval)]


class Qwen3VL(Qwen2VL):
    kind = "qwen3_vl"
    rl_prompts = False  # its thinking templates' generation prompts are not verified
    chat_modes: ClassVar[tuple[str, ...]] = ("qwen3", "qwen3_thinking")

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        cfg, t = self.settings["video"], self.temporal_patch_size
        indices = self.sample_frames(frames, fps)
        count = len(indices)
        max_pixels = cfg["max_pixels"]
        if cfg.get("cap_pixels_per_frame"):  # qwen-vl-utils' per-frame cap, where the config asks
            per_frame = min(cfg["max_video_tokens"] * self.factor**2, cfg["max_pixels"] // count)
            max_pixels = max(per_frame, int(cfg["min_pixels"] * 1.05)) * count
        try:
            h, w = video_smart_resize(count, height, width, t, self.factor, cfg["min_pixels"], max_pixels)
        except ValueError as err:
            raise rejected_resize(err, width, height) from err
        groups = -(-count // t)  # an odd count repeats its last frame
        grid = (groups, h // self.patch_size, w // self.patch_size)
        padded = list(indices) + [indices[-1]] * (groups * t - count)
        stamps = [i / fps for i in padded]
        timestamps = tuple((stamps[i] + stamps[i + t - 1]) / 2 for i in range(0, len(stamps), t))
        return MediaPlan("video", grid, self._tokens(grid), (h, w), indices, None, timestamps)

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """Frame indices as transformers' Qwen3VLVideoProcessor.sample_frames picks them:
        ``int(total / fps · video.fps)`` frames within [min_frames, max_frames] and the clip,
        spread by ``linspace`` over the clip (all frames when ``do_sample_frames`` is off)."""
        cfg = self.settings["video"]
        if not cfg.get("do_sample_frames", True):
            return tuple(range(total))
        count = int(total / video_fps * cfg["fps"])
        count = min(max(count, cfg["min_frames"]), cfg["max_frames"], total)
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames is too short to sample")
        return tuple(np.linspace(0, total - 1, count).round().astype(int).tolist())

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        if plan.kind != "video" or not plan.timestamps:  # no groups: one run, as the template writes it
            return super().media_layout(plan)
        tokens = self.media_tokens["video"]
        per_group = plan.num_tokens // plan.grid[0]
        inner: list[LayoutElement] = []
        for stamp in plan.timestamps:
            inner += [("text", f"<{stamp:.1f} seconds>"), ("token", tokens.before[0])]
            inner += [("pad", per_group), ("token", tokens.after[0])]
        return [("token", tokens.before[0]), *inner, ("token", tokens.after[0])]

    def vision_blocks(self, item: Mapping[str, Any]) -> list[tuple[int, int, int, int, float]]:
        if item["kind"] != "video":
            return super().vision_blocks(item)
        h, w = item["grid_h"] // self.merge_size, item["grid_w"] // self.merge_size
        starts = item["group_starts"] or [0]  # a video of one temporal patch is one pad run
        return [(item["token_offset"] + start, 1, h, w, 1.0) for start in starts]


class Qwen35(Qwen3VL):
    kind = "qwen3_5"
    linear_attention = True  # Gated DeltaNet layers: packed samples need seq_idx (causal conv) and cu_seqlens
    chat_modes: ClassVar[tuple[str, ...]] = ("qwen3_5",)


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' Qwen3-VL video ``smart_resize``: the pixel budget covers all frames
    (a test checks it against transformers' function)."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def mrope_positions(length: int, blocks: Sequence[tuple[int, int, int, int, float]]) -> np.ndarray:
    """[3, length] rotary positions of one sample: text advances all three rows by one per
    token; a block (offset, t, h, w, interval) starting at position p takes
    (p + int(i · interval), p + row, p + column) and the next text token p + max(h, w)."""
    spans = []
    for offset, t, h, w, interval in blocks:
        times = np.arange(t)
        if interval != 1.0:  # float32, truncated: (torch.arange(t) * interval).long()
            times = (times.astype(np.float32) * np.float32(interval)).astype(np.int64)
        spans.append((offset, block_grid(times, h, w), max(h, w)))
    return span_positions(length, spans)


def block_grid(times: np.ndarray, h: int, w: int) -> np.ndarray:
    """[3, t·h·w]: (time, row, column) of a vision block's tokens, from 0."""
    return np.stack(np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)


def span_positions(length: int, spans: Sequence[tuple[int, np.ndarray, int]]) -> np.ndarray:
    """[3, length] positions of one sample: text advances all three rows by one per token; a span
    (token offset, its positions from 0 [3, n], advance) starting at position p takes p + its
    positions, and the next token p + advance (the model's rule for what follows a block)."""
    rows, cursor, position = [], 0, 0
    for offset, relative, advance in sorted(spans, key=lambda s: s[0]):
        text = np.arange(offset - cursor) + position
        rows.append(np.broadcast_to(text, (3, len(text))))
        position += offset - cursor
        rows.append(relative + position)
        position += advance
        cursor = offset + relative.shape[1]
    rows.append(np.broadcast_to(np.arange(length - cursor) + position, (3, length - cursor)))
    return np.concatenate(rows, axis=1).astype(np.int64)
