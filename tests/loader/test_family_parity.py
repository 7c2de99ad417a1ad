"""Every family packed by ``tokenize.model``: ``model(**collate_packed(bins))`` on a tiny random
model of that family gives each sample the logits and loss it gets alone.

The model directories are the published processor configs and chat templates with a tiny
random config (tests/models/build.py); the oracle for each sample is transformers running
it alone, computing its own rotary positions (``get_rope_index``; Qwen2.5-VL videos with the
``second_per_grid_ts`` the processor gives). Qwen3.5's linear-attention layers cannot keep
packed samples apart with transformers' torch reference ops: the batch is refused there,
and with those two ops replaced (here only) by equivalents that restart at the batch's
boundaries (``seq_idx``, ``cu_seq_lens_q``) packed equals alone.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from loader import PackedDataset, collate_packed
from loader.hybrid import PackingUnsupported, require_sample_isolation
from tests.conftest import PARITY_BUDGET
from tests.loader.test_model_parity import (
    CALLS,
    KERNEL_CALLS,
    alone,
    assert_each_sample_alone,
    register_attentions,
    sample_media,
    vision_boundaries,
    with_attention,
)
from tests.models.build import tiny_models

pytestmark = pytest.mark.spark

MODELS = {  # tiny model type -> the family run whose shards it reads
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
}


@pytest.fixture(scope="module")
def flash_cpu():
    """transformers' flash-attention path, computed on the CPU, and mmpack_varlen on the CPU
    reference of its kernel (tests/loader/test_model_parity.py)."""
    register_attentions()


@functools.cache
def micro_batches(packed: Path) -> list[list[dict]]:
    """Micro-batches of the smallest multi-sample bins (of a pack into PARITY_BUDGET-token bins):
    an image bin beside a video bin, and one more image bin (≥ 6 samples); read once per pack
    for every attention and test."""
    bins = [b for b in PackedDataset(str(packed), shuffle=False) if len(b["sample_ids"]) > 1]
    bins.sort(key=lambda b: len(b["input_ids"]))
    video = next(b for b in bins if "pixel_values_videos" in b)
    images = [b for b in bins if "pixel_values" in b and "pixel_values_videos" not in b][:2]
    assert len(images) == 2
    return [[images[0], video], [images[1]]]


BOUNDARIES: list[str] = []  # what each replaced op was given to find the samples


@contextmanager
def restarting_linear_attention():
    """transformers' torch short convolution and chunked delta rule, run per sample: the
    convolution restarts where ``seq_idx`` changes, the delta rule at ``cu_seqlens`` (what
    causal-conv1d and flash-linear-attention do with them on a GPU)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe

    saved = [
        (m, name, getattr(m, name))
        for m in (dense, moe)
        for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
    ]

    def patched(module):
        conv, chunk = module.causal_conv1d_fn.__wrapped__, module.torch_chunk_gated_delta_rule.__wrapped__

        def conv_per_sample(hidden_states, weight, bias=None, activation=None, seq_idx=None, **_):
            BOUNDARIES.append("seq_idx" if seq_idx is not None else "none")
            if seq_idx is None:  # one sample alone
                return conv(hidden_states, weight, bias, activation)
            bounds = torch.cat(
                [
                    torch.tensor([0]),
                    torch.nonzero(seq_idx[0].diff()).flatten() + 1,
                    torch.tensor([seq_idx.shape[1]]),
                ]
            )
            parts = [
                conv(hidden_states[..., a:b], weight, bias, activation)
                for a, b in itertools.pairwise(bounds.tolist())
            ]
            return torch.cat(parts, dim=-1)

        def chunk_per_sample(
            query, key, value, g, beta, cu_seqlens=None, initial_state=None, output_final_state=False, **kw
        ):
            BOUNDARIES.append("cu_seqlens" if cu_seqlens is not None else "none")
            kw.pop("seq_idx", None)
            if cu_seqlens is None:  # one sample alone: the op as it is
                return chunk(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, **kw)  # fmt: skip
            window = [(slice(None), slice(a, b)) for a, b in itertools.pairwise(cu_seqlens.tolist())]
            outs = [
                chunk(query[w], key[w], value[w], g=g[w], beta=beta[w], initial_state=None, **kw)[0]
                for w in window
            ]
            return torch.cat(outs, dim=1), None

        module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = conv_per_sample, chunk_per_sample

    try:
        for module in (dense, moe):
            patched(module)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def check_packed_equals_alone(model, batches) -> int:
    """Assert every sample's logits (≤ 1e-4) and the summed loss; return the samples checked."""
    checked = 0
    pads = (model.config.image_token_id, model.config.video_token_id)
    for bins in batches:
        batch = collate_packed(bins)
        assert batch["position_ids"].shape == (4, 1, batch.meta["num_tokens"])
        with torch.no_grad():
            packed = model(**batch)
        media = sample_media(batch, batch.meta["cu_seq_lens"], pads)
        checked += assert_each_sample_alone(
            batch, packed, media, lambda ids, labels, m: alone(model, ids[0], labels[0], m)
        )
    return checked


@pytest.mark.parametrize(  # the MoE variant's attention is Qwen3-VL's: SDPA is enough there
    "model_type,attention",
    [
        *(
            (m, a)
            for m in ("qwen2_5_vl", "qwen3_vl")
            for a in ("sdpa", "eager", "flash_varlen_cpu", "mmpack_varlen")
        ),
        ("qwen3_vl_moe", "sdpa"),
    ],
)
def test_packed_equals_each_sample_alone(flash_cpu, family_run, model_type, attention):
    run = family_run(MODELS[model_type], PARITY_BUDGET)
    model = with_attention(tiny_models().tiny_model(model_type, seed=3), attention)
    CALLS.clear()
    KERNEL_CALLS.clear()
    batches = micro_batches(run.output / "packed")
    assert check_packed_equals_alone(model, batches) >= 6
    if attention == "flash_varlen_cpu":  # the text layers used the batch's boundaries
        assert CALLS.count("cu_seq_lens") >= 3 * model.config.text_config.num_hidden_layers
    if attention == "mmpack_varlen":  # the registered functions ran every layer, on their sequences
        collated = [collate_packed(bins) for bins in batches]
        sequences = [batch.meta["cu_seq_lens"] for batch in collated]
        causal = [cu for cu, window in KERNEL_CALLS if window == (-1, 0)]
        packed = [cu for cu in causal if len(cu) > 2]  # the samples alone are one sequence each
        assert len(packed) == len(batches) * model.config.text_config.num_hidden_layers
        assert all(cu in sequences for cu in packed)
        # the vision tower: one call a layer for all of a batch's images (videos), each frame (or
        # window) its own sequence; as many calls again for the samples alone
        towers = sum(len(vision_boundaries(batch)) for batch in collated)
        whole = [cu for cu, window in KERNEL_CALLS if window == (-1, -1) and len(cu) > 2]
        assert len(whole) >= towers * model.config.vision_config.depth


@pytest.mark.parametrize(
    "model_type,attention",
    [("qwen3_5", "sdpa"), ("qwen3_5", "flash_varlen_cpu"), ("qwen3_5_moe", "sdpa")],
)
def test_hybrid_packed_equals_alone_with_boundary_respecting_ops(
    flash_cpu, family_run, model_type, attention
):
    run = family_run(MODELS[model_type], PARITY_BUDGET)
    model = with_attention(tiny_models().tiny_model(model_type, seed=3), attention)
    batches = micro_batches(run.output / "packed")
    assert batches[0][0]["seq_idx"].dtype == torch.int32
    BOUNDARIES.clear()
    CALLS.clear()
    with restarting_linear_attention():
        assert check_packed_equals_alone(model, batches) >= 6
    layer_types = model.config.text_config.layer_types
    linear = sum(t == "linear_attention" for t in layer_types)
    assert BOUNDARIES.count("seq_idx") == BOUNDARIES.count("cu_seqlens") == len(batches) * linear
    if attention == "flash_varlen_cpu":  # the attention layers used the batch's boundaries too
        assert CALLS.count("cu_seq_lens") >= len(batches) * (len(layer_types) - linear)


def test_hybrid_packed_batches_are_refused_without_the_kernels(family_run):
    run = family_run("qwen3_5", PARITY_BUDGET)
    model = tiny_models().tiny_model("qwen3_5", seed=3)
    with pytest.raises(PackingUnsupported, match="flash-linear-attention and causal-conv1d"):
        require_sample_isolation(model)
    batch = collate_packed(micro_batches(run.output / "packed")[1])
    with pytest.raises(ValueError, match="can't keep packed sequences apart"), torch.no_grad():
        model(**batch)  # transformers' own refusal: its torch ops would leak state across samples
    require_sample_isolation(tiny_models().tiny_model("qwen3_vl"))  # no linear attention: nothing to refuse


POSITIONS = ("position_ids", "mrope_position_ids")
MEDIA_KEYS = (("image", "pixel_values"), ("video", "pixel_values_videos"))


def test_positions_without_media_equal_those_with_media_on_the_demo(packed_demo):
    check_positions_without_media(packed_demo / "packed", "qwen2_vl")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "llava_onevision"])
def test_positions_without_media_equal_those_with_media(family_run, family):
    check_positions_without_media(family_run(family).output / "packed", family)


def check_positions_without_media(packed: Path, family: str) -> None:
    """``PackedDataset(with_media=False)`` reads the media's grids and offsets only, never their
    bytes, and gives every bin the positions (mRoPE included) it gets with the media: on each
    family's demo pack with images and videos (Qwen3-VL's timestamped video groups included)."""
    with_media = PackedDataset(str(packed), shuffle=False)
    without = PackedDataset(str(packed), shuffle=False, with_media=False)
    kinds = set()
    for full, lean in zip(with_media, without, strict=True):
        assert "pixel_values" not in lean and "pixel_values_videos" not in lean
        kinds |= {kind for kind, key in MEDIA_KEYS if key in full}
        for key in POSITIONS:
            assert (key in full) == (key in lean)
            if key in full:
                assert torch.equal(full[key], lean[key]), (family, key, full["sample_ids"])
    assert kinds == ({"image"} if family == "internvl" else {"image", "video"})  # InternVL: frames are tiles
