"""Run under torchrun by test_train_qwen2_vl.py: FSDP2 (examples/train_qwen2_vl.py's ``wrap``
and ``accumulate_step``) on a tiny random model of each family given, two optimizer steps in
which one rank's micro-batch has media (the smallest media bin of the family's pack) and the
other's none (a text-only bin); the ranks swap on the second step. Without idle media the rank
without media would skip the vision tower's collectives and the ranks would fall out of step.
Prints, on rank 0, one JSON line per family: its losses and the idle media each rank added.

    torchrun --nproc-per-node 2 tests/examples/fsdp_idle_probe.py MODEL_TYPE=MANIFEST ...
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loader import PackedDataset, collate_packed  # noqa: E402
from loader.training import idle_media_settings, with_idle_media  # noqa: E402
from tests.loader.test_idle_media import text_bin  # noqa: E402


def manual():
    spec = importlib.util.spec_from_file_location("train_qwen2_vl", ROOT / "examples" / "train_qwen2_vl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smallest_media_bin(manifest: str) -> dict:
    bins = [b for b in PackedDataset(manifest, shuffle=False) if "pixel_values" in b or "input_features" in b]
    return min(bins, key=lambda b: len(b["input_ids"]))


def train_two_steps(example, model_type: str, manifest: str, rank: int) -> dict:
    device = torch.device("cpu")
    model = example.load_model(f"tiny-{model_type}", 0, "auto", device).train()
    idle = idle_media_settings(model.config)
    wrapped = example.wrap(model, fsdp=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    media, text = collate_packed([smallest_media_bin(manifest)]), collate_packed([text_bin(model_type)])
    datasets = PackedDataset(manifest).datasets
    added, supervised = [], []
    for step in range(2):
        batch = media if (rank + step) % 2 == 0 else text
        added.append(with_idle_media(batch, idle).meta.get("idle_media", []))
        _, tokens = example.accumulate_step(wrapped, [batch], device, idle, datasets)
        supervised.append(tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return {"rank": rank, "idle_media": added, "finite": finite, "tokens": supervised}


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    example = manual()
    for arg in sys.argv[1:]:
        model_type, manifest = arg.split("=", 1)
        result = train_two_steps(example, model_type, manifest, rank)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if rank == 0:
            print(json.dumps({"model_type": model_type, "ranks": gathered}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: once, in CI (torch 2.13), rank 0 aborted there
    # ("terminate called without an active exception", SIGABRT) after every family had passed
    # and the group was destroyed (the object whose destructor aborted was not identified).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
