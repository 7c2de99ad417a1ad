"""Training-side package: reads packed shards into GPU-ready batches. Never imports pyspark.

from loader import PackedDataset, collate_packed, varlen_attention

Names are imported on first use, so that ``loader.plan`` and ``loader.balance`` (numpy
only, used by ``mmpack balance-report``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PackedBatch": "loader.collate",
    "PackedDataset": "loader.dataset",
    "PackingUnsupported": "loader.hybrid",
    "ShardError": "loader.source",
    "block_diagonal_mask": "loader.attention",
    "collate_packed": "loader.collate",
    "normalize_pixel_values": "loader.collate",
    "require_sample_isolation": "loader.hybrid",
    "varlen_attention": "loader.attention",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
