"""Train a vision-language model with DPO on a preference pack (datasets with ``ranking: true``)
through transformers' ``Trainer`` (``loader.trainer.PackedDPOTrainer``), launched by torchrun.

    torchrun --nproc-per-node 8 examples/train_dpo.py \\
        --manifest s3://bucket/dpo/packed --model /models/Qwen2-VL-7B-Instruct --out ckpt --beta 0.1

The policy and the frozen reference model both load from ``--model`` (``tiny`` or
``tiny-<model_type>``: the same tiny random model twice, as the tests run it on CPU, gloo).
Each micro-batch's pairs take one forward of each; the loss is the mean sigmoid DPO loss
over the optimizer step's pairs on all ranks. The flags are ``examples/train_hf_trainer.py``'s,
plus ``--beta``; ``--trace FILE`` records, per rank and micro-batch, the pairs the training
step received.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from loader.trainer import PackedDPOTrainer


def _example(name: str):
    """A sibling example imported by path (this file also runs as a loaded module)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAINER = _example("train_hf_trainer")  # its flags, training arguments and StopAfter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags = TRAINER.MANUAL.training_flags(parser)
    flags.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    flags.add_argument("--beta", type=float, default=0.1, help="DPO's beta (the KL penalty's strength)")
    flags.add_argument("--eval", action="store_true", help="evaluate the evaluation split after training")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    training = TRAINER.training_arguments(args)
    device = training.device
    policy = TRAINER.MANUAL.load_model(args.model, args.seed, args.attn, device)
    reference = TRAINER.MANUAL.load_model(args.model, args.seed, args.attn, device)
    trainer = PackedDPOTrainer(
        model=policy,
        args=training,
        ref_model=reference,
        beta=args.beta,
        manifest=args.manifest,
        dataset_options={"drop_remainder": args.drop_remainder},
        trace=args.trace,
        eval_split=args.eval,
        callbacks=[TRAINER.StopAfter(args.stop_after)] if args.stop_after else None,
    )
    return TRAINER.train_and_report(trainer, args, training, "DPO loss {:.4f} per pair")


if __name__ == "__main__":
    sys.exit(main())
