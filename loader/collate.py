"""Bins → one micro-batch a model takes as it is: ``model(**batch)``.

Several bins become one flat sequence of shape [1, T] whose samples never see each other:
transformers finds the sample boundaries from the text positions, which restart at 0 per
sample, when there is no ``attention_mask`` and no KV cache (SDPA and eager build a
block-diagonal causal mask from them); flash-attn 2 takes the boundaries directly as
``cu_seq_lens_q/k`` and ``max_length_q/k``. For Qwen2-VL, ``position_ids`` is [4, 1, T]:
row 0 the text positions, rows 1–3 the per-sample mRoPE (with 3 rows, transformers finds
no boundaries and samples silently attend to each other). Optionally T is padded to a
fixed length (CUDA graphs, torch.compile): the padding is one more masked sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from loader import attention, vision
from loader.dataset import IGNORE

VISION_INPUTS = (  # concatenated across bins in order
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "image_sizes",  # LLaVA-OneVision
    "batch_num_images",
    "image_position_ids",  # Gemma 4
    "video_position_ids",
    "num_frames_per_video",
    "input_features",  # audio: one clip's log-mel features per row
    "feature_attention_mask",
)
FRAMED_INPUTS = ("input_features", "feature_attention_mask")  # clips' frames: bins may differ in width


class PackedBatch(dict):
    """The keyword arguments of one forward pass (``model(**batch)``), and ``meta``: what the
    batch holds (``sample_ids``, ``sample_datasets``, ``sample_supervised_tokens`` and
    ``sample_weights`` (each one's loss weight) of the real samples, ``sample_sequences``
    (each one's sequence among ``cu_seq_lens_q``'s),
    ``pairs`` (each preference pair's (chosen, rejected) indices into ``sample_ids``),
    ``sequence_datasets`` (each sequence's dataset, None for fillers and padding),
    ``sequence_weights`` (each sequence's loss weight, 1 for fillers and padding),
    ``num_tokens``, ``supervised_tokens``, ``num_bins``, ``fillers``, per bin
    ``bin_tokens`` and ``bin_sum_sq_lengths`` (its attention cost); ``num_tiles`` for
    internvl), kept out of the model's arguments.

    It survives what trainers do to batches: ``.to()`` (and accelerate's ``send_to_device``,
    which calls it) and pickling (dataloader workers) keep ``meta``; a rebuild from a plain
    mapping, ``type(batch)(mapping)`` (transformers' ``Trainer._prepare_input``), gives a
    valid batch whose ``meta`` is empty: ``loader.trainer`` moves batches with ``.to()``."""

    meta: dict[str, Any]

    def __init__(self, inputs: Mapping[str, Any] = (), meta: dict[str, Any] | None = None) -> None:
        super().__init__(inputs)
        self.meta = meta if meta is not None else dict(getattr(inputs, "meta", {}))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device`` (flash-attn wants ``cu_seq_lens_*`` there too)."""

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.to(device, non_blocking=non_blocking)
            if isinstance(value, dict):  # Gemma 3's masks by layer type
                return {k: move(v) for k, v in value.items()}
            return value

        return PackedBatch({k: move(v) for k, v in self.items()}, dict(self.meta))


def collate_packed(
    items: Sequence[dict[str, Any]], pad_to: int | None = None, pad_token_id: int = 0
) -> PackedBatch:
    """Concatenate bins (from ``PackedDataset``) into one model input.

    Keys: ``input_ids``, ``labels`` [1, T]; ``position_ids`` [4, 1, T] for qwen2_vl, else
    [1, T]; the vision tensors, concatenated in order; ``cu_seq_lens_q``/``cu_seq_lens_k``
    (int32, every sample's start and T) and ``max_length_q``/``max_length_k`` (int), except
    for families whose forward hands its keyword arguments to the vision tower (InternVL:
    ``Family.boundary_kwargs``; flash-attn then finds the boundaries from ``position_ids``;
    ``meta["cu_seq_lens"]`` and ``meta["max_length"]`` hold them for every family);
    ``use_cache=False`` (a cache turns off transformers' packed-sequence detection); for
    families with linear-attention layers (Qwen3.5) ``seq_idx`` [1, T] int32, each token's
    sample (what the causal-conv kernel needs to restart at sample boundaries); for families whose
    image tokens attend within their image (Gemma 3) ``attention_mask``, its masks by layer type
    (``attention.media_block_masks``: bool, SDPA's form; ``loader.training.token_losses`` hands
    another attention its own form, ``attention.with_model_masks``; ``meta["sliding_window"]``).
    With ``pad_to``, T is exactly that: the padding is one extra sequence, labels -100.
    """
    if not items:
        raise ValueError("collate_packed needs at least one bin")
    ids = torch.cat([b["input_ids"] for b in items])
    labels = torch.cat([b["labels"] for b in items])
    rows = [b["position_ids"][None] for b in items]
    if "mrope_position_ids" in items[0]:  # qwen2_vl: text row, then the three mRoPE rows
        rows = [torch.cat([row, b["mrope_position_ids"]]) for row, b in zip(rows, items, strict=True)]
    positions = torch.cat(rows, dim=1)
    offsets, total = [torch.zeros(1, dtype=torch.int32)], 0
    for b in items:
        offsets.append(b["cu_seqlens"][1:] + total)
        total += int(b["cu_seqlens"][-1])
    cu = torch.cat(offsets)
    max_length = max(b["max_seqlen"] for b in items)
    if pad_to is not None:
        pad = pad_to - total
        if pad < 0:
            raise ValueError(f"{total} tokens do not fit in pad_to={pad_to}")
        if pad:
            ids = torch.cat([ids, torch.full((pad,), pad_token_id, dtype=ids.dtype)])
            labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=labels.dtype)])
            fill = torch.arange(pad, dtype=positions.dtype).expand(len(positions), pad)
            positions = torch.cat([positions, fill], dim=1)
            cu = torch.cat([cu, torch.tensor([pad_to], dtype=torch.int32)])
            max_length = max(max_length, pad)
    inputs: dict[str, Any] = {
        "input_ids": ids[None],
        "labels": labels[None],
        "position_ids": positions[:, None, :] if len(positions) == 4 else positions,
        "use_cache": False,
    }
    if all(b.get("boundary_kwargs", True) for b in items):
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_length, max_length_k=max_length)
    for key in VISION_INPUTS:
        parts = [b[key] for b in items if key in b]
        if key in FRAMED_INPUTS and parts:  # zero frames, masked, up to the widest bin's (Qwen2.5-Omni)
            width = max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
        if parts:
            inputs[key] = torch.cat(parts)
    if "media_token_mask" in items[0]:  # Gemma 3 and 4: image tokens attend within their image
        media = torch.cat([b["media_token_mask"] for b in items])
        media = torch.cat([media, torch.zeros(len(ids) - len(media), dtype=torch.bool)])  # the padding
        inputs["attention_mask"] = attention.media_block_masks(
            cu, media, items[0]["sliding_window"], items[0].get("global_media_blocks", True)
        )
    if "seq_idx" in items[0]:  # linear-attention layers: the sample of every token, across bins
        inputs["seq_idx"] = _seq_idx(items, pad_to - total if pad_to is not None else 0)
    sequences, pairs = _samples_and_pairs(items)
    meta: dict[str, Any] = {
        "sample_ids": [s for b in items for s in b["sample_ids"]],
        "sample_sequences": sequences,
        "pairs": pairs,
        "sample_datasets": [d for b in items if not b.get("filler") for d in _datasets(b)],
        # the dataset of every sequence of cu_seq_lens (None: a filler's, the padding)
        "sequence_datasets": [d for b in items for d in _datasets(b)]
        + [None] * (pad_to is not None and pad > 0),
        "sample_supervised_tokens": [
            n for b in items if not b.get("filler") for n in _supervised_per_sample(b)
        ],
        "sample_weights": [w for b in items if not b.get("filler") for w in _weights(b)],
        # the loss weight of every sequence of cu_seq_lens (1: a filler's, the padding)
        "sequence_weights": [w for b in items for w in _weights(b)]
        + [1.0] * (pad_to is not None and pad > 0),
        "num_tokens": total,
        "supervised_tokens": int((labels != IGNORE).sum()),
        "num_bins": len(items),
        "fillers": sum(bool(b.get("filler")) for b in items),
        "cu_seq_lens": cu.tolist(),
        "max_length": max_length,
        "bin_tokens": [int(b["cu_seqlens"][-1]) for b in items],
        "bin_sum_sq_lengths": [int((b["cu_seqlens"].diff().to(torch.int64) ** 2).sum()) for b in items],
    }
    if "media_token_mask" in items[0]:
        meta["sliding_window"] = items[0]["sliding_window"]
        meta["global_media_blocks"] = items[0].get("global_media_blocks", True)
    spans = [b["second_per_grid_ts"] for b in items if "second_per_grid_ts" in b]
    if spans:  # per video, in order (Qwen2.5-VL's time positions are already in position_ids)
        meta["second_per_grid_ts"] = torch.cat(spans)
    norms = {k: v for b in items for k, v in b.get("pixel_norm", {}).items()}
    if norms:
        meta["pixel_norm"] = norms
    tiles = [b["num_tiles"] for b in items if "num_tiles" in b]
    if tiles:
        meta["num_tiles"] = torch.cat(tiles)
    return PackedBatch(inputs, meta)


def _samples_and_pairs(items: Sequence[dict[str, Any]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Each real sample's sequence number (fillers are sequences without samples), and each
    preference pair's (chosen, rejected) indices into the batch's samples: a ``chosen`` side
    is immediately followed by its ``rejected`` side in its bin (ValueError otherwise)."""
    sequences: list[int] = []
    pairs: list[tuple[int, int]] = []
    first_sequence = 0
    for b in items:
        base = len(sequences)
        sides = b.get("sample_pair_sides") or []
        sequences += range(first_sequence, first_sequence + len(b["sample_ids"]))
        for i, side in enumerate(sides):
            after = sides[i + 1] if i + 1 < len(sides) else None
            before = sides[i - 1] if i else None
            if (side == "chosen" and after != "rejected") or (side == "rejected" and before != "chosen"):
                raise ValueError(
                    f"bin with samples {b['sample_ids']}: a preference pair is not side by side "
                    f"(sides {sides}); validate the shards (mmpack validate)"
                )
            if side == "chosen":
                pairs.append((base + i, base + i + 1))
        first_sequence += len(b["cu_seqlens"]) - 1
    return sequences, pairs


def _datasets(item: dict[str, Any]) -> list[str | None]:
    """Each sequence's dataset (None where unknown: fillers, items built by hand, older shards)."""
    return item.get("sample_datasets") or [None] * (len(item["cu_seqlens"]) - 1)


def _weights(item: dict[str, Any]) -> list[float]:
    """Each sequence's loss weight (1 where none is given: fillers, older shards)."""
    return item.get("sample_weights") or [1.0] * (len(item["cu_seqlens"]) - 1)


def _seq_idx(items: Sequence[dict[str, Any]], pad: int) -> torch.Tensor:
    """[1, T] int32: each token's sample number in the batch (the padding is one more)."""
    parts, first = [], 0
    for b in items:
        parts.append(b["seq_idx"] + first)
        first += len(b["cu_seqlens"]) - 1
    if pad:
        parts.append(torch.full((pad,), first, dtype=torch.int32))
    return torch.cat(parts)[None]


def _supervised_per_sample(item: dict[str, Any]) -> list[int]:
    supervised = (item["labels"] != IGNORE).to(torch.int64)
    cu = item["cu_seqlens"].to(torch.int64)
    sums = torch.cat([torch.zeros(1, dtype=torch.int64), supervised.cumsum(0)])
    return (sums[cu[1:]] - sums[cu[:-1]]).tolist()


def normalize_pixel_values(
    pixels: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> torch.Tensor:
    """What the model takes from ``PackedDataset(pixel_dtype="uint8")`` pixels: ``(x / 255 -
    mean) / std`` per channel, on the tensor's device (one fused pass on the accelerator).
    2-D: Qwen-VL patches [rows, 3 · 2 · p²] (default mean/std: CLIP's, Qwen2-VL's; a batch's
    ``meta["pixel_norm"][key]`` holds its profile's); 3-D: Gemma 4's patch rows of p · p · 3
    values, channel last (default: none, [0, 1]); 4-D: InternVL tiles (ImageNet).
    Other dtypes are returned as they are::

        key, norm = "pixel_values", batch.meta["pixel_norm"]["pixel_values"]
        batch[key] = normalize_pixel_values(batch[key].to(device), torch.bfloat16, *norm)
    """
    if pixels.dtype != torch.uint8:
        return pixels
    device = pixels.device
    if pixels.ndim == 2:
        channel = torch.from_numpy(vision.patch_channel(pixels.shape[-1])).to(device)
        mean_, std_ = (
            torch.tensor(v if v is not None else d, dtype=torch.float32, device=device)[channel]
            for v, d in ((mean, vision.CLIP_MEAN), (std, vision.CLIP_STD))
        )
    elif pixels.ndim == 3:
        mean_, std_ = (
            torch.tensor(v if v is not None else d, dtype=torch.float32, device=device)
            for v, d in ((mean, (0.0,) * 3), (std, (1.0,) * 3))
        )
        rows = pixels.to(torch.float32).view(*pixels.shape[:-1], -1, 3)
        return ((rows * (1 / 255) - mean_) / std_).view(pixels.shape).to(dtype)
    else:
        mean_, std_ = (
            torch.tensor(v if v is not None else d, dtype=torch.float32, device=device).view(1, 3, 1, 1)
            for v, d in ((mean, vision.IMAGENET_MEAN), (std, vision.IMAGENET_STD))
        )
    return ((pixels.to(torch.float32) * (1 / 255) - mean_) / std_).to(dtype)
