"""transformers as the oracle for a Qwen-Omni model directory (Qwen2.5-Omni, Qwen3-Omni).

What a user's training script does, one sample per call: the directory's chat template on the
conversation as content parts (``{"type": "image"}``, ``{"type": "audio", "audio": ...}``,
``{"type": "video"}``; Qwen3-Omni: a turn without media as a string, as mmpack's template check
hands it over: its template finds the last user query only there), then transformers'
``Qwen2_5OmniProcessor`` or ``Qwen3OmniMoeProcessor`` whole (the PIL image processor and
``WhisperFeatureExtractor`` from preprocessor_config.json, Qwen2-VL's video processor with that
file's patching and normalization, as transformers gives it to a directory without a video
processor config, sampling frames at mmpack's documented fps) on the rendered text, the sample's images,
its waveforms (FFmpeg's 16 kHz decode, as for Qwen2-Audio) and its videos' frames. The processor
runs in the video oracle's process (``tests/oracles/qwen_video.py``: it needs torchvision).
Labels: assistant turns after their header through ``<|im_end|>``, media spans excluded.
Positions: the thinker's own ``get_rope_index``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loader import audio
from tests.oracles import qwen_family
from tests.oracles.qwen_family import chat_template, labels_of

PLACEHOLDER = re.compile(r"(<image>|<video>|<audio>)")
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)
MEDIA_SPANS = {  # by processor
    "qwen2_5_omni": re.compile(
        r"<\|vision_bos\|>(?:<\|IMAGE\|>)+<\|vision_eos\|>|<\|vision_bos\|>(?:<\|VIDEO\|>)+<\|vision_eos\|>"
        r"|<\|audio_bos\|>(?:<\|AUDIO\|>)+<\|audio_eos\|>"
    ),
    "qwen3_omni": re.compile(
        r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>"
        r"|<\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>"
        r"|<\|audio_start\|>(?:<\|audio_pad\|>)+<\|audio_end\|>"
    ),
}
# mmpack's documented video defaults (the checkpoint ships no video processor config), given to
# transformers' Qwen2-VL video processor explicitly; the processor passes its own frame size
VIDEO_SETTINGS = {"fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True}
Ask = Callable[[dict], list[dict]]


def messages(system: str | None, turns: list[dict], strings: bool = False) -> list[dict[str, Any]]:
    """A samples-table conversation as chat messages, each media item a part as users write them;
    ``strings``: a system prompt and a turn without media as a string."""
    parts = {
        "<image>": {"type": "image"},
        "<video>": {"type": "video"},
        "<audio>": {"type": "audio", "audio": "a.wav"},
    }
    out = qwen_family.messages(system, turns, PLACEHOLDER, lambda p: parts[p])
    if strings:
        for message in out:
            if all(part["type"] == "text" for part in message["content"]):
                message["content"] = "".join(part["text"] for part in message["content"])
    return out


def references(
    model_dir: Path,
    tokenizer,
    samples: list[dict],
    ask: Ask,
    tmp: Path,
    audio_in_video: bool = False,
    processor: str = "qwen2_5_omni",
) -> dict[str, dict]:
    """What transformers gives for each samples-table row alone (by sample id): ids, labels, grids,
    seconds per temporal patch, each clip's feature frames, and the pixel values and features.
    ``audio_in_video``: each video brings its track (``load_audio_from_video``), the audio slots
    in text order (``audio_from_video_indices``). ``processor``: ``qwen2_5_omni`` or ``qwen3_omni``."""
    requests = []
    for index, sample in enumerate(samples):
        text = tokenizer.apply_chat_template(
            messages(sample["system"], sample["turns"], strings=processor == "qwen3_omni"),
            chat_template=chat_template(model_dir),
            tokenize=False,
        )
        clips, slots, videos = [], [], 0
        for item in sample["media"]:
            if item["kind"] == "audio" or (item["kind"] == "video" and audio_in_video):
                clips.append(str(tmp / f"s{index}-a{len(clips)}.npy"))
                np.save(clips[-1], audio.decode(item["uri"]))  # a clip, or a video's track
                slots.append(videos if item["kind"] == "video" else None)
            videos += item["kind"] == "video"
        request = {
            "text": text,
            "images": [m["uri"] for m in sample["media"] if m["kind"] == "image"],
            "videos": [m["uri"] for m in sample["media"] if m["kind"] == "video"],
            "audio": clips,
            "out": str(tmp / f"s{index}"),
        }
        if audio_in_video and request["videos"]:
            request["audio_from_video_indices"] = slots
        requests.append(request)
    request = {"model_dir": str(model_dir), "video_settings": VIDEO_SETTINGS, "processor": processor}
    results = ask({**request, "samples": requests})
    out = {}
    for sample, request, result in zip(samples, requests, results, strict=True):
        ids = result["input_ids"]
        expanded = tokenizer.decode(ids, skip_special_tokens=False)
        arrays = {
            key: np.load(f"{request['out']}.{key}.npy")
            for key in ("pixel_values", "pixel_values_videos", "input_features")
            if Path(f"{request['out']}.{key}.npy").exists()
        }
        out[sample["sample_id"]] = {
            **result,
            **arrays,
            "labels": labels_of(tokenizer, expanded, ids, MEDIA_SPANS[processor], ASSISTANT_TURN),
            "text": expanded,
        }
    return out


def rope_index(model, ref: dict[str, Any], audio_in_video: bool = False) -> np.ndarray:
    """[3, T] positions of one sample by the thinker's own ``get_rope_index`` (Qwen3-Omni's: float32)."""
    input_ids = torch.tensor([ref["input_ids"]])
    grids = {
        key: torch.tensor(ref[key]) if ref[key] else None for key in ("image_grid_thw", "video_grid_thw")
    }
    positions, _ = model.model.get_rope_index(
        input_ids,
        grids["image_grid_thw"],
        grids["video_grid_thw"],
        torch.ones_like(input_ids),
        audio_in_video,
        torch.tensor(ref["feature_frames"]) if ref["feature_frames"] else None,
        torch.tensor(ref["video_second_per_grid"]) if ref["video_second_per_grid"] else None,
    )
    return positions[:, 0].numpy()
