"""Train a vision-language model of any family mmpack packs for on mmpack shards with
transformers' ``Trainer`` (``loader.trainer.PackedTrainer``), launched by torchrun or
``accelerate launch``.

    torchrun --nproc-per-node 8 examples/train_hf_trainer.py \\
        --manifest s3://bucket/run1/packed --model /models/Qwen3-VL-8B-Instruct --out ckpt

The flags are ``examples/train_qwen2_vl.py``'s where they apply; ``--model tiny`` or
``tiny-<model_type>`` builds a tiny random model (the tests run it that way on CPU, gloo).
``--trace FILE`` appends, per rank, one JSON line per micro-batch with what the Trainer's
training step received (written from inside the step). ``--stop-after N`` saves a
checkpoint after N optimizer steps and stops; ``--resume`` continues from the latest
checkpoint in ``--out`` (Trainer's own ``resume_from_checkpoint``). A finished run saves the
model to ``--out``/final.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

from loader.trainer import PackedTrainer


def _example(name: str):
    """A sibling example imported by path (this file also runs as a loaded module)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MANUAL = _example("train_qwen2_vl")  # its model loading and flags


class StopAfter(TrainerCallback):
    """Save a checkpoint and stop after ``steps`` optimizer steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_save = True
            control.should_training_stop = True
        return control


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags = MANUAL.training_flags(parser)
    flags.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    flags.add_argument(
        "--eval",
        action="store_true",
        help="evaluate the run's evaluation split (eval.fraction) after training",
    )
    return parser.parse_args(argv)


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.bins_per_micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        dataloader_num_workers=args.workers,
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    training = training_arguments(args)
    device = training.device
    model = MANUAL.load_model(args.model, args.seed, args.attn, device)
    trainer = PackedTrainer(
        model=model,
        args=training,
        manifest=args.manifest,
        dataset_options={"drop_remainder": args.drop_remainder},
        trace=args.trace,
        eval_split=args.eval,
        callbacks=[StopAfter(args.stop_after)] if args.stop_after else None,
    )
    return train_and_report(trainer, args, training, "loss {:.4f} per supervised token")


def train_and_report(trainer, args: argparse.Namespace, training: TrainingArguments, loss_format: str) -> int:
    """Train (resuming with ``--resume``), save the final model unless stopped early, print
    what happened (the loss by ``loss_format``) and evaluate with ``--eval``."""
    if training.process_index == 0:
        batches = trainer.train_dataset.num_batches(args.bins_per_micro_batch, args.workers)
        print(f"{training.world_size} rank(s), {batches} micro-batches per rank per epoch")
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    stopped = bool(args.stop_after) and result.global_step >= args.stop_after
    if not stopped:
        trainer.save_model(str(Path(args.out) / "final"))
    if training.process_index == 0:
        if stopped:
            print(f"stopped after step {result.global_step}")
        else:
            loss = loss_format.format(result.training_loss)
            print(f"finished {args.epochs} epoch(s), {result.global_step} steps, {loss}")
    if args.eval and not stopped:
        metrics = trainer.evaluate()
        if training.process_index == 0:
            print("evaluation: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())))
    trainer.end_ranks()  # every rank waits, then the group ends (see its docstring)
    return 0


if __name__ == "__main__":
    sys.exit(main())
