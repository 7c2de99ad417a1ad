"""The pipeline's stages, each with what it reads and writes under the output root: the one
list that the CLI, the spark-submit job and the Airflow DAG are built from.

Standard library only: the Airflow DAG loads this file by path, without mmpack installed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One stage: ``module.run(spark, ctx)`` reads ``reads`` and writes ``writes`` (paths under
    the output root; ``datasets`` is the configured input). ``run_options``: the run-level
    config keys that mean something to it (``run_id``: idempotent commits, ``mode``: how
    its Delta tables are written); the CLI offers only those."""

    name: str
    help: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    module: str
    run_options: tuple[str, ...] = ()

    def run(self, spark: Any, ctx: Any) -> dict[str, Any]:
        """Run the stage in ``spark`` for the run context ``ctx`` (``context.RunContext``)."""
        return importlib.import_module(self.module).run(spark, ctx)


STAGES: tuple[Stage, ...] = (
    Stage(
        "normalize",
        "input files + media → Delta samples/quarantine",
        reads=("datasets",),
        writes=("tables/samples", "tables/quarantine", "report/normalize.json"),
        module="mmpack_udfs.normalize.stage",
        run_options=("run_id", "mode"),
    ),
    Stage(
        "tokenize",
        "Delta samples → Delta tokenized (ids, labels, media spans)",
        reads=("tables/samples",),
        writes=("tables/tokenized", "tables/tokenize_quarantine", "report/tokenize.json"),
        module="mmpack_udfs.tokenize.stage",
        run_options=("run_id", "mode"),
    ),
    Stage(
        "pack",
        "Delta tokenized → packed Parquet shards + manifest.json + report",
        reads=("tables/tokenized",),
        writes=("packed/shards", "packed/manifest.json", "report/pack.json", "report/pack_skipped.json"),
        module="mmpack_udfs.pack.stage",
        run_options=("run_id",),
    ),
    Stage(
        "validate",
        "check OUT/packed: every shard against the manifest, every sample once",
        reads=("packed/manifest.json", "packed/shards", "tables/tokenized"),
        writes=("report/validate.json",),
        module="mmpack_udfs.validate.stage",
    ),
)
PIPELINE: tuple[str, ...] = ("normalize", "tokenize", "pack")  # what `mmpack run` runs (validate: after)


def stage(name: str) -> Stage:
    """The stage called ``name``."""
    for candidate in STAGES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no stage '{name}' (stages: {', '.join(s.name for s in STAGES)})")
