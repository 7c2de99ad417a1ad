"""LLaVA-OneVision in transformers (``model_type: llava_onevision``, the ``llava-hf/*-ov-hf``
checkpoints; ``LlavaOnevisionProcessor``, its image and video processors).

An image's tokens depend on its sample: the processor cuts the only image of a sample into
"anyres" crops (a whole-image crop, then the ``crop_size`` tiles of the best pinpoint
resolution) and gives it ``tokens_per_crop`` base tokens + the tiles' feature grid after
unpadding (shrunk when over ``max_crops`` crops' worth) + one newline token per grid row;
every image of a sample with several images is one padded-square crop of
``tokens_per_crop`` + 1 tokens. A video is ``frames`` · ⌈√tokens_per_crop / 2⌉² + 1 tokens
(pooled frames and one newline). Every item is a run of ``<image>`` / ``<video>`` tokens; the
chat template writes a message's images first, then its videos, then its texts (chat renderer
``llava_onevision``); 1-D positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import Family, IdleMedia, MediaPlan, MediaTokens
from mmpack_udfs.reasons import Reason, Rejected


class LlavaOnevision(Family):
    """transformers-native LLaVA-OneVision."""

    kind = "llava_onevision"
    chat_modes: ClassVar[tuple[str, ...]] = ("llava_onevision",)
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens((), "<image>", ()),
        "video": MediaTokens((), "<video>", ()),
    }
    content_parts = True  # its template renders only the text parts of a message's content list
    pixel_layout = "anyres"
    video_processor_resize = True

    def plans(self, media: Sequence[Mapping[str, Any]]) -> list[MediaPlan]:
        """Only the image of a one-image sample is cut into anyres crops; the images of a sample
        with several are one square crop each (the processor's ``batch_num_images`` rule)."""
        if sum(m["kind"] == "image" for m in media) == 1:
            return super().plans(media)
        return [self.plan_in_set() if m["kind"] == "image" else self.plan(m) for m in media]

    def plan_image(self, width: int, height: int) -> MediaPlan:
        """The only image of its sample: anyres crops, grid = (1, rows, columns) of tiles."""
        cfg = self.settings["image"]
        size, per_side = cfg["crop_size"], self.features_per_side()
        best_h, best_w = select_best_resolution(height, width, cfg["pinpoints"])
        rows, cols = best_h // size, best_w // size
        grid_tokens, newlines = unpadded_features(
            height, width, per_side * rows, per_side * cols, per_side, cfg["max_crops"]
        )
        tokens = grid_tokens + newlines + cfg["tokens_per_crop"]
        return MediaPlan("image", (1, rows, cols), tokens, (size, size))

    def plan_in_set(self) -> MediaPlan:
        """An image of a sample with several: one padded-square crop and its newline token;
        grid (1, 0, 0): no anyres tiles."""
        cfg = self.settings["image"]
        return MediaPlan("image", (1, 0, 0), cfg["tokens_per_crop"] + 1, (cfg["crop_size"], cfg["crop_size"]))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        """Frames resized to the video size, one crop each; grid = (frames, 0, 0)."""
        cfg = self.settings["video"]
        indices = self.sample_frames(frames, fps)
        pooled = math.ceil(self.features_per_side() / 2)
        tokens = len(indices) * pooled * pooled + 1
        return MediaPlan("video", (len(indices), 0, 0), tokens, (cfg["height"], cfg["width"]), indices)

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """``num_frames`` frames at ``arange(n) · total // n`` (transformers'
        ``default_sample_indices_fn``). The model takes a batch's videos as one [videos, frames,
        …] tensor, so packed videos need one frame count: every frame, or frames by fps, is
        refused (quarantined: ``media_unsupported``)."""
        cfg = self.settings["video"]
        if not (cfg["do_sample_frames"] and cfg["num_frames"]):
            raise Rejected(
                Reason.MEDIA_UNSUPPORTED,
                "LLaVA-OneVision stacks a batch's videos, so mmpack packs videos only with a fixed frame "
                "count: the video processor must set do_sample_frames and num_frames",
            )
        count = cfg["num_frames"]
        if count > total:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames cannot give {count} frames")
        return tuple(i * total // count for i in range(count))

    @classmethod
    def attention_blocks(
        cls, items: Mapping[str, np.ndarray], settings: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """A crop (an image's, a frame's) is one block of tokens_per_crop patches."""
        crops = items["grid_t"] + items["grid_h"] * items["grid_w"]
        return crops, np.full(len(crops), int(settings["image"]["tokens_per_crop"]))

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """Images: two black square crops of one sample (``batch_num_images`` 2: a crop and a
        newline each, no anyres grid); videos: one black frame (pooled features and a newline)."""
        size, patch = int(config.vision_config.image_size), int(config.vision_config.patch_size)
        crop = (size // patch) ** 2 - (config.vision_feature_select_strategy == "default")
        frame = math.ceil(size // patch / 2) ** 2
        square = {"image_sizes": [[size, size]] * 2, "batch_num_images": [2]}
        return [
            IdleMedia("image", "pixel_values", (2, 1, 3, size, size), int(config.image_token_id),
                      2 * (crop + 1), square),
            IdleMedia("video", "pixel_values_videos", (1, 1, 3, size, size), int(config.video_token_id),
                      frame + 1),
        ]  # fmt: skip

    def features_per_side(self) -> int:
        return math.isqrt(self.settings["image"]["tokens_per_crop"])


def select_best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(height, width) of the pinpoint that keeps most of the image's pixels, then wastes the
    fewest (transformers' ``select_best_resolution``; the first of equal ones)."""
    best, most_kept, least_wasted = (0, 0), 0, math.inf
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_w * pin_h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (pin_h, pin_w), kept, wasted
    return best


def unpadded_features(
    height: int, width: int, grid_h: int, grid_w: int, per_side: int, max_crops: int
) -> tuple[int, int]:
    """(grid tokens, newline tokens) of an anyres image: the tiles' ``grid_h`` × ``grid_w``
    features less the rows or columns that are padding at the image's aspect ratio, shrunk by
    ``ratio`` when over ``max_crops`` crops' worth (``anyres_max_N``)."""
    if width / height > grid_w / grid_h:
        padding = (grid_h - int(round(height * (grid_w / width), 7))) // 2
        grid_h -= 2 * padding
    else:
        padding = (grid_w - int(round(width * (grid_h / height), 7))) // 2
        grid_w -= 2 * padding
    ratio = math.sqrt(grid_h * grid_w / (max_crops * per_side**2))
    if ratio > 1.1:
        return int(grid_h // ratio) * int(grid_w // ratio), int(grid_h // ratio)
    return grid_h * grid_w, grid_h
