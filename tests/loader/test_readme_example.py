"""The README's training loop runs as written (on the packed demo shards, three steps an epoch)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

README = Path(__file__).resolve().parents[2] / "README.md"
LOOP = "for step, batch in enumerate(loader):"


def test_readme_training_loop_runs(packed_demo, capsys):
    block = re.search(r"### Train.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "model(**batch" in block and 'MANIFEST = "demo-out/packed"' in block and LOOP in block
    block = block.replace('"demo-out/packed"', repr(str(packed_demo / "packed")))
    block = block.replace(LOOP, "for step, batch in zip(range(3), loader):")  # a short run
    namespace: dict = {}
    exec(block, namespace)
    assert math.isfinite(namespace["loss"].item())
    out = capsys.readouterr().out
    assert "epoch 0 step 2" in out and "epoch 1 step 0" in out
