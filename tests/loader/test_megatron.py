"""loader.megatron: mmpack bins as Megatron-Core THD micro-batches.

Checked against megatron-core itself where it has the rule in plain torch (its multimodal
``get_padding``, its ``get_batch_on_this_cp_rank`` split, its ``PackedSeqParams``), and
against the torch loader (``collate_packed``) for everything a bin holds: random bins
(hypothesis) for the label shift and the padding, and a tiny model for the loss contract.
The demo's Qwen2-VL and Qwen2.5-VL packs (positions, pixels) are checked on their way
through Energon: tests/loader/test_energon.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import utils as mcore_utils
from megatron.core.models.multimodal.context_parallel import get_padding
from megatron.core.packed_seq_params import PackedSeqParams

from loader import PackingUnsupported
from loader.megatron import cp_indices, cp_partition, loss_sum_and_tokens, megatron_batch, pad_multiple

IGNORE = -100
VOCAB = 50
PARALLEL = [(cp, tp, sp) for cp in (1, 2, 4) for tp in (1, 2) for sp in (False, True)]


def make_bin(
    lengths: list[int], supervised: list[bool], mrope: bool = False, seed: int = 0
) -> dict[str, Any]:
    """A bin as PackedDataset yields it: labels are the ids where supervised (a sample's first
    token never is), positions restart per sample, mRoPE rows where asked (rows that differ)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(1, VOCAB, (total,), generator=generator)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    labels = torch.where(torch.tensor(supervised[:total]), ids, IGNORE)
    labels[torch.from_numpy(cu[:-1].astype(np.int64))] = IGNORE
    positions = torch.from_numpy(np.arange(total) - np.repeat(cu[:-1], lengths))
    item = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": max(lengths),
        "sample_ids": [f"s{i}" for i in range(len(lengths))],
        "filler": False,
    }
    if mrope:
        item["mrope_position_ids"] = torch.stack([positions, positions // 2, positions * 3])
    return item


def check_labels(item: dict[str, Any], batch: dict[str, Any]) -> None:
    """The shift contract: every supervised label is the next token of its own sample and the
    torch loader's label there; every torch-loader target is supervised exactly once; no pad
    token is supervised."""
    params = batch["packed_seq_params"]
    real, padded = params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded.tolist()
    ids, labels, mask = batch["input_ids"][0], batch["labels"][0], batch["loss_mask"][0]
    torch_labels = item["labels"]
    assert torch.equal(mask, (labels != IGNORE).float())
    for i, (start, end) in enumerate(itertools.pairwise(padded)):
        n, first = real[i + 1] - real[i], real[i]
        assert (labels[start + n : end] == IGNORE).all() and (mask[start + n : end] == 0).all()  # padding
        supervised = labels[start : start + n] != IGNORE
        assert not supervised[-1], f"sample {i}'s last token is supervised on the next sample"
        targets, kept = labels[start : start + n - 1], supervised[:-1]
        assert torch.equal(targets, torch_labels[first + 1 : first + n])  # the torch loader's, shifted
        assert torch.equal(targets[kept], ids[start + 1 : start + n][kept])  # the next token
    assert int(mask.sum()) == int((torch_labels != IGNORE).sum())


def rolled_labels(item: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
    """The mutant that wiring by hand gives: the ids rolled by one across the whole row, with the
    loss mask of the unshifted labels (a sample's supervised last token learns the next
    sample's first token)."""
    ids, params = batch["input_ids"][0], batch["packed_seq_params"]
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    for i, start in enumerate(params.cu_seqlens_q_padded[:-1].tolist()):
        a, b = params.cu_seqlens_q[i].item(), params.cu_seqlens_q[i + 1].item()
        supervised[start : start + b - a] = item["labels"][a:b] != IGNORE
    labels = torch.where(supervised, ids.roll(-1), IGNORE)[None]
    return {**batch, "labels": labels, "loss_mask": (labels != IGNORE).float()}


bins = st.lists(st.integers(1, 24), min_size=1, max_size=6).flatmap(
    lambda lengths: st.tuples(
        st.just(lengths),
        st.lists(st.booleans(), min_size=sum(lengths), max_size=sum(lengths)),
        st.sampled_from(PARALLEL),
        st.booleans(),
    )
)


@settings(max_examples=150, deadline=None)
@given(bins)
def test_no_label_crosses_a_sample_and_pads_train_nothing(case):
    lengths, supervised, (cp, tp, sp), mrope = case
    item = make_bin(lengths, supervised, mrope)
    batch = megatron_batch(item, cp_size=cp, tp_size=tp, sequence_parallel=sp)
    check_labels(item, batch)


def test_the_rolled_labels_mutant_fails_the_shift_check():
    lengths, supervised = [5, 4, 6], [True] * 15  # every sample's last token supervised
    item = make_bin(lengths, supervised)
    batch = megatron_batch(item, cp_size=2)
    check_labels(item, batch)
    with pytest.raises(AssertionError, match="supervised on the next sample"):
        check_labels(item, rolled_labels(item, batch))


@pytest.mark.parametrize(("cp", "tp", "sp"), PARALLEL)
def test_padding_splits_as_megatron_requires(cp, tp, sp):
    lengths = [7, 1, 12, 5, 16]
    item = make_bin(lengths, [True] * sum(lengths), mrope=True)
    batch = megatron_batch(item, cp_size=cp, tp_size=tp, sequence_parallel=sp)
    params = batch["packed_seq_params"]
    real, padded = params.cu_seqlens_q.diff().tolist(), params.cu_seqlens_q_padded.diff().tolist()
    assert real == lengths
    assert padded == [n + get_padding(n, cp, tp, sp and tp > 1) for n in lengths]  # megatron-core's rule
    assert all(p % pad_multiple(cp, tp, sp) == 0 for p in padded)
    total = params.cu_seqlens_q_padded[-1].item()
    assert all(batch[key].shape[-1] == total for key in ("input_ids", "labels", "loss_mask", "position_ids"))
    if sp and tp > 1:
        assert (total // cp) % tp == 0  # each CP rank's share splits across the TP ranks
    seen = torch.cat([cp_indices(params.cu_seqlens_q_padded, r, cp) for r in range(cp)])
    assert sorted(seen.tolist()) == list(range(total))  # every token on exactly one CP rank
    shares = [cp_partition(batch, r, cp) for r in range(cp)]
    assert len({part["input_ids"].shape[-1] for part in shares}) == 1
    assert all(part["position_ids"].shape[:-1] == (3, 1) for part in shares)


@pytest.fixture(scope="module")
def cp_group_of():
    """megatron-core reads a context-parallel group's size and rank from the group, once
    torch.distributed is up: a one-process gloo group, and a group that says (size, rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Group:
        def __init__(self, size: int, rank: int) -> None:
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    yield Group
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_the_cp_split_is_megatron_cores_split_of_each_sample(cp, cp_group_of):
    """Each sample (its padded span) cut as megatron-core's get_batch_on_this_cp_rank cuts a
    sequence: what Transformer Engine's THD partitioning does sample by sample."""
    item = make_bin([9, 3, 14], [True] * 26, mrope=True)
    batch = megatron_batch(item, cp_size=cp)
    spans = list(itertools.pairwise(batch["packed_seq_params"].cu_seqlens_q_padded.tolist()))
    for rank in range(cp):
        mine = cp_partition(batch, rank, cp)
        for key in ("input_ids", "labels", "loss_mask"):
            theirs = [
                mcore_utils.get_batch_on_this_cp_rank({key: batch[key][:, a:b]}, cp_group_of(cp, rank))[key]
                for a, b in spans
            ]
            assert torch.equal(mine[key], torch.cat(theirs, dim=1)), key
        rows = batch["position_ids"][:, 0, :]  # [3, T]: the sequence axis is the last
        theirs = [mcore_utils.get_batch_on_this_cp_rank({"p": rows[:, a:b]}, cp_group_of(cp, rank))["p"]
                  for a, b in spans]  # fmt: skip
        assert torch.equal(mine["position_ids"][:, 0, :], torch.cat(theirs, dim=1))


def test_packed_seq_params_is_megatron_cores_and_thd():
    item = make_bin([6, 10], [True] * 16)
    params = megatron_batch(item, cp_size=2, tp_size=2, sequence_parallel=True)["packed_seq_params"]
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name).dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 6, 16]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 24]
    assert params.max_seqlen_q == params.max_seqlen_kv == 16 and isinstance(params.max_seqlen_q, int)


def test_positions_restart_per_sample_and_count_on_into_the_padding():
    item = make_bin([3, 5], [True] * 8, mrope=True)
    positions = megatron_batch(item, cp_size=2)["position_ids"][:, 0, :]
    assert positions.tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 0, 1, 2, 0, 0, 1, 1, 2, 3, 4, 5],
        [0, 3, 6, 7, 0, 3, 6, 9, 12, 13, 14, 15],
    ]
    assert megatron_batch(make_bin([3], [True] * 3))["position_ids"].tolist() == [[0, 1, 2]]


def test_bins_megatron_attention_cannot_reproduce_are_refused():
    gemma = {**make_bin([4, 4], [True] * 8), "media_token_mask": torch.zeros(8, dtype=torch.bool)}
    with pytest.raises(PackingUnsupported, match="Gemma 3"):
        megatron_batch(gemma)
    hybrid = {**make_bin([4, 4], [True] * 8), "seq_idx": torch.tensor([0] * 4 + [1] * 4)}
    with pytest.raises(PackingUnsupported, match="seq_idx"):
        megatron_batch(hybrid)
    with pytest.raises(ValueError, match="cp_size must be at least 1"):
        megatron_batch(make_bin([4], [True] * 4), cp_size=0)


class TinyLM(torch.nn.Module):
    """Embedding + positions, one attention layer, an LM head: attends within the spans it is
    given, causally, over real tokens only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = torch.nn.Embedding(VOCAB, 16), torch.nn.Embedding(64, 16)
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(positions)
        y, _ = self.attention(x[None], x[None], x[None], attn_mask=~allowed)
        return self.head(x + y[0]).double()


def thd_mask(params) -> torch.Tensor:
    """[T, T] what THD attention lets each token see: earlier real tokens of its own sample (a
    pad token sees itself only)."""
    total = int(params.cu_seqlens_q_padded[-1])
    allowed = torch.eye(total, dtype=torch.bool)
    spans = params.cu_seqlens_q_padded.tolist()
    for i, start in enumerate(spans[:-1]):
        n = int(params.cu_seqlens_q[i + 1] - params.cu_seqlens_q[i])
        allowed[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    return allowed


@pytest.mark.parametrize(("cp", "tp", "sp"), [(1, 1, False), (2, 1, False), (4, 2, True)])
def test_summed_loss_and_tokens_equal_each_sample_alone(cp, tp, sp):
    """Megatron's loss contract (per-token sum over loss_mask, token count) on one padded row
    equals the sums over each sample run alone, transformers-style (unshifted labels)."""
    lengths = [9, 4, 13, 6]
    supervised = [bool(v) for v in torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(3))]
    item = make_bin(lengths, supervised, seed=5)
    batch = megatron_batch(item, cp_size=cp, tp_size=tp, sequence_parallel=sp)
    model = TinyLM()
    params = batch["packed_seq_params"]
    logits = model(batch["input_ids"][0], batch["position_ids"][0], thd_mask(params))
    per_token = torch.nn.functional.cross_entropy(
        logits, batch["labels"][0].clamp(min=0), reduction="none"
    )  # Megatron's cross entropy takes -100 as out of vocabulary: loss_mask removes it
    packed_sum, packed_tokens = loss_sum_and_tokens(per_token, batch)
    alone_sum, alone_tokens = torch.zeros((), dtype=torch.float64), 0
    for a, b in itertools.pairwise(item["cu_seqlens"].tolist()):
        ids, labels = item["input_ids"][a:b], item["labels"][a:b]
        alone = model(ids, item["position_ids"][a:b], torch.ones(b - a, b - a, dtype=torch.bool).tril())
        alone_sum += torch.nn.functional.cross_entropy(alone[:-1], labels[1:], reduction="sum")
        alone_tokens += int((labels[1:] != IGNORE).sum())
    assert packed_tokens == alone_tokens > 0
    assert torch.allclose(packed_sum, alone_sum, rtol=1e-5, atol=0)
