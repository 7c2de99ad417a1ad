"""Text-only ShareGPT data through `mmpack run`, as a user runs it, beside LLaMA-Factory's own
data path and the JSON parse bound (issue 58).

    python bench/bench_text.py --sizes 10000 100000 1000000 [--llamafactory]

For each size: text-only records (``mmpack_udfs.demo.text``), then

- **mmpack**: ``python -m mmpack_udfs.cli run`` in a fresh process (normalize, tokenize, pack,
  with the Qwen2.5-VL model directory of the tests), timed from the outside. Every line it
  prints is stamped as it arrives, which splits the wall time into the start-up (process start →
  the first stage begins: imports, config, the JVM), each stage, and the end (the last stage's
  summary → the process exits). Peak resident memory per process kind on the side.
- **LLaMA-Factory** (``--llamafactory``): its ``get_dataset`` on the same files, tokenizer and
  template (``llamafactory_get_dataset.py`` in ``.venv-llamafactory``, made on first use from
  ``llamafactory-requirements.txt``), imports included; it tokenizes and does not pack.
- **The parse bound**: pyarrow's JSON reader over the same files on one thread.

Results: OUT/bench_text.json and a Markdown table on stdout. ``--smoke``: 200 records, no
LLaMA-Factory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import OUT, PeakMemory, machine, parse_with_smoke

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' model directories (tests/models)

from mmpack_udfs.demo.text import generate_text  # noqa: E402
from tests.models.build import build_model_dir  # noqa: E402

LF_VENV = ROOT / ".venv-llamafactory"
LF_REQUIREMENTS = Path(__file__).with_name("llamafactory-requirements.txt")
STAGE_LINE = re.compile(r"\[(\d)/3\] (\w+) \.\.\.")
CORES = os.cpu_count() or 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--llamafactory", action="store_true", help="also time LLaMA-Factory's get_dataset")
    parser.add_argument("--set", dest="settings", action="append", default=[], help="KEY=VALUE for mmpack")
    args = parse_with_smoke(parser, argv, sizes=[200], llamafactory=False, settings=["spark.quick_jit=true"])
    cores = int(m.group(1)) if (m := re.fullmatch(r"local\[(\d+)\]", args.master)) else CORES
    model = build_model_dir("qwen2_5_vl", OUT / "text-bench-model")
    rows = []
    for size in args.sizes:
        data = generate_text(OUT / f"text-data-{size}", size)
        row = {"samples": size, "parse_bound": parse_bound(data.files)}
        out = OUT / f"text-run-{size}"
        row["mmpack"] = run_mmpack(data.config, model, out, args.master, cores, args.settings)
        if args.llamafactory:
            row["llamafactory"] = run_llamafactory(data.root / "data", model, OUT / f"text-lf-{size}", cores)
            row["speedup"] = round(row["llamafactory"]["seconds"] / row["mmpack"]["seconds"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"machine": machine(), "master": args.master, "rows": rows}
    (OUT / "bench_text.json").write_text(json.dumps(report, indent=2))
    print(table(rows))


def parse_bound(files: list[Path]) -> dict:
    """pyarrow's JSON reader over ``files`` on one thread: records and records/s."""
    from pyarrow import json as pa_json

    started, records = time.perf_counter(), 0
    for path in files:
        records += pa_json.read_json(path, read_options=pa_json.ReadOptions(use_threads=False)).num_rows
    seconds = time.perf_counter() - started
    return {
        "records": records,
        "seconds": round(seconds, 2),
        "records_per_s_per_core": round(records / seconds),
    }


def run_mmpack(config: Path, model: Path, out: Path, master: str, cores: int, settings: list[str]) -> dict:
    """``mmpack run`` in a fresh process: wall seconds, start-up, per stage, end, peak memory."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "mmpack_udfs.cli", "run", "--config", str(config), "--out", str(out),
               "--master", master, "--set", f"tokenize.model={model}"]  # fmt: skip
    for setting in settings:
        command += ["--set", setting]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = PeakMemory(pid=process.pid)
    memory.start()
    lines = stamped_lines(process.stdout, started)
    code = process.wait()
    seconds = time.perf_counter() - started
    memory.stop.set()
    memory.join()
    if code != 0:
        raise RuntimeError(f"mmpack run exited {code}:\n" + "\n".join(line for _, line in lines[-40:]))
    marks = stage_marks(lines)
    records = json.loads((out / "report" / "normalize.json").read_text())["totals"]["read"]
    tokens = json.loads((out / "packed" / "manifest.json").read_text())["totals"]["tokens"]
    stages = {}
    for (name, begun), (_, ended) in itertools.pairwise(marks):
        rate = records / (ended - begun) / cores
        stages[name] = {"seconds": round(ended - begun, 1), "records_per_s_per_core": round(rate)}
    return {
        "seconds": round(seconds, 1),
        "startup_s": round(marks[0][1], 1),
        "end_s": round(seconds - marks[-1][1], 1),
        "stages": stages,
        "records": records,
        "tokens": tokens,
        "records_per_s_per_core": round(records / seconds / cores),
        "peak_memory_gib": memory.gib(),
    }


def stamped_lines(stream, started: float) -> list[tuple[float, str]]:
    """Every line of ``stream`` with the seconds since ``started`` at which it arrived."""
    lines = []
    for line in iter(stream.readline, ""):
        lines.append((time.perf_counter() - started, line.rstrip("\n")))
    return lines


def stage_marks(lines: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """(stage, when it began) for each stage (its "[k/3] stage ..." line), then ("end", when
    the "pipeline done" line came)."""
    marks = [(m.group(2), at) for at, line in lines if (m := STAGE_LINE.search(line))]
    done = next(at for at, line in lines if line.startswith("pipeline done"))
    return [*marks, ("end", done)]


def run_llamafactory(dataset_dir: Path, model: Path, out: Path, cores: int) -> dict:
    """LLaMA-Factory's get_dataset on ``dataset_dir`` in its own virtualenv, with ``cores``
    preprocessing workers: its report plus the wall seconds seen from here."""
    python = ensure_llamafactory()
    shutil.rmtree(out, ignore_errors=True)
    model = llamafactory_model_dir(model, out / "model")
    script = Path(__file__).with_name("llamafactory_get_dataset.py")
    env = {**os.environ, "HF_DATASETS_CACHE": str(out / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([str(python), str(script), str(dataset_dir), str(model), str(out), str(cores)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"LLaMA-Factory's get_dataset exited {done.returncode}:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {**report, "seconds": round(seconds, 1)}


def llamafactory_model_dir(model: Path, copy: Path) -> Path:
    """``model`` as transformers 5.6 reads it: its Qwen2.5-VL image processor is called
    ``Qwen2VLImageProcessor`` there (the published name, ``Qwen2_5_VLImageProcessor``, came later).
    The tokenizer and chat template, all that text-only data uses, are the same files."""
    shutil.copytree(model, copy)
    config = copy / "preprocessor_config.json"
    config.write_text(config.read_text().replace("Qwen2_5_VLImageProcessor", "Qwen2VLImageProcessor"))
    return copy


def ensure_llamafactory() -> Path:
    """``.venv-llamafactory``'s Python, made from ``llamafactory-requirements.txt`` if absent."""
    python = LF_VENV / "bin" / "python"
    stamp = LF_VENV / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LF_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "torch==2.11.0", "torchaudio==2.11.0", "torchvision==0.26.0"], check=True)
        subprocess.run([*pip, "--no-deps", "llamafactory==0.9.5"], check=True)
        subprocess.run([*pip, "-r", str(LF_REQUIREMENTS)], check=True)
        stamp.touch()
    return python


def table(rows: list[dict]) -> str:
    """The Markdown table of RESULTS.md."""
    head = ("| samples | tokens | mmpack s | start-up s | normalize s (rec/s/core) | tokenize s | pack s "
            "| end s | LLaMA-Factory s | speed-up | parse bound rec/s/core | worker GiB |")  # fmt: skip
    lines = [head, "|" + "---:|" * 12]
    for row in rows:
        m, s = row["mmpack"], row["mmpack"]["stages"]
        lf = row.get("llamafactory", {}).get("seconds", "")
        lines.append(
            f"| {row['samples']:,} | {m['tokens']:,} | {m['seconds']} | {m['startup_s']} "
            f"| {s['normalize']['seconds']} ({s['normalize']['records_per_s_per_core']:,}) "
            f"| {s['tokenize']['seconds']} | {s['pack']['seconds']} | {m['end_s']} | {lf} "
            f"| {row.get('speedup', '')} | {row['parse_bound']['records_per_s_per_core']:,} "
            f"| {m['peak_memory_gib']['worker']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
