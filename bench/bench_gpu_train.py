"""Training throughput on a GPU: packed bins vs padded micro-batches, the same samples.

    .venv/bin/python bench/bench_gpu_train.py [--bins 24] [--batch-sizes 4 8]

Data: the demo packed for Qwen2-VL (`mmpack demo`, --demo-samples, budget --budget; made once
under bench/out/gpu-train-demo-BUDGET). Model: a random Qwen2-VL at Qwen2-VL-2B's widths (text hidden
1536, 12 heads, 2 KV heads, MLP 8960; vision 1280 wide, 16 heads) cut to --text-layers and
--vision-blocks, bf16, gradient checkpointing; --smoke: the tiny Qwen2-VL of
examples/tiny_models.py in float32 on the CPU.

For the first --bins bins it measures forward + backward (summed token loss, logits only where
supervised) of:
  packed    one bin per step, each attention given (--attentions: mmpack_varlen is torch's own
            FlashAttention-2 varlen kernel through transformers; sdpa builds a block mask from
            the restarting positions; flash_attention_2 where flash-attn is installed)
  padded    the bins' samples in micro-batches of each --batch-sizes, padded to the longest, SDPA
            with an attention_mask: in random order and grouped by length
and reports real (non-padding) tokens/s, the padding share and peak GPU memory (out of memory is
a result too). Then per-sample parity: the last hidden states of each sample in a packed bin
(every attention) vs the sample alone (SDPA), against the noise between two kernels on the same
sample alone (SDPA vs eager), and a leak control (the bin with 3-row positions: no boundaries).
Last, the loader's feed rate (PackedDataset + collate_packed, --workers workers, uint8 pixels).
On the CPU (no GPU or --smoke), mmpack_varlen runs on the kernel's CPU reference.
Results: bench/out/gpu_train.json; copy the tables into bench/RESULTS.md with the device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import OUT, SMOKE_DEMO_BUDGET, SMOKE_DEMO_SAMPLES, ensure_image_demo, machine, parse_with_smoke

from loader import PackedBatch, PackedDataset, collate_packed
from loader.attention import VARLEN, reference_varlen_attn, register_varlen, use_attention
from loader.training import summed_loss

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PAD, VIDEO_PAD = 151655, 151656
QWEN2_VL_2B = {  # Qwen2-VL-2B-Instruct's config.json widths
    "text_config": {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
        "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                      "mrope_section": [16, 24, 24]},
    },
    "vision_config": {"embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4},
    "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}  # fmt: skip


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    if args.smoke:
        sys.path.insert(0, str(ROOT / "examples"))
        from tiny_models import tiny_config

        config = AutoConfig.for_model(**tiny_config("qwen2_vl"))
    else:
        spec = json.loads(json.dumps(QWEN2_VL_2B))
        spec["text_config"]["num_hidden_layers"] = args.text_layers
        spec["vision_config"]["depth"] = args.vision_blocks
        config = AutoConfig.for_model("qwen2_vl", **spec)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if not args.smoke:
        model.gradient_checkpointing_enable()
    return model.to(device).train()


# -- the samples of the bins, alone ---------------------------------------------------------------


def samples_of(batch: PackedBatch) -> list[dict[str, torch.Tensor]]:
    """Each sample of a one-bin batch as its own inputs: ids, labels, its images' and videos'
    patches and grids (in order, by their pad tokens)."""
    cu, ids = batch.meta["cu_seq_lens"], batch["input_ids"][0]
    out = [{"input_ids": ids[a:b], "labels": batch["labels"][0, a:b]} for a, b in itertools.pairwise(cu)]
    for pad, pixels_key, grid_key in ((IMAGE_PAD, "pixel_values", "image_grid_thw"),
                                      (VIDEO_PAD, "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        if grid_key not in batch:
            continue
        grids, item, row = batch[grid_key], 0, 0
        for sample in out:
            tokens, mine = int((sample["input_ids"] == pad).sum()), []
            while tokens > 0:
                tokens -= int(grids[item].prod()) // 4
                mine.append(item)
                item += 1
            if mine:
                rows = sum(int(grids[i].prod()) for i in mine)
                sample[pixels_key], sample[grid_key] = batch[pixels_key][row : row + rows], grids[mine]
                row += rows
    return out


def padded_batch(samples: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Samples padded on the right to the longest, with an attention_mask (what a padded loop feeds)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask, "use_cache": False}
    kinds = (ids == IMAGE_PAD).int() + 2 * (ids == VIDEO_PAD).int()
    out["mm_token_type_ids"] = kinds
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            out[key] = torch.cat(parts)
    return out


def padded_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed token loss of a padded micro-batch, logits only where supervised."""
    from torch.nn.functional import cross_entropy

    inputs = dict(batch)
    labels = inputs.pop("labels")
    hidden = model.model(**inputs).last_hidden_state
    rows, cols = torch.nonzero(labels[:, 1:] != -100, as_tuple=True)
    logits = model.lm_head(hidden[rows, cols])
    return cross_entropy(logits.float(), labels[rows, cols + 1], reduction="sum")


# -- timing ---------------------------------------------------------------------------------------


def measure(model, steps: Sequence[Any], loss: Callable, device: torch.device) -> dict[str, Any]:
    """Forward + backward of every step (on a GPU the first once more beforehand, not timed: its
    kernels' warm-up): seconds and peak memory; "out of memory" when a step does not fit."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            loss(model, steps[0]).backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for step in steps:
            loss(model, step).backward()
            model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"result": "out of memory"}
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"seconds": round(seconds, 3), "peak_gib": round(peak, 2) if peak else None}


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    out = batch.to(device) if isinstance(batch, PackedBatch) else {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }  # fmt: skip
    for key in ("pixel_values", "pixel_values_videos"):
        if key in out:
            out[key] = out[key].to(dtype)
    return out


def throughput(args, model, bins: list[PackedBatch], device, dtype) -> list[dict[str, Any]]:
    samples = [s for b in bins for s in samples_of(b)]
    real = sum(len(s["input_ids"]) for s in samples)
    rows = []
    packed = [to_device(b, device, dtype) for b in bins]
    for name in args.attentions:
        use_attention(model, name)
        result = measure(model, packed, summed_loss, device)
        rows.append({"batches": "packed bins", "attention": name, "padding": 0.0, **result})
    model.set_attn_implementation("sdpa")
    for size, order in itertools.product(args.batch_sizes, ("random", "length-grouped")):
        chosen = list(samples)
        random.Random(0).shuffle(chosen)
        if order == "length-grouped":  # sorted within windows of 16 micro-batches, as Trainer's sampler
            window = 16 * size
            windows = [chosen[i : i + window] for i in range(0, len(chosen), window)]
            chosen = [s for w in windows for s in sorted(w, key=lambda s: -len(s["input_ids"]))]
        batches = [padded_batch(chosen[i : i + size], 0) for i in range(0, len(chosen), size)]
        slots = sum(b["input_ids"].numel() for b in batches)
        result = measure(model, [to_device(b, device, dtype) for b in batches], padded_loss, device)
        rows.append({"batches": f"padded, micro-batches of {size}, {order}", "attention": "sdpa",
                     "padding": round(1 - real / slots, 4), **result})  # fmt: skip
    for row in rows:
        if "seconds" in row:
            row["real_tokens_per_s"] = round(real / row["seconds"])
    return rows


# -- parity ---------------------------------------------------------------------------------------


def last_hidden(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.model(**{k: v for k, v in inputs.items() if k != "labels"}).last_hidden_state[0]


def alone_inputs(sample: dict, device, dtype) -> dict:
    inputs = padded_batch([sample], 0)
    inputs.pop("attention_mask")
    return to_device(inputs, device, dtype)


def parity(args, model, bins: list[PackedBatch], device, dtype) -> dict[str, Any]:
    """Max and median |packed − alone| of each sample's last hidden states, per attention; the
    kernel noise (alone: SDPA vs eager); the leak control (3-row positions, samples after the
    first)."""
    model.eval()
    diffs: dict[str, list[float]] = {name: [] for name in args.attentions}
    noise, leak, scale = [], [], 0.0
    for batch in bins[: args.parity_bins]:
        inputs = to_device(batch, device, dtype)
        cu, samples = batch.meta["cu_seq_lens"], samples_of(batch)
        model.set_attn_implementation("sdpa")
        alone = [last_hidden(model, alone_inputs(s, device, dtype)) for s in samples]
        model.set_attn_implementation("eager")
        eager = [last_hidden(model, alone_inputs(s, device, dtype)) for s in samples]
        noise += [float((a - e).abs().max()) for a, e in zip(alone, eager, strict=True)]
        scale = max(scale, *(float(a.abs().max()) for a in alone))
        for name in args.attentions:
            use_attention(model, name)
            packed = last_hidden(model, inputs)
            diffs[name] += [float((packed[a:b] - x).abs().max())
                            for (a, b), x in zip(itertools.pairwise(cu), alone, strict=True)]  # fmt: skip
        model.set_attn_implementation("sdpa")
        leaky = last_hidden(model, {**inputs, "position_ids": inputs["position_ids"][1:]})
        later = itertools.islice(zip(itertools.pairwise(cu), alone, strict=True), 1, None)
        leak += [float((leaky[a:b] - x).abs().max()) for (a, b), x in later]
    model.train()

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        middle = ordered[len(ordered) // 2]
        return {"max": round(ordered[-1], 4), "median": round(middle, 4), "samples": len(values)}

    return {"packed_vs_alone": {name: summary(v) for name, v in diffs.items()},
            "kernel_noise_sdpa_vs_eager": summary(noise), "largest_value": round(scale, 2),
            "leak_control_min": round(min(leak), 4) if leak else None}  # fmt: skip


def feed_rate(manifest: str, workers: int, bins: int) -> dict[str, Any]:
    """Tokens/s the loader hands over (uint8 pixels), over the first ``bins`` bins."""
    from torch.utils.data import DataLoader

    dataset = PackedDataset(manifest, seed=0, pixel_dtype="uint8")
    loader = DataLoader(dataset, batch_size=1, collate_fn=collate_packed, num_workers=workers)
    start, tokens = time.perf_counter(), 0
    for batch in itertools.islice(iter(loader), bins):
        tokens += batch.meta["num_tokens"]
    seconds = time.perf_counter() - start
    return {"workers": workers, "bins": bins, "tokens": tokens, "tokens_per_s": round(tokens / seconds)}


def first_bins(manifest: str, count: int, smallest: bool = False) -> list[PackedBatch]:
    """The epoch's first ``count`` bins; ``smallest``: the ``count`` bins of fewest tokens among
    those of two samples or more (the smoke run's: seconds on a CPU, a leak control still)."""
    items: Iterable[dict[str, Any]] = PackedDataset(manifest, seed=0)
    if smallest:
        several = [item for item in items if len(item["sample_ids"]) > 1]
        items = sorted(several, key=lambda item: len(item["input_ids"]))
    return [collate_packed([item]) for item in itertools.islice(items, count)]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--demo-samples", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=16384, help="pack.budget of the demo")
    parser.add_argument("--bins", type=int, default=24, help="bins timed (their samples, padded, too)")
    parser.add_argument("--parity-bins", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--attentions", nargs="+", default=[VARLEN, "sdpa"])
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--vision-blocks", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8, help="loader workers for the feed rate")
    args = parse_with_smoke(
        parser, demo_samples=SMOKE_DEMO_SAMPLES, budget=SMOKE_DEMO_BUDGET, bins=1, parity_bins=1,
        batch_sizes=[2], workers=0,
    )  # fmt: skip
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if VARLEN in args.attentions:
        register_varlen() if cuda else register_varlen(kernel=reference_varlen_attn)
    name = "loader-demo" if args.smoke else f"gpu-train-demo-{args.budget}"  # smoke: bench_loader's
    manifest = str(ensure_image_demo(args.demo_samples, budget=args.budget, name=name))
    model = build_model(args, device, dtype)
    bins = first_bins(manifest, args.bins, smallest=args.smoke)
    results = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "bins": len(bins),
        "throughput": throughput(args, model, bins, device, dtype),
        "parity": parity(args, model, bins, device, dtype),
        "feed": feed_rate(manifest, args.workers, args.bins),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_train.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    packed = [r for r in results["throughput"] if r["batches"] == "packed bins"]
    if not all(d["max"] == d["max"] for d in results["parity"]["packed_vs_alone"].values()):
        sys.exit("a packed sample's hidden states hold NaN")
    print("| batches | attention | real tokens/s | padding | peak GiB |")
    for row in results["throughput"]:
        print(f"| {row['batches']} | {row['attention']} | {row.get('real_tokens_per_s', row.get('result'))} "
              f"| {row['padding']:.1%} | {row.get('peak_gib')} |")  # fmt: skip
    assert packed, "no packed configuration measured"


if __name__ == "__main__":
    main()
