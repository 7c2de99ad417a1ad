"""The README's training loop runs as written (on the packed demo shards)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_training_loop_runs(packed_demo, capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "varlen_attention" in block and 'MANIFEST = "demo-out/packed"' in block
    namespace: dict = {}
    exec(block.replace('"demo-out/packed"', repr(str(packed_demo / "packed"))), namespace)
    assert math.isfinite(namespace["loss"].item())
    assert "epoch 1 step 0" in capsys.readouterr().out
