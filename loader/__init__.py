"""Training-side package: reads packed shards into GPU-ready batches. Never imports pyspark.

from loader import PackedDataset, collate_packed, varlen_attention
"""

from loader.attention import block_diagonal_mask, varlen_attention
from loader.collate import PackedBatch, collate_packed
from loader.dataset import PackedDataset
from loader.source import ShardError

__all__ = [
    "PackedBatch",
    "PackedDataset",
    "ShardError",
    "block_diagonal_mask",
    "collate_packed",
    "varlen_attention",
]
