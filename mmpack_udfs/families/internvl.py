"""InternVL, in two formats.

- ``internvl``: transformers-native InternVL 3 / 3.5 (``InternVLForConditionalGeneration``, the
  ``-hf`` checkpoints; transformers' ``InternVLProcessor`` with ``GotOcr2ImageProcessor`` and
  ``InternVLVideoProcessor``). An image is cut into tiles by GotOcr2's closest-aspect-ratio rule
  (``min_tiles`` … ``max_tiles`` tiles of ``tile_size`` px, plus a thumbnail of the whole image
  when there is more than one) and becomes ``<img>`` + ``<IMG_CONTEXT>`` × (``tokens_per_tile`` ·
  tiles) + ``</img>``; a video is one ``tile_size`` tile per frame (every frame unless the
  directory's video processor samples), written ``Frame1: <img>…</img>`` lines joined by
  newlines. The chat template writes ``<IMG_CONTEXT>`` / ``<video>`` + a newline where a media
  item stands (chat renderer ``internvl``); 1-D positions.
- ``internvl_chat``: the original InternVL repository's format (``InternVLChatModel``): the same
  tiles, a video as ``frames`` uniformly sampled tiles in one ``<img>`` … ``</img>`` span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import (
    Family,
    IdleMedia,
    LayoutElement,
    MediaPlan,
    MediaTokens,
    torch_arange_int,
)
from mmpack_udfs.reasons import Reason, Rejected

IMAGE_SPAN = MediaTokens(("<img>",), "<IMG_CONTEXT>", ("</img>",))


class _Tiled(Family):
    """What both InternVL formats share: an image as tiles of ``tokens_per_tile`` tokens."""

    media_tokens: ClassVar[dict[str, MediaTokens]] = {"image": IMAGE_SPAN, "video": IMAGE_SPAN}
    pixel_layout = "tiles"

    def plan_image(self, width: int, height: int) -> MediaPlan:
        cfg = self.settings["image"]
        cols, rows = self.tile_grid(width, height)
        tiles = cols * rows + (1 if cfg["thumbnail"] and cols * rows > 1 else 0)
        size = cfg["tile_size"]
        return MediaPlan("image", (1, rows, cols), tiles * cfg["tokens_per_tile"], (size, size))

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def attention_blocks(
        cls, items: Mapping[str, np.ndarray], settings: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """A tile is one block of 4 × tokens_per_tile patches (2 × 2 patches make a token)."""
        per_tile = int(settings["image"]["tokens_per_tile"])
        return items["num_tokens"] // per_tile, np.full(len(items["num_tokens"]), 4 * per_tile)


class InternVL(_Tiled):
    """transformers-native InternVL (``model_type: internvl``)."""

    kind = "internvl"
    boundary_kwargs = False  # InternVLModel passes **kwargs on to its vision tower's attention
    video_processor_resize = True
    chat_modes: ClassVar[tuple[str, ...]] = ("internvl",)
    template_tokens: ClassVar[dict[str, str]] = {"image": "<IMG_CONTEXT>", "video": "<video>"}

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """One black tile (its videos are tiles too: one vision call for both)."""
        vision = config.vision_config
        height, width = _pair(vision.image_size)
        patch_h, patch_w = _pair(vision.patch_size)
        tokens = round(height // patch_h * (width // patch_w) * float(config.downsample_ratio) ** 2)
        return [IdleMedia("image", "pixel_values", (1, 3, height, width), int(config.image_token_id), tokens)]

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        cfg = self.settings["image"]
        return got_ocr2_grid(width, height, cfg["tile_size"], cfg["min_tiles"], cfg["max_tiles"])

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        cfg = self.settings["video"]
        indices = self.sample_frames(frames, fps)
        tokens = len(indices) * self.settings["image"]["tokens_per_tile"]
        return MediaPlan("video", (len(indices), 1, 1), tokens, (cfg["height"], cfg["width"]), indices)

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """Frame indices as transformers' InternVLVideoProcessor picks them: every frame, or
        with ``do_sample_frames`` ``num_frames`` (or ``int(total / fps · video.fps)``) frames at
        ``arange(shift, total, total / n).int()``, shift = half a step (``initial_shift``)."""
        cfg = self.settings["video"]
        if total <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, "video has no frames")
        if not cfg["do_sample_frames"]:
            return tuple(range(total))
        count = cfg["num_frames"] or int(total / video_fps * cfg["fps"])
        if count <= 0 or count > total:
            raise Rejected(
                Reason.MEDIA_UNSUPPORTED, f"video of {total} frames cannot give {count} sampled frames"
            )
        shift = total / count / 2 if cfg["initial_shift"] else 0.0
        return tuple(torch_arange_int(total, total / count, start=shift))

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        if plan.kind == "image":
            return super().media_layout(plan)
        per_frame = self.settings["image"]["tokens_per_tile"]
        layout: list[LayoutElement] = []
        for i in range(len(plan.frame_indices)):
            layout += [("text", f"{'' if i == 0 else chr(10)}Frame{i + 1}: "), ("token", "<img>")]
            layout += [("pad", per_frame), ("token", "</img>")]
        return layout

    def template_layout(self, kind: str) -> list[LayoutElement]:
        return [("token", self.template_tokens[kind])]


class InternVLChat(_Tiled):
    """The original InternVL repository's format (``tokenize.profile: internvl_chat``)."""

    kind = "internvl_chat"

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        cfg = self.settings["image"]
        return closest_tile_grid(width, height, cfg["tile_size"], cfg["min_tiles"], cfg["max_tiles"])

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        count = min(self.settings["video"]["frames"], frames)
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, "video has no frames")
        segment = (frames - 1) / count  # InternVL's get_index: the middle of each segment
        indices = tuple(int(segment / 2 + round(segment * i)) for i in range(count))
        size = self.settings["image"]["tile_size"]
        tokens = count * self.settings["image"]["tokens_per_tile"]
        return MediaPlan("video", (count, 1, 1), tokens, (size, size), indices)


def got_ocr2_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of tiles as transformers' GotOcr2 image processor chooses them
    (``get_optimal_tiled_canvas``): grids of ``min_tiles`` … ``max_tiles`` tiles in order of
    size (columns outer, rows inner within a size), the closest aspect ratio first; an exact
    tie goes to the later grid while the image covers more than half of its canvas."""
    grids = sorted(
        (
            (c, r)
            for c in range(1, max_tiles + 1)
            for r in range(1, max_tiles + 1)
            if min_tiles <= c * r <= max_tiles
        ),
        key=lambda g: g[0] * g[1],
    )
    return _closest(grids, width, height, tile)


def closest_tile_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of tiles: InternVL's dynamic_preprocess closest-aspect-ratio rule."""
    ratios = sorted(
        {
            (i, j)
            for n in range(min_tiles, max_tiles + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_tiles <= i * j <= max_tiles
        },
        key=lambda r: r[0] * r[1],
    )
    return _closest(ratios, width, height, tile)


def _closest(grids: list[tuple[int, int]], width: int, height: int, tile: int) -> tuple[int, int]:
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))
