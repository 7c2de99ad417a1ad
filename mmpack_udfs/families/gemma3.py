"""Gemma 3 in transformers (``model_type: gemma3``, ``Gemma3ForConditionalGeneration``;
``Gemma3Processor`` with ``Gemma3ImageProcessor``).

Every image is resized to one ``size`` × ``size`` square (bilinear, aspect not kept) and becomes
``\\n\\n<start_of_image>`` + ``<image_soft_token>`` × ``tokens_per_image`` + ``<end_of_image>\\n\\n``;
the newlines are text. The processor tokenizes its expanded string whole, and Gemma 3's
vocabulary joins newlines only with newlines, so the newlines before an image are encoded with
the text before it (the role header's newline, the newlines of an image just before); those
after it stand alone, since the text that follows is trimmed (never starts with a newline).
Pan-and-scan crops are refused (``families.model_dir``). The chat template (renderer
``gemma3``) starts with ``<bos>``, writes ``<start_of_turn>user`` / ``<start_of_turn>model``
turns of trimmed texts, and puts a system prompt at the head of the first user turn. No
videos. 1-D positions.

The model's image tokens attend to each other within one image (bidirectionally), which a
packed batch must keep without letting samples see each other: the loader hands the model its
per-layer-type masks (``loader.attention.media_block_masks``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import ChatFormat, Family, IdleMedia, LayoutElement, MediaPlan, MediaTokens
from mmpack_udfs.reasons import Reason, Rejected

IMAGE_NEWLINES = "\n\n"  # around every image in the processor's expanded string


class Gemma3(Family):
    """transformers-native Gemma 3 (4B, 12B, 27B: the sizes with a vision tower)."""

    kind = "gemma3"
    chat: ClassVar[ChatFormat] = ChatFormat("<start_of_turn>", "<end_of_turn>", "\n")
    chat_modes: ClassVar[tuple[str, ...]] = ("gemma3",)
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<start_of_image>",), "<image_soft_token>", ("<end_of_image>",))
    }
    template_tokens: ClassVar[dict[str, str]] = {"image": "<start_of_image>"}
    content_parts = True  # its template reads a message's content parts (images, trimmed texts)
    pixel_layout = "squares"
    bos_tokens = ("<bos>",)
    bidirectional_media = True

    def plan_image(self, width: int, height: int) -> MediaPlan:
        cfg = self.settings["image"]
        return MediaPlan("image", (1, 1, 1), cfg["tokens_per_image"], (cfg["size"], cfg["size"]))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        raise Rejected(Reason.MEDIA_UNSUPPORTED, "Gemma 3 takes no videos")

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        return [("text", IMAGE_NEWLINES), *super().media_layout(plan), ("text", IMAGE_NEWLINES)]

    def template_layout(self, kind: str) -> list[LayoutElement]:
        """The template writes ``<start_of_image>`` for an image and nothing for a video."""
        return [("token", self.template_tokens[kind])] if kind in self.template_tokens else []

    @classmethod
    def attention_blocks(
        cls, items: Mapping[str, np.ndarray], settings: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """An image is one block of (size / patch_size)² patches (SigLIP attends over the whole
        square before pooling to tokens_per_image)."""
        image = settings["image"]
        patches = (int(image["size"]) // int(image["patch_size"])) ** 2
        return np.ones(len(items["num_tokens"]), np.int64), np.full(len(items["num_tokens"]), patches)

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """One black square: ``mm_tokens_per_image`` soft tokens (bidirectional among themselves)."""
        size = int(config.vision_config.image_size)
        tokens = int(config.mm_tokens_per_image)
        return [IdleMedia("image", "pixel_values", (1, 3, size, size), int(config.image_token_id), tokens)]
