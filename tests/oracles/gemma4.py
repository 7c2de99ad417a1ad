"""transformers as the oracle for a Gemma 4 model directory (``model_type: gemma4``).

What a user's training script does with the directory: its chat template on the conversation
(content parts where a turn has media), then ``Gemma4Processor`` on the text and media: the PIL
image processor (``Gemma4ImageProcessorPil``, the backend AutoProcessor picks without
torchvision) from ``processor_config.json``'s image section, each ``<|image|>`` replaced by the
processor's own ``replace_image_token``, and the video half from its video processor (in a
subprocess: tests/oracles/qwen_video.py) replacing each ``<|video|>``. Token types as the
processor marks them (1: image tokens, 2: video tokens). Labels: model turns after
``<|turn>model\\n`` through ``<turn|>``, media spans excluded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from mmpack_udfs.tokenize.template_check import messages
from tests.oracles.qwen_family import chat_template, labels_of, rgb

MODEL_TURN = re.compile(r"<\|turn>model\n(.*?<turn\|>)", re.DOTALL)
FRAME = r"\d\d:\d\d <\|image>(?:<\|video\|>)+<image\|>"
MEDIA_SPAN = re.compile(rf"<\|image>(?:<\|image\|>)+<image\|>|{FRAME}(?: {FRAME})*")


def image_processor(model_dir: Path):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    settings = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]
    return Gemma4ImageProcessorPil(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )


def processor(tokenizer):
    """Gemma4Processor for its text expansion (its image processor; no video half here)."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    wrapper = Gemma4Processor.__new__(Gemma4Processor)  # only its tokens and image expansion
    wrapper.boi_token, wrapper.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
    wrapper.image_token = tokenizer.image_token
    return wrapper


def reference(model_dir: Path, tokenizer, sample: dict, videos) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, token types, soft tokens
    per item, pixels and patch positions (images in-process, videos from ``videos(m)``)."""
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=chat_template(model_dir), tokenize=False
    )
    images = [rgb(m["uri"]) for m in sample["media"] if m["kind"] == "image"]
    out: dict[str, Any] = {"pixel_values": [], "image_position_ids": [], "videos": []}
    expansions = []
    if images:
        processed = image_processor(model_dir)(images=images)
        wrapper = processor(tokenizer)
        expansions = [wrapper.replace_image_token(processed, i) for i in range(len(images))]
        out["pixel_values"] = list(np.asarray(processed["pixel_values"]))
        out["image_position_ids"] = list(np.asarray(processed["image_position_ids"]))
        out["image_tokens"] = [int(n) for n in processed["num_soft_tokens_per_image"]]
    images_in_order = iter(expansions)
    text = re.sub(r"<\|image\|>", lambda _: next(images_in_order), text)
    clips = [videos(m) for m in sample["media"] if m["kind"] == "video"]
    out["videos"] = clips
    clips_in_order = iter(clip["replacement"] for clip in clips)
    text = re.sub(r"<\|video\|>", lambda _: next(clips_in_order), text)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    image_id, video_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image|>", "<|video|>"))
    out.update(
        input_ids=ids,
        labels=labels_of(tokenizer, text, ids, MEDIA_SPAN, MODEL_TURN),
        mm_token_type_ids=[1 if i == image_id else 2 if i == video_id else 0 for i in ids],
        text=text,
    )
    return out
