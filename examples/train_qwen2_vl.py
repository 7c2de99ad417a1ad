"""Train a vision-language model of any family mmpack packs for (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL dense and MoE, Qwen3.5) on mmpack shards with DDP or FSDP2, launched by torchrun.
(``examples/train_hf_trainer.py`` does the same with transformers' ``Trainer``.)

    torchrun --nproc-per-node 8 examples/train_qwen2_vl.py \\
        --manifest s3://bucket/run1/packed --model /models/Qwen3-VL-8B-Instruct --out ckpt

``--model`` is the model directory the shards were tokenized for (``tokenize.model``).
``--model tiny`` (Qwen2-VL) or ``tiny-<model_type>`` (``examples/tiny_models.py``) builds a
tiny random model from a hand-made config (no download): the test suite runs this script
that way on CPU (gloo). A model whose packed samples its kernels cannot keep apart
(Qwen3.5's linear attention without flash-linear-attention and causal-conv1d) is refused
before the first step. What it shows:

- every rank runs the same number of steps (``PackedDataset`` plans fillers), so no rank
  waits in a collective at the end of an epoch;
- ``model(**batch)``: the collated batch is the model's keyword arguments as they are
  (``position_ids`` [4, 1, T], no attention mask, ``use_cache=False``, flash-attn's
  ``cu_seq_lens_*``); logits are computed only where a label is supervised; ``--attn auto``
  (the default) runs ``mmpack_varlen`` on CUDA (flash-attn-4 or flash-attn if installed, else
  torch's own FlashAttention-2 varlen kernel, torch 2.4+), else SDPA: nothing to build for full
  speed;
- gradient accumulation over ``--grad-accum`` micro-batches, the loss normalised by the
  number of supervised tokens of the whole step across all ranks (not per micro-batch);
- checkpoints (model, optimizer, every rank's loader position) and an exact resume with
  torchdata's ``StatefulDataLoader``;
- ``--fsdp``: FSDP2 (``fully_shard``). Every rank must then run the vision tower as often
  as the others (its parameters are all-gathered in step), so a micro-batch without images or
  videos gets a masked idle image and video (``loader.training.with_idle_media``), for every
  family.

``--trace FILE`` appends one JSON line per micro-batch and rank (what was trained), which
is how the tests check exactly-once training.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from loader import PackedBatch, PackedDataset, collate_packed, require_sample_isolation
from loader.attention import VARLEN, use_attention, varlen_report
from loader.training import (
    dataset_losses,
    has_media,
    idle_media_settings,
    step_supervised_tokens,
    token_losses,
    traced_samples,
    weighted_sum,
    with_idle_media,
)


def tiny_models():
    """examples/tiny_models.py, imported by path (this file also runs as a loaded module)."""
    spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).with_name("tiny_models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_qwen2_vl(seed: int = 0, attn_implementation: str = "sdpa"):
    """A random Qwen2-VL small enough for a CPU, with the real Qwen2 vocabulary size (the
    shards hold real token ids) and the real vision geometry (14-px patches, 2 × 2 merge,
    2 frames deep), so it takes exactly what a full-size Qwen2-VL takes."""
    return tiny_models().tiny_model("qwen2_vl", seed, attn_implementation)


def load_model(name: str, seed: int, attn_implementation: str, device: torch.device) -> torch.nn.Module:
    """The model to train: ``attn_implementation`` "auto" picks ``mmpack_varlen`` where an exact
    varlen kernel runs (CUDA sm80+, bf16: flash-attn-4, flash-attn, else torch's own
    FlashAttention-2; vision towers in one call a layer), else SDPA (``use_attention``); rank 0
    prints which kernel and why (``varlen_report``)."""
    if name == "tiny" or name.startswith("tiny-"):
        model_type = "qwen2_vl" if name == "tiny" else name.removeprefix("tiny-")
        model = tiny_models().tiny_model(model_type, seed, "sdpa")
    else:
        from transformers import AutoModelForImageTextToText

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(name, attn_implementation="sdpa", dtype=dtype)
    if use_attention(model, attn_implementation) == VARLEN and int(os.environ.get("RANK", "0")) == 0:
        print(varlen_report(), flush=True)
    require_sample_isolation(model)
    return model.to(device)


def wrap(model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
    """DDP, or FSDP2: ``fully_shard`` on every block transformers names unsplittable (decoder
    layers, vision blocks; the outermost where they nest, as Qwen2-Audio's attention inside its
    encoder layer), then on the whole model."""
    if not fsdp:
        # A micro-batch without images or videos leaves the vision tower out of the graph on
        # that rank only: DDP must be told to look for parameters that got no gradient.
        return DistributedDataParallel(model, find_unused_parameters=True)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    sharded: set[int] = set()  # the modules inside a sharded block
    for module in model.modules():
        if type(module).__name__ in blocks and id(module) not in sharded:
            fully_shard(module)
            sharded.update(id(inner) for inner in module.modules())
    fully_shard(model)
    return model


def gradient_sync(wrapped: torch.nn.Module, sync: bool):
    """Reduce gradients across ranks on this backward (the step's last micro-batch) or not."""
    if isinstance(wrapped, DistributedDataParallel):
        return contextlib.nullcontext() if sync else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(sync)  # FSDP2
    return contextlib.nullcontext()


def micro_batch_groups(batches: Iterator[PackedBatch], size: int) -> Iterator[list[PackedBatch]]:
    """Consecutive micro-batches of one optimizer step (the last group of an epoch may be
    shorter: the same on every rank, since every rank has the same number of batches)."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def accumulate_step(
    wrapped: torch.nn.Module,
    group: list[PackedBatch],
    device: torch.device,
    idle: dict | None,
    datasets: list[str],
) -> tuple[torch.Tensor, float]:
    """Forward and backward of one optimizer step's micro-batches (gradients reduced across
    ranks on the last one). Returns this rank's summed loss and supervised tokens per dataset
    ([2, datasets], ``dataset_losses``) and the step's supervised tokens over every
    micro-batch and rank, by which the loss is normalised: each token weighs the same."""
    supervised = step_supervised_tokens(group, device).item()
    world = dist.get_world_size()
    per_dataset = torch.zeros(2, len(datasets), dtype=torch.float64)
    for i, batch in enumerate(group):
        inputs = batch.to(device)
        if idle is not None:
            inputs = with_idle_media(inputs, idle)
        with gradient_sync(wrapped, sync=i == len(group) - 1):
            losses, positions = token_losses(wrapped, inputs)
            # DDP and FSDP average gradients over ranks: scale by world size to get the global sum
            (weighted_sum(losses, positions, inputs) * world / supervised).backward()
        per_dataset += dataset_losses(losses, positions, inputs, datasets).cpu()
    return per_dataset, supervised


class Checkpoints:
    """``--out``/step-N: model and optimizer (full state, saved by rank 0, so a DDP and an
    FSDP run read each other's), each rank's loader state, progress."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root, self.rank = root, rank

    def save(self, step: int, model, optimizer, loader: StatefulDataLoader, progress: dict) -> None:
        target = self.root / f"step-{step}"
        target.mkdir(parents=True, exist_ok=True)
        torch.save(loader.state_dict(), target / f"loader-rank{self.rank}.pt")
        # every rank takes part in gathering the full state (FSDP shards it)
        weights, moments = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        if self.rank == 0:
            torch.save({"model": weights, "optimizer": moments}, target / "train.pt")
            (target / "progress.json").write_text(json.dumps(progress))
        dist.barrier()
        if self.rank == 0:
            (self.root / "latest").write_text(target.name)  # points at complete checkpoints only

    def load(self, model, optimizer, loader: StatefulDataLoader) -> dict | None:
        latest = self.root / "latest"
        if not latest.exists():
            return None
        source = self.root / latest.read_text().strip()
        state = torch.load(source / "train.pt", map_location="cpu", weights_only=True)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        loader.load_state_dict(torch.load(source / f"loader-rank{self.rank}.pt", weights_only=False))
        return json.loads((source / "progress.json").read_text())


def training_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags both training examples take (``examples/train_hf_trainer.py`` too)."""
    parser.add_argument("--manifest", required=True, help="OUT/packed, its manifest.json, or s3://...")
    parser.add_argument(
        "--model", default="tiny", help="a local model directory, 'tiny' (Qwen2-VL) or 'tiny-<model_type>'"
    )
    parser.add_argument("--out", required=True, help="checkpoint directory")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--bins-per-micro-batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--workers", type=int, default=1, help="dataloader workers per rank")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attn",
        default="auto",
        help="auto (mmpack_varlen where an exact varlen kernel runs: CUDA sm80+, bf16; else sdpa), "
        "mmpack_varlen, flash_attention_2, sdpa or eager",
    )
    parser.add_argument("--drop-remainder", action="store_true", help="no filler bins; drop the epoch's tail")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps")
    parser.add_argument("--stop-after", type=int, default=0, help="save and exit after N optimizer steps")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--trace", help="append what each training step received (JSON lines, per rank)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = training_flags(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard) instead of DDP; media-less micro-batches "
        "get a masked idle image and video so that every rank runs the vision tower alike",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    message = train(args, cuda)
    # Everything that holds the group (DDP's reducer holds it from C++) is freed before the
    # group is: freed last by the reducer at exit, with the GIL held, its destructor can wait
    # for ever on a gloo thread that needs the GIL (the group's own destructor releases it).
    gc.collect()
    dist.barrier()
    if dist.get_rank() == 0:
        print(message)
    dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, cuda: bool) -> str:
    """The training loop, checkpoints and the trace; what happened, in a line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = load_model(args.model, args.seed, args.attn, device)
    model.train()
    idle = idle_media_settings(model.config) if args.fsdp else None
    wrapped = wrap(model, args.fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dataset = PackedDataset(args.manifest, seed=args.seed, drop_remainder=args.drop_remainder)
    loader = StatefulDataLoader(
        dataset, batch_size=args.bins_per_micro_batch, collate_fn=collate_packed, num_workers=args.workers
    )
    checkpoints = Checkpoints(Path(args.out), rank)
    progress = {"epoch": 0, "step": 0}
    if args.resume:
        progress = checkpoints.load(model, optimizer, loader) or progress
    steps_per_epoch = dataset.num_batches(args.bins_per_micro_batch, args.workers)
    if rank == 0:
        print(f"{world} rank(s), {len(dataset)} bins and {steps_per_epoch} micro-batches per rank per epoch")
    trace = open(f"{args.trace}.rank{rank}", "a") if args.trace else None  # noqa: SIM115

    for epoch in range(progress["epoch"], args.epochs):
        dataset.set_epoch(epoch)  # a resumed loader continues this epoch where it stopped
        for group in micro_batch_groups(iter(loader), args.grad_accum):
            per_dataset, supervised = accumulate_step(wrapped, group, device, idle, dataset.datasets)
            dist.all_reduce(per_dataset)  # every rank's sums: the step's loss per dataset
            by_dataset = {
                name: [loss, int(tokens)]
                for name, loss, tokens in zip(dataset.datasets, *per_dataset.tolist(), strict=True)
                if tokens
            }
            if trace:
                for batch in group:
                    record = {"epoch": epoch, "step": progress["step"], "rank": rank, **_traced(batch)}
                    trace.write(json.dumps({**record, "datasets": by_dataset}) + "\n")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress["step"] += 1
            if rank == 0:
                mean = per_dataset[0].sum().item() / supervised
                parts = ", ".join(
                    f"{name} {loss / tokens:.4f}" for name, (loss, tokens) in by_dataset.items()
                )
                print(
                    f"epoch {epoch} step {progress['step']}: loss {mean:.4f} per supervised token ({parts})"
                )
            done = args.stop_after and progress["step"] >= args.stop_after
            if done or (args.save_every and progress["step"] % args.save_every == 0):
                checkpoints.save(progress["step"], model, optimizer, loader, {**progress, "epoch": epoch})
            if done:
                return _closed(trace, f"stopped after step {progress['step']}")
        progress["epoch"] = epoch + 1
    return _closed(trace, f"finished {args.epochs} epoch(s), {progress['step']} steps")


def _traced(batch: PackedBatch) -> dict:
    """What one micro-batch trained: each real sample with its supervised tokens."""
    return {"samples": traced_samples(batch), "fillers": batch.meta["fillers"], "media": has_media(batch)}


def _closed(trace, message: str) -> str:
    if trace:
        trace.close()
    return message


if __name__ == "__main__":
    sys.exit(main())
