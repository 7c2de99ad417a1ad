"""The layering of pyproject.toml's import contracts (``lint-imports``, run by ``make test``):
the tree keeps them, and an upward import or a new circle breaks them, naming the modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy before the editable install
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the packages and their contracts."""
    for name in ("mmpack_udfs", "loader"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(file: Path, line: str) -> None:
    text = file.read_text()
    head, _, rest = text.partition("from __future__ import annotations\n")
    file.write_text(f"{head}from __future__ import annotations\n{line}\n{rest}")


def test_the_tree_keeps_every_contract(tree):
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "file, line, broken, named",
    [
        # a family reaching up into a stage (the old model_dir -> tokenize)
        (
            "mmpack_udfs/families/model_dir.py",
            "from mmpack_udfs.tokenize import template_check",
            "families know no stage",
            "mmpack_udfs.families.model_dir -> mmpack_udfs.tokenize.template_check",
        ),
        # configuration reading a model directory (the old config.loading -> families.model_dir)
        (
            "mmpack_udfs/config/loading.py",
            "from mmpack_udfs.families import model_dir",
            "config is data",
            "mmpack_udfs.config.loading -> mmpack_udfs.families.model_dir",
        ),
        # a circle inside a package (the old sharegpt <-> preference)
        (
            "mmpack_udfs/normalize/sharegpt.py",
            "from mmpack_udfs.normalize import preference",
            "no import circles inside a package",
            "No cycles are allowed in mmpack_udfs.normalize",
        ),
        # the training side importing Spark
        ("loader/plan.py", "import pyspark", "loader (the training side)", "loader.plan -> pyspark"),
    ],
)
def test_an_upward_import_or_a_circle_breaks_a_contract_naming_the_modules(tree, file, line, broken, named):
    add_import(tree / file, line)
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout
    summary, _, details = result.stdout.partition("Broken contracts")
    assert any(broken in line for line in summary.splitlines() if "BROKEN" in line), result.stdout
    assert named in details, result.stdout
