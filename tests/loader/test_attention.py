"""Packed varlen attention equals attention over each sample alone; ``mmpack_varlen``
(transformers' attention on torch's varlen kernel, here on its CPU reference) and its refusals;
Gemma 3's masks in the form of the attention in use, against transformers' own."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from loader import attention, block_diagonal_mask, collate_packed, varlen_attention
from loader.attention import VARLEN, reference_varlen_attn, with_model_masks
from loader.hybrid import PackingUnsupported


def per_sample(q, k, v, cu, causal):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        if ks.shape[1] != qs.shape[1]:
            ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
            vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_equals_per_sample(causal, kv_heads):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 19, 40], dtype=torch.int32)
    q = torch.randn(40, 4, 16)
    k, v = torch.randn(40, kv_heads, 16), torch.randn(40, kv_heads, 16)
    packed = varlen_attention(q, k, v, cu, max_seqlen=21, causal=causal)
    torch.testing.assert_close(packed, per_sample(q, k, v, cu, causal), atol=1e-5, rtol=1e-5)


def test_block_diagonal_mask_is_additive():
    inf = float("-inf")
    mask = block_diagonal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[0, inf, inf], [0, 0, inf], [inf, inf, 0]]
    assert block_diagonal_mask(torch.tensor([0, 2, 3]), causal=False)[0].tolist() == [0, 0, inf]


def test_block_diagonal_mask_blocks_when_added_to_scores():
    """Eager attention adds the mask to the scores: a blocked key must get zero weight."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    scores = torch.randn(7, 7)
    weights = torch.softmax(scores + block_diagonal_mask(cu), dim=-1)
    assert weights[3:, :3].abs().max() == 0 and weights[:3, 3:].abs().max() == 0
    assert torch.triu(weights, diagonal=1).abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))


# -- mmpack_varlen: transformers' attention on torch's varlen kernel ------------------------------


def tiny_causal_lm(attention_name: str, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **extra,
    )  # fmt: skip
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attention_name).eval()


def packed_rows(lengths: list[int]) -> dict:
    ids = torch.randint(0, 500, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions, "cu": cu}


@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
def test_mmpack_varlen_packed_equals_each_sample_alone_with_a_sliding_window(varlen_kernel, boundaries):
    """A causal LM with sliding-window layers (window 4, samples longer): mmpack_varlen on a packed
    row, with the sequences as keyword arguments or in the restarting positions, gives every
    sample SDPA's logits for it alone."""
    calls = []

    def kernel(*args, **options):
        calls.append(options["window_size"])
        return reference_varlen_attn(*args, **options)

    varlen_kernel(kernel)
    window = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    packed_model, alone_model = tiny_causal_lm(VARLEN, **window), tiny_causal_lm("sdpa", **window)
    rows = packed_rows([9, 3, 12])
    cu = rows["cu"]
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 12, "max_length_k": 12}
    with torch.no_grad():
        packed = packed_model(
            input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False,
            **(kwargs if boundaries == "cu_seq_lens" else {}),
        ).logits[0]  # fmt: skip
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = alone_model(input_ids=rows["input_ids"][:, a:b], use_cache=False).logits[0]
            torch.testing.assert_close(packed[a:b], alone, atol=1e-5, rtol=1e-5)
    assert calls == [(3, 0), (3, 0)]  # both layers, W = 4 keys: three before and the query


def test_mmpack_varlen_without_boundaries_would_leak(varlen_kernel):
    """The control: one row without sequences is one sample, so later samples see earlier ones."""
    varlen_kernel(reference_varlen_attn)
    model = tiny_causal_lm(VARLEN)
    rows = packed_rows([9, 3, 12])
    with torch.no_grad():
        right = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False)
        wrong = model(input_ids=rows["input_ids"], use_cache=False)
    assert (right.logits[0, 9:] - wrong.logits[0, 9:]).abs().max() > 1e-3
    torch.testing.assert_close(right.logits[0, :9], wrong.logits[0, :9], atol=1e-5, rtol=1e-5)


def call(query, key=None, mask=None, **kwargs):
    module = torch.nn.Module()
    module.is_causal = True
    key = query if key is None else key
    return attention.varlen_attention_forward(module, query, key, key, mask, **kwargs)


@pytest.mark.parametrize(
    "key,mask,options,message",
    [
        (None, torch.ones(1, 4, dtype=torch.bool), {}, "padding mask .*'sdpa'"),
        (None, torch.zeros(1, 1, 4, 4), {}, "padding mask .*'sdpa'"),
        (None, None, {"dropout": 0.1}, "dropout 0.1"),
        (None, None, {"softcap": 50.0}, "soft-capping"),
        (torch.zeros(1, 2, 9, 8), None, {}, "KV cache"),
        (None, None, {"is_causal": False, "sliding_window": 4}, "sliding window on bidirectional"),
    ],
)  # fmt: skip
def test_mmpack_varlen_refuses_what_no_varlen_kernel_computes(varlen_kernel, key, mask, options, message):
    varlen_kernel(reference_varlen_attn)
    with pytest.raises(PackingUnsupported, match=message):
        call(torch.zeros(1, 2, 4, 8), key, mask, **options)


def test_mmpack_varlen_computes_a_layer_handed_a_bool_mask_of_the_row_with_sdpa(varlen_kernel):
    """Gemma 4's sliding layers under mmpack_varlen (``model_masks`` leaves them their bool masks):
    SDPA with that mask, exactly."""
    varlen_kernel(reference_varlen_attn)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 6, 8, generator=generator) for _ in range(3))
    allowed = torch.rand(1, 1, 6, 6, generator=generator) > 0.4
    allowed |= torch.eye(6, dtype=torch.bool)
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = attention.varlen_attention_forward(module, query, key, value, allowed, scaling=0.5)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(got, expected)


# -- Gemma 3's masks, in the form of the attention in use ---------------------------------------

SOFT, GEMMA_WINDOW = 262144, 64


def gemma3_bin(lengths_and_images: list[tuple[int, int]]) -> dict:
    """A Gemma 3 bin by hand: per sample, ``text`` tokens then one image of 256 soft tokens at
    ``image`` (its start), labels on the text."""
    ids, media, cu = [], [], [0]
    generator = torch.Generator().manual_seed(3)
    for length, image in lengths_and_images:
        sample = torch.randint(300, 5000, (length,), generator=generator)
        sample[image : image + 256] = SOFT
        ids.append(sample)
        media.append(sample == SOFT)
        cu.append(cu[-1] + length)
    ids_ = torch.cat(ids)
    labels = torch.where(ids_ == SOFT, -100, ids_)
    return {
        "input_ids": ids_, "labels": labels, "media_token_mask": torch.cat(media),
        "position_ids": torch.cat([torch.arange(n) for n, _ in lengths_and_images]),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": max(n for n, _ in lengths_and_images),
        "sample_ids": [f"s{i}" for i in range(len(lengths_and_images))], "sliding_window": GEMMA_WINDOW,
        "pixel_values": torch.zeros(len(lengths_and_images), 3, 896, 896),
    }  # fmt: skip


def transformers_masks(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The masks transformers hands Gemma 3's decoder layers for ``ids`` alone (its processor's
    ``token_type_ids``), by layer type."""
    seen = {}
    layers = model.model.language_model.layers
    types = model.config.text_config.layer_types

    def hook(index):
        def record(module, args, kwargs):
            seen.setdefault(types[index], kwargs["attention_mask"])

        return record

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(
                input_ids=ids[None], token_type_ids=(ids == SOFT).long()[None], use_cache=False,
                pixel_values=torch.zeros(1, 3, 896, 896, dtype=model.dtype),
            )  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention_name", ["sdpa", "eager"])
def test_gemma3_masks_are_what_transformers_builds_for_each_sample(attention_name, dtype):
    """Per sample (two of them, longer than the sliding window, an image each), the packed masks
    in the model's form equal in dtype and value the masks transformers builds for it alone:
    bool for SDPA, additive in the model's dtype for eager; nothing across samples."""
    from tests.models.build import tiny_models

    model = tiny_models().tiny_model("gemma3", seed=1, attn_implementation=attention_name).to(dtype)
    batch = collate_packed([gemma3_bin([(300, 20), (280, 5)])])
    masks = with_model_masks(batch, model)["attention_mask"]
    assert batch["attention_mask"]["full_attention"].dtype == torch.bool  # collated: SDPA's form
    cu = batch.meta["cu_seq_lens"]
    for a, b in itertools.pairwise(cu):
        theirs = transformers_masks(model, batch["input_ids"][0, a:b])
        for kind in ("full_attention", "sliding_attention"):
            mine = masks[kind]
            assert mine.dtype == theirs[kind].dtype == (torch.bool if attention_name == "sdpa" else dtype)
            assert torch.equal(mine[..., a:b, a:b], theirs[kind])
            blocked = False if mine.dtype == torch.bool else torch.finfo(dtype).min
            assert (mine[..., a:b, :a] == blocked).all() and (mine[..., a:b, b:] == blocked).all()
    assert not torch.equal(masks["full_attention"], masks["sliding_attention"])


@pytest.mark.parametrize("attention_name", [VARLEN, "flash_attention_2", "flex_attention"])
def test_gemma3_masks_are_refused_for_an_attention_that_cannot_take_them(attention_name):
    masks = collate_packed([gemma3_bin([(300, 20)])])["attention_mask"]
    with pytest.raises(PackingUnsupported, match="use 'sdpa' or 'eager'"):
        attention.model_masks(masks, attention_name, torch.bfloat16)


# -- vision towers in one varlen call a layer ------------------------------------------------------


def vision_inputs(model) -> tuple:
    """Five images for ``model``'s vision tower, as its processor hands them over: Qwen-VL's
    patches of three grids (one of two frames), InternVL's tiles, LLaVA-OneVision's crops."""
    vision = model.config.vision_config
    generator = torch.Generator().manual_seed(4)
    if hasattr(vision, "temporal_patch_size"):
        grid = torch.tensor([[1, 4, 4], [2, 4, 8], [1, 8, 4]])
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return torch.randn(int(grid.prod(-1).sum()), width, generator=generator), grid
    size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
    return (torch.randn(5, 3, size, size, generator=generator),)


def run_tower(model, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        if len(inputs) == 2:
            out = model.model.visual(inputs[0], grid_thw=inputs[1])
        elif model.config.model_type == "internvl":
            return model.model.get_image_features(inputs[0]).pooler_output
        else:
            out = model.model.vision_tower(inputs[0])
    return out.last_hidden_state


@pytest.mark.parametrize(
    "model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "llava_onevision"]
)
def test_vision_towers_attend_over_all_images_in_one_varlen_call_a_layer(varlen_kernel, model_type):
    """Under ``use_attention(model, "mmpack_varlen")`` every vision layer calls the kernel once for
    all of the images, each image (frame) its own sequence, and the tower's output is SDPA's.
    A Qwen-VL tower gets its one-call name (transformers would loop over the images otherwise)."""
    from tests.models.build import tiny_models

    calls = []

    def kernel(*args, **options):
        calls.append((args[3].tolist(), options["window_size"]))
        return reference_varlen_attn(*args, **options)

    varlen_kernel(kernel)
    model = tiny_models().tiny_model(model_type, seed=2)
    inputs = vision_inputs(model)
    expected = run_tower(model, inputs)
    assert attention.use_attention(model, VARLEN) == VARLEN
    qwen = len(inputs) == 2
    tower_name = attention.VISION_VARLEN if qwen else VARLEN
    assert model.config.vision_config._attn_implementation == tower_name
    assert model.config.text_config._attn_implementation == VARLEN
    got = run_tower(model, inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    vision = model.config.vision_config
    layers = getattr(vision, "depth", None) or vision.num_hidden_layers
    assert len(calls) == layers and all(window == (-1, -1) for _, window in calls)
    if qwen:  # each frame its own sequence of h·w patches (Qwen2.5-VL's window layers: windows of them)
        frames = [0, 16, 48, 80, 112]
        assert any(cu == frames for cu, _ in calls)
    else:
        assert all(len(cu) == 6 for cu, _ in calls)  # five tiles or crops, rows of one call
