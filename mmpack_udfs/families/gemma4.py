"""Gemma 4 in transformers (``model_type: gemma4``, ``Gemma4ForConditionalGeneration``;
``Gemma4Processor`` with ``Gemma4ImageProcessor`` and ``Gemma4VideoProcessor``, 5.24).

- **Images**: resized with the aspect ratio kept to the largest size whose sides are multiples
  of ``pooling_kernel_size · patch_size`` (48 px) within ``max_soft_tokens · pooling²`` patches
  of 16 px (``get_aspect_ratio_preserving_size``); each 3 × 3 block of patches is one soft
  token, so an image has (h / 48) · (w / 48) tokens, at most ``max_soft_tokens`` (280 by
  default): ``<|image>`` + that many image tokens + ``<image|>``. No newlines around it.
- **Videos**: ``num_frames`` frames sampled uniformly (transformers' ``default_sample_indices_fn``:
  ``arange(n) · total // n``; a clip with fewer frames is refused, as the processor fails),
  each resized as an image under the video budget (``max_soft_tokens`` 70 by default) and
  written ``"mm:ss <|image>" + video tokens + "<image|>"``, frames joined by spaces; the time is
  the frame's index / fps.
- **Positions**: 1-D. **Attention**: where ``text_config.use_bidirectional_attention`` is
  ``"vision"`` (the profile's ``bidirectional_media``), a run of image or video tokens (an
  image, a frame) attends to itself in both directions **on sliding-window layers only**;
  global layers stay causal (``create_masks_for_vision_model``: "Unlike Gemma 3"). The loader
  builds those masks for packed rows (``loader.attention.media_block_masks``).
- **Pixels**: every image's (frame's) patches as rows of 16 · 16 · 3 values in [0, 1] (no
  mean/std: the model scales them), padded to the budget's patch count, with each patch's
  (x, y) and -1 for padding (``image_position_ids`` / ``video_position_ids``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from mmpack_udfs.families.base import (
    ChatFormat,
    Family,
    IdleMedia,
    LayoutElement,
    MediaPlan,
    MediaTokens,
    rejected_resize,
)
from mmpack_udfs.reasons import Reason, Rejected


def aspect_preserving_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling: int
) -> tuple[int, int]:
    """transformers' Gemma 4 ``get_aspect_ratio_preserving_size``: the largest (height, width),
    both multiples of ``pooling · patch_size``, within ``max_patches`` patches, the aspect ratio
    kept (a side rounding to 0 takes one block, the other side its ratio); ValueError where
    the processor raises (a test checks it against transformers' function)."""
    target = max_patches * patch_size**2
    factor = math.sqrt(target / (height * width))
    side = pooling * patch_size
    h = math.floor(factor * height / side) * side
    w = math.floor(factor * width / side) * side
    if h == 0 and w == 0:
        raise ValueError(f"resizing to 0 x 0: sides must be multiples of {side}")
    longest = (max_patches // pooling**2) * side
    if h == 0:
        h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
        h, w = min(math.floor(height / width) * side, longest), side
    if h * w > target:
        raise ValueError(f"resizing [{height}x{width}] to [{h}x{w}] exceeds {max_patches} patches")
    return h, w


def timestamp(seconds: float) -> str:
    """A video frame's time as Gemma4Processor writes it: ``mm:ss``."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4(Family):
    """transformers-native Gemma 4 (E2B, E4B, 26B-A4B, 31B): images and videos, no audio."""

    kind = "gemma4"
    chat: ClassVar[ChatFormat] = ChatFormat("<|turn>", "<turn|>", "\n")
    chat_modes: ClassVar[tuple[str, ...]] = ("gemma4",)
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|image>",), "<|image|>", ("<image|>",)),
        "video": MediaTokens(("<|image>",), "<|video|>", ("<image|>",)),
    }
    template_tokens: ClassVar[dict[str, str]] = {"image": "<|image|>", "video": "<|video|>"}
    pixel_layout = "soft_patches"
    bos_tokens = ("<bos>",)
    bidirectional_media = True
    media_blocks_on_global_layers = False  # image blocks are bidirectional on sliding layers only
    padded_encoder_config = "vision_config"  # its tower masks each image's padding patches

    def plan_image(self, width: int, height: int) -> MediaPlan:
        return self._plan("image", width, height)

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        indices = self.sample_frames(frames)
        one = self._plan("video", width, height)
        grid = (len(indices), one.grid[1], one.grid[2])
        stamps = tuple(i / fps for i in indices)
        return MediaPlan("video", grid, len(indices) * one.num_tokens, one.resized, indices, None, stamps)

    def _plan(self, kind: str, width: int, height: int) -> MediaPlan:
        """One image (a video's frame): its patch grid (1, h / 16, w / 16), soft tokens, size."""
        cfg = self.settings[kind]
        patch, pooling = cfg["patch_size"], cfg["pooling_kernel_size"]
        try:
            h, w = aspect_preserving_size(height, width, patch, cfg["max_soft_tokens"] * pooling**2, pooling)
        except ValueError as err:
            raise rejected_resize(err, width, height) from err
        return MediaPlan(kind, (1, h // patch, w // patch), (h // patch) * (w // patch) // pooling**2, (h, w))

    def sample_frames(self, total: int) -> tuple[int, ...]:
        """``num_frames`` frames at ``arange(n) · total // n`` (``default_sample_indices_fn``);
        a clip of fewer frames is refused, as the processor raises."""
        count = self.settings["video"]["num_frames"]
        if count > total:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames cannot give {count} frames")
        return tuple(i * total // count for i in range(count))

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        if plan.kind != "video":
            return super().media_layout(plan)
        tokens, per_frame = self.media_tokens["video"], plan.num_tokens // plan.grid[0]
        layout: list[LayoutElement] = []
        for k, stamp in enumerate(plan.timestamps):
            layout.append(("text", f"{' ' if k else ''}{timestamp(stamp)} "))
            layout += [("token", tokens.before[0]), ("pad", per_frame), ("token", tokens.after[0])]
        return layout

    def template_layout(self, kind: str) -> list[LayoutElement]:
        """The template writes the pad token alone for an image or a video."""
        return [("token", self.template_tokens[kind])]

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """A black 48 px image and a one-frame video of it (encoded in two calls): one soft token
        each, from one pooling block of patches."""
        vision = config.vision_config
        pooling, patch = int(vision.pooling_kernel_size), int(vision.patch_size)
        shape = (1, pooling * pooling, 3 * patch * patch)
        positions = [[[x, y] for y in range(pooling) for x in range(pooling)]]
        return [
            IdleMedia("image", "pixel_values", shape, int(config.image_token_id), 1,
                      {"image_position_ids": positions}),
            IdleMedia("video", "pixel_values_videos", shape, int(config.video_token_id), 1,
                      {"video_position_ids": positions, "num_frames_per_video": [1]}),
        ]  # fmt: skip
