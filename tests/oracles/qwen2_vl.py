"""transformers as the oracle for Qwen2-VL tokenization.

The reference pipeline is what a Qwen2-VL training script does: ``apply_chat_template``
on the conversation, then the processor's expansion of each ``<|image_pad|>`` /
``<|video_pad|>`` into ``grid.prod() // merge**2`` copies, then the tokenizer.

transformers' Qwen2-VL *video* processor module imports torchvision at import time, and
there is no CPU torchvision here; its frame sampling and resize rule need none of it, so
the oracle imports it with an inert torchvision stand-in (tests only).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

PLACEHOLDER = re.compile(r"(<image>|<video>)")


def video_plans(cases: list[tuple[int, float, int, int]], video_cfg: dict) -> list[tuple[int, list[int]]]:
    """(tokens, frame indices) per (frames, fps, width, height), from transformers' processor.

    Runs in a fresh interpreter that installs the torchvision stand-in before transformers
    is imported (transformers caches what it found at import time).
    """
    payload = json.dumps({"cases": cases, "cfg": video_cfg})
    result = subprocess.run(
        [sys.executable, "-m", "tests.oracles.qwen2_vl_video"],
        input=payload,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return [(tokens, frames) for tokens, frames in json.loads(result.stdout)]


def image_tokens(image: Image.Image, min_pixels: int, max_pixels: int) -> int:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    grid = processor(images=[image])["image_grid_thw"][0]
    return int(grid.prod()) // 4


def reference_ids(hf_tokenizer, system, turns, media_tokens: list[int]) -> list[int]:
    """Token ids of a conversation as transformers renders and expands it."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for turn in turns:
        parts = [p for p in PLACEHOLDER.split(turn["text"]) if p]
        role = "assistant" if turn["role"] == "function_call" else turn["role"]
        if len(parts) == 1 and not PLACEHOLDER.fullmatch(parts[0]):
            messages.append({"role": role, "content": parts[0]})
        else:
            content = [
                {"type": p[1:-1]} if PLACEHOLDER.fullmatch(p) else {"type": "text", "text": p} for p in parts
            ]
            messages.append({"role": role, "content": content})
    return render_ids(hf_tokenizer, messages, media_tokens)


def render_ids(hf_tokenizer, messages: list[dict], media_tokens: list[int]) -> list[int]:
    """Token ids of chat ``messages`` (string or content-part contents) as transformers renders
    them, each media pad expanded to its token count."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    counts = iter(media_tokens)
    text = re.sub(r"<\|(image|video)_pad\|>", lambda m: m.group(0) * next(counts), text)
    return hf_tokenizer(text, add_special_tokens=False).input_ids
