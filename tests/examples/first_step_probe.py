"""Run under torchrun by test_train_hf_trainer.py: the first optimizer step of the same bins
through examples/train_qwen2_vl.py's step (DDP) and through ``PackedTrainer``, on two
identical tiny random Qwen2-VLs. Prints, on rank 0, one JSON line: the two losses and the
largest relative gradient difference.

    torchrun --nproc-per-node 2 tests/examples/first_step_probe.py MANIFEST OUT
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import TrainerCallback, TrainingArguments

from loader import PackedDataset, collate_packed
from loader.trainer import PackedTrainer

GRAD_ACCUM = 2
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Gradients(TrainerCallback):
    """The gradients the optimizer is about to apply (no clipping: max_grad_norm=0)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {
            n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
        }


def manual_step(manual, manifest: str) -> tuple[float, dict[str, torch.Tensor | None]]:
    model = manual.load_model("tiny", 0, "sdpa", torch.device("cpu"))
    wrapped = manual.wrap(model, fsdp=False)
    dataset = PackedDataset(manifest, seed=0)
    loader = StatefulDataLoader(dataset, batch_size=1, collate_fn=collate_packed)
    group = next(manual.micro_batch_groups(iter(loader), GRAD_ACCUM))
    per_dataset, supervised = manual.accumulate_step(
        wrapped, group, torch.device("cpu"), None, dataset.datasets
    )
    dist.all_reduce(per_dataset)
    return per_dataset[0].sum().item() / supervised, {n: p.grad for n, p in model.named_parameters()}


def trainer_step(manual, manifest: str, out: str) -> tuple[float, dict[str, torch.Tensor | None]]:
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=1,
        max_grad_norm=0.0,
        logging_steps=1,  # Trainer gathers the logged loss across ranks; an unlogged rest is rank 0's
        seed=0,
        dataloader_num_workers=0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    gradients = Gradients()
    model = manual.load_model("tiny", 0, "sdpa", torch.device("cpu"))
    trainer = PackedTrainer(model=model, args=args, manifest=manifest, callbacks=[gradients])
    result = trainer.train()
    return result.training_loss, gradients.grads


def relative_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """‖a − b‖ / ‖b‖; a gradient that is None on one side must be all zeros on the other."""
    if a is None or b is None:
        other = b if a is None else a
        return 0.0 if other is None or not other.any() else float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main() -> None:
    manifest, out = sys.argv[1], sys.argv[2]
    manual = example("train_qwen2_vl")
    args_probe = TrainingArguments(output_dir=out, use_cpu=True, report_to="none")
    args_probe.process_index  # sets up torch.distributed (gloo) the way Trainer does  # noqa: B018
    manual_loss, manual_grads = manual_step(manual, manifest)
    trainer_loss, trainer_grads = trainer_step(manual, manifest, out)
    differences = {n: relative_difference(trainer_grads[n], g) for n, g in manual_grads.items()}
    worst = max(differences, key=differences.get)
    if dist.get_rank() == 0:
        record = {
            "manual_loss": manual_loss,
            "trainer_loss": trainer_loss,
            "max_grad_difference": differences[worst],
            "worst_parameter": worst,
            "parameters": len(differences),
            "with_gradient": sum(g is not None for g in manual_grads.values()),
        }
        print(json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # here, not at exit: see PackedTrainer.end_ranks


if __name__ == "__main__":
    main()
