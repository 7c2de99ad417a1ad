"""The exact varlen attention kernels of this machine, resolved once and called one way.

Every kernel here is called as torch 2.12+'s ``varlen_attn`` is::

    kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa) -> out

q [T, H, D], k/v [T, Hkv, D] (H % Hkv == 0), ``cu_*`` int32 on the device, ``max_*`` Python ints,
``window_size = (left, right)`` with -1 unbounded: (-1, 0) causal, (W - 1, 0) a causal window of W
keys, (-1, -1) bidirectional. ``resolve_kernels`` lists what this machine has, fastest first:

1. flash-attn-4 (``flash_attn.cute.flash_attn_varlen_func``; its backward needs sm90+, so only
   there). Called directly: torch 2.10-2.13's ``activate_flash_attention_impl("FA4")`` unpacks
   two values where flash-attn-4 >= 4.0.0b19 returns more.
2. flash-attn 2 (``flash_attn.flash_attn_varlen_func``), when the user built or installed it.
3. torch's FlashAttention-2, every torch >= 2.4, nothing to build: ``torch.nn.attention.varlen.
   varlen_attn`` by its release's signature (2.10: ``is_causal``, no scale or window; 2.11: ``scale``
   and ``window_size``, GQA native; 2.12+: ``enable_gqa`` too), else the op under it,
   ``aten._flash_attention_forward`` (same schema 2.4-2.11, 2.12+ add optional arguments;
   differentiable in every release from 2.4.1, derivatives.yaml).

The facts are read from the released wheels (shared/research/varlen-attention.md); every
adapter is checked against fakes with exactly those signatures (tests/loader/test_varlen_kernels.py).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

Kernel = Callable[..., torch.Tensor]  # the calling convention above
Window = tuple[int, int]
CAUSAL: Window = (-1, 0)
BIDIRECTIONAL: Window = (-1, -1)


@dataclass(frozen=True)
class VarlenKernel:
    """One exact kernel: what it is, how to call it, why it was taken, the head dims it takes."""

    name: str
    call: Kernel
    why: str
    takes_head_dim: Callable[[int], bool]


def fa2_head_dim(dim: int) -> bool:
    """FlashAttention-2 (torch's and flash-attn's): multiples of 8 up to 256."""
    return 8 <= dim <= 256 and dim % 8 == 0


def fa4_head_dim(major: int) -> Callable[[int], bool]:
    """flash-attn-4's ``_validate_head_dims`` for equal q and v head dims: sm90 up to 256, sm100/110
    up to 128 or exactly 256, sm120 unchecked; multiples of 8 (its bf16/fp16 alignment)."""

    def takes(dim: int) -> bool:
        if dim < 8 or dim % 8:
            return False
        return dim <= 256 if major in (9, 12) else dim <= 128 or dim == 256

    return takes


# -- what is installed (tests replace these) --------------------------------------------------------


def _fa4_function() -> Callable[..., Any] | None:
    """flash-attn-4's varlen function, or None."""
    return _installed_function("flash-attn-4", "flash_attn.cute")


def _flash_attn_function() -> Callable[..., Any] | None:
    """flash-attn 2's varlen function, or None (flash-attn-4 shares the ``flash_attn`` namespace
    without this function: the distribution decides)."""
    return _installed_function("flash-attn", "flash_attn")


def _installed_function(distribution: str, module: str) -> Callable[..., Any] | None:
    """``module.flash_attn_varlen_func`` where ``distribution`` is installed and imports."""
    try:
        metadata.version(distribution)
        return importlib.import_module(module).flash_attn_varlen_func
    except (metadata.PackageNotFoundError, ImportError, AttributeError):
        return None


def _torch_varlen_attn() -> Callable[..., Any] | None:
    """``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _aten_flash_forward() -> Callable[..., Any] | None:
    """``aten._flash_attention_forward`` where it takes windows (torch 2.4+), or None."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "window_size_left" not in str(op.default._schema):
        return None
    return op


def _distribution(name: str) -> str:
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


# -- adapters: the calling convention onto each kernel ------------------------------------------------


def _aten_kernel(op: Callable[..., Any]) -> Kernel:
    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
        left, right = window_size
        causal = tuple(window_size) == CAUSAL  # as varlen_attn passes it: a window is not causal
        return op(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )[0]  # fmt: skip

    return call


def _torch_kernel(varlen_attn: Callable[..., Any], aten: Kernel | None) -> tuple[Kernel, str] | None:
    """An adapter onto ``varlen_attn`` by its parameters, and the signature it was read as; None
    for a signature none of the releases had (the op under it is called instead)."""
    params = set(inspect.signature(varlen_attn).parameters)
    if "enable_gqa" in params:  # 2.12-2.15: raises without the flag when Hq != Hkv

        def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
            return varlen_attn(
                q, k, v, cu_q, cu_k, max_q, max_k,
                scale=scale, window_size=tuple(window_size), enable_gqa=k.shape[1] != q.shape[1],
            )  # fmt: skip

        return call, "2.12+ (scale, window_size, enable_gqa)"
    if "window_size" in params:  # 2.11: GQA native; causal only as the tuple (-1, 0)

        def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
            return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=tuple(window_size))

        return call, "2.11 (scale, window_size)"
    if "is_causal" in params and aten is not None:  # 2.10: the default scale, causal or not, only

        def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
            default_scale = scale is None or math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-12)
            if default_scale and tuple(window_size) in (CAUSAL, BIDIRECTIONAL):
                causal = tuple(window_size) == CAUSAL
                return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal)
            return aten(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

        return call, "2.10 (is_causal; other scales and windows on the op under it)"
    return None


def _flash_attn_kernel(function: Callable[..., Any]) -> Kernel:
    """flash-attn 2: -1 unbounded; ``causal`` with (W - 1, 0) is a causal window of W keys."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
        left, right = window_size
        return function(
            q, k, v, cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=right == 0, window_size=(left, right),
        )  # fmt: skip

    return call


def _fa4_kernel(function: Callable[..., Any]) -> Kernel:
    """flash-attn-4: None unbounded (its (-1, 0) would mean no mask at all); returns (out, lse)."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=CAUSAL, enable_gqa=False):
        left, right = window_size
        out, _ = function(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=tuple(window_size) == CAUSAL,
            window_size=(None if left < 0 else left, None if right < 0 else right),
        )  # fmt: skip
        return out

    return call


# -- resolution -----------------------------------------------------------------------------------


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without CUDA."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def resolve_kernels(capability: tuple[int, int] | None) -> list[VarlenKernel]:
    """The exact varlen kernels for a device of ``capability`` (None: no CUDA, so none), fastest
    first. A call takes the first whose head dims fit."""
    if capability is None or capability[0] < 8:  # every FlashAttention kernel needs sm80+
        return []
    major = capability[0]
    sm = f"sm{major}{capability[1]}"
    kernels = []
    if major >= 9 and (fa4 := _fa4_function()) is not None:
        why = f"flash-attn-4 is installed and trains on {sm} (its backward needs sm90+)"
        name = _distribution("flash-attn-4")
        kernels.append(VarlenKernel(name, _fa4_kernel(fa4), why, fa4_head_dim(major)))
    if (fa2 := _flash_attn_function()) is not None:
        why = "the flash-attn package is installed"
        kernels.append(VarlenKernel(_distribution("flash-attn"), _flash_attn_kernel(fa2), why, fa2_head_dim))
    op = _aten_flash_forward()
    aten = _aten_kernel(op) if op is not None else None
    torch_version = f"torch {torch.__version__}"
    varlen_attn = _torch_varlen_attn()
    adapter = _torch_kernel(varlen_attn, aten) if varlen_attn is not None else None
    if adapter is not None:
        why = f"{torch_version}'s own FlashAttention-2, called by its {adapter[1]} signature"
        kernels.append(VarlenKernel("torch.nn.attention.varlen.varlen_attn", adapter[0], why, fa2_head_dim))
    elif aten is not None:
        why = f"{torch_version} has no varlen_attn of a known signature: the FlashAttention-2 op (2.4+)"
        kernels.append(VarlenKernel("aten._flash_attention_forward", aten, why, fa2_head_dim))
    return kernels


def aten_flash_kernel() -> VarlenKernel | None:
    """The FlashAttention-2 op itself (torch 2.4+), or None: what ``resolve_kernels`` calls where
    torch has no ``varlen_attn`` of a known signature (2.4-2.9), for a GPU check beside it."""
    op = _aten_flash_forward()
    if op is None:
        return None
    why = f"torch {torch.__version__}'s FlashAttention-2 op (2.4+), called directly"
    return VarlenKernel("aten._flash_attention_forward", _aten_kernel(op), why, fa2_head_dim)


def kernel_for(kernels: list[VarlenKernel], head_dim: int) -> VarlenKernel | None:
    """The first of ``kernels`` that takes ``head_dim``."""
    return next((kernel for kernel in kernels if kernel.takes_head_dim(head_dim)), None)
