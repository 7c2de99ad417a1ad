"""transformers as the oracle for a transformers-native InternVL model directory.

What a user's training script does: the directory's chat template on the conversation
(content parts for media), then transformers' ``InternVLProcessor`` on the text and the
files, with the ``GotOcr2`` image processor of ``preprocessor_config.json`` (PIL backend) and
``InternVLVideoProcessor`` for videos (in a subprocess with the test-only torchvision
scaffold: tests/oracles/qwen_video.py). Labels: assistant turns after their header through
``<|im_end|>``, except media spans (an image's ``<img>…</img>``, a video's ``Frame1: <img>…</img>``
lines).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor

from tests.oracles.qwen_family import labels_of, messages, rgb

MEDIA_SPAN = re.compile(
    r"<img>(?:<IMG_CONTEXT>)+</img>(?!\nFrame)|Frame1: <img>(?:<IMG_CONTEXT>)+</img>"
    r"(?:\nFrame\d+: <img>(?:<IMG_CONTEXT>)+</img>)*"
)


class ImageTextProcessor(InternVLProcessor):
    """transformers' InternVLProcessor without its video half (which imports torchvision): the
    videos' text comes from the subprocess that runs the video processor."""

    def __init__(
        self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None, **kw
    ):
        super().__init__(image_processor, tokenizer, None, image_seq_length=image_seq_length, **kw)


def image_processor(model_dir: Path) -> GotOcr2ImageProcessorPil:
    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    return GotOcr2ImageProcessorPil(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )


def processor(model_dir: Path, tokenizer) -> ImageTextProcessor:
    settings = json.loads((model_dir / "processor_config.json").read_text())
    return ImageTextProcessor(image_processor(model_dir), tokenizer, settings["image_seq_length"])


def reference(model_dir: Path, tokenizer, sample: dict, videos) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, tiles per item and the
    pixel values in item order. ``videos(item)`` gives a processed video (its frames, pixels
    and the text the processor puts in place of ``<video>``)."""
    template = (model_dir / "chat_template.jinja").read_text()
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=template, tokenize=False
    )
    images = [rgb(m["uri"]) for m in sample["media"] if m["kind"] == "image"]
    wrapper = processor(model_dir, tokenizer)
    # the processor's own text for each item (replace_image_token, replace_video_token), put in
    # place of the template's placeholders in order, and tokenized as the processor does
    processed, image_texts = wrapper._process_images(images, crop_to_patches=True) if images else ({}, [])
    image_texts = iter(image_texts)
    image_tiles = np.split(
        np.asarray(processed.get("pixel_values", [])), np.cumsum(processed.get("num_patches", []))[:-1]
    )
    video_texts = iter([videos(m)["replacement"] for m in sample["media"] if m["kind"] == "video"])
    expanded = re.sub(
        r"<IMG_CONTEXT>|<video>",
        lambda p: next(image_texts if p[0] == "<IMG_CONTEXT>" else video_texts),
        text,
    )
    ids = tokenizer(expanded, add_special_tokens=False).input_ids
    if not any(m["kind"] == "video" for m in sample["media"]):  # the whole processor agrees
        assert list(wrapper(text=[text], images=images or None)["input_ids"][0]) == ids
    pixels, tiles = [], []
    images_in_order = iter(image_tiles)
    for m in sample["media"]:
        if m["kind"] == "image":
            pixels.append(next(images_in_order))
        else:
            pixels.append(videos(m)["pixels"])
        tiles.append(len(pixels[-1]))
    return {
        "input_ids": ids,
        "labels": labels_of(tokenizer, expanded, ids, MEDIA_SPAN),
        "tiles": tiles,
        "pixel_values": pixels,
        "text": expanded,
    }
