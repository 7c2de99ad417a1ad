"""InternVL in its original repository format: fixed 448 px tiles with dynamic tiling
(InternVL's closest-aspect-ratio rule, up to ``max_tiles``, plus a thumbnail tile), 256
``<IMG_CONTEXT>`` tokens per tile wrapped in ``<img>`` … ``</img>``; a video is ``frames``
uniformly sampled frames of one tile each, in one ``<img>`` … ``</img>`` span; 1-D positions."""

from __future__ import annotations

from typing import ClassVar

from mmpack_udfs.families.base import Family, MediaPlan, MediaTokens
from mmpack_udfs.reasons import Reason, Rejected


class InternVL(Family):
    kind = "internvl"
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<img>",), "<IMG_CONTEXT>", ("</img>",)),
        "video": MediaTokens(("<img>",), "<IMG_CONTEXT>", ("</img>",)),
    }

    def plan_image(self, width: int, height: int) -> MediaPlan:
        cfg = self.settings["image"]
        cols, rows = closest_tile_grid(width, height, cfg["tile_size"], cfg["min_tiles"], cfg["max_tiles"])
        tiles = cols * rows + (1 if cfg["thumbnail"] and cols * rows > 1 else 0)
        size = cfg["tile_size"]
        return MediaPlan("image", (1, rows, cols), tiles * cfg["tokens_per_tile"], (size, size))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        count = min(self.settings["video"]["frames"], frames)
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, "video has no frames")
        segment = (frames - 1) / count  # InternVL's get_index: the middle of each segment
        indices = tuple(int(segment / 2 + round(segment * i)) for i in range(count))
        size = self.settings["image"]["tile_size"]
        tokens = count * self.settings["image"]["tokens_per_tile"]
        return MediaPlan("video", (count, 1, 1), tokens, (size, size), indices)


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
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best
