"""mmpack_varlen's kernels: resolved per machine, each called with the arguments its release takes.

The fakes below have exactly the released signatures (torch 2.10, 2.11, 2.12-2.15 ``varlen_attn``;
``aten._flash_attention_forward`` 2.4-2.11; flash-attn 2.7/2.8 and flash-attn-4 4.0.0b27
``flash_attn_varlen_func``; shared/research/varlen-attention.md) and compute what the released
kernel computes from those arguments on the CPU reference, so a wrong argument is either a
TypeError (binding) or a wrong number. The real aten op runs on meta tensors: its autograd and
what it saves for the backward."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from loader import attention, varlen_kernels
from loader.attention import reference_varlen_attn
from loader.hybrid import PackingUnsupported
from loader.varlen_kernels import fa4_head_dim, kernel_for, resolve_kernels

CALLS: list[tuple[str, dict[str, Any]]] = []  # (which fake, its keyword arguments as bound)


def per_sequence(q, k, v, cu, window, scale=None):
    """Each sequence of ``cu`` alone, SDPA with its (left, right) window as a mask."""
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        n = b - a
        offset = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        allowed = torch.ones(n, n, dtype=torch.bool)
        if window[0] >= 0:
            allowed &= offset >= -window[0]
        if window[1] >= 0:
            allowed &= offset <= window[1]
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
        vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], dim=1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def computed(q, k, v, cu, window, scale=None):
    """What a FlashAttention kernel computes (GQA native), on the CPU reference."""
    return reference_varlen_attn(q, k, v, cu, cu, 0, 0, scale=scale, window_size=window, enable_gqa=True)


# -- fakes with the released signatures ------------------------------------------------------------


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    CALLS.append(("2.10", {"is_causal": is_causal}))
    return computed(query, key, value, cu_seq_q, (-1, 0) if is_causal else (-1, -1))


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    CALLS.append(("2.11", {"scale": scale, "window_size": window_size}))
    return computed(query, key, value, cu_seq_q, tuple(window_size), scale)


def varlen_attn_2_12(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    CALLS.append(("2.12", {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa}))
    if query.shape[1] != key.shape[1] and not enable_gqa:  # as released: 2.12+ raise without the flag
        raise ValueError("... Try setting enable_gqa=True for GQA.")
    return computed(query, key, value, cu_seq_q, tuple(window_size), scale)


def aten_flash_attention_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
    scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
):  # fmt: skip
    CALLS.append(("aten", {
        "dropout_p": dropout_p, "is_causal": is_causal, "return_debug_mask": return_debug_mask,
        "scale": scale, "window": (window_size_left, window_size_right),
    }))  # fmt: skip
    left = -1 if window_size_left is None else window_size_left
    right = 0 if is_causal else -1 if window_size_right is None else window_size_right
    out = computed(query, key, value, cum_seq_q, (left, right), scale)
    return out, None, None, None, None


def flash_attn_2_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    CALLS.append(("flash-attn", {"causal": causal, "window_size": window_size, "dropout_p": dropout_p}))
    left, right = window_size
    return computed(q, k, v, cu_seqlens_q, (left, 0 if causal else right), softmax_scale)


def flash_attn_4_varlen(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
    softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
    num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
    block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
):  # fmt: skip
    """flash-attn-4's normalisation (interface.py ``_resolve_causal_local_window``): None is
    unbounded; a window whose sides sum below 0 is no window at all."""
    CALLS.append(("flash-attn-4", {"causal": causal, "window_size": window_size}))
    left, right = window_size
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    out = computed(q, k, v, cu_seqlens_q, (-1 if left is None else left, -1 if right is None else right),
                   softmax_scale)  # fmt: skip
    return out, None


RELEASES = {  # torch release -> (its varlen_attn, or None before 2.10)
    "2.4-2.9": None,
    "2.10": varlen_attn_2_10,
    "2.11": varlen_attn_2_11,
    "2.12-2.15": varlen_attn_2_12,
}


@pytest.fixture
def torch_release(monkeypatch):
    """``torch_release("2.11")``: resolution reads that release's varlen_attn and the aten op."""

    def release(name: str) -> None:
        monkeypatch.setattr(varlen_kernels, "_torch_varlen_attn", lambda: RELEASES[name])
        monkeypatch.setattr(varlen_kernels, "_aten_flash_forward", lambda: aten_flash_attention_forward)
        monkeypatch.setattr(varlen_kernels, "_fa4_function", lambda: None)
        monkeypatch.setattr(varlen_kernels, "_flash_attn_function", lambda: None)

    return release


def packed(kv_heads: int = 2, dim: int = 16):
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 8, 20, 31], dtype=torch.int32)
    q = torch.randn(31, 4, dim)
    return q, torch.randn(31, kv_heads, dim), torch.randn(31, kv_heads, dim), cu


CASES = {  # name -> (window, scale)
    "causal": ((-1, 0), None),
    "causal, the model's own scale": ((-1, 0), 16**-0.5),
    "causal, another scale": ((-1, 0), 0.3),
    "a causal window of 4 keys": ((3, 0), None),
    "bidirectional": ((-1, -1), None),
}
EXPECTED_CALL = {  # (release, case) -> (which fake, its arguments); scale 0.3 and windows on 2.10 go to aten
    ("2.10", "causal"): ("2.10", {"is_causal": True}),
    ("2.10", "causal, the model's own scale"): ("2.10", {"is_causal": True}),
    ("2.10", "bidirectional"): ("2.10", {"is_causal": False}),
}


def expected_call(release: str, case: str, kv_heads: int) -> tuple[str, dict[str, Any]]:
    window, scale = CASES[case]
    if (release, case) in EXPECTED_CALL:
        return EXPECTED_CALL[release, case]
    if release == "2.11":
        return "2.11", {"scale": scale, "window_size": window}
    if release == "2.12-2.15":
        return "2.12", {"scale": scale, "window_size": window, "enable_gqa": kv_heads != 4}
    aten = {"dropout_p": 0.0, "is_causal": window == (-1, 0), "return_debug_mask": False}
    return "aten", {**aten, "scale": scale, "window": window}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("release", list(RELEASES))
def test_each_torch_release_is_called_by_its_own_signature(torch_release, release, case, kv_heads):
    """On an H100 with each torch release: torch's FlashAttention-2 is the one kernel, called as
    that release takes it (a tuple window; enable_gqa only where it exists; scale only where it is
    accepted; 2.10 only with the default scale, causal or not), and computes each sequence alone."""
    torch_release(release)
    kernels = resolve_kernels((9, 0))
    assert len(kernels) == 1
    expected_name = "aten._flash_attention_forward" if release == "2.4-2.9" else "varlen.varlen_attn"
    assert kernels[0].name.endswith(expected_name)
    q, k, v, cu = packed(kv_heads)
    window, scale = CASES[case]
    CALLS.clear()
    out = kernels[0].call(q, k, v, cu, cu, 12, 12, scale=scale, window_size=window, enable_gqa=kv_heads != 4)
    assert [expected_call(release, case, kv_heads)] == CALLS
    assert all(type(args["window_size"]) is tuple for _, args in CALLS if "window_size" in args)
    torch.testing.assert_close(out, per_sequence(q, k, v, cu, window, scale), atol=1e-6, rtol=1e-6)


def test_a_varlen_attn_of_an_unknown_signature_leaves_the_op_under_it(monkeypatch, torch_release):
    """A future release whose signature none of the known ones had: the aten op, not a crash."""
    torch_release("2.11")
    monkeypatch.setattr(varlen_kernels, "_torch_varlen_attn", lambda: lambda query, key, value, *, spec: None)
    kernels = resolve_kernels((9, 0))
    assert [kernel.name for kernel in kernels] == ["aten._flash_attention_forward"]
    assert "no varlen_attn of a known signature" in kernels[0].why


def test_a_window_given_as_a_list_still_reaches_torch_as_a_tuple(torch_release):
    """2.11+ find causal by ``window_size == (-1, 0)``: a list would silently not be causal."""
    torch_release("2.11")
    q, k, v, cu = packed()
    CALLS.clear()
    resolve_kernels((9, 0))[0].call(q, k, v, cu, cu, 12, 12, window_size=[-1, 0])
    assert CALLS[0][1]["window_size"] == (-1, 0) and type(CALLS[0][1]["window_size"]) is tuple


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("package", ["flash-attn-4", "flash-attn"])
def test_the_flash_attn_packages_are_called_as_they_take_windows(monkeypatch, torch_release, package, case):
    """flash-attn: -1 unbounded, ``causal`` with (W - 1, 0); flash-attn-4: None unbounded (its (-1,
    0) would be no mask at all), a tuple back."""
    torch_release("2.11")
    fake = flash_attn_4_varlen if package == "flash-attn-4" else flash_attn_2_varlen
    function = "_fa4_function" if package == "flash-attn-4" else "_flash_attn_function"
    monkeypatch.setattr(varlen_kernels, function, lambda: fake)
    kernels = resolve_kernels((9, 0))
    assert kernels[0].name.startswith(package) and len(kernels) == 2
    q, k, v, cu = packed()
    window, scale = CASES[case]
    CALLS.clear()
    out = kernels[0].call(q, k, v, cu, cu, 12, 12, scale=scale, window_size=window)
    assert [name for name, _ in CALLS] == [package]
    if package == "flash-attn-4":
        assert all(side is None or side >= 0 for side in CALLS[0][1]["window_size"])
    torch.testing.assert_close(out, per_sequence(q, k, v, cu, window, scale), atol=1e-6, rtol=1e-6)


def test_resolution_order_and_the_gpus_each_kernel_needs(monkeypatch, torch_release):
    torch_release("2.12-2.15")
    monkeypatch.setattr(varlen_kernels, "_fa4_function", lambda: flash_attn_4_varlen)
    monkeypatch.setattr(varlen_kernels, "_flash_attn_function", lambda: flash_attn_2_varlen)

    def names(capability):
        return [kernel.name.split()[0] for kernel in resolve_kernels(capability)]

    torch_name = "torch.nn.attention.varlen.varlen_attn"
    assert names((9, 0)) == ["flash-attn-4", "flash-attn", torch_name]
    assert names((10, 0)) == ["flash-attn-4", "flash-attn", torch_name]
    assert names((8, 0)) == ["flash-attn", torch_name]  # flash-attn-4's backward needs sm90+
    assert names((7, 5)) == [] and names(None) == []  # FlashAttention needs sm80+


def test_a_head_dim_one_kernel_lacks_goes_to_the_next(monkeypatch, torch_release):
    """flash-attn-4 on sm100 takes head dims up to 128 (or 256); 192 goes to torch's kernel; 264
    to none."""
    torch_release("2.11")
    monkeypatch.setattr(varlen_kernels, "_fa4_function", lambda: flash_attn_4_varlen)
    kernels = resolve_kernels((10, 0))
    assert kernel_for(kernels, 128).name.startswith("flash-attn-4")
    assert kernel_for(kernels, 192).name == "torch.nn.attention.varlen.varlen_attn"
    assert kernel_for(kernels, 264) is None and kernel_for(kernels, 12) is None
    assert fa4_head_dim(9)(256) and not fa4_head_dim(10)(192) and fa4_head_dim(10)(256)


def test_the_aten_op_on_meta_tensors_is_differentiable_with_gqa():
    """The real ``aten._flash_attention_forward`` (this torch), through its adapter: the output
    carries FlashAttentionBackward0, which saved the adapter's arguments, and the gradients of K and
    V have the KV heads (GQA summed back)."""
    kernel = varlen_kernels.aten_flash_kernel()  # what gpu_check runs beside varlen_attn
    assert kernel is not None and kernel.name == "aten._flash_attention_forward"
    call = kernel.call
    q = torch.randn(64, 8, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(64, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device="meta")
    for window, scale, causal in (((-1, 0), None, True), ((3, 0), 0.1, False), ((-1, -1), None, False)):
        out = call(q, k, v, cu, cu, 44, 44, scale=scale, window_size=window)
        saved = out.grad_fn
        assert type(saved).__name__ == "FlashAttentionBackward0"
        assert saved._saved_is_causal is causal and saved._saved_dropout_p == 0.0
        sides = (saved._saved_window_size_left, saved._saved_window_size_right)
        assert tuple(side - 2**64 if side >= 2**63 else side for side in sides) == window  # -1 read unsigned
        assert saved._saved_scale == scale and saved._saved_max_q == 44
    out.sum().backward()
    assert q.grad.shape == (64, 8, 64) and k.grad.shape == v.grad.shape == (64, 2, 64)


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (3, 0)])
def test_the_reference_kernel_equals_each_sequence_alone(window):
    q, k, v, cu = packed()
    got = reference_varlen_attn(q, k, v, cu, cu, 12, 12, window_size=window, enable_gqa=True)
    torch.testing.assert_close(got, per_sequence(q, k, v, cu, window), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_varlen_attn(q, k, v, cu, cu, 12, 12)


def test_mmpack_varlen_runs_the_resolved_kernel_and_reports_it(fake_gpu, torch_release, monkeypatch):
    """Registered on a (faked) H100 with torch 2.11: the report names the kernel and the reason;
    a call refuses CPU tensors (the kernels run on CUDA), float32 and a head dim none takes,
    naming SDPA; a GPU older than sm80 has no kernel."""
    fake_gpu((9, 0))
    torch_release("2.11")
    attention.register_varlen()
    report = attention.varlen_report()
    assert "torch.nn.attention.varlen.varlen_attn" in report and "2.11 (scale, window_size)" in report
    assert "sm90" in report
    module = torch.nn.Module()
    module.is_causal = True
    for query, message in (
        (torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16), "CUDA only"),
        (torch.zeros(1, 2, 4, 8), "float16 or bfloat16, not torch.float32"),
        (torch.zeros(1, 2, 4, 12, dtype=torch.bfloat16), "multiples of 8 up to 256, not 12"),
    ):
        with pytest.raises(PackingUnsupported, match=f"{message}.*'sdpa'"):
            attention.varlen_attention_forward(module, query, query, query, None)
    fake_gpu((7, 5))
    attention.register_varlen()
    assert "no FlashAttention kernel for this GPU" in attention.varlen_report()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.raises(PackingUnsupported, match=r"sm75; they need sm80\+"):
        query = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
        attention.varlen_attention_forward(module, query, query, query, None)


def test_auto_picks_mmpack_varlen_where_an_exact_kernel_runs(fake_gpu):
    assert attention.choose_attention("auto", "qwen2_vl") == "sdpa"  # this machine: no CUDA
    assert attention.choose_attention("eager", "qwen2_vl") == "eager"
    fake_gpu((9, 0))
    assert attention.choose_attention("auto", "qwen2_vl") == attention.VARLEN
    assert attention._STATE["kernel"] is None and attention._STATE["kernels"]  # the real kernels
    assert attention.choose_attention("auto", "qwen2_vl", torch.float32) == "sdpa"  # they take halves
    assert attention.choose_attention("auto", "gemma3") == "sdpa"  # masks: bidirectional image blocks
    fake_gpu((7, 5))
    assert attention.choose_attention("auto", "internvl") == "sdpa"  # no FlashAttention on sm75
