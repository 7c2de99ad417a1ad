"""Micro-batches of several bins: one flat sequence with offsets (varlen), optionally padded
to a fixed length so that every step has the same shapes (CUDA graphs, torch.compile)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loader.dataset import IGNORE

CONCATENATED = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "num_tiles")


def collate_packed(items: Sequence[dict[str, Any]], pad_to: int | None = None, pad_token_id: int = 0) -> dict:
    """Concatenate bins into ``input_ids``/``labels``/``position_ids`` of shape [1, T],
    ``cu_seqlens`` over all their samples and ``max_seqlen``; vision tensors are concatenated
    in order. With ``pad_to``, T is padded to exactly that length: the padding is one extra
    sequence in ``cu_seqlens`` with labels -100 (so no loss and no attention leaks)."""
    if not items:
        raise ValueError("collate_packed needs at least one bin")
    ids = torch.cat([b["input_ids"] for b in items])
    labels = torch.cat([b["labels"] for b in items])
    positions = torch.cat([b["position_ids"] for b in items])
    offsets, total = [torch.zeros(1, dtype=torch.int32)], 0
    for b in items:
        offsets.append(b["cu_seqlens"][1:] + total)
        total += int(b["cu_seqlens"][-1])
    cu = torch.cat(offsets)
    max_seqlen = max(b["max_seqlen"] for b in items)
    mrope = (
        torch.cat([b["mrope_position_ids"] for b in items], dim=1)
        if "mrope_position_ids" in items[0]
        else None
    )
    if pad_to is not None:
        pad = pad_to - total
        if pad < 0:
            raise ValueError(f"{total} tokens do not fit in pad_to={pad_to}")
        if pad:
            ids = torch.cat([ids, torch.full((pad,), pad_token_id, dtype=ids.dtype)])
            labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=labels.dtype)])
            fill = torch.arange(pad, dtype=positions.dtype)
            positions = torch.cat([positions, fill])
            cu = torch.cat([cu, torch.tensor([pad_to], dtype=torch.int32)])
            max_seqlen = max(max_seqlen, pad)
            if mrope is not None:
                mrope = torch.cat([mrope, fill.expand(3, pad)], dim=1)
    batch: dict[str, Any] = {
        "input_ids": ids[None],
        "labels": labels[None],
        "position_ids": positions[None],
        "cu_seqlens": cu,
        "max_seqlen": max_seqlen,
        "sample_ids": [s for b in items for s in b["sample_ids"]],
        "num_tokens": total,
    }
    if mrope is not None:
        batch["mrope_position_ids"] = mrope[:, None, :]  # [3, 1, T], as Qwen2-VL takes position_ids
    for key in CONCATENATED:
        parts = [b[key] for b in items if key in b]
        if parts:
            batch[key] = torch.cat(parts)
    return batch
