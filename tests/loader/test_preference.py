"""DPO on packed bins with a tiny random Qwen2-VL (``loader.preference``, ``PackedDPOTrainer``).

Without Spark, on bins built by hand as ``PackedDataset`` yields them (a pair's chosen and
rejected sequences side by side, sharing their prompt's image; the loader's own mRoPE):
every pair's log-probabilities from one packed forward equal each sequence run alone
(SDPA, eager, the flash-attention calling convention), the DPO loss and its gradients equal
the unpacked computation, the batch metadata names the pairs (with a filler and idle media
in the batch), collate refuses a broken pair, the trainers refuse the other kind of pack,
and one Trainer step's gradient is the mean over the step's pairs.

With Spark (``-m spark``), the same on the preference demo's real shards.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback, TrainingArguments

from loader import PackedDataset, collate_packed
from loader.collate import PackedBatch
from loader.dataset import _as_filler
from loader.preference import dpo_losses, pair_logprobs, sequence_logprobs, step_pairs
from loader.training import idle_media_settings, with_idle_media
from mmpack_udfs.families.qwen_vl import mrope_positions
from tests.loader.test_model_parity import (
    CALLS,
    IMAGE_PAD,
    alone,
    register_attentions,
    sample_media,
    with_attention,
)
from tests.loader.test_training import tiny_qwen2_vl

BETA = 0.1
VISION_START, VISION_END = 151652, 151653
PATCH_VALUES = 3 * 2 * 14 * 14  # a Qwen2-VL patch row: channels × temporal patch × patch²


# -- bins by hand ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One tokenized row: its prompt (with an image of ``grid`` patches) and supervised answer."""

    sample_id: str
    side: str | None
    ids: torch.Tensor
    labels: torch.Tensor
    mrope: torch.Tensor  # [3, n]
    pixels: torch.Tensor | None
    grid: tuple[int, int, int] | None


def prompt(generator: torch.Generator, grid: tuple[int, int, int] | None) -> tuple[torch.Tensor, int]:
    """Text, then (with ``grid``) <vision_start> image pads <vision_end>, then text; and where
    the first pad is."""
    head, tail = (torch.randint(200, 5000, (n,), generator=generator) for n in (3, 4))
    if grid is None:
        return torch.cat([head, tail]), -1
    pads = torch.full((math.prod(grid) // 4,), IMAGE_PAD)
    vision = torch.cat([torch.tensor([VISION_START]), pads, torch.tensor([VISION_END])])
    return torch.cat([head, vision, tail]), len(head) + 1


def pair(name: str, grid: tuple[int, int, int] | None, answers: tuple[int, int], seed: int) -> list[Row]:
    """A preference pair: one prompt (and image), two different answers of these lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids, first_pad = prompt(generator, grid)
    pixels = torch.randn(math.prod(grid), PATCH_VALUES, generator=generator) if grid else None
    return [
        sequence(
            f"{name}-{side}",
            side,
            ids,
            torch.randint(200, 5000, (n,), generator=generator),
            first_pad,
            pixels,
            grid,
        )
        for side, n in zip(("chosen", "rejected"), answers, strict=True)
    ]


def sequence(
    sample_id: str,
    side: str | None,
    prompt_ids: torch.Tensor,
    answer: torch.Tensor,
    first_pad: int,
    pixels: torch.Tensor | None,
    grid: tuple[int, int, int] | None,
) -> Row:
    ids = torch.cat([prompt_ids, answer])
    labels = torch.cat([torch.full_like(prompt_ids, -100), answer])  # the final answer only
    blocks = [(first_pad, grid[0], grid[1] // 2, grid[2] // 2, 1.0)] if grid else []
    mrope = torch.from_numpy(mrope_positions(len(ids), blocks))
    return Row(sample_id, side, ids, labels, mrope, pixels, grid)


def make_bin(sequences: list[Row]) -> dict[str, Any]:
    """An item as ``PackedDataset`` yields it."""
    lengths = [len(s.ids) for s in sequences]
    item: dict[str, Any] = {
        "input_ids": torch.cat([s.ids for s in sequences]),
        "labels": torch.cat([s.labels for s in sequences]),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "mrope_position_ids": torch.cat([s.mrope for s in sequences], dim=1),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "sample_ids": [s.sample_id for s in sequences],
        "sample_datasets": ["prefs"] * len(sequences),
        "sample_pair_sides": [s.side for s in sequences],
        "filler": False,
    }
    images = [s for s in sequences if s.grid is not None]
    if images:
        item["pixel_values"] = torch.cat([s.pixels for s in images])
        item["image_grid_thw"] = torch.tensor([s.grid for s in images])
    return item


def sft_sample() -> Row:
    generator = torch.Generator().manual_seed(99)
    ids, _ = prompt(generator, None)
    return sequence("plain", None, ids, torch.randint(200, 5000, (4,), generator=generator), -1, None, None)


def hand_bins() -> list[dict[str, Any]]:
    """Three bins, four pairs (three with an image, one text-only) and a sample of no pair."""
    return [
        make_bin([*pair("p0", (1, 4, 4), (5, 8), seed=0), sft_sample()]),
        make_bin([*pair("p1", None, (3, 6), seed=1), *pair("p2", (1, 4, 6), (7, 2), seed=2)]),
        make_bin(pair("p3", (1, 6, 4), (4, 4), seed=3)),
    ]


@pytest.fixture(scope="module")
def bins() -> list[dict[str, Any]]:
    return hand_bins()


class HandPack(PackedDataset):
    """A ``PackedDataset`` of given bins (rank 0 of 1), with the manifest's preference flag."""

    def __init__(self, items: list[dict[str, Any]], preference: bool = True) -> None:
        IterableDataset.__init__(self)
        self.items, self.preference = items, preference
        self.rank, self.world_size, self.epoch, self.datasets = 0, 1, 0, ["prefs"]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def num_batches(self, batch_size: int, num_workers: int, drop_last: bool = False) -> int:
        return math.ceil(len(self.items) / batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# -- the oracle: each sequence alone ------------------------------------------------------------
def logprobs_alone(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Each sample's summed log-probability of its supervised tokens, run alone, unpacked, as a
    user would (the model computes its own mRoPE)."""
    cu = batch["cu_seq_lens_q"].tolist()
    out = []
    for (a, b), media in zip(itertools.pairwise(cu), sample_media(batch, cu), strict=True):
        ids, labels = batch["input_ids"][0, a:b], batch["labels"][0, a:b]
        logits = alone(model, ids, labels, media).logits[0]
        supervised = labels[1:] != -100
        losses = F.cross_entropy(logits[:-1][supervised].float(), labels[1:][supervised], reduction="none")
        out.append(-losses.double().sum())
    return torch.stack(out)[torch.tensor(batch.meta["sample_sequences"])]


def perturbed(model: torch.nn.Module, scale: float = 0.01, seed: int = 7) -> torch.nn.Module:
    """``model`` with noise on every weight: a reference whose margins are not 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def flash_cpu() -> str:
    """``flash_varlen_cpu`` (tests/loader/test_model_parity.py): transformers' flash-attention
    calling convention, ``cu_seq_lens_*`` passed through, computed on the CPU."""
    register_attentions()
    return "flash_varlen_cpu"


# -- hand-made bins (no Spark) ------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_varlen_cpu"])
def test_logprobs_from_one_packed_forward_equal_each_sequence_alone(bins, attention, flash_cpu):
    batch = collate_packed(bins)
    assert batch.meta["pairs"] == [(0, 1), (3, 4), (5, 6), (7, 8)]
    model = with_attention(tiny_qwen2_vl(), attention)
    CALLS.clear()
    with torch.no_grad():
        packed = sequence_logprobs(model, batch)
        single = logprobs_alone(with_attention(tiny_qwen2_vl(), "sdpa"), batch)
    seen = set(CALLS)  # how flash attention learnt the boundaries: cu_seq_lens, every call
    assert seen == ({"cu_seq_lens"} if attention == "flash_varlen_cpu" else set())
    assert packed.shape == (9,) and packed.dtype == torch.float64 and (packed < 0).all()
    assert (packed - single).abs().max().item() <= 1e-4, (packed, single)
    chosen, rejected = pair_logprobs(batch, packed)
    torch.testing.assert_close(chosen, packed[[0, 3, 5, 7]], rtol=0, atol=0)
    torch.testing.assert_close(rejected, packed[[1, 4, 6, 8]], rtol=0, atol=0)


def test_dpo_loss_and_gradients_equal_the_unpacked_computation(bins):
    batch = collate_packed(bins)
    policy, reference = tiny_qwen2_vl().train(), perturbed(tiny_qwen2_vl())

    def loss_of(logprobs) -> torch.Tensor:
        with torch.no_grad():
            ref = pair_logprobs(batch, logprobs(reference, batch))
        return dpo_losses(*pair_logprobs(batch, logprobs(policy, batch)), *ref, beta=BETA).losses.mean()

    packed = loss_of(sequence_logprobs)
    packed.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    unpacked = loss_of(logprobs_alone)
    unpacked.backward()
    assert abs(packed.item() - unpacked.item()) <= 1e-4 * unpacked.item()
    assert abs(packed.item() - math.log(2)) > 1e-4  # the reference differs: a real margin
    assert any(".visual." in f".{n}" for n in grads) and len(grads) > 20
    for name, param in policy.named_parameters():
        if name in grads:
            scale = param.grad.abs().max().item()
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_dpo_losses_and_rewards_by_the_formula():
    values = ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -5.0], [-3.0, -2.5])
    pc, pr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in values)
    out = dpo_losses(pc, pr, rc, rr, beta=0.5)
    torch.testing.assert_close(out.chosen_rewards, 0.5 * (pc - rc))
    torch.testing.assert_close(out.rejected_rewards, 0.5 * (pr - rr))
    torch.testing.assert_close(out.losses, -F.logsigmoid(0.5 * ((pc - rc) - (pr - rr))))
    same = dpo_losses(pc, pr, pc, pr)  # policy == reference: log 2 whatever the log-probabilities
    torch.testing.assert_close(same.losses, torch.full((2,), math.log(2), dtype=torch.float64))


def test_pairs_and_sequences_with_a_filler_and_idle_media(bins):
    filler = _as_filler(bins[1])  # a real bin (4 sequences) that trains nothing
    mixed = collate_packed([bins[0], filler, bins[2]], pad_to=200)
    assert mixed.meta["sample_ids"] == [*bins[0]["sample_ids"], *bins[2]["sample_ids"]]
    assert mixed.meta["sample_sequences"] == [0, 1, 2, 7, 8]  # the filler's are 3 to 6, padding 9
    assert mixed.meta["pairs"] == [(0, 1), (3, 4)]
    assert len(mixed["cu_seq_lens_q"]) - 1 == 10
    model = tiny_qwen2_vl()
    idle = with_idle_media(mixed, idle_media_settings(model.config))  # no video: an idle one
    assert idle.meta["idle_media"] == ["video"] and len(idle["cu_seq_lens_q"]) - 1 == 11
    text = collate_packed([make_bin(pair("t", None, (2, 3), seed=5))])
    idle_text = with_idle_media(text, idle_media_settings(model.config))  # an idle image and video
    assert idle_text.meta["idle_media"] == ["image", "video"] and idle_text.meta["pairs"] == [(0, 1)]
    with torch.no_grad():
        for plain, with_idle in ((mixed, idle), (text, idle_text)):
            expected = logprobs_alone(model, plain)
            for got in (sequence_logprobs(model, plain), sequence_logprobs(model, with_idle)):
                assert got.shape == expected.shape
                assert (got - expected).abs().max().item() <= 1e-4
    assert step_pairs([mixed, idle_text, collate_packed([filler])]).item() == 3
    assert step_pairs([collate_packed([filler])]).item() == 1  # at least 1
    no_pairs = collate_packed([make_bin([sft_sample()])])
    assert no_pairs.meta["pairs"] == [] and no_pairs.meta["sample_sequences"] == [0]
    assert [t.shape for t in pair_logprobs(no_pairs, torch.zeros(1))] == [(0,), (0,)]


@pytest.mark.parametrize(
    "sides",
    [
        ["rejected", "chosen", None],
        ["chosen", None, "rejected"],
        [None, "chosen", "chosen"],
        [None, "rejected", "rejected"],
        [None, None, "chosen"],
    ],
)
def test_a_pair_not_side_by_side_is_refused_by_collate(bins, sides):
    item = {**bins[0], "sample_pair_sides": sides}
    with pytest.raises(ValueError, match="a preference pair is not side by side"):
        collate_packed([bins[2], item])


def training_args(tmp_path, **extra: Any) -> TrainingArguments:
    return TrainingArguments(
        str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, **extra
    )


def test_the_trainer_sets_the_attention_auto_picks(bins, tmp_path, fake_gpu, capsys):
    """``PackedTrainer(attention="auto")``: SDPA on a CPU or for a float32 model; for a bf16 model
    on an sm90 GPU, mmpack_varlen (torch's kernel, flash-attn not installed) with the vision
    tower's one-call name, and the kernel it runs on printed."""
    from loader.attention import VISION_VARLEN
    from loader.trainer import PackedTrainer

    sft = HandPack(bins, preference=False)
    model = tiny_qwen2_vl("eager")
    PackedTrainer(model=model, args=training_args(tmp_path), train_dataset=sft, attention="auto")
    assert model.config._attn_implementation == "sdpa"
    fake_gpu((9, 0))
    model = tiny_qwen2_vl("eager").to(torch.bfloat16)
    PackedTrainer(model=model, args=training_args(tmp_path), train_dataset=sft, attention="auto")
    assert model.config._attn_implementation == "mmpack_varlen"
    assert model.config.text_config._attn_implementation == "mmpack_varlen"
    assert model.config.vision_config._attn_implementation == VISION_VARLEN
    assert "mmpack_varlen on torch" in capsys.readouterr().out


def test_each_trainer_refuses_the_other_kind_of_pack(bins, tmp_path):
    from loader.trainer import PackedDPOTrainer, PackedTrainer

    args, model = training_args(tmp_path), tiny_qwen2_vl()
    preference, sft = HandPack(bins), HandPack(bins, preference=False)
    with pytest.raises(ValueError, match="holds preference pairs: train it with PackedDPOTrainer"):
        PackedTrainer(model=model, args=args, train_dataset=preference)
    with pytest.raises(ValueError, match="evaluation pack holds preference pairs"):
        PackedTrainer(model=model, args=args, train_dataset=sft, eval_dataset=preference)
    with pytest.raises(ValueError, match="holds no preference pairs"):
        PackedDPOTrainer(model=model, args=args, ref_model=tiny_qwen2_vl(), train_dataset=sft)
    with pytest.raises(ValueError, match="evaluation pack holds no preference pairs"):
        PackedDPOTrainer(model=model, args=args, ref_model=tiny_qwen2_vl(), train_dataset=preference,
                         eval_dataset=sft)  # fmt: skip
    trainer = PackedDPOTrainer(model=model, args=args, ref_model=tiny_qwen2_vl(), train_dataset=preference)
    assert not trainer.ref_model.training
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    with pytest.raises(ValueError, match="evaluation pack holds no preference pairs"):
        trainer.evaluate(sft)


class GradientsBeforeStep(TrainerCallback):
    """Every parameter's gradient before each optimizer step (after clipping, none here)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def dpo_step(items: list[dict[str, Any]], reference: torch.nn.Module, out: Path) -> tuple[Any, dict]:
    """This rank's ``PackedDPOTrainer`` after one optimizer step on ``items`` (a micro-batch of
    one bin each, all in the step, SGD), and the step's gradients before the optimizer."""
    from loader.trainer import PackedDPOTrainer

    args = training_args(out, per_device_train_batch_size=1, gradient_accumulation_steps=len(items),
                         num_train_epochs=1, logging_steps=1, optim="sgd", learning_rate=0.1,
                         max_grad_norm=0.0, dataloader_num_workers=0)  # fmt: skip
    data = HandPack(items)
    data.rank, data.world_size = args.process_index, args.world_size
    gradients = GradientsBeforeStep()
    trainer = PackedDPOTrainer(model=tiny_qwen2_vl().train(), args=args, ref_model=reference, beta=BETA,
                               train_dataset=data, trace=str(out / "trace"),
                               callbacks=[gradients])  # fmt: skip
    trainer.train()
    (step,) = gradients.steps
    return trainer, step


def mean_pair_gradients(items: list[dict[str, Any]], reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the mean DPO loss over the pairs of ``items``, bin by bin, on one process."""
    policy, losses = tiny_qwen2_vl().train(), []
    for item in items:
        batch = collate_packed([item])
        with torch.no_grad():
            ref = pair_logprobs(batch, sequence_logprobs(reference, batch))
        policy_sides = pair_logprobs(batch, sequence_logprobs(policy, batch))
        losses.append(dpo_losses(*policy_sides, *ref, beta=BETA).losses)
    torch.cat(losses).mean().backward()
    return {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}


def worst_relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |got - expected| / max |expected| (inf where one is missing)."""
    if not got.keys() >= expected.keys() or len(expected) < 20:
        return math.inf
    return max(
        ((got[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in expected.items()
    )


def test_a_trainer_step_is_the_mean_dpo_loss_over_its_pairs(bins, tmp_path):
    """One optimizer step of three micro-batches (one bin each): its loss is log 2 (the policy
    starts as the reference), its gradient that of the mean DPO loss over the step's four pairs
    (not a mean of micro-batch means), and the trace lists the pairs."""
    trainer, step = dpo_step(bins, tiny_qwen2_vl(), tmp_path)
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert abs(log["loss"] - math.log(2)) <= 1e-4
    assert log["rewards/accuracy"] == 0.0 and log["rewards/margin"] == 0.0
    assert worst_relative_difference(step, mean_pair_gradients(bins, tiny_qwen2_vl())) <= 1e-4
    records = [json.loads(line) for line in (tmp_path / "trace.rank0").read_text().splitlines()]
    assert [r["pairs"] for r in records] == [
        [["p0-chosen", "p0-rejected"]],
        [["p1-chosen", "p1-rejected"], ["p2-chosen", "p2-rejected"]],
        [["p3-chosen", "p3-rejected"]],
    ]


def two_ranks_main(out: Path) -> None:
    """A rank of the 2-rank test: rank 0 trains bins 0 and 2 (a pair and a plain sample, a
    pair), rank 1 bin 1 (two pairs) and a filler; rank 0 writes how far the DDP step's
    gradient is from that of the mean over all four pairs computed on one process."""
    bins = hand_bins()
    reference = perturbed(tiny_qwen2_vl())
    rank = int(os.environ["RANK"])
    mine = [[bins[0], bins[2]], [bins[1], _as_filler(bins[0])]][rank]
    trainer, step = dpo_step(mine, reference, out)
    if rank == 0:
        worst = worst_relative_difference(step, mean_pair_gradients(bins, reference))
        (out / "result.json").write_text(json.dumps({"worst": worst, "log": trainer.state.log_history}))
    trainer.end_ranks()


@pytest.mark.slow
@pytest.mark.families  # no fixture of either lane: in the one with time to spare (Makefile)
def test_two_ranks_step_gradient_is_the_mean_over_all_their_pairs(tmp_path, monkeypatch):
    """DDP averages gradients over ranks: each rank's loss, times the world size over the
    step's pairs on all ranks, makes the step's gradient the mean over every pair, however
    unevenly they fall (micro-batches of 1, 1, 2 and 0 pairs)."""
    from tests.examples.torchrun import ROOT, torchrun

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    torchrun(Path(__file__), 2, str(tmp_path), log=tmp_path / "log")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["worst"] <= 1e-4, result


def test_the_dpo_trainer_evaluates_every_pair(bins, tmp_path):
    from loader.trainer import PackedDPOTrainer

    policy, reference = perturbed(tiny_qwen2_vl()), tiny_qwen2_vl()
    args = training_args(tmp_path, per_device_eval_batch_size=2)
    trainer = PackedDPOTrainer(model=policy, args=args, ref_model=reference, beta=BETA,
                               train_dataset=HandPack(bins), eval_dataset=HandPack(bins))  # fmt: skip
    metrics = trainer.evaluate()
    batch = collate_packed(bins)
    with torch.no_grad():
        ref = pair_logprobs(batch, sequence_logprobs(reference, batch))
        out = dpo_losses(*pair_logprobs(batch, sequence_logprobs(policy.eval(), batch)), *ref, beta=BETA)
    margins = out.chosen_rewards - out.rejected_rewards
    assert metrics["eval_pairs"] == 4
    assert abs(metrics["eval_loss"] - out.losses.mean().item()) <= 1e-5
    assert abs(metrics["eval_rewards/margin"] - margins.mean().item()) <= 1e-5
    assert metrics["eval_rewards/accuracy"] == (margins > 0).double().mean().item()


# -- the preference demo's real shards (Spark) ----------------------------------------------------
@pytest.fixture(scope="module")
def pairs_bins(preference_run) -> list[dict]:
    bins = list(PackedDataset(str(preference_run.output / "packed"), shuffle=False))
    bins.sort(key=lambda b: len(b["input_ids"]))  # the smallest first: a quick CPU forward
    assert all(b["sample_pair_sides"] == ["chosen", "rejected"] * (len(b["sample_ids"]) // 2) for b in bins)
    return bins


@pytest.fixture(scope="module")
def demo_batch(pairs_bins):
    """Two bins with images in one micro-batch."""
    with_images = [b for b in pairs_bins if "pixel_values" in b][:2]
    assert len(with_images) == 2
    return collate_packed(with_images)


@pytest.mark.spark
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_demo_pair_logprobs_from_one_packed_forward_equal_each_sequence_alone(demo_batch, attention):
    model = with_attention(tiny_qwen2_vl(), attention)
    assert len(demo_batch.meta["pairs"]) >= 4
    with torch.no_grad():
        packed = pair_logprobs(demo_batch, sequence_logprobs(model, demo_batch))
        single = pair_logprobs(demo_batch, logprobs_alone(model, demo_batch))
    for side_packed, side_alone in zip(packed, single, strict=True):
        assert (side_packed - side_alone).abs().max().item() <= 1e-4, (side_packed, side_alone)
        assert (side_packed < 0).all()


@pytest.mark.spark
def test_demo_dpo_loss_and_gradients_equal_the_unpacked_computation(demo_batch):
    policy, reference = tiny_qwen2_vl().train(), perturbed(tiny_qwen2_vl())

    def loss_of(logprobs) -> torch.Tensor:
        with torch.no_grad():
            ref = pair_logprobs(demo_batch, logprobs(reference, demo_batch))
        return dpo_losses(
            *pair_logprobs(demo_batch, logprobs(policy, demo_batch)), *ref, beta=BETA
        ).losses.mean()

    packed = loss_of(sequence_logprobs)
    packed.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    unpacked = loss_of(logprobs_alone)
    unpacked.backward()
    assert abs(packed.item() - unpacked.item()) <= 1e-5 and abs(packed.item() - math.log(2)) > 1e-4
    assert len(grads) > 20
    for name, param in policy.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.spark
def test_demo_pairs_and_sequences_with_a_filler_and_idle_media(pairs_bins, demo_batch):
    small = next(b for b in pairs_bins if "pixel_values_videos" not in b)  # gets an idle video
    filler = _as_filler(small)
    mixed = collate_packed([filler, small])
    first = len(filler["cu_seqlens"]) - 1  # the filler's sequences come first
    n = len(small["sample_ids"])
    assert mixed.meta["sample_sequences"] == list(range(first, first + n))
    assert mixed.meta["pairs"] == [(i, i + 1) for i in range(0, n, 2)]
    model = tiny_qwen2_vl().eval()
    idle = with_idle_media(mixed, idle_media_settings(model.config))
    with torch.no_grad():
        plain, with_idle = sequence_logprobs(model, mixed), sequence_logprobs(model, idle)
    assert len(plain) == n and (plain - with_idle).abs().max().item() <= 1e-4
    assert step_pairs([mixed, demo_batch]).item() == n // 2 + len(demo_batch.meta["pairs"])


@pytest.mark.spark
def test_demo_each_trainer_refuses_the_other_kind_of_pack(preference_run, packed_demo, tmp_path):
    from loader.trainer import PackedDPOTrainer, PackedTrainer

    args, model = training_args(tmp_path), tiny_qwen2_vl()
    with pytest.raises(ValueError, match="holds preference pairs: train it with PackedDPOTrainer"):
        PackedTrainer(model=model, args=args, manifest=str(preference_run.output / "packed"))
    with pytest.raises(ValueError, match="holds no preference pairs"):
        PackedDPOTrainer(
            model=model, args=args, ref_model=tiny_qwen2_vl(), manifest=str(packed_demo / "packed")
        )


@pytest.mark.spark
def test_demo_dpo_trainer_evaluates_every_pair_once(preference_run, tmp_path):
    from loader.trainer import PackedDPOTrainer

    manifest = str(preference_run.output / "packed")
    policy, reference = perturbed(tiny_qwen2_vl()), tiny_qwen2_vl()
    args = training_args(tmp_path, per_device_eval_batch_size=2)
    data = PackedDataset(manifest, shuffle=False)
    trainer = PackedDPOTrainer(model=policy, args=args, ref_model=reference, beta=BETA, manifest=manifest,
                               eval_dataset=data)  # fmt: skip
    metrics = trainer.evaluate()
    losses, margins = [], []
    with torch.no_grad():
        for batch in DataLoader(data, batch_size=2, collate_fn=collate_packed):
            ref = pair_logprobs(batch, sequence_logprobs(reference.eval(), batch))
            out = dpo_losses(*pair_logprobs(batch, sequence_logprobs(policy.eval(), batch)), *ref, beta=BETA)
            losses.append(out.losses)
            margins.append(out.chosen_rewards - out.rejected_rewards)
    losses, margins = torch.cat(losses), torch.cat(margins)
    assert metrics["eval_pairs"] == len(losses) == preference_run.summaries["pack"]["samples"] // 2
    assert abs(metrics["eval_loss"] - losses.mean().item()) <= 1e-5
    assert abs(metrics["eval_rewards/margin"] - margins.mean().item()) <= 1e-5
    assert metrics["eval_rewards/accuracy"] == (margins > 0).double().mean().item()


if __name__ == "__main__":  # the 2-rank test's ranks (torchrun)
    two_ranks_main(Path(sys.argv[1]))
