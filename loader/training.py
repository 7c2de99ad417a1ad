"""What one training step does with ``PackedBatch`` es, whatever runs the loop (our DDP and
FSDP2 example, transformers' ``Trainer`` through ``loader.trainer``).

- ``summed_loss``: cross-entropy summed over the batch's supervised tokens, logits only
  where a label is supervised; a step divides the sum of its micro-batches by
  ``step_supervised_tokens`` (every rank, every micro-batch of the optimizer step).
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

from loader.collate import PackedBatch
from mmpack_udfs.constants import IGNORE_INDEX as IGNORE

MEDIA_INPUTS = ("pixel_values", "pixel_values_videos")


def token_losses(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of every supervised token of the batch, and where each token is. Logits
    only where the next token is supervised (``logits_to_keep``): the vocabulary projection of
    every position would be the largest tensor of the step. Labels are not shifted in the shards."""
    inputs = dict(batch)
    labels = inputs.pop("labels")[0]
    keep = torch.nonzero(labels[1:] != IGNORE).flatten()  # position t predicts token t + 1
    logits = model(**inputs, logits_to_keep=keep).logits[0]
    return F.cross_entropy(logits.float(), labels[keep + 1], reduction="none"), keep + 1


def summed_loss(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Cross-entropy summed over the batch's supervised tokens (``token_losses``)."""
    return token_losses(model, batch)[0].sum()


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
    cu = sequence_bounds(batch, losses.device)
    sequence = torch.searchsorted(cu, positions, right=True) - 1
    if len(positions) and int(sequence.max()) >= len(names):
        raise ValueError("a supervised token lies after the batch's listed sequences (idle media are masked)")
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


def idle_media_settings(config: Any) -> dict[str, int] | None:
    """What ``with_idle_media`` needs of a model config (the Qwen-VL line's), or None when the
    model has no vision tower of that kind."""
    vision = getattr(config, "vision_config", None)
    tokens = [getattr(config, f"{kind}_token_id", None) for kind in ("image", "video")]
    if vision is None or None in tokens or not hasattr(vision, "spatial_merge_size"):
        return None
    return {
        "image_token_id": int(tokens[0]),
        "video_token_id": int(tokens[1]),
        "merge": int(vision.spatial_merge_size),
        "patch": int(vision.patch_size),
        "temporal": int(vision.temporal_patch_size),
        "channels": int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3))),
    }


IDLE_KINDS = (  # (kind, pixel key, grid key, token id key)
    ("image", "pixel_values", "image_grid_thw", "image_token_id"),
    ("video", "pixel_values_videos", "video_grid_thw", "video_token_id"),
)


def with_idle_media(
    batch: PackedBatch, settings: dict[str, int], dtype: torch.dtype | None = None
) -> PackedBatch:
    """``batch`` with an idle image when it has no image and an idle video when it has no
    video, so that every rank's forward runs the vision tower exactly once per kind (Qwen-VL
    models encode images and videos in two calls). Each idle item is the smallest the model
    takes: one merged token (``merge²`` black patches, one temporal patch), a sample of its
    own at the batch's end, its token in ``input_ids``, its label masked, positions
    restarting at 0 and its own ``cu_seq_lens`` entry (and ``seq_idx``), so it stays apart
    from the real samples and trains nothing. ``meta`` is unchanged (the token counts are
    the real samples'), plus ``idle_media``: the kinds added."""
    missing = [kind for kind in IDLE_KINDS if kind[1] not in batch]
    if not missing:
        return batch
    inputs = dict(batch)
    for _, pixels, grid, token in missing:
        _append_idle_sample(inputs, settings[token])
        like = next((batch[key] for key in MEDIA_INPUTS if key in batch), None)
        rows = settings["channels"] * settings["temporal"] * settings["patch"] ** 2
        inputs[pixels] = torch.zeros(
            settings["merge"] ** 2,
            rows,
            dtype=dtype or (like.dtype if like is not None else torch.float32),
            device=batch["input_ids"].device,
        )
        inputs[grid] = torch.tensor(
            [[1, settings["merge"], settings["merge"]]], dtype=torch.int64, device=batch["input_ids"].device
        )
    meta = {**batch.meta, "idle_media": [kind for kind, *_ in missing]}
    if "cu_seq_lens_q" in inputs:  # the idle samples are sequences too
        meta.update(cu_seq_lens=inputs["cu_seq_lens_q"].tolist(), max_length=inputs["max_length_q"])
    return PackedBatch(inputs, meta)


def _append_idle_sample(inputs: dict[str, Any], token_id: int) -> None:
    """One more one-token sample at the end of ``inputs`` (in place): masked, positions at 0."""
    ids = inputs["input_ids"]
    inputs["input_ids"] = torch.cat([ids, ids.new_full((1, 1), token_id)], dim=1)
    inputs["labels"] = torch.cat([inputs["labels"], inputs["labels"].new_full((1, 1), IGNORE)], dim=1)
    positions = inputs["position_ids"]
    inputs["position_ids"] = torch.cat([positions, positions.new_zeros((*positions.shape[:-1], 1))], dim=-1)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], inputs[key][-1:] + 1])
    for key in ("max_length_q", "max_length_k"):
        if key in inputs:
            inputs[key] = max(inputs[key], 1)
    if "seq_idx" in inputs:
        inputs["seq_idx"] = torch.cat([inputs["seq_idx"], inputs["seq_idx"][:, -1:] + 1], dim=1)
