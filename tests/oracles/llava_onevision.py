"""transformers as the oracle for a LLaVA-OneVision model directory (``model_type: llava_onevision``).

What a user's training script does: the directory's chat template on the conversation
(content parts for media; the template writes a message's images first, then its videos, then
its texts), then transformers' ``LlavaOnevisionProcessor`` on the text and the files, with the
image processor of ``preprocessor_config.json`` (PIL backend) given the sample's images as one
sample (``images=[[...]]``: the only image of a sample is cut into anyres crops, the images of
a sample with several are one square crop each, ``batch_num_images``), and
``LlavaOnevisionVideoProcessor`` for videos (in a subprocess with the test-only torchvision
scaffold: tests/oracles/qwen_video.py). Labels: assistant turns after their header through
``<|im_end|>``, except the runs of ``<image>`` / ``<video>`` tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

from tests.oracles.qwen_family import labels_of, messages, rgb

MEDIA_SPAN = re.compile(r"(?:<image>)+|(?:<video>)+")


class ImageTextProcessor(LlavaOnevisionProcessor):
    """transformers' LlavaOnevisionProcessor without its video half (whose class needs
    torchvision, so that the constructor's class check of even a missing video processor
    fails): the videos' text comes from the subprocess that runs the video processor."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def processor_settings(model_dir: Path) -> dict[str, Any]:
    """processor_config.json less its class name (num_image_tokens, the feature strategy …)."""
    settings = json.loads((model_dir / "processor_config.json").read_text())
    return {k: v for k, v in settings.items() if k != "processor_class"}


def image_processor(model_dir: Path) -> LlavaOnevisionImageProcessorPil:
    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    return LlavaOnevisionImageProcessorPil(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )


def processor(model_dir: Path, tokenizer) -> ImageTextProcessor:
    return ImageTextProcessor(image_processor(model_dir), tokenizer, None, **processor_settings(model_dir))


def reference(model_dir: Path, tokenizer, sample: dict, videos) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, the tokens of every item
    and the pixel values in the template's item order (an image's own crops, ``(crops, 3, H, W)``; a video's
    frames, ``(frames, 3, H, W)``), with the image sizes and ``batch_num_images`` the model
    takes. ``videos(item)`` gives a processed video (its frames, pixels and the text the
    processor puts in place of ``<video>``)."""
    template = (model_dir / "chat_template.jinja").read_text()
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=template, tokenize=False
    )
    images = [rgb(m["uri"]) for m in sample["media"] if m["kind"] == "image"]
    wrapper = processor(model_dir, tokenizer)
    # the processor's own text for each item (replace_image_token, replace_video_token), put in
    # place of the template's placeholders in order: the template moves a message's images
    # before its videos but keeps each kind's order, so the i-th <image> is the i-th image item
    processed, image_texts = wrapper._process_images([images]) if images else ({}, [])
    video_texts = [videos(m)["replacement"] for m in sample["media"] if m["kind"] == "video"]
    by_kind = {"<image>": iter(image_texts), "<video>": iter(video_texts)}
    expanded = re.sub(r"<image>|<video>", lambda p: next(by_kind[p[0]]), text)
    ids = tokenizer(expanded, add_special_tokens=False).input_ids
    if not video_texts:  # the whole processor agrees
        assert list(wrapper(text=[text], images=[images] if images else None)["input_ids"][0]) == ids
    image_pixels = iter(np.asarray(processed.get("pixel_values", [])))  # one sample: no padding crops
    image_tokens = iter(t.count("<image>") for t in image_texts)
    video_tokens = iter(t.count("<video>") for t in video_texts)
    clips = iter(m for m in sample["media"] if m["kind"] == "video")
    pixels, tokens = [], []
    for placeholder in re.findall(r"<image>|<video>", text):  # the items in the template's order
        if placeholder == "<image>":
            pixels.append(next(image_pixels))
            tokens.append(next(image_tokens))
        else:
            pixels.append(videos(next(clips))["pixels"])
            tokens.append(next(video_tokens))
    return {
        "input_ids": ids,
        "labels": labels_of(tokenizer, expanded, ids, MEDIA_SPAN),
        "tokens": tokens,
        "pixel_values": pixels,
        "image_sizes": [[int(x) for x in s] for s in processed.get("image_sizes", [])],
        "batch_num_images": [int(n) for n in processed.get("batch_num_images", [])],
        "text": expanded,
    }
