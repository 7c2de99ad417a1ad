"""``model(**collate_packed(bins))`` on real transformers models equals running each sample alone.

Tiny random models from hand-made configs (no hub), fp32 on CPU, real token ids from the
packed demo shards (images and videos). The oracle for every sample is transformers
itself: the sample alone, with the model computing its own mRoPE (``get_rope_index``).
Attention: SDPA, eager, ``flash_varlen_cpu``, a stand-in registered under a name that
makes transformers take its flash-attention path (no mask; ``cu_seq_lens_*`` and
``max_length_*`` passed through) and computes varlen attention on the CPU, and
``mmpack_varlen`` (``loader.attention``) with torch's CUDA kernel replaced by
``recording_kernel``: its CPU reference, which records what each call received.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from loader import PackedDataset, collate_packed, varlen_attention
from loader.attention import VARLEN, reference_varlen_attn, register_varlen, use_attention

pytestmark = pytest.mark.spark

IMAGE_PAD, VIDEO_PAD = 151655, 151656
ROOT = Path(__file__).resolve().parents[2]
ATTENTION = ["sdpa", "eager", "flash_varlen_cpu", "mmpack_varlen"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_qwen2_vl", ROOT / "examples" / "train_qwen2_vl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CALLS: list[str] = []  # how each flash_varlen_cpu call learnt the sequence boundaries


def flash_varlen_cpu(module, query, key, value, attention_mask, scaling=None, is_causal=None, **kwargs):
    """transformers' flash-attention calling convention ([B, H, T, D] in, [B, T, H, D] out),
    computed by ``varlen_attention`` on the CPU. Like flash-attn, it takes the boundaries
    from ``cu_seq_lens_q``, else from restarting ``position_ids``, else one sequence."""
    assert attention_mask is None, "flash attention gets no mask"
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))
    causal = module.is_causal if is_causal is None else is_causal
    if kwargs.get("cu_seq_lens_q") is not None:
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        assert isinstance(longest, int) and cu.dtype == torch.int32
        CALLS.append("cu_seq_lens")
    elif kwargs.get("position_ids") is not None:
        starts = torch.nonzero(kwargs["position_ids"][0] == 0).flatten()
        cu = torch.cat([starts, torch.tensor([len(q)])]).int()
        longest = int(cu.diff().max())
        CALLS.append("position_ids")
    else:
        cu, longest = torch.tensor([0, len(q)], dtype=torch.int32), len(q)
        CALLS.append("whole")
    return varlen_attention(q, k, v, cu, longest, causal=causal, softmax_scale=scaling)[None], None


KERNEL_CALLS: list[tuple[list[int], tuple[int, int]]] = []  # mmpack_varlen: (cu_seq_q, window) a call


def recording_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
    """torch's varlen kernel's signature, computed by its CPU reference; records each call."""
    assert cu_seq_q.dtype == torch.int32 and isinstance(max_q, int) and max_q == int(cu_seq_q.diff().max())
    KERNEL_CALLS.append((cu_seq_q.tolist(), tuple(options["window_size"])))
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)


def text_calls(cu: list[int], vision: list[list[int]] | None = None) -> int:
    """mmpack_varlen's causal calls (the language model's layers), each checked to have received
    the batch's sequences ``cu``; bidirectional calls (a vision tower's) are one image or crop
    per row, whatever text boundaries came along, or (``vision``: a Qwen-VL tower under its
    one-call name) one of the towers' own boundaries."""
    causal = [seen for seen, window in KERNEL_CALLS if window == (-1, 0)]
    assert all(seen == cu for seen in causal), (causal[:1], cu)
    for seen in (seen for seen, window in KERNEL_CALLS if window == (-1, -1)):
        assert seen in vision if vision is not None else len(set(np.diff(seen))) == 1, seen
    return len(causal)


def vision_boundaries(batch) -> list[list[int]]:
    """The sequences a Qwen-VL tower attends over in one call: every frame of every image (then
    every video) of the batch its own sequence of h·w patches."""
    out = []
    for key in ("image_grid_thw", "video_grid_thw"):
        if key in batch:
            grid = batch[key]
            lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
            out.append([0, *lengths.cumsum(0).tolist()])
    return out


def register_attentions() -> None:
    """flash_varlen_cpu, and mmpack_varlen on ``recording_kernel``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("flash_varlen_cpu", flash_varlen_cpu)
    AttentionMaskInterface.register("flash_varlen_cpu", flash_attention_mask)
    register_varlen(kernel=recording_kernel)


@pytest.fixture(scope="module")
def example():
    register_attentions()
    return load_example()


def with_attention(model, name: str):
    """Switch a built model's attention (a flash name is set after building: transformers
    would otherwise look for a flash-attn kernel to load); mmpack_varlen as a user sets it
    (``use_attention``: a Qwen-VL vision tower gets its one-call name)."""
    if name == VARLEN:
        use_attention(model, VARLEN)
        return model.eval()
    for config in (model.config, *(getattr(model.config, k, None) for k in ("text_config", "vision_config"))):
        if config is not None:
            config._attn_implementation_internal = name
    return model.eval()


def sample_media(batch, cu: list[int], pads: tuple[int, int] = (IMAGE_PAD, VIDEO_PAD)) -> list[dict]:
    """Each sample's own vision inputs, cut out of the batch by its pad tokens (in order);
    Qwen2.5-VL videos with their ``second_per_grid_ts``."""
    ids = batch["input_ids"][0]
    out = [{} for _ in cu[:-1]]
    videos = 0
    for pad, pixels_key, grid_key in (
        (pads[0], "pixel_values", "image_grid_thw"),
        (pads[1], "pixel_values_videos", "video_grid_thw"),
    ):
        if grid_key not in batch:
            continue
        grids, item, patch = batch[grid_key], 0, 0
        for s, (a, b) in enumerate(itertools.pairwise(cu)):
            tokens, mine = int((ids[a:b] == pad).sum()), []
            while tokens > 0:
                mine.append(item)
                tokens -= int(grids[item].prod()) // 4
                item += 1
            assert tokens == 0
            if mine:
                size = sum(int(grids[i].prod()) for i in mine)
                out[s][pixels_key] = batch[pixels_key][patch : patch + size]
                out[s][grid_key] = grids[mine]
                patch += size
                if pixels_key == "pixel_values_videos" and "second_per_grid_ts" in batch.meta:
                    out[s]["second_per_grid_ts"] = batch.meta["second_per_grid_ts"][
                        videos : videos + len(mine)
                    ]
                    videos += len(mine)
        assert item == len(grids) and patch == len(batch[pixels_key])
    return out


def alone(model, ids: torch.Tensor, labels: torch.Tensor, media: dict):
    """One sample as a user runs it unpacked: the model computes its own mRoPE."""
    config = model.config
    kinds = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    return model(input_ids=ids[None], labels=labels[None], mm_token_type_ids=kinds[None], **media)


def alone_1d(model, ids: torch.Tensor, labels: torch.Tensor, media: dict):
    """One sample ([1, L] ids and labels) as a user runs it unpacked, for models with 1-D
    positions (InternVL, LLaVA-OneVision: the model makes them)."""
    return model(input_ids=ids, labels=labels, use_cache=False, **media)


def assert_each_sample_alone(batch, packed, media: list[dict], run_alone) -> int:
    """Every sample of ``batch`` gets from ``run_alone(ids, labels, media)`` (its forward unpacked,
    [1, L] ids and labels, its ``media`` entry) the logits it has in ``packed`` (≤ 1e-4), and the
    per-sample losses sum to the packed loss; return the samples checked."""
    cu = batch.meta["cu_seq_lens"]
    labels = batch["labels"][0]
    targets = int((labels[1:] != -100).sum())
    summed_alone = torch.zeros((), dtype=torch.float64)
    for (a, b), mine in zip(itertools.pairwise(cu), media, strict=True):
        with torch.no_grad():
            single = run_alone(batch["input_ids"][:, a:b], batch["labels"][:, a:b], mine)
        # in place in the sample's own logits: a [L, vocab] difference allocated anew per sample
        # took a quarter of a tiny model's parity test
        diff = single.logits[0].sub_(packed.logits[0, a:b]).abs_().max().item()
        assert diff <= 1e-4, f"sample at [{a}, {b}) differs by {diff}"
        supervised = int((labels[a + 1 : b] != -100).sum())
        if supervised:
            summed_alone += single.loss.double() * supervised
    torch.testing.assert_close(packed.loss.double() * targets, summed_alone, rtol=1e-5, atol=1e-3)
    return len(cu) - 1


@pytest.fixture(scope="module")
def micro_batches(parity_demo):
    """Three micro-batches of the smallest bins: 3 bins with images only, 1 with a video, one
    micro-batch of two bins."""
    bins = [b for b in PackedDataset(str(parity_demo / "packed"), shuffle=False) if len(b["sample_ids"]) > 1]
    bins.sort(key=lambda b: len(b["input_ids"]))
    video = next(b for b in bins if "pixel_values_videos" in b)
    images = [b for b in bins if "pixel_values" in b and "pixel_values_videos" not in b][:3]
    assert len(images) == 3
    return [[images[0], video], [images[1]], [images[2]]]


@pytest.mark.parametrize("attention", ATTENTION)
def test_qwen2_vl_packed_equals_each_sample_alone(example, micro_batches, attention):
    model = with_attention(example.tiny_qwen2_vl(seed=3), attention)
    checked_samples = 0
    for bins in micro_batches:
        batch = collate_packed(bins)
        assert batch["position_ids"].shape == (4, 1, batch.meta["num_tokens"])
        CALLS.clear()
        KERNEL_CALLS.clear()
        with torch.no_grad():
            packed = model(**batch)
        if attention == "flash_varlen_cpu":  # text layers used the batch's boundaries, not a guess
            assert CALLS.count("cu_seq_lens") >= model.config.text_config.num_hidden_layers
        if attention == "mmpack_varlen":  # the registered functions ran every layer, on their sequences
            vision = vision_boundaries(batch)
            assert text_calls(batch.meta["cu_seq_lens"], vision) == model.config.text_config.num_hidden_layers
            one_call = [seen for seen, window in KERNEL_CALLS if window == (-1, -1)]  # a layer, all images
            assert len(one_call) == len(vision) * model.config.vision_config.depth
        media = sample_media(batch, batch.meta["cu_seq_lens"])
        checked_samples += assert_each_sample_alone(
            batch, packed, media, lambda ids, labels, m: alone(model, ids[0], labels[0], m)
        )
    assert checked_samples >= 6


def test_qwen2_5_vl_takes_the_same_batches(example, micro_batches):
    """Qwen2.5-VL (window attention in its vision tower): same keys, same isolation. Image
    bins only: for videos Qwen2.5-VL scales mRoPE time by the frame rate, which a
    ``qwen2_vl`` packing does not store."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(5)
    config = Qwen2_5_VLConfig(
        text_config=example.tiny_qwen2_vl().config.text_config.to_dict(),
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": 16, "fullatt_block_indexes": [1]},
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    batch = collate_packed(micro_batches[1])
    assert "pixel_values" in batch and "pixel_values_videos" not in batch
    with torch.no_grad():
        packed = model(**batch)
        cu = batch["cu_seq_lens_q"].tolist()
        for (a, b), media in zip(itertools.pairwise(cu), sample_media(batch, cu), strict=True):
            single = alone(model, batch["input_ids"][0, a:b], batch["labels"][0, a:b], media)
            assert (packed.logits[0, a:b] - single.logits[0]).abs().max().item() <= 1e-4


def test_three_row_positions_would_leak(example, micro_batches):
    """Why ``position_ids`` has 4 rows: with only the 3 mRoPE rows transformers finds no
    boundaries and samples attend to the samples before them."""
    model = with_attention(example.tiny_qwen2_vl(seed=3), "sdpa")
    batch = collate_packed(micro_batches[1])
    leaky = {**batch, "position_ids": batch["position_ids"][1:]}
    with torch.no_grad():
        right, wrong = model(**batch).logits, model(**leaky).logits
    first = int(batch["cu_seq_lens_q"][1])
    torch.testing.assert_close(right[0, :first], wrong[0, :first], atol=1e-5, rtol=1e-5)
    assert (right[0, first:] - wrong[0, first:]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_plain_causal_lm_packed_equals_each_sample_alone(attention):
    """Text-only / InternVL-style shards: [1, T] positions into a plain transformers causal LM."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=attention).eval()
    lengths = [[5, 17], [9], [1, 30, 4]]
    bins = []
    for bin_lengths in lengths:
        cu = torch.tensor([0, *torch.tensor(bin_lengths).cumsum(0).tolist()], dtype=torch.int32)
        ids = torch.randint(0, 1000, (int(cu[-1]),))
        labels = ids.clone()
        labels[cu[:-1].long()] = -100
        positions = torch.cat([torch.arange(n) for n in bin_lengths])
        bins.append(
            {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seqlens": cu,
             "max_seqlen": max(bin_lengths), "sample_ids": [f"s{i}" for i in range(len(bin_lengths))]}
        )  # fmt: skip
    batch = collate_packed(bins, pad_to=80)
    assert batch["position_ids"].shape == (1, 80)
    with torch.no_grad():
        packed = model(**batch).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        for a, b in itertools.pairwise(cu[:-1]):  # the last sequence is the padding
            single = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
            torch.testing.assert_close(packed[a:b], single, atol=1e-5, rtol=1e-5)
