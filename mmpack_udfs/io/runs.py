"""What every stage does around its work: skip a run that is already committed, save and
print its summary."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmpack_udfs import schemas
from mmpack_udfs.io import fs, tables


def run_id_from(stage: str, facts: Mapping[str, Any]) -> str:
    """``<stage>-<hash>``: a run id that changes exactly when ``facts`` (JSON-able) change."""
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return f"{stage}-{hashlib.sha256(blob).hexdigest()[:20]}"


def previous_summary(
    output: str, report_name: str, run_id: str, mode: str, uris: Sequence[str], s3: fs.S3Options | None
) -> dict | None:
    """The saved summary of ``run_id`` if every one of its tables still holds its commit."""
    if any(tables.committed_run(uri, run_id, mode, s3) is None for uri in uris):
        return None
    report = schemas.report_uri(output, report_name)
    if not fs.exists(report, s3):
        return None
    summary = json.loads(fs.read_bytes(report, s3))
    return {**summary, "skipped": True} if summary.get("run_id") == run_id else None


def publish_summary(
    output: str,
    report_name: str,
    summary: Mapping[str, Any],
    formatter: Callable[[Mapping[str, Any]], str],
    s3: fs.S3Options | None,
) -> None:
    """Write the summary to ``OUT/report/<report_name>`` and print it."""
    fs.write_bytes(schemas.report_uri(output, report_name), json.dumps(summary, indent=2).encode(), s3)
    print(formatter(summary))
