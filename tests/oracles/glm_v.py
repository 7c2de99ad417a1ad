"""transformers as the oracle for a GLM-V model directory (GLM-4.5V, GLM-4.6V, GLM-OCR).

What a user's training script does with the directory: its chat template on the conversation
(content parts where a turn has media, text turns as strings: GLM-4.1V's template writes an
assistant's content as it is), GLM's processor on the text and media: the PIL image processor
(``Glm4vImageProcessorPil``) from ``preprocessor_config.json``, the video half from the
directory's video processor class (in a subprocess: tests/oracles/qwen_video.py), each
``<|image|>`` expanded to its tokens and each ``<|video|>`` replaced by the processor's frame
blocks; the token types by the processor's own ``create_mm_token_type_ids``; positions by the
model's own ``get_rope_index``. The template leaves a conversation's last turn open: mmpack
closes it with ``<|user|>``, the token GLM generates to stop (ChatFormat.closing_token), so
the reference appends it. Labels: an assistant turn after its ``<|assistant|>\\n`` through the
role token that ends it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpack_udfs.tokenize.template_check import messages
from tests.oracles.qwen_family import chat_template, labels_of, rgb

ASSISTANT_TURN = re.compile(r"<\|assistant\|>\n(.*?(?:<\|user\|>|<\|observation\|>))", re.DOTALL)
MEDIA_SPAN = re.compile(
    r"<\|begin_of_image\|>(?:<\|image\|>)+<\|end_of_image\|>|<\|begin_of_video\|>.*?<\|end_of_video\|>",
    re.DOTALL,
)


def image_processor(model_dir: Path):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    return Glm4vImageProcessorPil(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )


def token_types(tokenizer, ids: list[int]) -> list[int]:
    """The processor's ``mm_token_type_ids`` (0 text, 1 image, 2 a video's frames)."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    processor = Glm4vProcessor.__new__(Glm4vProcessor)  # only its token ids: no image or video processor
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image|>")
    processor.video_start_id = tokenizer.convert_tokens_to_ids("<|begin_of_video|>")
    processor.video_end_id = tokenizer.convert_tokens_to_ids("<|end_of_video|>")
    return processor.create_mm_token_type_ids([ids])[0]


def reference(model_dir: Path, tokenizer, sample: dict, videos) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, token types, grids and pixels."""
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=chat_template(model_dir), tokenize=False
    )
    out: dict[str, Any] = {
        key: [] for key in ("image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos")
    }
    images = [m for m in sample["media"] if m["kind"] == "image"]
    processed = image_processor(model_dir)(images=[rgb(m["uri"]) for m in images]) if images else None
    if processed is not None:
        out["image_grid_thw"] = [[int(x) for x in g] for g in processed["image_grid_thw"]]
        out["pixel_values"] = [np.asarray(processed["pixel_values"])]
    replacements, items, image_row, image_grids = [], [], 0, iter(out["image_grid_thw"])
    for m in sample["media"]:  # in token order
        if m["kind"] == "video":
            video = videos(m)
            out["video_grid_thw"].append(video["grid"])
            out["pixel_values_videos"].append(video["pixels"])
            replacements.append(video["replacement"])
            t, h, w = video["grid"]
            items.append(("video", np.asarray(video["pixels"]), [[1, h, w]] * t))
        else:
            t, h, w = next(image_grids)
            rows = out["pixel_values"][0][image_row : image_row + t * h * w]
            items.append(("image", rows, [[1, h, w]]))
            image_row += t * h * w
    out["items"] = items  # (kind, pixel rows, grids as images): what the model is handed, in order
    grids = iter(out["image_grid_thw"])
    text = re.sub(r"<\|image\|>", lambda _: "<|image|>" * (int(np.prod(next(grids))) // 4), text)
    frames = iter(replacements)
    text = re.sub(r"<\|video\|>", lambda _: next(frames), text) + "<|user|>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    out.update(
        input_ids=ids,
        labels=labels_of(tokenizer, text, ids, MEDIA_SPAN, ASSISTANT_TURN),
        mm_token_type_ids=token_types(tokenizer, ids),
        text=text,
    )
    return out


def rope_index(model, ids: list[int], ref: dict[str, Any]) -> np.ndarray:
    """[3, T] positions of one sample by the model's own ``get_rope_index``."""
    kwargs = {key: torch.tensor(ref[key]) for key in ("image_grid_thw", "video_grid_thw") if ref[key]}
    positions, _ = model.model.get_rope_index(
        torch.tensor([ids]), torch.tensor([ref["mm_token_type_ids"]]), **kwargs
    )
    return positions[:, 0].numpy()
