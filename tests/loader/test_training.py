"""Batches through the containers trainers use, and the idle media that keep FSDP ranks in
step (``loader.training``), on a tiny random Qwen2-VL."""

from __future__ import annotations

import importlib.util
import itertools
import pickle
from pathlib import Path

import pytest
import torch
from accelerate.utils import recursively_apply, send_to_device
from torch.utils.data import DataLoader

from loader import PackedBatch, PackedDataset, collate_packed
from loader.training import has_media, idle_media_settings, summed_loss, with_idle_media

ROOT = Path(__file__).resolve().parents[2]


def tiny_qwen2_vl(attention: str = "sdpa"):
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "examples" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_model("qwen2_vl", 3, attention)


@pytest.fixture(scope="module")
def media_batch(packed_demo) -> PackedBatch:
    dataset = PackedDataset(str(packed_demo / "packed"), seed=0, shuffle=False)
    loader = DataLoader(dataset, batch_size=2, collate_fn=collate_packed, num_workers=1)
    return next(batch for batch in loader if has_media(batch))


def text_batch(lengths: tuple[int, ...] = (9, 6, 11)) -> PackedBatch:
    """Three text-only samples, packed as collate_packed packs them (Qwen2-VL positions)."""
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    ids = torch.randint(200, 5000, (1, total), generator=generator)
    starts = torch.tensor([0, *lengths]).cumsum(0)
    labels = ids.clone()
    labels[0, starts[:-1]] = -100
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(4, 1, total).contiguous()
    cu = starts.to(torch.int32)
    inputs = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "use_cache": False,
    }
    return PackedBatch(inputs, {"supervised_tokens": total - len(lengths), "sample_ids": ["a", "b", "c"]})


def same_tensors(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_a_batch_survives_the_containers_trainers_use(media_batch):
    moved = send_to_device(media_batch, "cpu")  # accelerate's device placement: calls .to
    assert isinstance(moved, PackedBatch) and moved.meta == media_batch.meta
    assert same_tensors(moved, media_batch)
    pickled = pickle.loads(pickle.dumps(media_batch))  # dataloader workers
    assert pickled.meta == media_batch.meta and same_tensors(pickled, media_batch)
    rebuilt = recursively_apply(lambda t: t.clone(), media_batch)  # type(batch)({...}), no meta to give
    assert isinstance(rebuilt, PackedBatch) and same_tensors(rebuilt, media_batch) and rebuilt.meta == {}
    assert type(media_batch)(dict(media_batch)).meta == {}
    assert PackedBatch(media_batch).meta == media_batch.meta
    assert media_batch.to("cpu").meta == media_batch.meta


def test_a_rebuilt_batch_still_runs_the_model(media_batch):
    model = tiny_qwen2_vl().eval()
    rebuilt = recursively_apply(lambda t: t, media_batch)
    with torch.no_grad():
        expected = summed_loss(model, media_batch)
        assert torch.equal(summed_loss(model, rebuilt), expected)
        model(**{k: v for k, v in rebuilt.items() if k != "labels"})  # every key is one the model takes


def test_a_batch_with_media_gets_no_idle_media(media_batch):
    settings = idle_media_settings(tiny_qwen2_vl().config)
    assert "pixel_values" in media_batch
    added = with_idle_media(media_batch, settings)
    assert ("pixel_values_videos" in media_batch) == (added is media_batch)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_idle_media_change_no_real_logit_and_give_the_vision_tower_a_gradient(attention):
    model = tiny_qwen2_vl(attention)
    settings = idle_media_settings(model.config)
    plain = text_batch()
    idle = with_idle_media(plain, settings)
    length = plain["input_ids"].shape[1]
    assert idle["input_ids"].shape[1] == length + 2  # one token each: an image and a video
    assert idle["cu_seq_lens_q"].tolist() == [*plain["cu_seq_lens_q"].tolist(), length + 1, length + 2]
    assert idle.meta["idle_media"] == ["image", "video"] and idle.meta["supervised_tokens"] == 23
    inputs = {k: v for k, v in plain.items() if k != "labels"}
    idle_inputs = {k: v for k, v in idle.items() if k != "labels"}
    with torch.no_grad():
        alone = model(**inputs).logits[0]
        together = model(**idle_inputs).logits[0, :length]
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)

    vision = [p for name, p in model.named_parameters() if ".visual." in f".{name}"]
    summed_loss(model, plain).backward()
    assert all(p.grad is None for p in vision)  # the tower sat out: an FSDP rank would not gather it
    model.zero_grad(set_to_none=True)
    loss = summed_loss(model, idle)
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in vision)  # it ran, and trained nothing
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, summed_loss(model, plain), rtol=1e-6, atol=0)


def test_the_loss_per_dataset_is_the_per_sample_losses_grouped_by_hand(packed_demo):
    from loader.dataset import _as_filler
    from loader.training import dataset_losses, token_losses

    dataset = PackedDataset(str(packed_demo / "packed"), seed=0, shuffle=False)
    items = list(itertools.islice(iter(dataset), 4))
    batch = collate_packed([*items[:3], _as_filler(items[3])])
    assert len(set(batch.meta["sample_datasets"])) > 1  # the test needs samples of several datasets
    model = tiny_qwen2_vl()
    with torch.no_grad():
        losses, positions = token_losses(model, batch)
        per_dataset = dataset_losses(losses, positions, batch, dataset.datasets)
        inputs = dict(batch)
        labels = inputs.pop("labels")[0]
        logits = model(**inputs).logits[0].float()
    # by hand: every real sample's tokens, from its own span of the full logits
    expected = {name: [0.0, 0] for name in dataset.datasets}
    starts = [0]
    for item in items[:3]:
        for length in item["cu_seqlens"].diff().tolist():
            starts.append(starts[-1] + length)
    for name, start, end in zip(batch.meta["sample_datasets"], starts[:-1], starts[1:], strict=True):
        for t in range(start + 1, end):
            if labels[t] != -100:
                expected[name][0] += torch.nn.functional.cross_entropy(logits[t - 1], labels[t]).item()
                expected[name][1] += 1
    for i, name in enumerate(dataset.datasets):
        assert per_dataset[1, i].item() == expected[name][1]
        assert per_dataset[0, i].item() == pytest.approx(expected[name][0], rel=1e-5)
    assert per_dataset[1].sum().item() == batch.meta["supervised_tokens"]  # the filler counts nothing


def test_each_tokens_loss_weighs_its_samples_weight():
    from loader.training import weighted_sum

    batch = text_batch((9, 6, 11))  # sequences [0, 9), [9, 15), [15, 26)
    positions = torch.tensor([1, 8, 9, 14, 15, 25])  # the first and last token of each
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert weighted_sum(losses, positions, batch) == 21.0  # no weights given: each 1
    batch.meta["sequence_weights"] = [1.0, 0.5, 2.0]
    assert weighted_sum(losses, positions, batch) == 1 + 2 + 0.5 * (3 + 4) + 2 * (5 + 6)
    batch.meta["sequence_weights"] = [1.0, 0.5]
    with pytest.raises(ValueError, match="after the batch's listed sequences"):
        weighted_sum(losses, positions, batch)
