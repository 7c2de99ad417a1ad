"""DPO on packed bins of the preference demo (real shards, real images) with a tiny random
Qwen2-VL: every pair's log-probabilities from one packed forward equal each sequence run alone,
the DPO loss and its gradients equal the unpacked computation, and the batch metadata names
the pairs (with fillers and idle media in the batch). Trainers refuse the wrong kind of pack."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from loader import PackedDataset, collate_packed
from loader.preference import dpo_losses, pair_logprobs, sequence_logprobs, step_pairs
from loader.training import idle_media_settings, with_idle_media
from tests.loader.test_model_parity import alone, sample_media, with_attention
from tests.loader.test_training import tiny_qwen2_vl

pytestmark = pytest.mark.spark

BETA = 0.1


@pytest.fixture(scope="module")
def pairs_bins(preference_run) -> list[dict]:
    bins = list(PackedDataset(str(preference_run.output / "packed"), shuffle=False))
    bins.sort(key=lambda b: len(b["input_ids"]))  # the smallest first: a quick CPU forward
    assert all(b["sample_pair_sides"] == ["chosen", "rejected"] * (len(b["sample_ids"]) // 2) for b in bins)
    return bins


@pytest.fixture(scope="module")
def batch(pairs_bins):
    """Two bins with images in one micro-batch."""
    with_images = [b for b in pairs_bins if "pixel_values" in b][:2]
    assert len(with_images) == 2
    return collate_packed(with_images)


def logprobs_alone(model, batch) -> torch.Tensor:
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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pair_logprobs_from_one_packed_forward_equal_each_sequence_alone(batch, attention):
    model = with_attention(tiny_qwen2_vl(), attention)
    assert len(batch.meta["pairs"]) >= 4
    with torch.no_grad():
        packed = pair_logprobs(batch, sequence_logprobs(model, batch))
        single = pair_logprobs(batch, logprobs_alone(model, batch))
    for side_packed, side_alone in zip(packed, single, strict=True):
        assert (side_packed - side_alone).abs().max().item() <= 1e-4, (side_packed, side_alone)
        assert (side_packed < 0).all()


def test_dpo_loss_and_gradients_equal_the_unpacked_computation(batch):
    policy, reference = tiny_qwen2_vl().train(), tiny_qwen2_vl().eval()
    with torch.no_grad():  # a reference that differs from the policy: margins are not 0
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))

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
    assert (
        abs(packed.item() - unpacked.item()) <= 1e-5
        and abs(packed.item() - torch.log(torch.tensor(2.0))) > 1e-4
    )
    assert len(grads) > 20
    for name, param in policy.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_pairs_and_sequences_with_a_filler_and_idle_media(pairs_bins, batch):
    small = next(b for b in pairs_bins if "pixel_values_videos" not in b)  # gets an idle video
    filler = {**small, "labels": torch.full_like(small["labels"], -100), "sample_ids": [],
              "sample_datasets": [], "sample_pair_sides": [], "filler": True}  # fmt: skip
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
    assert step_pairs([mixed, batch]).item() == n // 2 + len(batch.meta["pairs"])


def test_a_pair_not_side_by_side_is_refused_by_collate(pairs_bins):
    item = dict(pairs_bins[0])
    item["sample_pair_sides"] = item["sample_pair_sides"][::-1]
    with pytest.raises(ValueError, match="a preference pair is not side by side"):
        collate_packed([item])


def test_each_trainer_refuses_the_other_kind_of_pack(preference_run, packed_demo, tmp_path):
    from transformers import TrainingArguments

    from loader.trainer import PackedDPOTrainer, PackedTrainer

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    model = tiny_qwen2_vl()
    with pytest.raises(ValueError, match="holds preference pairs: train it with PackedDPOTrainer"):
        PackedTrainer(model=model, args=args, manifest=str(preference_run.output / "packed"))
    with pytest.raises(ValueError, match="holds no preference pairs"):
        PackedDPOTrainer(
            model=model, args=args, ref_model=tiny_qwen2_vl(), manifest=str(packed_demo / "packed")
        )


def test_the_dpo_trainer_evaluates_every_pair_once(preference_run, tmp_path):
    from torch.utils.data import DataLoader
    from transformers import TrainingArguments

    from loader.trainer import PackedDPOTrainer

    manifest = str(preference_run.output / "packed")
    policy, reference = tiny_qwen2_vl(), tiny_qwen2_vl()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", per_device_eval_batch_size=2)
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
