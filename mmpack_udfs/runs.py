"""What every stage does around its work: skip a run that is already committed, save and
print its summary."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmpack_udfs.io import tables

if TYPE_CHECKING:  # the driver's: stage modules import this in Python workers too
    from mmpack_udfs.context import RunContext


def run_id_from(stage: str, facts: Mapping[str, Any]) -> str:
    """``<stage>-<hash>``: a run id that changes exactly when ``facts`` (JSON-able) change."""
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return f"{stage}-{hashlib.sha256(blob).hexdigest()[:20]}"


def previous_summary(ctx: RunContext, report_name: str, run_id: str, uris: Sequence[str]) -> dict | None:
    """The saved summary of ``run_id`` if every one of its tables still holds its commit."""
    if any(tables.committed_run(uri, run_id, ctx.mode, ctx.storage) is None for uri in uris):
        return None
    report = ctx.report(report_name)
    if not ctx.storage.exists(report):
        return None
    summary = json.loads(ctx.storage.read_bytes(report))
    return {**summary, "skipped": True} if summary.get("run_id") == run_id else None


def publish_summary(
    ctx: RunContext,
    report_name: str,
    summary: Mapping[str, Any],
    formatter: Callable[[Mapping[str, Any]], str],
) -> None:
    """Write the summary to ``OUT/report/<report_name>`` and print it."""
    ctx.storage.write_bytes(ctx.report(report_name), json.dumps(summary, indent=2).encode())
    print(formatter(summary))
