"""examples/megatron_energon.py, the data provider of a Megatron recipe, runs on an export with
a validation split: every (data-parallel, context-parallel) rank's micro-batches, a loader
restored from its saved state going on where it stopped, and a validation epoch of equal
length on every rank."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_the_megatron_energon_example_runs(energon_export, capsys):
    import megatron_energon

    export = energon_export("mixed")
    megatron_energon.main([str(export), "--dp-size", "2", "--cp-size", "2", "--steps", "2", "--workers", "0"])
    out = capsys.readouterr().out
    for dp in range(2):
        steps = re.findall(
            rf"^dp {dp} step \d+: bin (\S+), \d+ samples, (\d+) tokens \(padded\), (\d+) per CP", out, re.M
        )
        assert len(steps) == 2 and all(int(whole) == 2 * int(mine) for _, whole, mine in steps)
        assert re.search(rf"^dp {dp} resume: .* \(ok\)$", out, re.M)
    validation = re.findall(r"^dp \d validation: (\d+) micro-batches \((\d+) fillers\)", out, re.M)
    assert len(validation) == 2 and validation[0][0] == validation[1][0] != "0"
