"""What one training step does with ``PackedBatch`` es, whatever runs the loop (our DDP and
FSDP2 example, transformers' ``Trainer`` through ``loader.trainer``).

- ``summed_loss``: cross-entropy summed over the batch's supervised tokens (each weighted by
  its sample's loss weight), logits only where a label is supervised; a step divides the
  sum of its micro-batches by ``step_supervised_tokens`` (every rank, every micro-batch of
  the optimizer step).
- ``with_idle_media``: under FSDP or ZeRO-3 every rank must run the vision tower as often
  as the others (its parameters are gathered collectively, once per call), so a micro-batch
  without images (videos) gets one tiny image (video) of its own: a separate masked sample,
  which trains nothing and changes no other sample's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loader import attention
from loader.collate import PackedBatch
from mmpack_udfs.constants import IGNORE_INDEX as IGNORE
from mmpack_udfs.families import FAMILIES, MODEL_TYPES
from mmpack_udfs.families.base import IdleMedia

MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")


def token_losses(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of every supervised token of the batch, and where each token is. Logits
    only where the next token is supervised (``logits_to_keep``): the vocabulary projection of
    every position would be the largest tensor of the step. Labels are not shifted in the shards."""
    inputs = dict(attention.with_model_masks(batch, model))
    labels = inputs.pop("labels")[0]
    keep = torch.nonzero(labels[1:] != IGNORE).flatten()  # position t predicts token t + 1
    # squeeze, not [0]: the backward of an index allocates and zero-fills the whole [1, kept,
    # vocab] gradient and copies into it; a squeeze's is a view
    logits = model(**inputs, logits_to_keep=keep).logits.squeeze(0)
    if logits.shape[0] != keep.numel():  # a model that takes no logits_to_keep (Qwen2-Audio): all positions
        logits = logits[keep]
    return F.cross_entropy(logits.float(), labels[keep + 1], reduction="none"), keep + 1


def summed_loss(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Cross-entropy summed over the batch's supervised tokens (``token_losses``), each token's
    times its sample's loss weight (``weighted_sum``)."""
    return weighted_sum(*token_losses(model, batch), batch)


def weighted_sum(losses: torch.Tensor, positions: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Σ weight × loss over the tokens of ``token_losses``: each token weighs its sample's loss
    weight (``meta["sequence_weights"]``; a sample's ``weight`` times its dataset's
    ``loss_weight``). The step's normaliser stays its supervised tokens: a weight scales what a
    sample contributes, it does not re-average the step."""
    weights = batch.meta.get("sequence_weights")
    if not weights or all(w == 1 for w in weights):
        return losses.sum()
    of_sequence = torch.tensor(weights, dtype=losses.dtype, device=losses.device)
    return (losses * of_sequence[token_sequences(positions, batch, len(weights))]).sum()


def token_sequences(positions: torch.Tensor, batch: PackedBatch, listed: int) -> torch.Tensor:
    """The sequence of the batch each token position lies in (int64, like ``positions``); a
    ValueError if one lies beyond the ``listed`` sequences that ``meta`` describes."""
    sequence = torch.searchsorted(sequence_bounds(batch, positions.device), positions, right=True) - 1
    if len(positions) and int(sequence.max()) >= listed:
        raise ValueError("a supervised token lies after the batch's listed sequences (idle media are masked)")
    return sequence


def sequence_bounds(batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """int64 [sequences + 1]: where each sequence of the batch starts, and its length T
    (``meta["cu_seq_lens"]``, or ``cu_seq_lens_q`` for a batch built without it)."""
    bounds = batch.meta.get("cu_seq_lens")
    if bounds is None:
        return batch["cu_seq_lens_q"].to(device=device, dtype=torch.int64)
    return torch.tensor(bounds, device=device, dtype=torch.int64)


def dataset_losses(
    losses: torch.Tensor, positions: torch.Tensor, batch: PackedBatch, datasets: Sequence[str]
) -> torch.Tensor:
    """[2, len(datasets)] float64, detached: per dataset (the manifest's ``datasets`` order), the
    summed loss of its supervised tokens in this batch and their number. Each token's
    sequence comes from ``meta["cu_seq_lens"]``, its dataset from ``meta["sequence_datasets"]``.
    Sum these over micro-batches and ranks (``all_reduce``), then divide row 0 by row 1."""
    index = {name: i for i, name in enumerate(datasets)}
    names = batch.meta["sequence_datasets"]
    of_sequence = torch.tensor([index[n] if n is not None else -1 for n in names], device=losses.device)
    sequence = token_sequences(positions, batch, len(names))
    dataset = of_sequence[sequence] if len(positions) else sequence
    real = dataset >= 0
    out = torch.zeros(2, len(datasets), dtype=torch.float64, device=losses.device)
    out[0].index_add_(0, dataset[real], losses.detach()[real].to(torch.float64))
    out[1].index_add_(
        0, dataset[real], torch.ones(int(real.sum()), dtype=torch.float64, device=losses.device)
    )
    return out


def step_supervised_tokens(group: Sequence[PackedBatch], device: torch.device | None = None) -> torch.Tensor:
    """The supervised tokens of one optimizer step: its micro-batches on every rank (all-reduced
    when torch.distributed runs), float64, at least 1. Each token then weighs the same,
    however the step's tokens fall across micro-batches and ranks."""
    return step_total(sum(b.meta["supervised_tokens"] for b in group), device)


def step_total(count: float, device: torch.device | None = None) -> torch.Tensor:
    """``count`` summed over every rank (all-reduced when torch.distributed runs), float64, at
    least 1: the normaliser of an optimizer step's loss."""
    total = torch.tensor(count, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total.clamp(min=1)


def traced_samples(batch: PackedBatch) -> list[tuple[str, int]]:
    """(sample id, supervised tokens) of every real sample of the batch, in order: what a
    training trace records (a sample repeated by a dataset weight appears once per copy)."""
    return list(zip(batch.meta["sample_ids"], batch.meta["sample_supervised_tokens"], strict=True))


def has_media(batch: PackedBatch) -> bool:
    return any(key in batch for key in MEDIA_INPUTS)


def idle_media_settings(config: Any) -> list[IdleMedia] | None:
    """What ``with_idle_media`` adds for a model of ``config`` (its family's ``idle_media``:
    Qwen-VL, InternVL, LLaVA-OneVision, Gemma 3 and 4, GLM-V, Qwen2-Audio), or None when mmpack
    packs for no family of that ``model_type`` or the model has no vision or audio tower."""
    kind = MODEL_TYPES.get(getattr(config, "model_type", None) or "")
    towers = (getattr(config, name, None) for name in ("vision_config", "audio_config"))
    if kind is None or all(tower is None for tower in towers):
        return None
    return FAMILIES[kind].idle_media(config)


def with_idle_media(
    batch: PackedBatch, settings: Sequence[IdleMedia], dtype: torch.dtype | None = None
) -> PackedBatch:
    """``batch`` with an idle item of every kind it lacks (``settings``: ``idle_media_settings``),
    so that every rank's forward runs the vision tower exactly as often (Qwen-VL and
    LLaVA-OneVision encode images and videos in two calls). Each idle item is the smallest its
    model takes (one merged token for Qwen-VL, a tile for InternVL, two square crops or one frame
    for LLaVA-OneVision, a square for Gemma 3), black, a sample of its own at the batch's end: its
    tokens in ``input_ids``, its labels masked, positions restarting at 0, its own
    ``cu_seq_lens`` entry (and ``seq_idx``; Gemma 3: its own block of the masks), so it stays
    apart from the real samples and trains nothing. ``meta`` keeps the real samples' counts,
    plus ``idle_media`` (the kinds added) and the new ``cu_seq_lens``. Add idle media before
    ``attention.with_model_masks`` (``token_losses`` does that)."""
    missing = [idle for idle in settings if idle.pixel_key not in batch]
    if not missing:
        return batch
    inputs = dict(batch)
    device = batch["input_ids"].device
    like = next((batch[key] for key in MEDIA_INPUTS if key in batch), None)
    pixel_dtype = dtype or (like.dtype if like is not None else torch.float32)
    cu = list(batch.meta.get("cu_seq_lens") or sequence_bounds(batch, device).tolist())
    for idle in missing:
        _append_idle_sample(inputs, idle.token_id, idle.tokens, batch.meta)
        cu.append(cu[-1] + idle.tokens)
        inputs[idle.pixel_key] = torch.zeros(idle.pixel_shape, dtype=pixel_dtype, device=device)
        for key, value in idle.extra.items():
            extra = torch.tensor(value, dtype=torch.int64, device=device)
            inputs[key] = torch.cat([inputs[key], extra]) if key in inputs else extra
    meta = {**batch.meta, "idle_media": [idle.kind for idle in missing], "cu_seq_lens": cu}
    meta["max_length"] = max(batch.meta.get("max_length", 0), *(idle.tokens for idle in missing))
    return PackedBatch(inputs, meta)


def _append_idle_sample(inputs: dict[str, Any], token_id: int, tokens: int, meta: dict[str, Any]) -> None:
    """One more sample of ``tokens`` copies of ``token_id`` at the end of ``inputs`` (in place):
    masked, positions from 0 on every row, its own sequence (and its own mask block)."""
    ids = inputs["input_ids"]
    inputs["input_ids"] = torch.cat([ids, ids.new_full((1, tokens), token_id)], dim=1)
    inputs["labels"] = torch.cat([inputs["labels"], inputs["labels"].new_full((1, tokens), IGNORE)], dim=1)
    positions = inputs["position_ids"]
    fill = torch.arange(tokens, dtype=positions.dtype, device=positions.device)
    inputs["position_ids"] = torch.cat([positions, fill.expand(*positions.shape[:-1], tokens)], dim=-1)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], inputs[key][-1:] + tokens])
    for key in ("max_length_q", "max_length_k"):
        if key in inputs:
            inputs[key] = max(inputs[key], tokens)
    if "seq_idx" in inputs:
        inputs["seq_idx"] = torch.cat(
            [inputs["seq_idx"], inputs["seq_idx"][:, -1:].add(1).expand(1, tokens)], dim=1
        )
    if isinstance(inputs.get("attention_mask"), dict):
        inputs["attention_mask"] = _with_media_block(inputs["attention_mask"], tokens, meta)


def _with_media_block(masks: dict[str, torch.Tensor], tokens: int, meta: dict[str, Any]) -> dict:
    """Gemma 3's (4's) bool masks with one more sample: a whole image of ``tokens`` tokens."""
    if any(mask.dtype != torch.bool for mask in masks.values()):
        raise ValueError("add idle media before converting the masks for the model (with_model_masks)")
    device = next(iter(masks.values())).device
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    idle = attention.media_block_masks(
        cu,
        torch.ones(tokens, dtype=torch.bool),
        meta["sliding_window"],
        meta.get("global_media_blocks", True),
    )
    out = {}
    for kind, mask in masks.items():
        length = mask.shape[-1]
        grown = torch.zeros(1, 1, length + tokens, length + tokens, dtype=torch.bool, device=device)
        grown[..., :length, :length] = mask
        grown[..., length:, length:] = idle[kind].to(device)
        out[kind] = grown
    return out
