"""The GLM-V line: GLM-4.1V (``glm4v``), GLM-4.5V (``glm4v_moe``), GLM-4.6V (``glm46v``) and
GLM-OCR (``glm_ocr``), one processor family and one ``get_rope_index`` (transformers 5.24).

- **Images**: Qwen2-VL's patches (patch 14, merge 2, every image duplicated into a temporal
  patch of 2), resized by GLM's ``smart_resize`` with the pixel budget counted over the two
  copies; ``<|begin_of_image|>`` + h·w/4 ``<|image|>`` + ``<|end_of_image|>``.
- **Videos**: frames sampled by the video processor's rule (``video.sampling``: ``glm4v``,
  ``fps`` frames a second for clips up to ``max_duration``; ``glm46v``, GLM-4.6V's rate by
  duration), an odd count repeating its last frame, the pixel budget over all frames. Inside
  ``<|begin_of_video|>`` … ``<|end_of_video|>`` every temporal patch is its own
  ``<|begin_of_image|>`` + pads of ``<|image|>`` (the image token: GLM marks no video pads) +
  ``<|end_of_image|>``, followed by its first frame's time as text (``frame_label``:
  ``int(t)`` for Glm4vProcessor, ``f"{t:.1f} seconds"`` for Glm46VProcessor). Its template
  writes ``<|begin_of_video|><|video|><|end_of_video|>``.
- **Positions**: 3-D mRoPE per sample; a run of image tokens (an image, a video's frame) at
  position p takes (p, p + row, p + column) and the next text token p + max(h, w) (merged),
  which is Qwen-VL's rule with one temporal patch per block (``qwen_vl.mrope_positions``).
- **The model's inputs**: transformers' GLM-V finds image and video features by the same
  ``<|image|>`` id, so a forward holding both would fail its feature count check. A video's
  frames are what the vision tower encodes as images (grid [1, h, w] each, as
  ``get_video_features`` flattens them), so the loader hands every item over as
  ``pixel_values`` + ``image_grid_thw`` in token order (``videos_as_images``): images and
  videos may share a bin, and a sample may hold both.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import (
    ChatFormat,
    IdleMedia,
    LayoutElement,
    MediaPlan,
    MediaTokens,
    rejected_resize,
)
from mmpack_udfs.families.qwen_vl import Qwen3VL, video_smart_resize
from mmpack_udfs.reasons import Reason, Rejected

# GLM-4.6V's video processor (Glm46VVideoProcessor.sample_frames): sampled frames per second by
# clip length (seconds, at most), the most frames, the longest duration considered
GLM46V_RATES = ((30, 3.0), (300, 1.0), (2400, 0.5))
GLM46V_MAX_FRAMES = 640
GLM46V_MAX_DURATION = 2400


class GlmV(Qwen3VL):
    """GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR (``glm4v`` profiles): Qwen3-VL's patches, grouped
    video layout and mRoPE blocks, GLM's resizing, sampling, tokens and chat format."""

    kind = "glm4v"
    rl_prompts = False
    videos_as_images = True
    chat: ClassVar[ChatFormat] = ChatFormat(
        "",
        "",
        "\n",
        role_tokens=(
            ("system", "<|system|>"),
            ("user", "<|user|>"),
            ("assistant", "<|assistant|>"),
            ("observation", "<|observation|>"),
        ),
        closing_token="<|user|>",
    )
    chat_modes: ClassVar[tuple[str, ...]] = ("glm4v", "glm45v", "glm41v")
    bos_tokens = ("[gMASK]", "<sop>")
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|begin_of_image|>",), "<|image|>", ("<|end_of_image|>",)),
        "video": MediaTokens(("<|begin_of_video|>",), "<|image|>", ("<|end_of_video|>",)),
    }
    template_tokens: ClassVar[dict[str, str]] = {"video": "<|video|>"}

    def plan_image(self, width: int, height: int) -> MediaPlan:
        cfg, t = self.settings["image"], self.temporal_patch_size
        try:  # the image counts as its two temporal copies in the pixel budget
            h, w = video_smart_resize(t, height, width, t, self.factor, cfg["min_pixels"], cfg["max_pixels"])
        except ValueError as err:
            raise rejected_resize(err, width, height) from err
        grid = (1, h // self.patch_size, w // self.patch_size)
        return MediaPlan("image", grid, self._tokens(grid), (h, w))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        cfg, t = self.settings["video"], self.temporal_patch_size
        indices = self.sample_frames(frames, fps)
        try:
            h, w = video_smart_resize(
                len(indices), height, width, t, self.factor, cfg["min_pixels"], cfg["max_pixels"]
            )
        except ValueError as err:
            raise rejected_resize(err, width, height) from err
        grid = (len(indices) // t, h // self.patch_size, w // self.patch_size)
        timestamps = tuple(i / fps for i in indices[::t])  # each temporal patch's first frame
        return MediaPlan("video", grid, self._tokens(grid), (h, w), indices, None, timestamps)

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """Frame indices as the directory's video processor samples them from a clip of ``total``
        frames at ``video_fps`` (its duration as transformers' video loaders give it:
        frames / fps), distinct, an odd count padded with its last index."""
        cfg = self.settings["video"]
        duration = total / video_fps
        if cfg["sampling"] == "glm46v":
            chosen = glm46v_frames(total, video_fps, duration, self.temporal_patch_size)
        else:
            chosen = glm4v_frames(total, video_fps, duration, cfg["fps"], cfg["max_duration"])
        indices = list(dict.fromkeys(chosen))
        if not indices:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames is too short to sample")
        if len(indices) % 2:
            indices.append(indices[-1])
        return tuple(indices)

    def frame_label(self, seconds: float) -> str:
        """The text after a frame's ``<|end_of_image|>``: Glm4vProcessor writes whole seconds,
        Glm46VProcessor one decimal and a unit."""
        if self.settings["frame_label"] == "seconds":
            return f"{seconds:.1f} seconds"
        return str(int(seconds))

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        if plan.kind != "video":
            return super().media_layout(plan)
        frame, tokens = self.media_tokens["image"], self.media_tokens["video"]  # each frame an image block
        per_frame = plan.num_tokens // plan.grid[0]
        inner: list[LayoutElement] = []
        for stamp in plan.timestamps:
            inner += [("token", frame.before[0]), ("pad", per_frame), ("token", frame.after[0])]
            inner.append(("text", self.frame_label(stamp)))
        return [("token", tokens.before[0]), *inner, ("token", tokens.after[0])]

    def template_layout(self, kind: str) -> list[LayoutElement]:
        """The template writes ``<|begin_of_image|><|image|><|end_of_image|>`` for an image and
        ``<|begin_of_video|><|video|><|end_of_video|>`` for a video."""
        if kind != "video":
            return super().template_layout(kind)
        tokens = self.media_tokens["video"]
        return [
            ("token", tokens.before[0]),
            ("token", self.template_tokens["video"]),
            ("token", tokens.after[0]),
        ]

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """One image of one merged token: every item reaches the vision tower as an image."""
        return [m for m in super().idle_media(config) if m.kind == "image"]


def glm4v_frames(total: int, video_fps: float, duration: float, fps: float, max_duration: int) -> list[int]:
    """Glm4vVideoProcessor.sample_frames: ``fps`` frames a second (at least one), or, beyond
    ``max_duration`` seconds, ``max_duration · fps`` frames spread over the clip."""
    last = total - 1
    if duration <= max_duration:
        count = max(math.floor(duration * fps), 1)
        return [min(last, math.ceil(i * video_fps / fps)) for i in range(count)]
    count = int(max_duration * fps)
    if count >= total:
        return list(range(total))
    return [min(last, math.ceil(t * video_fps)) for t in np.linspace(0, duration, count, endpoint=True)]


def glm46v_frames(total: int, video_fps: float, duration: float, temporal: int) -> list[int]:
    """Glm46VVideoProcessor.sample_frames: a rate by clip length (3, 1 or 0.5 frames a second per
    temporal patch), frames taken on that clock, respread by ``linspace`` where too few or too many."""
    effective = min(duration, GLM46V_MAX_DURATION)
    rate = next(r for limit, r in GLM46V_RATES if effective <= limit)
    wanted = min(int(effective * rate * temporal), GLM46V_MAX_FRAMES)
    per_frame = 1 / video_fps
    last_second = int(duration)
    if total < wanted:
        chosen = np.linspace(0, total - 1, wanted, dtype=int).tolist()
    else:
        chosen, clock, step = [], 0, 1 / (temporal * rate)
        for index in range(total):
            if index * per_frame >= clock:
                clock += step
                chosen.append(index)
                if clock >= last_second:
                    break
    if len(chosen) < wanted:
        start, end = (chosen[0], chosen[-1]) if chosen else (0, max(total - 1, 0))
        chosen = np.linspace(start, end, wanted, dtype=int).tolist()
    elif len(chosen) > wanted:
        chosen = np.linspace(0, total - 1, wanted, dtype=int).tolist()
    return chosen
