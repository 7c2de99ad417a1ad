"""One device call that checks mmpack's attention on a GPU: kernels, parity, throughput.

    make gpu-check        # python3 bench/gpu_check.py, on the GPU machine's own Python and torch

It installs nothing and reaches no network: the machine's torch (whatever release: the kernels
are resolved for it, loader/varlen_kernels.py), its transformers, or the wheels under
bench/gpu-wheels/ that ``make gpu-check`` installs first (carry them: transformers 5.24 is ~13 MB;
PyAV, ~36 MB, only for the audio lines' packs). ``--families-only``: the kernels and tiny families.
The data: the demo packed for Qwen2-VL (bench/out/gpu-train-demo-BUDGET/packed) and each
family's demo packed for its tiny model directory (bench/out/gpu-check-packs/<model_type>/packed),
both made by ``--prepare`` on a machine with Spark, then carried (~12 MB, media embedded). In order:

1. ``varlen_report()``: the kernel mmpack_varlen runs on and why, with torch and the device.
2. Kernels: every kernel this machine resolves, in bf16, forward and backward with GQA (8 query
   heads, 2 KV heads), head dims 64 and 128, causal, a causal window, bidirectional: the largest
   difference from float32 attention over each sequence alone, against the difference of
   bf16 SDPA over each sequence alone (the precision's own noise); gradient shapes; NaNs.
3. Parity, in bf16: a random Qwen2-VL at 2B widths cut to a few layers, each sample packed vs
   alone under every attention (each kernel of mmpack_varlen, SDPA, eager) against SDPA-vs-eager
   noise alone, and a leak control; then a tiny random model of every family on its pack, each
   packed sample under every attention against the same bins in float32 under SDPA (equal to
   each sample alone: the CPU parity suites), NaN counts, a leak control, refusals as results.
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
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import bench_gpu_train as train
import torch
import torch.nn.functional as F
from common import OUT, SMOKE_DEMO_BUDGET, SMOKE_DEMO_SAMPLES, ensure_image_demo, machine, parse_with_smoke

from loader import PackedBatch, PackingUnsupported, require_sample_isolation
from loader.attention import (
    VARLEN,
    reference_varlen_attn,
    register_varlen,
    sequence_mask,
    use_attention,
    varlen_report,
    with_model_masks,
)
from loader.training import summed_loss
from loader.varlen_kernels import VarlenKernel, aten_flash_kernel, cuda_capability, resolve_kernels

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12}  # dense


# -- 2. kernels ------------------------------------------------------------------------------------


def per_sequence(q, k, v, cu, window, scale=None) -> torch.Tensor:
    """Each sequence alone, SDPA with its window (``sequence_mask``) as a mask, in the inputs' dtype."""
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        allowed = sequence_mask(torch.tensor([0, b - a], device=q.device), window)
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
    return round(float((a.detach().float() - b.detach().float()).abs().max()), 5)


# -- 3. parity, 4. throughput ----------------------------------------------------------------------


def kernels_to_run(cuda: bool) -> list[VarlenKernel]:
    """What mmpack_varlen can run on here: each resolved kernel and the FlashAttention-2 op under
    them, or on a CPU the reference."""
    if cuda:
        kernels = resolve_kernels(cuda_capability())
        aten = aten_flash_kernel()
        if aten is not None and all(kernel.name != aten.name for kernel in kernels):
            kernels.append(aten)  # torch 2.4-2.9's path, checked beside varlen_attn
        return kernels
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
    device_name = _device_name() if device.type == "cuda" else ""
    peak = next((flops_per_s for gpu, flops_per_s in PEAK_BF16_FLOPS.items() if gpu in device_name), None)
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


# The families checked on carried packs (``--prepare`` makes them, one tiny model directory each,
# tests/models/build.py): Qwen3.5 only where flash-linear-attention and causal-conv1d are installed;
# the audio lines' loader needs PyAV (carry its wheel)
FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "llava_onevision", "gemma3",
    "gemma4", "gemma4_moe", "glm4v", "glm4v_moe", "glm46v", "glm_ocr",
    "qwen2_audio", "qwen2_5_omni", "qwen3_omni",
)  # fmt: skip
FAMILY_BUDGET = {"internvl": 2048, "llava_onevision": 2048}  # a tile is 256 tokens; the rest 1,024


def prepare_packs(root: Path, samples: int) -> None:
    """Each family's demo, tokenized for its tiny model directory and packed into small bins;
    only the packs (media embedded, ~0.3 MB each) are kept under ``root``, to carry."""
    import shutil
    import subprocess
    import tempfile

    build_model_dir = _model_dirs().build_model_dir

    for model_type in FAMILIES:
        if (root / model_type / "packed" / "manifest.json").exists():
            continue
        with tempfile.TemporaryDirectory() as work:
            name = "qwen2_5_vl" if model_type == "qwen2_vl" else model_type  # the same files, another config
            model = build_model_dir(name, Path(work) / "model")
            if model_type == "qwen2_vl":
                model = _as_qwen2_vl(model, Path(work) / "qwen2_vl")
            settings = [f"tokenize.model={model}", f"pack.budget={FAMILY_BUDGET.get(model_type, 1024)}",
                        "pack.oversize=skip"]  # fmt: skip
            out = Path(work) / "run"
            command = [sys.executable, "-m", "mmpack_udfs.cli", "demo", "--out", str(out),
                       "--master", "local[2]", "--samples", str(samples)]  # fmt: skip
            command += [part for setting in settings for part in ("--set", setting)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            shutil.copytree(out / "packed", root / model_type / "packed")
        print(f"{model_type}: {root / model_type / 'packed'}", flush=True)


def _as_qwen2_vl(source: Path, target: Path) -> Path:
    """A Qwen2-VL directory: Qwen2.5-VL's published files with a tiny Qwen2-VL config.json."""
    import shutil

    shutil.copytree(source, target, dirs_exist_ok=True)
    (target / "config.json").write_text(json.dumps(_model_dirs().tiny_models().tiny_config("qwen2_vl")))
    return target


def family_packs(root: Path) -> list[tuple[str, Path]]:
    """The carried family packs."""
    return [(name, root / name / "packed") for name in FAMILIES if (root / name / "packed").exists()]


def tiny_family_model(family: str, device, dtype) -> torch.nn.Module:
    """examples/tiny_models.py's random tiny model of ``family``'s model directory (its config's
    model_type: an Omni directory's is its thinker's), seed 0, in ``dtype``."""
    dirs = _model_dirs()
    model_type = dirs.MODELS[family][1] if family in dirs.MODELS else family  # qwen2_vl: _as_qwen2_vl's
    return dirs.tiny_models().tiny_model(model_type, seed=0).to(device, dtype)


def _model_dirs():
    """tests/models/build.py: the tests' model directories (their published files), tiny models."""
    if str(train.ROOT) not in sys.path:
        sys.path.insert(0, str(train.ROOT))
    from tests.models import build

    return build


def packed_hidden(model, batch: PackedBatch, device, dtype) -> torch.Tensor:
    """The last hidden states of a packed batch, in the attention's form of its masks (Gemma 3):
    the whole model's forward (an Omni thinker's ``model`` is its text model alone)."""
    inputs = with_model_masks(train.to_device(batch, device, dtype), model)
    inputs = {k: v.to(dtype) if k == "input_features" else v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states[-1][0].float()


def family_bins(pack: Path, count: int) -> list[PackedBatch]:
    """The ``count`` smallest bins of two samples or more, and the smallest with audio where those
    have none (an audio line's pack)."""
    several = train.first_bins(str(pack), 10**9, smallest=True)  # a family's pack is a few bins
    bins = several[:count]
    if not any("input_features" in b for b in bins):
        bins += [b for b in several[count:] if "input_features" in b][:1]
    return bins


BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def without_boundaries(batch: PackedBatch) -> PackedBatch:
    """The leak control: one sequence for the whole bin (positions counting on, no cu_seq_lens)."""
    out = type(batch)({k: v for k, v in batch.items() if k not in BOUNDARY_KWARGS})
    out.meta = dict(batch.meta)
    positions = batch["position_ids"].clone()
    length = positions.shape[-1]
    if positions.dim() == 3:  # Qwen-VL: the text row finds the samples
        positions[0] = torch.arange(length)
    else:
        positions[...] = torch.arange(length)
    out["position_ids"] = positions
    return out


def family_parity(model_type: str, pack: Path, kernels, device, dtype, count: int) -> dict[str, Any]:
    """A tiny random model of the family, in ``dtype``: each packed sample's last hidden states
    under every attention (each kernel of mmpack_varlen, SDPA, eager) against the same packed bins
    in float32 under SDPA (equal to each sample alone: the CPU parity suites), SDPA's and eager's
    own differences from it the precision's noise; a leak control (no boundaries; not Gemma 3 or
    4, whose masks carry them); NaN counts. A refusal (Gemma 3 under a varlen kernel, Qwen3.5 without
    its kernels) is a result."""
    bins = family_bins(pack, count)
    reference_model = tiny_family_model(model_type, device, torch.float32)
    try:
        require_sample_isolation(reference_model)
    except PackingUnsupported as refusal:
        return {"refused": str(refusal)}
    reference = [packed_hidden(reference_model, b, device, torch.float32) for b in bins]
    model = tiny_family_model(model_type, device, dtype)
    attentions = [(with_kernel, kernel) for kernel in kernels] + [(None, "sdpa"), (None, "eager")]
    results: dict[str, Any] = {}
    for setter, what in attentions:
        name = setter(model, what) if setter else what
        if not setter:
            model.set_attn_implementation(what)
        try:
            hidden = [packed_hidden(model, b, device, dtype) for b in bins]
        except PackingUnsupported as refusal:
            results[name] = {"refused": str(refusal).split(": ", 1)[-1][:120]}
            continue
        diffs = [
            float((h[a:b] - r[a:b]).abs().max())
            for h, r, batch in zip(hidden, reference, bins, strict=True)
            for a, b in itertools.pairwise(batch.meta["cu_seq_lens"])
        ]
        results[name] = {"max": round(max(diffs), 4), "median": round(sorted(diffs)[len(diffs) // 2], 4),
                         "samples": len(diffs), "nan": sum(int(h.isnan().sum()) for h in hidden)}  # fmt: skip
    if not isinstance(bins[0].get("attention_mask"), dict):  # masks (Gemma 3, 4) carry the boundaries
        model.set_attn_implementation("sdpa")
        leaky = [packed_hidden(model, without_boundaries(b), device, dtype) for b in bins]
        later = [float((h[a:] - r[a:]).abs().max()) for h, r, b in zip(leaky, reference, bins, strict=True)
                 for a in b.meta["cu_seq_lens"][1:-1]]  # fmt: skip
        results["leak_control_min"] = round(min(later), 4) if later else None
    results["nan"] = any(row.get("nan") for row in results.values() if isinstance(row, dict))
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}; torch {results['torch']}; transformers {results['transformers']}",
             "", "```", results["varlen_report"], "```", "",
             "| kernel | head dim | window | out diff | bf16 SDPA noise | grad diff | NaN |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in results.get("kernels", []):
        lines.append(f"| {row['kernel']} | {row['head_dim']} | {tuple(row['window'])} | {row['out_diff']} "
                     f"| {row['out_noise_bf16_sdpa']} | {row['grad_diff']} | {row['nan']} |")  # fmt: skip
    title = "| model | attention | packed vs alone (tiny: vs packed float32 SDPA), max | median |"
    lines += ["", title, "|---|---|---|---|"]
    for model, summary in results.get("parity", {}).items():
        for name, row in summary.items():
            if isinstance(row, dict) and "refused" in row:
                lines.append(f"| {model} | {name} | refused: {row['refused']} | |")
            elif isinstance(row, dict):
                lines.append(f"| {model} | {name} | {row['max']} | {row['median']} |")
        if "refused" in summary:
            lines.append(f"| {model} | all | refused: {summary['refused']} | |")
        lines.append(f"| {model} | leak control (min) | {summary.get('leak_control_min')} | |")
    header = "| batches | attention | real tokens/s | padding | peak GiB | vision share | TFLOP/s | MFU |"
    lines += ["", header, "|---|---|---|---|---|---|---|---|"]
    for row in results.get("throughput", []):
        lines.append(
            f"| {row['batches']} | {row['attention']} | {row.get('real_tokens_per_s', row.get('result'))} "
            f"| {row['padding']:.1%} | {row.get('peak_gib')} | {row.get('vision_share')} "
            f"| {row.get('model_tflops_per_s')} | {row.get('mfu')} |"
        )
    lines.append(f"\nloader feed: {results.get('feed')}")
    lines += [f"\nfailed: {name}" for name in results.get("errors", {})]
    return "\n".join(lines) + "\n"


class Sections:
    """Runs the check's parts one by one: a part that raises is recorded (its traceback, under
    "errors") and the rest still run; the JSON and table are written after every part, so a run cut
    short by the machine's time limit keeps what it measured."""

    def __init__(self, results: dict[str, Any], started: float) -> None:
        self.results, self.started = results, started

    def __call__(self, name: str, compute: Callable[[], Any], into: dict[str, Any] | None = None) -> None:
        """``compute()`` stored as ``name`` in the results (or in ``into``)."""
        try:
            (self.results if into is None else into)[name] = compute()
        except Exception:
            failure = traceback.format_exc()
            self.results.setdefault("errors", {})[name] = failure[-3000:]
            print(failure, file=sys.stderr, flush=True)
        print(f"gpu-check: {name} done at {time.perf_counter() - self.started:.0f} s", flush=True)
        self.write()

    def write(self) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_check.json").write_text(json.dumps(self.results, indent=2))
        (OUT / "gpu_check.md").write_text(markdown(self.results))


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
    parser.add_argument("--family-samples", type=int, default=60, help="--prepare: demo samples a family")
    parser.add_argument("--prepare", action="store_true", help="only make the demo pack (Spark)")
    parser.add_argument("--families-only", action="store_true", help="kernels and the tiny families' parity")
    args = parse_with_smoke(
        parser, demo_samples=SMOKE_DEMO_SAMPLES, budget=SMOKE_DEMO_BUDGET, bins=1, parity_bins=1,
        batch_sizes=[], workers=0, head_dims=[16],  # padded batches: bench_gpu_train's smoke
    )  # fmt: skip
    if args.prepare:
        print(ensure_image_demo(args.demo_samples, budget=args.budget, name=f"gpu-train-demo-{args.budget}"))
        prepare_packs(args.packs, args.family_samples)
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
    section = Sections(results, started)

    def kernel_rows() -> list[dict[str, Any]]:
        return [row for k in kernels for row in check_kernel(k, device, dtype, args.head_dims)]

    section("kernels", kernel_rows)
    results["parity"] = {}
    if not args.families_only:
        name = "loader-demo" if args.smoke else f"gpu-train-demo-{args.budget}"
        manifest = str(ensure_image_demo(args.demo_samples, budget=args.budget, name=name))
        model = train.build_model(args, device, dtype)
        bins = train.first_bins(manifest, args.bins, smallest=args.smoke)
        parity = partial(parity_rows, args, model, bins[: args.parity_bins], kernels, device, dtype)
        section("qwen2_vl (2B widths)", parity, into=results["parity"])
    smoke_pack = args.smoke and not args.families_only
    packs = [("qwen2_vl", Path(manifest))] if smoke_pack else family_packs(args.packs)  # smoke: the demo's
    for model_type, pack in packs:
        parity = partial(family_parity, model_type, pack, kernels, device, dtype, args.parity_bins)
        section(f"{model_type} (tiny)", parity, into=results["parity"])
    if not args.families_only:
        section("throughput", lambda: throughput_rows(args, model, bins, kernels, device, dtype))
        section("feed", lambda: train.feed_rate(manifest, args.workers, args.bins))
    results["seconds"] = round(time.perf_counter() - started, 1)
    register_varlen()  # as the run found it
    section.write()
    print(markdown(results))
    if results.get("errors"):
        sys.exit(f"failed: {', '.join(results['errors'])} (tracebacks in {OUT / 'gpu_check.json'})")
    parity_nan = [summary.get("nan") for summary in results["parity"].values()]
    if any(row["nan"] for row in results.get("kernels", [])) or any(parity_nan):
        sys.exit("NaN in a kernel's output or a packed sample's hidden states")


if __name__ == "__main__":
    main()
