"""The README's training blocks run as written (on the packed demo shards): the loop, Trainer, Megatron."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
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


def test_readme_trainer_block_runs(packed_demo, tmp_path):
    """The "Train with Trainer" block, in a process of its own, on a tiny random Qwen2-VL saved
    as a model directory, for 2 optimizer steps."""
    block = re.search(r"### Train with Trainer.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    for expected in ('MANIFEST = "demo-out/packed"', 'MODEL = "/models/', "num_train_epochs=1,", '"ckpt",'):
        assert expected in block
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "examples" / "tiny_models.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tiny.tiny_model("qwen2_vl", 0, "sdpa").save_pretrained(tmp_path / "tiny")
    block = block.replace('"demo-out/packed"', repr(str(packed_demo / "packed")))
    block = re.sub(r'MODEL = "[^"]*"', f"MODEL = {str(tmp_path / 'tiny')!r}", block)
    block = block.replace("num_train_epochs=1,", "max_steps=2,").replace(
        '"ckpt",', repr(str(tmp_path / "ckpt")) + ","
    )
    script = tmp_path / "readme_trainer.py"
    script.write_text(block + "\nprint('global step', trainer.state.global_step)\n")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "global step 2" in done.stdout


def test_readme_megatron_block_runs(packed_demo):
    """The "Train with Megatron-Core" block: two data-parallel ranks × two context-parallel
    ranks, TP 2 with sequence parallel. Both CP ranks of a DP rank get the same bins' halves."""
    section = r"### Train with Megatron-Core.*?```python\n(.*?)```"
    block = re.search(section, README.read_text(), re.S).group(1)
    assert 'MANIFEST = "demo-out/packed"' in block
    namespace: dict = {}
    exec(block.replace('"demo-out/packed"', repr(str(packed_demo / "packed"))), namespace)
    steps = {}
    for dp, cp in itertools.product(range(2), range(2)):
        steps[dp, cp] = list(namespace["micro_batches"](dp, 2, cp, 2, 2))
    assert len({len(s) for s in steps.values()}) == 1 and steps[0, 0]
    for dp in range(2):
        for a, b in zip(steps[dp, 0], steps[dp, 1], strict=True):
            assert a["meta"]["sample_ids"] == b["meta"]["sample_ids"]
            assert a["input_ids"].shape == b["input_ids"].shape
            whole = a["packed_seq_params"].cu_seqlens_q_padded[-1]
            assert a["input_ids"].shape[-1] * 2 == whole and int(whole) % 8 == 0
    seen = [s for dp in range(2) for batch in steps[dp, 0] for s in batch["meta"]["sample_ids"]]
    manifest = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    assert len(seen) == len(set(seen)) == manifest["totals"]["samples"]  # every sample once an epoch


def test_readme_energon_block_runs(energon_export):
    """The "Train with Megatron (Energon)" block on the demo's export: 2 data-parallel × 2
    context-parallel ranks, TP 2 with sequence parallel. Both CP ranks of a DP rank read the
    same bins and keep halves of them; the DP ranks read different bins."""
    section = r"### Train with Megatron \(Energon\).*?```python\n(.*?)```"
    block = re.search(section, README.read_text(), re.S).group(1)
    assert 'EXPORT = "demo-energon"' in block
    export = energon_export("qwen2_vl")
    namespace: dict = {}
    exec(block.replace('"demo-energon"', repr(str(export))), namespace)
    steps = {}
    for dp, cp in itertools.product(range(2), range(2)):
        stream = namespace["micro_batches"](dp, 2, cp, 2, 2, num_workers=0)
        steps[dp, cp] = list(itertools.islice(stream, 3))
        stream.close()
    for dp in range(2):
        for a, b in zip(steps[dp, 0], steps[dp, 1], strict=True):
            assert a["meta"]["key"] == b["meta"]["key"] and a["input_ids"].shape == b["input_ids"].shape
            whole = a["packed_seq_params"].cu_seqlens_q_padded[-1]
            assert a["input_ids"].shape[-1] * 2 == whole and int(whole) % 8 == 0
            assert not torch.equal(a["input_ids"], b["input_ids"])
    keys = [{batch["meta"]["key"] for batch in steps[dp, 0]} for dp in range(2)]
    assert len(keys[0]) == len(keys[1]) == 3 and not keys[0] & keys[1]
