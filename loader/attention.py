"""Attention over packed sequences: each sample attends only to itself.

- ``varlen_attention`` (hand-written models) calls the fastest exact varlen kernel of this
  machine on CUDA (``loader.varlen_kernels``); otherwise SDPA with a block-diagonal mask (CPU
  too). Tensors use flash-attn's layout: q [T, heads, dim], k/v [T, kv_heads, dim].
- ``register_varlen`` / ``choose_attention`` / ``use_attention``: ``mmpack_varlen``,
  transformers' attention on those kernels (flash-attn-4, flash-attn, else PyTorch's own
  FlashAttention-2 from torch 2.4 on: nothing to build), vision towers in one call a layer
  (``VISION_VARLEN``), refusing what it cannot compute exactly (``PackingUnsupported``);
  ``varlen_report`` says which kernel runs and why.
- ``media_block_masks`` / ``with_model_masks``: Gemma 3's per-layer-type masks of a packed row,
  in the form of the attention in use (bool for SDPA, additive in the model's dtype for eager).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from loader.hybrid import PackingUnsupported
from loader.varlen_kernels import (
    BIDIRECTIONAL,
    CAUSAL,
    Kernel,
    cuda_capability,
    fa2_head_dim,
    kernel_for,
    resolve_kernels,
)


def sequence_mask(cu_seqlens: torch.Tensor, window: tuple[int, int] = (-1, 0)) -> torch.Tensor:
    """[T, T] bool: True where query i may attend key j. Both in the same sequence of
    ``cu_seqlens``, and ``i - left <= j <= i + right`` for ``window = (left, right)``, -1 meaning
    unbounded: (-1, 0) causal, (-1, -1) bidirectional, (W - 1, 0) a causal sliding window of W keys
    (flash-attn's convention). Every row keeps its diagonal, so no row is empty."""
    total = int(cu_seqlens[-1])
    lengths = torch.diff(cu_seqlens.long())
    device = cu_seqlens.device
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    allowed = sample[:, None] == sample[None, :]
    offset = torch.arange(total, device=device)[None, :] - torch.arange(total, device=device)[:, None]
    left, right = window
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed


def block_diagonal_mask(
    cu_seqlens: torch.Tensor, causal: bool = True, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[T, T] additive mask: 0 where query i may attend key j (same sample, and j <= i if
    causal), -inf elsewhere. Additive, so it blocks whether it is added to the scores
    (eager attention) or passed to SDPA; every row keeps its diagonal, so no row is empty."""
    allowed = sequence_mask(cu_seqlens, (-1, 0) if causal else (-1, -1))
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def media_block_masks(
    cu_seqlens: torch.Tensor, media_tokens: torch.Tensor, sliding_window: int, on_global_layers: bool = True
) -> dict[str, torch.Tensor]:
    """The attention masks of a packed row whose image tokens attend within their image, by
    layer type: [1, 1, T, T] bool, True where a query may attend a key (what transformers builds
    for SDPA; ``model_masks`` gives other attentions theirs). A query sees a key of its own
    sample that is not after it, or any key of its own image (a run of ``media_tokens``:
    bidirectional); ``sliding_attention`` also needs the key within ``sliding_window`` tokens
    before the query (transformers' ``sliding_window_overlay``: key > query - window). Gemma 3
    has the image blocks on every layer; Gemma 4 (``on_global_layers=False``) on sliding layers
    only, its full-attention layers causal (``create_masks_for_vision_model``).

    transformers 5.24 builds the full-attention mask of a packed Gemma 3 row right, but remaps
    its sliding layers' image blocks by position ids, so every sample after the first gets the
    first sample's blocks (tests/integration/test_gemma3.py shows it); these masks are what it
    builds for each sample alone, side by side."""
    total = int(cu_seqlens[-1])
    lengths = torch.diff(cu_seqlens.long())
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = media_tokens & ~torch.nn.functional.pad(media_tokens[:-1], (1, 0), value=False)
    block = torch.where(media_tokens, torch.cumsum(starts, 0), 0)  # 0: not an image token
    index = torch.arange(total)
    same = sample[:, None] == sample[None, :]
    causal = same & (index[None, :] <= index[:, None])
    allowed = causal | (same & (block[:, None] == block[None, :]) & (block[:, None] > 0))
    full = (allowed if on_global_layers else causal)[None, None]
    if int(lengths.max()) <= sliding_window:  # no sample reaches past its window
        sliding = allowed[None, None]
    else:
        sliding = (allowed & (index[None, :] > index[:, None] - sliding_window))[None, None]
    return {"full_attention": full, "sliding_attention": sliding}


def model_masks(
    masks: dict[str, torch.Tensor],
    attn_implementation: str,
    dtype: torch.dtype,
    on_global_layers: bool = True,
) -> dict[str, torch.Tensor | None]:
    """``media_block_masks`` in the form ``attn_implementation`` takes, as transformers builds
    them: bool for SDPA, additive in the model's ``dtype`` (0 or its minimum) for eager. (A
    float32 additive mask handed to SDPA with a bf16 model gave NaN on CUDA.) Under
    ``mmpack_varlen``, layers whose masks are causal only (Gemma 4's full-attention layers:
    ``on_global_layers=False``) take none and run the varlen kernel; the sliding layers keep
    their bool masks (``varlen_attention_forward`` runs SDPA on them). Another attention that
    takes no mask (flash-attn), or ``mmpack_varlen`` with image blocks on every layer (Gemma 3),
    cannot keep the image blocks bidirectional: refused."""
    if attn_implementation == "sdpa":
        return dict(masks)
    if attn_implementation == "eager":
        return {kind: _additive(mask, dtype) for kind, mask in masks.items()}
    if attn_implementation == VARLEN and not on_global_layers:
        return {kind: None if kind == "full_attention" else mask for kind, mask in masks.items()}
    raise PackingUnsupported(
        f"packed batches whose image tokens attend within their image (Gemma 3) need attention masks: "
        f"attn_implementation={attn_implementation!r} cannot take mmpack's; use 'sdpa' or 'eager'"
    )


def with_model_masks(batch: Any, model: torch.nn.Module) -> Any:
    """``batch`` with its attention masks (Gemma 3 and 4: ``attention_mask`` by layer type) in the
    form ``model``'s text attention takes (``model_masks``); a batch without masks as it is."""
    masks = batch.get("attention_mask") if isinstance(batch, dict) else None
    if not isinstance(masks, dict):
        return batch
    model = getattr(model, "module", model)  # DDP
    config = getattr(model.config, "text_config", None) or model.config
    family = _family(model.config.model_type)
    on_global = family.media_blocks_on_global_layers if family is not None else True
    converted = model_masks(masks, config._attn_implementation, model.dtype, on_global)
    out = type(batch)({**batch, "attention_mask": converted})
    if hasattr(batch, "meta"):
        out.meta = dict(batch.meta)
    return out


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of packed samples, [T, heads, dim]; equal to attending each sample alone. On CUDA
    in half precision the fastest exact kernel of this machine (``loader.varlen_kernels``), else
    ``reference_varlen_attn`` (SDPA with a block-diagonal mask)."""
    window = CAUSAL if causal else BIDIRECTIONAL
    kernel = None
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kernel = kernel_for(_machine_kernels(), q.shape[-1])
    call = kernel.call if kernel is not None else reference_varlen_attn
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    lengths = (max_seqlen, max_seqlen)
    return call(q, k, v, cu, cu, *lengths, scale=softmax_scale, window_size=window, enable_gqa=True)


@functools.cache
def _machine_kernels() -> list:
    """This machine's kernels, resolved once for ``varlen_attention`` (a per-layer call)."""
    return resolve_kernels(cuda_capability())


# --- transformers' attention on the exact varlen kernels ------------------------------------------

VARLEN = "mmpack_varlen"  # the attn_implementation name ``register_varlen`` registers
# A vision tower's attention under mmpack_varlen. transformers' Qwen-VL vision attention takes its
# one-call varlen path (cu_seqlens) only for a name that reads as flash-attn's ("flash" in it) and
# loops over images otherwise; a name with "flash" fails ``set_attn_implementation`` at the top
# level (transformers 5.24 looks it up as a hub kernel) but is accepted for a vision sub-model,
# which is where ``use_attention`` puts it.
VISION_VARLEN = "mmpack_varlen_flash_vision"
# what mmpack_varlen runs on: ``kernels`` resolved by ``register_varlen`` (fastest first), or one
# ``kernel`` given to it (any device and dtype: ``reference_varlen_attn`` on a CPU)
_STATE: dict[str, Any] = {"registered": False, "kernel": None, "kernels": [], "capability": None}


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (the arguments ``mmpack_varlen`` passes) computed
    with SDPA and a [T, T] mask, on any device and dtype: the kernel's reference, for tests and
    CPU smoke runs (``register_varlen(kernel=reference_varlen_attn)``). O(T²) memory."""
    if not torch.equal(cu_seq_q, cu_seq_k):
        raise ValueError("reference_varlen_attn: queries and keys must share their sequences")
    if key.shape[1] != query.shape[1]:
        if not enable_gqa:
            raise ValueError(f"{query.shape[1]} query heads and {key.shape[1]} key heads need enable_gqa")
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    allowed = sequence_mask(cu_seq_q, tuple(window_size))
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (query, key, value)), attn_mask=allowed, scale=scale
    )
    return out[0].transpose(0, 1)


def register_varlen(kernel: Kernel | None = None) -> str:
    """Register ``mmpack_varlen`` (and ``VISION_VARLEN``) with transformers (mask function: none,
    as for flash-attn) and return the name, for ``from_pretrained(attn_implementation=...)``,
    ``model.set_attn_implementation`` or ``use_attention``. The kernels are resolved here, once
    (``loader.varlen_kernels.resolve_kernels``; ``varlen_report`` says which and why); ``kernel``
    replaces them (same signature: ``reference_varlen_attn`` runs on a CPU)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    capability = cuda_capability()
    kernels = [] if kernel is not None else resolve_kernels(capability)
    _STATE.update(registered=True, kernel=kernel, kernels=kernels, capability=capability)
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    AttentionInterface.register(VISION_VARLEN, vision_varlen_attention_forward)
    AttentionMaskInterface.register(VISION_VARLEN, flash_attention_mask)
    return VARLEN


def varlen_report() -> str:
    """What ``mmpack_varlen`` runs on here and why (the examples and ``PackedTrainer`` print it)."""
    if _STATE["kernel"] is not None:
        return f"mmpack_varlen: the given kernel {getattr(_STATE['kernel'], '__name__', _STATE['kernel'])}"
    capability = _STATE["capability"]
    where = f"torch {torch.__version__}"
    if capability is None:
        return f"mmpack_varlen on {where}: no CUDA device, so no kernel (it will refuse; use 'sdpa')"
    where += f", {torch.cuda.get_device_name()} (sm{capability[0]}{capability[1]})"
    kernels = _STATE["kernels"]
    if not kernels:
        return f"mmpack_varlen on {where}: no FlashAttention kernel for this GPU (sm80+); use 'sdpa'"
    lines = [f"mmpack_varlen on {where}: {kernels[0].name}: {kernels[0].why}"]
    lines += [f"  then, for head dims it lacks: {k.name}: {k.why}" for k in kernels[1:]]
    return "\n".join(lines)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface ([B, H, T, D] in, [B, T, H, D] out) on the varlen kernel.

    A causal call (the language model) takes the batch's sequences from ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` (what ``collate_packed`` hands over), else from ``position_ids`` restarting
    at 0 (InternVL's batches), else each row is one sequence. A bidirectional call (a vision
    tower's: InternVL's tiles, SigLIP's crops, a Qwen-VL tower run image by image) is one sequence
    per row: the text's boundaries passed on to it do not apply. GQA, causal sliding windows (W
    keys: window (W - 1, 0)). What the kernel cannot do exactly is refused (``PackingUnsupported``)."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if _is_block_mask(attention_mask, query):  # mmpack's own (model_masks): exact under SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal=False
        )
    _refuse_inexact(query, key, attention_mask, dropout, softcap, sliding_window, causal)
    rows, _, length, _ = query.shape
    device = query.device
    cu, longest = _sequences(kwargs, rows, length, device) if causal else _rows(rows, length, device)
    window = (sliding_window - 1, 0) if sliding_window else CAUSAL if causal else BIDIRECTIONAL
    return _attend(query, key, value, cu, longest, scaling, window), None


def _is_block_mask(mask: torch.Tensor | None, query: torch.Tensor) -> bool:
    """Whether ``mask`` is a [1, 1, T, T] bool mask of the whole row: what ``model_masks`` leaves a
    Gemma 4 sliding layer under mmpack_varlen (transformers' own masks for it are 2-D or None)."""
    length = query.shape[2]
    return mask is not None and mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, length, length)


def vision_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``VISION_VARLEN``: a vision tower's bidirectional attention over all of a batch's images in
    one kernel call, each image (frame, window) its own sequence, as the tower hands them to a
    flash-attn implementation (Qwen-VL: ``cu_seq_lens_q/k``, ``max_length_q/k``); without them,
    each row one sequence."""
    _refuse_inexact(query, key, attention_mask, dropout, kwargs.get("softcap"), None, False)
    rows, _, length, _ = query.shape
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        cu, longest = _rows(rows, length, query.device)
    else:
        cu = _checked_boundaries(cu, kwargs.get("cu_seq_lens_k", cu), rows, length, query.device)
        longest = int(longest) if longest is not None else int(cu.diff().max())
    return _attend(query, key, value, cu, longest, scaling, BIDIRECTIONAL), None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scaling: float | None,
    window: tuple[int, int],
) -> torch.Tensor:
    """[B, H, T, D] in, [B, T, H, D] out: the rows flattened into the kernel's [B·T, H, D]."""
    kernel = _STATE["kernel"] or _resolved_kernel(query)
    rows, heads, length, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = kernel(
        q, k, v, cu, cu, longest, longest,
        scale=scaling, window_size=window, enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip
    return out.reshape(rows, length, heads, out.shape[-1])


def _refuse_inexact(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    softcap: float | None,
    sliding_window: int | None,
    causal: bool,
) -> None:
    """``PackingUnsupported`` for what a varlen kernel cannot compute exactly, with the way out."""
    problem = None
    if attention_mask is not None:
        problem = (
            "the batch carries a padding mask (or a mask not of mmpack's bool form), which a varlen "
            "kernel cannot apply: use attn_implementation='sdpa' (or 'eager')"
        )
    elif dropout:
        problem = f"attention dropout {dropout} (the kernel has none): set attention_dropout=0 or use 'sdpa'"
    elif softcap:
        problem = f"attention logit soft-capping ({softcap}; the kernel has none): use 'eager'"
    elif sliding_window and not causal:
        problem = "a sliding window on bidirectional attention: use 'sdpa'"
    elif key.shape[2] != query.shape[2]:
        problem = (
            f"{query.shape[2]} queries over {key.shape[2]} keys (a KV cache: generation); "
            "mmpack_varlen is for training on packed batches: generate with 'sdpa'"
        )
    if problem:
        raise PackingUnsupported(f"mmpack_varlen cannot run this exactly: {problem}")


def _resolved_kernel(query: torch.Tensor) -> Kernel:
    """The first resolved kernel that takes ``query``, or ``PackingUnsupported`` saying why none
    does: not fp16/bf16, a head dim no kernel has, not CUDA, a GPU older than sm80."""
    dim, kernels = query.shape[-1], _STATE["kernels"]
    kernel = kernel_for(kernels, dim)
    problem = None
    if query.dtype not in (torch.float16, torch.bfloat16):
        problem = f"the kernels take float16 or bfloat16, not {query.dtype}: load the model in bfloat16"
    elif (kernel is None) if kernels else not fa2_head_dim(dim):
        names = ", ".join(k.name for k in kernels) or "FlashAttention-2"
        problem = f"{names} take head dimensions that are multiples of 8 up to 256, not {dim}"
    elif not query.is_cuda:
        problem = f"the FlashAttention kernels run on CUDA only (the tensors are on {query.device})"
    elif kernel is None:
        capability = _STATE["capability"]
        sm = f"sm{capability[0]}{capability[1]}" if capability else "no CUDA device at registration"
        problem = f"no FlashAttention kernel for this GPU ({sm}; they need sm80+)"
    if problem:
        raise PackingUnsupported(f"mmpack_varlen cannot run here: {problem}; use attn_implementation='sdpa'")
    return kernel.call


def _rows(rows: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each of ``rows`` rows of ``length`` tokens one sequence."""
    return torch.arange(rows + 1, dtype=torch.int32, device=device) * length, length


def _checked_boundaries(
    cu: torch.Tensor, cu_k: torch.Tensor, rows: int, length: int, device: torch.device
) -> torch.Tensor:
    """``cu`` as int32 on ``device``, refused unless it covers one row exactly, as keys do."""
    if rows != 1 or int(cu[-1]) != length or not torch.equal(cu, cu_k):
        raise PackingUnsupported(
            f"mmpack_varlen: cu_seq_lens_q ends at {int(cu[-1])} for {rows} row(s) of {length} tokens "
            "(packed batches are one row: collate_packed)"
        )
    return cu.to(device=device, dtype=torch.int32)


def _sequences(
    kwargs: dict[str, Any], rows: int, length: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 on ``device``, longest sequence) of a causal call's flattened rows."""
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    positions = kwargs.get("position_ids")
    if cu is not None:
        cu = _checked_boundaries(cu, kwargs.get("cu_seq_lens_k", cu), rows, length, device)
        return cu, int(longest) if longest is not None else int(cu.diff().max())
    if positions is not None and rows == 1 and positions.shape[-1] == length:
        text = positions.reshape(-1, length)[0]
        starts = torch.nonzero(text == 0).flatten()
        if not len(starts) or int(starts[0]) != 0:
            starts = torch.cat([starts.new_zeros(1), starts])
        cu = torch.cat([starts, starts.new_full((1,), length)]).to(device=device, dtype=torch.int32)
        return cu, int(cu.diff().max())
    return _rows(rows, length, device)


def choose_attention(
    requested: str, model_type: str | None = None, dtype: torch.dtype | None = torch.bfloat16
) -> str:
    """The ``attn_implementation`` for ``requested``: ``"auto"`` is ``mmpack_varlen`` where an exact
    varlen kernel runs (CUDA sm80+, fp16/bf16: flash-attn-4, flash-attn, else torch's own
    FlashAttention-2; its vision towers in one call under ``use_attention``), else ``sdpa``; a
    model whose packed batches carry masks (Gemma 3: image blocks attend bidirectionally) gets
    ``sdpa``. "auto" registers ``mmpack_varlen`` on this machine's kernels; ``"mmpack_varlen"``
    registers it unless it is already (a kernel given to ``register_varlen`` stays); other names
    are returned as they are."""
    if requested == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        if _takes_masks(model_type) or not half or not resolve_kernels(cuda_capability()):
            return "sdpa"
        return register_varlen()
    if requested != VARLEN:
        return requested
    return VARLEN if _STATE["registered"] else register_varlen()


def use_attention(model: torch.nn.Module, requested: str = "auto") -> str:
    """Set ``model``'s attention to ``choose_attention(requested, ...)`` and return the name. Under
    ``mmpack_varlen``, a vision tower that transformers runs image by image except under a
    flash-attn name (``Family.vision_varlen_config``: Qwen-VL) gets ``VISION_VARLEN``, so each
    layer attends over all of a batch's images in one kernel call."""
    name = choose_attention(requested, model.config.model_type, model.dtype)
    family = _family(model.config.model_type)
    vision = family.vision_varlen_config if family is not None and name == VARLEN else None
    padded = family.padded_encoder_config if family is not None and name == VARLEN else None
    if vision is None and padded is None:
        model.set_attn_implementation(name)
        return name
    # every sub-config named: a dict's sub-configs otherwise keep what they had
    implementation = {"": name, **{key: name for key in model.config.sub_configs}}
    implementation.update({vision: VISION_VARLEN} if vision else {padded: "sdpa"})
    model.set_attn_implementation(implementation)
    return name


def _family(model_type: str | None):
    from mmpack_udfs.families import FAMILIES, MODEL_TYPES

    kind = MODEL_TYPES.get(model_type or "")
    return FAMILIES[kind] if kind is not None else None


def _takes_masks(model_type: str | None) -> bool:
    """Whether packed batches of ``model_type``'s family carry attention masks."""
    family = _family(model_type)
    return family is not None and family.bidirectional_media
