"""mmpack bins as Megatron-Core's packed (THD) micro-batches: what Megatron-Bridge's VLM step takes.

    from loader import PackedDataset
    from loader.megatron import megatron_batch, cp_partition

    for item in PackedDataset(manifest, rank=dp_rank, world_size=dp_size):
        batch = megatron_batch(item, cp_size=2, tp_size=2, sequence_parallel=True)
        mine = cp_partition(batch, cp_rank, cp_size=2)    # what this CP rank feeds its model

One bin is one micro-batch of shape [1, T]; its samples never see each other because
``packed_seq_params`` (``PackedSeqParams(qkv_format="thd")``) gives the attention their
boundaries. The conventions followed (docs/megatron.md names the source lines):

- ``labels`` are shifted inside each sample, as Megatron expects (it does not shift in the
  model; transformers does): ``labels[t]`` is the torch loader's ``labels[t + 1]``, the next
  token where it is supervised, else -100, and -100 at each sample's last token, so no
  sample learns the next sample's first token. ``loss_mask`` [1, T] float is
  ``labels != -100``; Megatron's loss is the sum over it with the token count beside it.
- Each sample is padded at its tail to a multiple of ``pad_multiple(cp, tp, sp)`` (2·CP
  under context parallelism, 2·CP·TP with sequence parallel too, TP with sequence parallel
  alone: Megatron-Core's multimodal ``get_padding``). Pad tokens are ``pad_token_id``,
  label -100, loss_mask 0, positions counting on. The padding happens here, at load time;
  the shards never hold it.
- ``cu_seqlens_q/kv`` are the cumulative real lengths and ``cu_seqlens_q/kv_padded`` the
  physical offsets (Transformer Engine's convention: sample i lies in ``[padded[i],
  padded[i+1])``, its real tokens first), int32; ``max_seqlen_q/kv`` the longest padded
  sample, an int.
- ``position_ids``: [3, 1, T] mRoPE for the Qwen-VL families (the torch loader's rows 1-3,
  restarting per sample), [1, T] otherwise. No ``attention_mask``.
- The vision inputs exactly as ``collate_packed`` gives them (``pixel_values``,
  ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ...).

A bin Megatron's causal THD attention cannot reproduce is refused (``PackingUnsupported``):
Gemma 3's images (Gemma 4's, on its sliding layers) attend within themselves in both
directions, and Qwen3.5's linear-attention layers need each token's sample (``seq_idx``),
which megatron-core 0.16's ``PackedSeqParams`` does not carry. megatron-core is imported on
first use (``pip install 'mmpack[megatron]'``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from loader.collate import VISION_INPUTS, collate_packed
from loader.dataset import IGNORE
from loader.hybrid import PackingUnsupported
from mmpack_udfs.families import make_family

TOKEN_KEYS = ("input_ids", "labels", "loss_mask", "position_ids")  # [..., T]: what CP splits
INSTALL = "pip install 'mmpack[megatron]'"


def pad_multiple(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """What each sample's length must divide by: 2·CP under context parallelism (each sample
    is cut into 2·CP chunks), times TP with sequence parallel (each CP rank's tokens are cut
    again across the TP ranks); TP alone with sequence parallel and no CP; else 1."""
    for name, size in (("cp_size", cp_size), ("tp_size", tp_size)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    sp = sequence_parallel and tp_size > 1
    if cp_size > 1:
        return 2 * cp_size * (tp_size if sp else 1)
    return tp_size if sp else 1


def packed_seq_params_class() -> type:
    """megatron-core's ``PackedSeqParams``, imported on first use."""
    try:
        with warnings.catch_warnings():  # its optimizer modules warn about Apex / TE on import
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
            from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as err:
        raise ImportError(f"loader.megatron needs megatron-core: {INSTALL} ({err})") from err
    return PackedSeqParams


def megatron_batch(
    item: dict[str, Any],
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """One bin (as ``PackedDataset`` yields it) → Megatron's THD micro-batch (module docstring).

    ``meta`` holds what the batch is, outside the model's arguments: ``sample_ids``,
    ``num_tokens`` (real), ``supervised_tokens``, ``filler``."""
    refuse_unexpressible(item)
    torch_batch = collate_packed([item])
    cu = np.asarray(torch_batch.meta["cu_seq_lens"], dtype=np.int64)
    lengths = np.diff(cu)
    multiple = pad_multiple(cp_size, tp_size, sequence_parallel)
    padded_lengths = -(-lengths // multiple) * multiple
    cu_padded = np.concatenate([[0], np.cumsum(padded_lengths)])
    total = int(cu_padded[-1])
    place = torch.from_numpy(np.arange(cu[-1]) - np.repeat(cu[:-1] - cu_padded[:-1], lengths))

    ids = torch.full((total,), pad_token_id, dtype=torch.int64)
    ids[place] = torch_batch["input_ids"][0]
    labels = torch.full((total,), IGNORE, dtype=torch.int64)
    labels[place] = shift_within_samples(torch_batch["labels"][0], cu)
    batch: dict[str, Any] = {
        "input_ids": ids[None],
        "labels": labels[None],
        "loss_mask": (labels != IGNORE).float()[None],
        "position_ids": _padded_positions(torch_batch["position_ids"], place, cu, cu_padded),
        "attention_mask": None,
        "packed_seq_params": _packed_seq_params(cu, cu_padded, int(padded_lengths.max())),
    }
    for key in VISION_INPUTS:
        if key in torch_batch:
            batch[key] = torch_batch[key]
    if "second_per_grid_ts" in torch_batch.meta:
        batch["second_per_grid_ts"] = torch_batch.meta["second_per_grid_ts"]
    batch["meta"] = {
        "sample_ids": torch_batch.meta["sample_ids"],
        "num_tokens": int(cu[-1]),
        "supervised_tokens": int((labels != IGNORE).sum()),
        "filler": bool(item.get("filler")),
    }
    return batch


UNEXPRESSIBLE = {  # a family property → why Megatron's causal THD attention would not train it exactly
    "bidirectional_media": "Gemma 3 and Gemma 4 bins: each image's tokens attend to each other in both "
    "directions (Gemma 4: on its sliding layers), and Megatron-Core's THD attention is causal within a "
    "sample; train them with the torch loader (collate_packed builds their masks)",
    "linear_attention": "Qwen3.5 bins: its linear-attention layers need each token's sample (seq_idx) to "
    "restart at sample boundaries, and megatron-core's PackedSeqParams does not carry it; train "
    "Qwen3.5 packs with the torch loader",
}
ITEM_KEYS = {"bidirectional_media": "media_token_mask", "linear_attention": "seq_idx"}  # how a bin shows it


def unexpressible(profile: dict[str, Any]) -> str | None:
    """Why a pack of ``profile`` cannot become Megatron-Core THD batches, or None."""
    family = make_family(profile["kind"], profile)
    return next((why for prop, why in UNEXPRESSIBLE.items() if getattr(family, prop)), None)


def refuse_unexpressible(item: dict[str, Any]) -> None:
    """``PackingUnsupported`` for a bin Megatron's causal THD attention would not train exactly."""
    for prop, key in ITEM_KEYS.items():
        if key in item:
            raise PackingUnsupported(UNEXPRESSIBLE[prop])


def shift_within_samples(labels: torch.Tensor, cu: np.ndarray) -> torch.Tensor:
    """[T] labels of the torch loader (transformers shifts them in the model) → Megatron's:
    ``out[t] = labels[t + 1]``, and -100 at each sample's last token."""
    out = torch.full_like(labels, IGNORE)
    out[:-1] = labels[1:]
    out[torch.from_numpy(cu[1:] - 1)] = IGNORE
    return out


def _padded_positions(
    positions: torch.Tensor, place: torch.Tensor, cu: np.ndarray, cu_padded: np.ndarray
) -> torch.Tensor:
    """The torch loader's positions ([4, 1, T] for mRoPE families: text row first; else [1, T])
    at their padded places: [3, 1, T'] or [1, T']. A sample's pad tokens count on from its
    last position."""
    rows = positions[1:, 0, :] if positions.dim() == 3 else positions  # mRoPE: drop the text row
    total = int(cu_padded[-1])
    out = torch.empty((len(rows), total), dtype=rows.dtype)
    out[:, place] = rows
    pads = np.diff(cu_padded) - np.diff(cu)  # per sample
    is_pad = np.ones(total, dtype=bool)
    is_pad[place.numpy()] = False
    slots = np.flatnonzero(is_pad)  # in sample order
    first_pad = np.repeat(cu_padded[1:] - pads, pads)  # each slot's sample's first pad slot
    last_real = np.repeat(cu[1:] - 1, pads)  # and its last real token
    out[:, slots] = rows[:, last_real] + torch.from_numpy(slots - first_pad + 1)
    return out[:, None, :] if positions.dim() == 3 else out


def _packed_seq_params(cu: np.ndarray, cu_padded: np.ndarray, max_seqlen: int):
    real = torch.from_numpy(cu.astype(np.int32))
    padded = torch.from_numpy(cu_padded.astype(np.int32))
    return packed_seq_params_class()(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real.clone(),
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded.clone(),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def cp_indices(cu_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The token positions context-parallel rank ``cp_rank`` of ``cp_size`` keeps: each sample
    (its padded span) cut into 2·CP equal chunks, chunks ``cp_rank`` and ``2·CP − 1 − cp_rank``
    (Transformer Engine's ``thd_get_partitioned_indices``: every rank gets the same share of
    each sample's causal attention work)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return torch.arange(int(cu_padded[-1]))
    starts, lengths = cu_padded[:-1].tolist(), cu_padded.diff().tolist()
    chunks = 2 * cp_size
    parts = []
    for start, length in zip(starts, lengths, strict=True):
        if length % chunks:
            raise ValueError(
                f"a sample of {length} padded tokens does not split into {chunks} chunks: build the "
                f"batch with megatron_batch(..., cp_size={cp_size})"
            )
        size = length // chunks
        for chunk in (cp_rank, chunks - 1 - cp_rank):
            parts.append(torch.arange(start + chunk * size, start + (chunk + 1) * size))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def cp_partition(batch: dict[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """What context-parallel rank ``cp_rank`` feeds its model: the token tensors (``TOKEN_KEYS``,
    along their last axis) at ``cp_indices``; ``packed_seq_params`` (the whole row's
    boundaries, as Transformer Engine takes them) and the vision inputs unchanged."""
    index = cp_indices(batch["packed_seq_params"].cu_seqlens_q_padded, cp_rank, cp_size)
    out = dict(batch)
    for key in TOKEN_KEYS:
        out[key] = batch[key].index_select(-1, index)
    return out


def loss_sum_and_tokens(per_token_loss: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Megatron's loss contract for one micro-batch: the per-token losses summed over
    ``loss_mask``, and the token count (never a mean of means across samples)."""
    mask = batch["loss_mask"].reshape(-1)
    return (per_token_loss.reshape(-1) * mask).sum(), int(mask.sum())
