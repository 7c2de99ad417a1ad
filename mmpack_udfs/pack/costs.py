"""Per-bin cost figures and the cost model: what a trainer needs to balance data-parallel
ranks, from a shard's own columns (pyarrow and numpy only: the loader imports this too).

The vision encoder attends within blocks (``Family.attention_blocks``): a Qwen2-VL image or
video attends per temporal patch (``grid_t`` blocks of ``grid_h × grid_w`` patches), an InternVL
tile is one block of ``4 × tokens_per_tile`` patches, a LLaVA-OneVision crop one block of
``tokens_per_crop`` patches.

A bin costs ``llm_token·tokens + llm_pair·Σ l²`` in the LLM and ``vision_patch·patches +
vision_pair·Σ patches²`` in the vision encoder (docs/BALANCE.md derives the defaults).
The pack lays bins out in row groups *stratified* by cost: sorted by ``order_key`` and
dealt so that each row group holds one bin of every cost stratum of the run, and
consecutive row groups are near-copies of each other. A balanced plan (loader.balance)
then gives the ranks such near-copies, reading every row group once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.constants import VISION_PATCHES_PER_TOKEN
from mmpack_udfs.errors import MmpackError
from mmpack_udfs.families import FAMILIES
from mmpack_udfs.io import fs
from mmpack_udfs.pack.shards import owner_of_elements

SHARD_COLUMNS = ["num_tokens", "sum_sq_lengths", "vision_patches", "supervised_tokens"]
MEDIA_FIELDS = ["grid_t", "grid_h", "grid_w", "num_tokens"]
KEY_BITS = 16  # per axis of the order key's grid: log2(cost) in steps of 1/1024, up to 2^64


class CostIndexError(MmpackError):
    """The cost index a manifest names is missing, unreadable or not what the manifest says."""


@dataclass(frozen=True)
class CostModel:
    """Cost of a bin per phase, in FLOPs (or any unit: only ratios matter)."""

    llm_token: float  # per token: ≈ 6 × LLM parameters
    llm_pair: float  # per (token, earlier token) pair of one sample: ≈ 6 × layers × hidden
    vision_patch: float  # per vision-encoder patch: ≈ 6 × vision parameters
    vision_pair: float  # per (patch, patch) pair of one attention block: ≈ 12 × layers × width

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CostModel:
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise ValueError(f"a cost model has exactly the keys {sorted(names)}, got {sorted(values)}")
        numbers = {}
        for name in sorted(names):
            try:
                numbers[name] = float(values[name])
            except (TypeError, ValueError):
                raise ValueError(f"cost model {name} must be a number, got {values[name]!r}") from None
            if not np.isfinite(numbers[name]) or numbers[name] < 0:
                raise ValueError(f"cost model {name} must be a finite number >= 0, got {values[name]!r}")
        return cls(**numbers)

    @classmethod
    def for_profile(cls, config: Any, profile: str) -> CostModel:
        """The configured model of a profile (``balance.cost_model.<profile>``) of a config (its
        model, or the plain data a manifest records)."""
        data = config if isinstance(config, Mapping) else config.as_dict()
        models = data.get("balance", {}).get("cost_model", {})
        if profile not in models:
            known = ", ".join(sorted(models)) or "none"
            raise ValueError(
                f"no cost model for profile '{profile}' under balance.cost_model (known: {known})"
            )
        return cls.from_mapping(models[profile])

    def phases(self, index: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(vision, llm) cost per bin of a cost index (a table or a mapping of columns)."""

        def col(name: str) -> np.ndarray:
            values = index[name]
            return (values.to_numpy() if hasattr(values, "to_numpy") else np.asarray(values)).astype(
                np.float64
            )

        vision = self.vision_patch * col("vision_patches") + self.vision_pair * col("vision_sq_patches")
        llm = self.llm_token * col("tokens") + self.llm_pair * col("sum_sq_lengths")
        return vision, llm


def bin_figures(
    bin_of: np.ndarray, num_bins: int, tokens: np.ndarray, vision_tokens: np.ndarray, squares: np.ndarray
) -> dict[str, np.ndarray]:
    """The cost figures of bins not built yet, from their samples' (``bin_of[i]``: sample
    ``i``'s bin, -1 if not packed): tokens, Σ l², vision patches and Σ patches²."""
    packed = bin_of >= 0
    if packed.all():  # the pack stage packs every sample: views, not copies
        packed = slice(None)
    bins = bin_of[packed]

    def per_bin(values: np.ndarray, power: int = 1, scale: int = 1) -> np.ndarray:
        weights = values[packed].astype(np.float64)
        weights **= power
        weights *= scale
        return np.bincount(bins, weights=weights, minlength=num_bins)

    return {
        "tokens": per_bin(tokens),
        "sum_sq_lengths": per_bin(tokens, power=2),
        "vision_patches": per_bin(vision_tokens, scale=VISION_PATCHES_PER_TOKEN),
        "vision_sq_patches": per_bin(squares),
    }


def write_order(figures: Mapping[str, Any], model: CostModel, per_row_group: int, seed: int) -> np.ndarray:
    """The order the pack job writes bins in (``order[k]``: the bin written k-th): row groups
    stratified by cost under ``model``; bins of equal cost in a ``seed``-ed order."""
    tie = np.random.default_rng(seed).permutation(len(figures["tokens"]))
    return stratified_order(order_key(*model.phases(figures)), per_row_group, tie)


def order_key(vision: np.ndarray, llm: np.ndarray) -> np.ndarray:
    """A 1-D order in which neighbours are close in both phases: the position on a Hilbert
    curve over (log2 vision cost, log2 llm cost). Fixed scale, so pack and loader agree."""
    top = (1 << KEY_BITS) - 1

    def axis(cost: np.ndarray) -> np.ndarray:
        return np.minimum(np.log2(np.maximum(cost, 0.0) + 1.0) * 1024, top).astype(np.int64)

    x, y = axis(vision), axis(llm)
    key = np.zeros(len(x), np.int64)
    s = 1 << (KEY_BITS - 1)
    while s:
        rx, ry = (x & s) > 0, (y & s) > 0
        key += s * s * ((3 * rx) ^ ry)
        flip = ~ry & rx  # rotate the quadrant so the curve stays continuous
        x, y = np.where(flip, s - 1 - x, x), np.where(flip, s - 1 - y, y)
        x, y = np.where(~ry, y, x), np.where(~ry, x, y)
        s >>= 1
    return key


def stratified_order(key: np.ndarray, per_row_group: int, tie: np.ndarray | None = None) -> np.ndarray:
    """The order to write bins in: every full row group takes one bin of
    each of ``per_row_group`` cost strata, row group ``i`` the ``i``-th of each, so that
    consecutive row groups are near-copies; within a row group the strata come in
    bit-reversed order (any prefix spans the range). The last row group (the remainder)
    takes bins spread evenly over the strata. ``tie`` orders bins of equal key."""
    n = len(key)
    ranked = np.lexsort((np.arange(n) if tie is None else tie, key))  # bin indices, cheapest first
    spare = n % per_row_group
    spread = ((np.arange(spare) + 0.5) * n / spare).astype(np.int64) if spare else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(n), spread)
    units = rest.reshape(per_row_group, -1)  # units[j, i]: rank of stratum j's bin of row group i
    slots = bit_reversed(per_row_group)
    layout = np.concatenate([units[slots].T.reshape(-1), spread[bit_reversed(spare)]])
    return ranked[layout]


def bit_reversed(n: int) -> np.ndarray:
    """0..n-1 in bit-reversed order (0, n/2, n/4, 3n/4, … for a power of two)."""
    bits = max(int(n - 1).bit_length(), 1)
    index = np.arange(1 << bits)
    reversed_ = np.zeros_like(index)
    for b in range(bits):
        reversed_ |= ((index >> b) & 1) << (bits - 1 - b)
    return reversed_[reversed_ < n]


def media_squares(media: pa.Array, profile: Mapping[str, Any]) -> np.ndarray:
    """Per row of a ``list<struct>`` media column (MEDIA_FIELDS): Σ over the vision encoder's
    attention blocks of patches²."""
    items = pc.list_flatten(media)
    if not len(items):  # text only
        return np.zeros(len(media), np.int64)
    counts = pc.list_value_length(media).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    owner = owner_of_elements(counts)
    field = {name: items.field(name).to_numpy(zero_copy_only=False).astype(np.int64) for name in MEDIA_FIELDS}
    blocks, block_patches = FAMILIES[profile["kind"]].attention_blocks(field, profile)
    return np.bincount(owner, weights=blocks * block_patches**2, minlength=len(media)).astype(np.int64)


def bin_costs(bins: pa.Table, shard: int, profile: Mapping[str, Any]) -> pa.Table:
    """The cost index rows of one shard's bins (``bins`` holds at least SHARD_COLUMNS and
    ``media`` with MEDIA_FIELDS)."""
    media = bins["media"].combine_chunks()
    column = {name: bins[name].to_numpy().astype(np.int64) for name in SHARD_COLUMNS}
    return pa.table(
        {
            "shard": np.full(bins.num_rows, shard, np.int64),
            "row": np.arange(bins.num_rows, dtype=np.int64),
            "tokens": column["num_tokens"],
            "sum_sq_lengths": column["sum_sq_lengths"],
            "media_items": pc.list_value_length(media)
            .fill_null(0)
            .to_numpy(zero_copy_only=False)
            .astype(np.int64),
            "vision_patches": column["vision_patches"],
            "vision_sq_patches": media_squares(media, profile),
            "supervised_tokens": column["supervised_tokens"],
        },
        schema=schemas.COST_INDEX,
    )


def read_index(
    packed_root: str, manifest: Mapping[str, Any], storage: fs.Storage, verify: bool = True
) -> pa.Table:
    """The cost index ``manifest`` names, checked: its size and sha256 (``verify``), its
    schema, and one row per bin in manifest order. Raises CostIndexError saying what is wrong."""
    entry = manifest.get("cost_index")
    if entry is None:
        raise CostIndexError("this manifest has no cost index (packed before mmpack wrote one): re-run pack")
    name = f"cost_index {entry['path']}"
    try:
        data = storage.read_bytes(fs.join(packed_root, entry["path"]))
    except OSError as err:
        raise CostIndexError(f"{name}: cannot be read: {err}") from err
    if verify and (len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]):
        raise CostIndexError(f"{name}: {len(data)} bytes, not the size and sha256 the manifest gives")
    index = pq.read_table(pa.BufferReader(data))
    expected = owner_of_elements(np.array([s["rows"] for s in manifest["shards"]], np.int64))
    if not index.schema.equals(schemas.COST_INDEX) or not np.array_equal(index["shard"].to_numpy(), expected):
        raise CostIndexError(
            f"{name}: not the cost index schema, or not one row per bin in manifest order "
            f"({index.num_rows} rows)"
        )
    return index


def shard_rows(bins: pa.Table, path: str, profile: Mapping[str, Any], first_row: int = 0) -> pa.Table:
    """Rows of the index for bins of one shard (starting at its row ``first_row``) before the
    manifest numbers the shards: ``path`` instead of ``shard``. Computed by the task that
    writes the shard, from the bins in its hands."""
    rows = bin_costs(bins, 0, profile).drop_columns(["shard"])
    rows = rows.set_column(0, "row", pa.array(np.arange(bins.num_rows, dtype=np.int64) + first_row))
    return rows.append_column("path", pa.array([path] * bins.num_rows, pa.string()))


def assemble(parts: list[pa.Table], shards: list[dict]) -> pa.Table:
    """The index from every shard's rows (``shard_rows``): shards numbered in manifest order."""
    number = {shard["path"]: i for i, shard in enumerate(shards)}
    if not parts:
        return schemas.COST_INDEX.empty_table()
    rows = pa.concat_tables(parts)
    shard = pa.array([number[path] for path in rows["path"].to_pylist()], pa.int64())
    rows = rows.append_column("shard", shard).sort_by([("shard", "ascending"), ("row", "ascending")])
    return rows.select(list(schemas.COST_INDEX_COLUMNS)).cast(schemas.COST_INDEX)


def to_ipc(table: pa.Table) -> bytes:
    """A table as Arrow IPC stream bytes (how a Spark task hands its rows to the driver)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def index_bytes(index: pa.Table) -> bytes:
    """The index as Parquet bytes: the same table always gives the same bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(index, sink, compression="zstd")
    return sink.getvalue().to_pybytes()
