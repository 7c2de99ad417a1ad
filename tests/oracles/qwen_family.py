"""transformers as the oracle for a model directory of the Qwen-VL line.

What a user's training script does with the directory: the directory's chat template on the
conversation (content parts for media), the family's processor on the text and the media
files (the image processor from ``preprocessor_config.json``, PIL backend; the video
processor from ``video_preprocessor_config.json``), which expands every pad as the model
wants. Labels: every token of an assistant turn after its role header through its
``<|im_end|>``, except media spans: found on the processor's own text by character offsets.
Positions: the model's own ``get_rope_index``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

PLACEHOLDER = re.compile(r"(<image>|<video>)")
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)
MEDIA_SPAN = re.compile(
    r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>"
    r"|<\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>"
    r"|<\|vision_start\|>(?:<[0-9.]+ seconds><\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>)+"
    r"<\|vision_end\|>"
)


def chat_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    return json.loads((model_dir / "chat_template.json").read_text())["chat_template"]


def messages(
    system: str | None, turns: list[dict], placeholder: re.Pattern = PLACEHOLDER, part=None
) -> list[dict[str, Any]]:
    """A samples-table conversation as chat messages: every turn as content parts (a media
    part: ``part(placeholder)``, by default ``{"type": kind}``)."""
    part = part or (lambda p: {"type": p[1:-1]})
    out = [] if system is None else [{"role": "system", "content": [{"type": "text", "text": system}]}]
    for turn in turns:
        role = "assistant" if turn["role"] == "function_call" else turn["role"]
        parts = [p for p in placeholder.split(turn["text"]) if p]
        content = [part(p) if placeholder.fullmatch(p) else {"type": "text", "text": p} for p in parts]
        out.append({"role": role, "content": content if content else [{"type": "text", "text": ""}]})
    return out


def labels_of(
    tokenizer,
    text: str,
    ids: list[int],
    media_span: re.Pattern = MEDIA_SPAN,
    turns: re.Pattern = ASSISTANT_TURN,
) -> list[int]:
    """Supervised tokens of the expanded text: assistant ``turns`` after their header through
    the turn's end token (``<|im_end|>``), media spans excluded (by the tokens' character offsets)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded.input_ids == ids
    supervised = np.zeros(len(text) + 1, bool)
    for turn in turns.finditer(text):
        supervised[turn.start(1) : turn.end(0)] = True
    for span in media_span.finditer(text):
        supervised[span.start() : span.end()] = False
    return [
        i if supervised[start] else -100 for i, (start, _) in zip(ids, encoded.offset_mapping, strict=True)
    ]


def image_processor(model_dir: Path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    settings = {k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    return Qwen2VLImageProcessorPil(**settings)


def rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def reference(model_dir: Path, tokenizer, sample: dict, videos) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, grids and pixels.
    ``videos(uri)`` gives the processed video's inputs and its text replacement (the video
    half of the processor, run where torchvision is set up)."""
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=chat_template(model_dir), tokenize=False
    )
    keys = ("image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos", "second_per_grid_ts")
    out: dict[str, Any] = {key: [] for key in keys}
    images = [m for m in sample["media"] if m["kind"] == "image"]
    processed = image_processor(model_dir)(images=[rgb(m["uri"]) for m in images]) if images else None
    image_index, video_replacements = 0, []
    for m in sample["media"]:
        if m["kind"] == "image":
            grid = processed["image_grid_thw"][image_index]
            out["image_grid_thw"].append([int(x) for x in grid])
            image_index += 1
        else:
            video = videos(m)
            out["video_grid_thw"].append(video["grid"])
            out["pixel_values_videos"].append(video["pixels"])
            out["second_per_grid_ts"].append(video.get("second_per_grid_t"))
            video_replacements.append(video["replacement"])
    if processed is not None:
        out["pixel_values"] = [np.asarray(processed["pixel_values"])]
    grids = iter(out["image_grid_thw"])
    text = re.sub(r"<\|image_pad\|>", lambda _: "<|image_pad|>" * (int(np.prod(next(grids))) // 4), text)
    replacements = iter(video_replacements)
    text = re.sub(r"<\|video_pad\|>", lambda _: next(replacements), text)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    out.update(input_ids=ids, labels=labels_of(tokenizer, text, ids), text=text)
    return out


def rope_index(model, ids: list[int], ref: dict[str, Any]) -> np.ndarray:
    """[3, T] positions of one sample by the model's own ``get_rope_index``."""
    config = model.config
    input_ids = torch.tensor([ids])
    kinds = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    kwargs: dict[str, Any] = {}
    if ref["image_grid_thw"]:
        kwargs["image_grid_thw"] = torch.tensor(ref["image_grid_thw"])
    if ref["video_grid_thw"]:
        kwargs["video_grid_thw"] = torch.tensor(ref["video_grid_thw"])
        if any(s is not None for s in ref["second_per_grid_ts"]):
            kwargs["second_per_grid_ts"] = torch.tensor(ref["second_per_grid_ts"], dtype=torch.float32)
    positions, _ = model.model.get_rope_index(input_ids, kinds, **kwargs)
    return positions[:, 0].numpy()
