"""Preference optimisation (DPO) on packed bins: every pair's log-probabilities from one forward.

A preference pack (``PackedDataset.preference``) holds pairs side by side in one bin; a
batch lists them in ``meta["pairs"]`` as (chosen, rejected) indices into
``meta["sample_ids"]``. One forward of the policy and one of the reference model per
micro-batch give every sequence's summed log-probability of its supervised tokens (the
answer: tokenize supervises a pair's final answer only), from which the DPO loss follows::

    policy = sequence_logprobs(model, batch)
    with torch.no_grad():
        reference = sequence_logprobs(ref_model, batch)
    out = dpo_losses(*pair_logprobs(batch, policy), *pair_logprobs(batch, reference), beta=0.1)
    loss = out.losses.sum() / step_pairs(step_batches)   # the mean over the step's pairs

torch only: ``import loader`` stays free of transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from loader.collate import PackedBatch
from loader.training import sequence_bounds, step_total, token_losses


class DPOOutput(NamedTuple):
    losses: torch.Tensor  # [pairs]: -log σ(β((π_c - ref_c) - (π_r - ref_r)))
    chosen_rewards: torch.Tensor  # [pairs], detached: β(π_c - ref_c)
    rejected_rewards: torch.Tensor  # [pairs], detached: β(π_r - ref_r)


def sequence_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[len(meta["sample_ids"])] float64: each sample's summed log-probability of its supervised
    tokens (summed in float64: a long answer's sum keeps its precision), from one forward
    with logits only where a label is supervised (``token_losses``).
    Each token's sequence comes from ``meta["cu_seq_lens"]``; fillers, padding and idle media are
    sequences of their own without supervised tokens."""
    losses, positions = token_losses(model, batch)
    cu = sequence_bounds(batch, losses.device)
    sequence = torch.searchsorted(cu, positions, right=True) - 1
    per_sequence = torch.zeros(len(cu) - 1, dtype=torch.float64, device=losses.device)
    per_sequence = per_sequence.index_add(0, sequence, -losses.to(torch.float64))
    return per_sequence[torch.tensor(batch.meta["sample_sequences"], dtype=torch.int64, device=losses.device)]


def pair_logprobs(batch: PackedBatch, per_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probabilities [pairs] of the batch's pairs, from ``per_sample``."""
    pairs = torch.tensor(batch.meta["pairs"], dtype=torch.int64, device=per_sample.device).reshape(-1, 2)
    return per_sample[pairs[:, 0]], per_sample[pairs[:, 1]]


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> DPOOutput:
    """The sigmoid DPO loss of each pair (Rafailov et al. 2023) and its implicit rewards."""
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return DPOOutput(losses, beta * chosen.detach(), beta * rejected.detach())


def step_pairs(group: Sequence[PackedBatch], device: torch.device | None = None) -> torch.Tensor:
    """The preference pairs of one optimizer step: its micro-batches on every rank (all-reduced
    when torch.distributed runs), float64, at least 1: dividing the step's summed pair losses
    by it gives the mean over the step's pairs, however they fall across micro-batches and
    ranks."""
    return step_total(sum(len(b.meta["pairs"]) for b in group), device)
