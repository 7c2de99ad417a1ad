"""Models whose language model has linear-attention layers (Qwen3.5's Gated DeltaNet).

Such a layer runs a short causal convolution and a recurrent delta rule over the whole
sequence: on a packed batch, unless their kernels are told where samples start, each
sample inherits the state of the one before it (measured with transformers 5.23, tiny
random Qwen3.5, CPU: logits off by 2–4e-2 on every later sample). The batches carry
what the kernels need: ``cu_seq_lens_q`` (flash-linear-attention's chunked delta rule) and
``seq_idx`` (causal-conv1d). transformers' reference torch implementations honour neither:
with them it raises its own ValueError naming the package to install. ``require_sample_isolation``
says so before training starts, and never makes a packed run go by dropping the boundaries.
"""

from __future__ import annotations

import importlib.util

KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


class PackingUnsupported(RuntimeError):
    """The model cannot keep packed samples apart on this installation."""


def linear_attention_layers(model) -> int:
    """How many of the model's language-model layers are linear attention."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    return sum(t == "linear_attention" for t in (getattr(text, "layer_types", None) or []))


def missing_kernels() -> list[str]:
    """The packages that keep packed samples apart in linear-attention layers, not installed."""
    return [package for module, package in KERNELS.items() if importlib.util.find_spec(module) is None]


def require_sample_isolation(model) -> None:
    """Raise ``PackingUnsupported`` when ``model`` has linear-attention layers and the kernels
    that restart them at sample boundaries are missing; say what to install."""
    layers = linear_attention_layers(model)
    missing = missing_kernels() if layers else []
    if missing:
        raise PackingUnsupported(
            f"{type(model).__name__} has {layers} linear-attention layers whose convolution and recurrent "
            "state would run across packed samples: training on packed batches needs the kernels that "
            f"restart at sample boundaries; install {' and '.join(missing)} (CUDA), or train unpacked"
        )
