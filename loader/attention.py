"""Attention over packed sequences: each sample attends only to itself.

``varlen_attention`` calls flash-attn's varlen kernel when flash-attn and CUDA are there;
otherwise PyTorch's scaled_dot_product_attention with a block-diagonal mask (CPU too).
Tensors use flash-attn's layout: q [T, heads, dim], k/v [T, kv_heads, dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_diagonal_mask(
    cu_seqlens: torch.Tensor, causal: bool = True, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[T, T] additive mask: 0 where query i may attend key j (same sample, and j <= i if
    causal), -inf elsewhere. Additive, so it blocks whether it is added to the scores
    (eager attention) or passed to SDPA; every row keeps its diagonal, so no row is empty."""
    total = int(cu_seqlens[-1])
    lengths = torch.diff(cu_seqlens.long())
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    allowed = sample[:, None] == sample[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
    mask = torch.zeros(total, total, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def media_block_masks(
    cu_seqlens: torch.Tensor,
    media_tokens: torch.Tensor,
    sliding_window: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Gemma 3's attention masks of a packed row, by layer type: [1, 1, T, T] additive (0 or the
    dtype's minimum; eager adds them, SDPA takes them). A query sees a key of its own sample that
    is not after it, or any key of its own image (a run of ``media_tokens``: bidirectional);
    ``sliding_attention`` also needs the key within ``sliding_window`` tokens before the query
    (transformers' ``sliding_window_overlay``: key > query - window).

    transformers 5.24 builds the full-attention mask of a packed row right, but remaps its
    sliding layers' image blocks by position ids, so every sample after the first gets the
    first sample's blocks (tests/integration/test_gemma3.py shows it); these masks are what it
    builds for each sample alone, side by side."""
    total = int(cu_seqlens[-1])
    lengths = torch.diff(cu_seqlens.long())
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = media_tokens & ~torch.nn.functional.pad(media_tokens[:-1], (1, 0), value=False)
    block = torch.where(media_tokens, torch.cumsum(starts, 0), 0)  # 0: not an image token
    index = torch.arange(total)
    allowed = (sample[:, None] == sample[None, :]) & (
        (index[None, :] <= index[:, None]) | ((block[:, None] == block[None, :]) & (block[:, None] > 0))
    )
    full = _additive(allowed, dtype)
    if int(lengths.max()) <= sliding_window:  # no sample reaches past its window: the same mask
        return {"full_attention": full, "sliding_attention": full}
    near = index[None, :] > index[:, None] - sliding_window
    return {"full_attention": full, "sliding_attention": _additive(allowed & near, dtype)}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of packed samples, [T, heads, dim]; equal to attending each sample alone."""
    flash = _flash_varlen() if q.is_cuda else None
    if flash is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return flash(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal, softmax_scale=softmax_scale)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head across its query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = block_diagonal_mask(cu_seqlens.to(q.device), causal, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=softmax_scale,
    )
    return out[0].transpose(0, 1)
