"""One device call that checks mmpack's attention on a GPU: kernels, parity, throughput.

    make gpu-check        # python3 bench/gpu_check.py, on the GPU machine's own Python and torch

It installs nothing and reaches no network: the machine's torch (whatever release: the kernels
are resolved for it, loader/varlen_kernels.py), its transformers, or the wheels under
bench/gpu-wheels/ that ``make gpu-check`` installs first (carry them: transformers 5.24 is ~12 MB).
The data is the demo packed for Qwen2-VL (bench/out/gpu-train-demo-BUDGET, made by
``bench_gpu_train.py`` on a machine with Spark: carry it); any more packs under
bench/out/gpu-check-packs/<model_type>/packed are checked for parity too. In order:

1. ``varlen_report()``: the kernel mmpack_varlen runs on and why, with torch and the device.
2. Kernels: every kernel this machine resolves, in bf16, forward and backward with GQA (8 query
   heads, 2 KV heads), head dims 64 and 128, causal, a causal window, bidirectional: the largest
   difference from float32 attention over each sequence alone, against the difference of
   bf16 SDPA over each sequence alone (the precision's own noise); gradient shapes; NaNs.
3. Parity: on tiny random models in bf16 (Qwen2-VL at 2B widths cut to a few layers, and each
   carried family pack), each sample's last hidden states packed vs alone under every attention
   (each kernel of mmpack_varlen, SDPA, eager), against SDPA-vs-eager noise alone; a leak control.
4. Throughput at Qwen2-VL-2B widths: packed bins under each kernel and SDPA, padded micro-batches
   (random and length-grouped) at each batch size, peak memory, the vision tower's share of the
   step, the packed step's model FLOP/s and utilisation (FLOPs from the widths, attention from
   Σ l²), and the loader's feed rate.

Output: bench/out/gpu_check.json and bench/out/gpu_check.md (copy the table into
bench/RESULTS.md with the device and torch). ``--smoke`` runs every part on a CPU in float32 on
the kernel's CPU reference, in seconds (``make test``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import bench_gpu_train as train
import torch
import torch.nn.functional as F
from common import OUT, SMOKE_DEMO_BUDGET, SMOKE_DEMO_SAMPLES, ensure_image_demo, machine, parse_with_smoke

from loader import PackedBatch
from loader.attention import VARLEN, reference_varlen_attn, register_varlen, use_attention, varlen_report
from loader.training import summed_loss
from loader.varlen_kernels import VarlenKernel, cuda_capability, resolve_kernels

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12}  # dense


# -- 2. kernels ------------------------------------------------------------------------------------


def per_sequence(q, k, v, cu, window, scale=None) -> torch.Tensor:
    """Each sequence alone, SDPA with its window as a mask, in the inputs' dtype."""
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        n = b - a
        offset = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if window[0] >= 0:
            allowed &= offset >= -window[0]
        if window[1] >= 0:
            allowed &= offset <= window[1]
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def check_kernel(
    kernel: VarlenKernel, device: torch.device, dtype: torch.dtype, dims: list[int]
) -> list[dict[str, Any]]:
    """``kernel`` against float32 attention of each sequence alone, forward and backward."""
    rows = []
    lengths = [700, 1, 301, 1024, 66]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    for dim, window in itertools.product(dims, ((-1, 0), (127, 0), (-1, -1))):
        generator = torch.Generator(device="cpu").manual_seed(dim)
        tensors = [torch.randn(cu[-1].item(), heads, dim, generator=generator) for heads in (8, 2, 2)]
        inputs = [t.to(device, dtype).requires_grad_() for t in tensors]
        exact = [t.to(device, torch.float32).requires_grad_() for t in tensors]
        got = kernel.call(*inputs, cu, cu, max(lengths), max(lengths), window_size=window, enable_gqa=True)
        want = per_sequence(*exact, cu, window)
        noise_out = per_sequence(*(t.detach().to(dtype) for t in exact), cu, window)
        grad = torch.randn(want.shape, generator=generator).to(device)
        got.backward(grad.to(dtype))
        want.backward(grad)
        rows.append({
            "kernel": kernel.name, "head_dim": dim, "window": list(window),
            "out_diff": _max_diff(got, want), "out_noise_bf16_sdpa": _max_diff(noise_out, want),
            "grad_diff": max(_max_diff(a.grad, b.grad) for a, b in zip(inputs, exact, strict=True)),
            "grad_shapes_ok": all(a.grad.shape == a.shape for a in inputs),
            "nan": int(got.isnan().sum()) + sum(int(a.grad.isnan().sum()) for a in inputs),
        })  # fmt: skip
    return rows


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).abs().max()), 5)


# -- 3. parity, 4. throughput ----------------------------------------------------------------------


def kernels_to_run(cuda: bool) -> list[VarlenKernel]:
    """What mmpack_varlen can run on here: each resolved kernel, or on a CPU the reference."""
    if cuda:
        return resolve_kernels(cuda_capability())
    return [VarlenKernel("reference_varlen_attn (CPU)", reference_varlen_attn, "smoke run", lambda d: True)]


def with_kernel(model: torch.nn.Module, kernel: VarlenKernel) -> str:
    """``model`` on mmpack_varlen over ``kernel`` alone (its vision tower in one call); the
    attention's name in the results."""
    register_varlen(kernel=kernel.call)
    use_attention(model, VARLEN)
    return f"{VARLEN} [{kernel.name}]"


def parity_rows(args, model, bins: list[PackedBatch], kernels, device, dtype) -> dict[str, Any]:
    """bench_gpu_train's parity (packed vs alone per attention, SDPA-vs-eager noise, leak) with
    mmpack_varlen on each kernel, and NaN counts."""
    results: dict[str, Any] = {}
    for kernel in kernels:
        name = with_kernel(model, kernel)
        args.attentions = [VARLEN]
        summary = train.parity(args, model, bins, device, dtype)
        results[name] = summary["packed_vs_alone"][VARLEN]
        results.update({k: v for k, v in summary.items() if k != "packed_vs_alone"})
    args.attentions = ["sdpa", "eager"]
    summary = train.parity(args, model, bins, device, dtype)
    results.update(summary["packed_vs_alone"])
    results["nan"] = any(row["max"] != row["max"] for row in results.values() if isinstance(row, dict))
    return results


def vision_seconds(model, bins: list[PackedBatch], device) -> float | None:
    """Forward + backward of the vision tower alone over the bins' images and videos."""
    visual = getattr(model.model, "visual", None)
    if visual is None:
        return None
    keys = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
    steps = [(b[pixels], b[grid]) for b in bins for pixels, grid in keys if grid in b]

    def loss(_, step):
        out = visual(step[0], grid_thw=step[1])
        return (out.pooler_output if hasattr(out, "pooler_output") else out).float().sum()

    return train.measure(model, steps, loss, device).get("seconds")


def step_flops(config, bins: list[PackedBatch]) -> float:
    """Training FLOPs of the bins (forward + backward = 3 × forward): 6·N per token for the
    language model's and vision tower's matrices, attention 6·Σ l²·width per layer causal (half of
    12) and 12·Σ p²·width per vision block (bidirectional, each image or frame its own sequence)."""
    text, vision = config.text_config, config.vision_config
    width, layers, ffn = text.hidden_size, text.num_hidden_layers, text.intermediate_size
    kv = text.num_key_value_heads * (width // text.num_attention_heads)
    per_token = layers * (2 * width * width + 2 * width * kv + 3 * width * ffn)
    vis_width = vision.embed_dim
    per_patch = vision.depth * (4 * vis_width * vis_width + 2 * vis_width * int(vis_width * vision.mlp_ratio))
    flops = 0.0
    for batch in bins:
        cu = torch.tensor(batch.meta["cu_seq_lens"])
        tokens, squares = int(cu[-1]), float((cu.diff().double() ** 2).sum())
        flops += 6 * per_token * tokens + 6 * layers * width * squares
        for key in ("image_grid_thw", "video_grid_thw"):
            if key in batch:
                grid = batch[key]
                frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).double()
                attention = 12 * vision.depth * vis_width * float((frames**2).sum())
                flops += 6 * per_patch * float(frames.sum()) + attention
    return flops


def throughput_rows(args, model, bins, kernels, device, dtype) -> list[dict[str, Any]]:
    rows = []
    packed = [train.to_device(b, device, dtype) for b in bins]
    real = sum(b.meta["num_tokens"] for b in bins)
    flops = step_flops(model.config, bins)
    name = _device_name() if device.type == "cuda" else ""
    peak = next((flops_per_s for gpu, flops_per_s in PEAK_BF16_FLOPS.items() if gpu in name), None)
    for kernel in kernels:
        name = with_kernel(model, kernel)
        result = train.measure(model, packed, summed_loss, device)
        vision = vision_seconds(model, packed, device)
        row = {"batches": "packed bins", "attention": name, "padding": 0.0, **result}
        if "seconds" in result:
            row["vision_share"] = round(vision / result["seconds"], 3) if vision else None
            row["model_tflops_per_s"] = round(flops / result["seconds"] / 1e12, 2)
            row["mfu"] = round(flops / result["seconds"] / peak, 3) if peak else None
        rows.append(row)
    args.attentions = ["sdpa"]
    model.set_attn_implementation("sdpa")
    rows += train.throughput(args, model, bins, device, dtype)
    for row in rows:
        if "seconds" in row:
            row["real_tokens_per_s"] = round(real / row["seconds"])
    return rows


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


FAMILY_PACKS = ("qwen2_vl", "qwen3_vl")  # what bench_gpu_train.samples_of cuts alone: Qwen2 ids, images


def family_packs(root: Path) -> list[tuple[str, Path]]:
    """Carried packs of the families whose samples ``samples_of`` cuts out of a bin."""
    return [(name, root / name / "packed") for name in FAMILY_PACKS if (root / name / "packed").exists()]


def tiny_family_model(model_type: str, device, dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    sys.path.insert(0, str(train.ROOT / "examples"))
    from tiny_models import tiny_config

    torch.manual_seed(0)
    config = AutoConfig.for_model(**tiny_config(model_type))
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)


def markdown(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}; torch {results['torch']}; transformers {results['transformers']}",
             "", "```", results["varlen_report"], "```", "",
             "| kernel | head dim | window | out diff | bf16 SDPA noise | grad diff | NaN |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in results["kernels"]:
        lines.append(f"| {row['kernel']} | {row['head_dim']} | {tuple(row['window'])} | {row['out_diff']} "
                     f"| {row['out_noise_bf16_sdpa']} | {row['grad_diff']} | {row['nan']} |")  # fmt: skip
    lines += ["", "| model | attention | packed vs alone, max | median |", "|---|---|---|---|"]
    for model, summary in results["parity"].items():
        for name, row in summary.items():
            if isinstance(row, dict):
                lines.append(f"| {model} | {name} | {row['max']} | {row['median']} |")
        lines.append(f"| {model} | leak control (min) | {summary.get('leak_control_min')} | |")
    header = "| batches | attention | real tokens/s | padding | peak GiB | vision share | TFLOP/s | MFU |"
    lines += ["", header, "|---|---|---|---|---|---|---|---|"]
    for row in results["throughput"]:
        lines.append(
            f"| {row['batches']} | {row['attention']} | {row.get('real_tokens_per_s', row.get('result'))} "
            f"| {row['padding']:.1%} | {row.get('peak_gib')} | {row.get('vision_share')} "
            f"| {row.get('model_tflops_per_s')} | {row.get('mfu')} |"
        )
    lines.append(f"\nloader feed: {results['feed']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--demo-samples", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=16384, help="pack.budget of the demo")
    parser.add_argument("--bins", type=int, default=16, help="bins timed")
    parser.add_argument("--parity-bins", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--vision-blocks", type=int, default=8)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--workers", type=int, default=8, help="loader workers for the feed rate")
    parser.add_argument("--packs", type=Path, default=OUT / "gpu-check-packs", help="more families' packs")
    parser.add_argument("--prepare", action="store_true", help="only make the demo pack (Spark)")
    args = parse_with_smoke(
        parser, demo_samples=SMOKE_DEMO_SAMPLES, budget=SMOKE_DEMO_BUDGET, bins=1, parity_bins=1,
        batch_sizes=[2], workers=0, head_dims=[16],
    )  # fmt: skip
    if args.prepare:
        print(ensure_image_demo(args.demo_samples, budget=args.budget, name=f"gpu-train-demo-{args.budget}"))
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    register_varlen()  # resolved for this machine: what the report says
    import transformers

    results: dict[str, Any] = {"machine": machine(), "device": _device_name() if cuda else "cpu",
                               "torch": torch.__version__, "transformers": transformers.__version__,
                               "dtype": str(dtype), "varlen_report": varlen_report()}  # fmt: skip
    print(results["varlen_report"], flush=True)
    kernels = kernels_to_run(cuda)
    started = time.perf_counter()
    results["kernels"] = [row for k in kernels for row in check_kernel(k, device, dtype, args.head_dims)]
    name = "loader-demo" if args.smoke else f"gpu-train-demo-{args.budget}"
    manifest = str(ensure_image_demo(args.demo_samples, budget=args.budget, name=name))
    model = train.build_model(args, device, dtype)
    bins = train.first_bins(manifest, args.bins, smallest=args.smoke)
    parity_bins = bins[: args.parity_bins]
    parity = parity_rows(args, model, parity_bins, kernels, device, dtype)
    results["parity"] = {"qwen2_vl (2B widths)": parity}
    packs = [("qwen2_vl", Path(manifest))] if args.smoke else family_packs(args.packs)  # smoke: the demo's
    for model_type, pack in packs:
        family_model = tiny_family_model(model_type, device, dtype)
        family_bins = train.first_bins(str(pack), args.parity_bins, smallest=True)
        results["parity"][model_type] = parity_rows(args, family_model, family_bins, kernels, device, dtype)
    results["throughput"] = throughput_rows(args, model, bins, kernels, device, dtype)
    results["feed"] = train.feed_rate(manifest, args.workers, args.bins)
    results["seconds"] = round(time.perf_counter() - started, 1)
    register_varlen()  # as the run found it
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (OUT / "gpu_check.md").write_text(table)
    print(table)
    if any(row["nan"] for row in results["kernels"]) or any(p["nan"] for p in results["parity"].values()):
        sys.exit("NaN in a kernel's output or a packed sample's hidden states")


if __name__ == "__main__":
    main()
