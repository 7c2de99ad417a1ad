"""``mmpack balance-report``: how much a data-parallel step waits for its slowest rank, in
today's order and in the balanced plan, from a cost index alone (no shard is opened).

Works on the index of a packed output (``--out``) or on any Parquet file with the cost
index columns (``--index``; row groups are then taken as ``--bins-per-row-group``
consecutive bins of a shard).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmpack_udfs import schemas
from mmpack_udfs.io import fs
from mmpack_udfs.pack import costs
from mmpack_udfs.report.pack_report import ReportError, read_manifest


def from_output(out: str, storage: fs.Storage) -> tuple[pa.Table, int, str]:
    """(cost index, bins per row group, profile) of a packed output root."""
    manifest = read_manifest(out, storage)
    index = costs.read_index(schemas.packed_uri(out), manifest, storage)
    return index, manifest["bins_per_row_group"], manifest["profile"]


def from_file(path: str, storage: fs.Storage) -> pa.Table:
    filesystem, inner = storage.filesystem(path)
    try:
        index = pq.read_table(filesystem.open_input_file(inner))
    except (OSError, pa.ArrowInvalid) as err:
        raise ReportError(f"cannot read the cost index {path}: {err}") from err
    missing = [c for c in schemas.COST_INDEX_COLUMNS if c not in index.column_names]
    if missing:
        raise ReportError(f"{path} is not a cost index: it lacks the column(s) {', '.join(missing)}")
    return index


def row_group_sizes(index: pa.Table, per_row_group: int) -> np.ndarray:
    """Bins per row group: each shard's rows cut into runs of ``per_row_group``, in index order."""
    shard = index["shard"].to_numpy()
    if len(shard) and (np.diff(shard) < 0).any():
        raise ReportError("the cost index must list its bins by shard, then row")
    _, counts = np.unique(shard, return_counts=True)
    return np.array([min(per_row_group, c - i) for c in counts for i in range(0, c, per_row_group)], np.int64)


def build(
    index: pa.Table,
    per_row_group: int,
    model: costs.CostModel,
    world_size: int,
    micro_batches: int,
    seed: int = 0,
    epoch: int = 0,
) -> dict[str, Any]:
    """The report as one JSON-ready mapping."""
    from loader import balance

    if world_size < 1 or micro_batches < 1:
        raise ReportError("--world-size and --micro-batches must be at least 1")
    vision, llm = model.phases(index)
    sizes = row_group_sizes(index, per_row_group)
    result = balance.compare(vision, llm, sizes, world_size, micro_batches, seed, epoch)
    return {"bins": index.num_rows, "world_size": world_size, "micro_batches": micro_batches, **result}


def format_text(report: Mapping[str, Any], profile: str) -> str:
    lines = [
        f"balance-report  {report['bins']:,} bins, {report['world_size']} ranks × "
        f"{report['micro_batches']} micro-batch(es), profile {profile}",
        "  straggler overhead (Σ slowest rank / Σ mean rank − 1) and read amplification:",
        f"  {'order':10s} {'steps':>7s} {'vision':>9s} {'llm':>9s} {'step':>9s} {'read':>7s}",
    ]
    for name in ("random", "balanced"):
        r = report[name]
        lines.append(
            f"  {name:10s} {r['steps']:7,d} {r['overhead_vision']:9.2%} {r['overhead_llm']:9.2%} "
            f"{r['overhead_step']:9.2%} {r['read_amplification']:6.3f}×"
        )
    return "\n".join(lines)


def as_json(report: Mapping[str, Any]) -> str:
    return json.dumps(report, sort_keys=True)
