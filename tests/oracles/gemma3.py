"""transformers as the oracle for a Gemma 3 model directory (``model_type: gemma3``).

What a user's training script does: the directory's chat template (in tokenizer_config.json)
on the conversation as content parts, then transformers' ``Gemma3Processor`` on the rendered
text and the sample's images (``Gemma3ImageProcessorPil``, the backend AutoProcessor picks
without torchvision), with ``add_special_tokens=False`` (the template already starts with
``<bos>``). Labels: model turns after their header through ``<end_of_turn>``, except each
image's span (its newlines, ``<start_of_image>``, soft tokens, ``<end_of_image>``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

from tests.oracles.qwen_family import labels_of, messages, rgb

MODEL_TURN = re.compile(r"<start_of_turn>model\n(.*?)<end_of_turn>", re.DOTALL)
IMAGE_SPAN = re.compile(r"\n\n<start_of_image>(?:<image_soft_token>)+<end_of_image>\n\n")


def image_processor(model_dir: Path) -> Gemma3ImageProcessorPil:
    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    return Gemma3ImageProcessorPil(
        **{k: v for k, v in settings.items() if v is not None and not k.endswith(("_type", "_class"))}
    )


def processor(model_dir: Path, tokenizer) -> Gemma3Processor:
    settings = json.loads((model_dir / "processor_config.json").read_text())
    return Gemma3Processor(
        image_processor(model_dir), tokenizer, image_seq_length=settings["image_seq_length"]
    )


def reference(model_dir: Path, tokenizer, sample: dict, videos: Any = None) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, token type ids, the tokens
    of every image and its pixel values ``(3, size, size)`` (``videos``: unused, Gemma 3 takes
    none)."""
    text = tokenizer.apply_chat_template(messages(sample["system"], sample["turns"]), tokenize=False)
    images = [rgb(m["uri"]) for m in sample["media"]]
    wrapper = processor(model_dir, tokenizer)
    out = wrapper(text=[text], images=[images] if images else None, add_special_tokens=False)
    ids = [int(i) for i in out["input_ids"][0]]
    expanded = tokenizer.decode(ids, skip_special_tokens=False)
    soft = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    runs = [len(m.group(0)) for m in re.finditer(f"(?:{soft},)+", ",".join(map(str, ids)) + ",")]
    return {
        "input_ids": ids,
        "labels": labels_of(tokenizer, expanded, ids, IMAGE_SPAN, MODEL_TURN),
        "token_type_ids": [int(t) for t in out["token_type_ids"][0]],
        "tokens": [r // (len(str(soft)) + 1) for r in runs],
        "pixel_values": list(np.asarray(out["pixel_values"])) if images else [],
        "text": expanded,
    }
