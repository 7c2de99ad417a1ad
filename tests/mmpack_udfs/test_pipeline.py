"""The stage list: what each stage reads and writes, and the one place the CLI, the job and the
DAG take their stages from."""

import ast
import importlib
import sys
from pathlib import Path

from mmpack_udfs import cli, pipeline, schemas


def test_every_stage_reads_what_an_earlier_stage_writes():
    written = {"datasets"}
    for stage in pipeline.STAGES:
        assert set(stage.reads) <= written, f"{stage.name} reads {set(stage.reads) - written}"
        written |= set(stage.writes)


def test_declared_outputs_match_the_stage_modules():
    tables = {f"tables/{name}" for name in schemas.TABLES}
    for stage in pipeline.STAGES:
        module = importlib.import_module(stage.module)
        assert callable(module.run)
        assert f"report/{module.REPORT_NAME}" in stage.writes
        assert {w for w in stage.writes if w.startswith("tables/")} <= tables
    assert {w for s in pipeline.STAGES for w in s.writes if w.startswith("tables/")} == tables


def test_the_cli_has_one_command_per_stage_and_run_for_the_pipeline():
    commands = {name: stages for name, stages, _ in cli.STAGE_COMMANDS}
    assert commands.pop("run") == list(pipeline.PIPELINE)
    assert commands == {s.name: [s.name] for s in pipeline.STAGES}


def test_the_stage_list_needs_only_the_standard_library():
    """The Airflow DAG loads pipeline.py by path, in an environment without mmpack."""
    tree = ast.parse(Path(pipeline.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
