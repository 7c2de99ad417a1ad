"""The training side installs and runs without the Spark side: ``pip install 'mmpack[train]'``
brings torch, torchdata, pyarrow, numpy, Pillow and OpenCV, and nothing of the pipeline;
``mmpack[train,hf]`` adds transformers and accelerate, and runs the Trainer example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import installs

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
SPARK_SIDE = ["pyspark", "deltalake", "numba", "transformers", "tokenizers", "yaml", "matplotlib"]

# Reads one epoch with media (images and videos) and prints the top-level modules it loaded.
READ_AND_LIST_MODULES = """
import json, sys
from torch.utils.data import DataLoader
from loader import PackedDataset, collate_packed
dataset = PackedDataset(sys.argv[1], rank=1, world_size=2)
steps = sum(1 for _ in DataLoader(dataset, batch_size=2, collate_fn=collate_packed, num_workers=0))
print(json.dumps({"steps": steps, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def read_with(python: str, packed: Path, cwd: Path) -> dict:
    done = subprocess.run(
        [python, "-c", READ_AND_LIST_MODULES, str(packed)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_reading_shards_loads_nothing_of_the_spark_side(packed_demo, tmp_path):
    result = read_with(sys.executable, packed_demo / "packed", tmp_path)
    assert result["steps"] > 0
    assert [name for name in SPARK_SIDE if name in result["modules"]] == []
    assert "av" not in result["modules"]  # PyAV (FFmpeg's libraries) only for packs with audio


@pytest.mark.slow
def test_fresh_virtualenv_with_only_the_training_install(training_env, packed_demo, tmp_path):
    env_dir = training_env  # torch, then mmpack[train] (tests/installs.py: built in the background)
    listed = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"torch", "torchdata", "pyarrow", "numpy", "pillow", "opencv-python-headless"} <= installed
    assert installed.isdisjoint({"pyspark", "deltalake", "numba", "transformers", "pandas", "pyyaml"})
    result = read_with(str(env_dir / "bin" / "python"), packed_demo / "packed", tmp_path)
    reference = read_with(sys.executable, packed_demo / "packed", tmp_path)
    assert result["steps"] == reference["steps"] > 0
    console = subprocess.run([str(env_dir / "bin" / "mmpack"), "run"], capture_output=True, text=True)
    assert console.returncode == 2 and "pip install 'mmpack[spark]'" in console.stderr

    # + transformers and accelerate: the Trainer example trains; `import loader` still loads neither
    done = installs.pip(env_dir, f"{ROOT}[train,hf]")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    after = read_with(str(env_dir / "bin" / "python"), packed_demo / "packed", tmp_path)
    assert [name for name in SPARK_SIDE if name in after["modules"]] == []
    example = [str(env_dir / "bin" / "python"), "-m", "torch.distributed.run", "--standalone"]
    example += ["--nproc-per-node=1", str(ROOT / "examples" / "train_hf_trainer.py")]
    example += ["--manifest", str(packed_demo / "packed"), "--out", str(tmp_path / "ckpt")]
    trained = subprocess.run(
        [*example, "--workers", "0", "--stop-after", "1"], cwd=tmp_path, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    assert "stopped after step 1" in trained.stdout
    assert (tmp_path / "ckpt" / "checkpoint-1" / "mmpack-loader-rank0.pt").exists()
