"""The ``mmpack`` command line: ``mmpack --help`` and ``mmpack COMMAND --help`` explain it."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from mmpack_udfs import resolve
from mmpack_udfs.config.model import WRITE_MODES
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError, MmpackError
from mmpack_udfs.io import fs, lock
from mmpack_udfs.pipeline import PIPELINE, STAGES, stage

log = logging.getLogger("mmpack_udfs.cli")  # not __name__: `python -m` makes that __main__

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FAILED", "EXIT_OK", "main"]
STAGE_COMMANDS = [  # (command, the stages it runs, help): `run` and one command per stage
    ("run", list(PIPELINE), f"the whole pipeline: {' → '.join(PIPELINE)} (+ report)"),
    *[(s.name, [s.name], s.help) for s in STAGES],
]
RUN_OPTIONS = {  # config key → (option, its help)
    "run_id": ("--run-id", "run id for idempotent commits (config key 'run_id'; default: from the inputs)"),
    "mode": ("--mode", "how the Delta tables are written: overwrite or append (config key 'mode')"),
}


def add_out_option(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--out, the same in every command: required unless the command has a default."""
    parser.add_argument(
        "--out",
        metavar="DIR|s3://...",
        required=default is None,
        default=default,
        help="output root (config key 'output')" + (f"; default {default}" if default else ""),
    )


def add_stage_options(parser: argparse.ArgumentParser, stages: Sequence[str]) -> None:
    """The options of a command that runs ``stages`` on Spark: config, --out, the run options
    those stages use, --master."""
    add_config_file_options(parser, "normalize.max_image_pixels=1e8")
    add_out_option(parser)
    used = {option for name in stages for option in stage(name).run_options}
    for key, (option, about) in RUN_OPTIONS.items():
        if key in used:
            kwargs = {"choices": WRITE_MODES} if key == "mode" else {}
            parser.add_argument(option, help=about, **kwargs)
    add_master_option(parser)
    add_verbose_option(parser)


def add_master_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="Spark master (default: config spark.master, local[*])")


def stage_description(stages: Sequence[str], about: str) -> str:
    """A command's help page: what it does, then what each stage reads and writes under OUT."""
    lines = [about[:1].upper() + about[1:] + "."]
    for name in stages:
        s = stage(name)
        reads = ", ".join("the configured datasets" if r == "datasets" else f"OUT/{r}" for r in s.reads)
        lines.append(f"{name}: reads {reads}; writes {', '.join(f'OUT/{w}' for w in s.writes)}.")
    return "\n".join(lines)


def add_config_file_options(parser: argparse.ArgumentParser, example: str) -> None:
    """--config FILE and repeatable --set KEY=VALUE."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML config merged over the defaults (`mmpack config`)"
    )
    add_set_option(parser, example)


def add_set_option(parser: argparse.ArgumentParser, example: str) -> None:
    """Repeatable --set KEY=VALUE."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config key, e.g. --set {example} (repeatable; every key: `mmpack config --keys`)",
    )


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose", action="store_true", help="show Spark's own log lines, and the traceback of a failure"
    )


def context_from_args(args: argparse.Namespace) -> RunContext:
    """The run context of a command: --config, --set, and the options that set keys; its
    model directory read once (``resolve.load_run``)."""
    overrides = list(args.overrides)
    for key in ("output", "run_id", "mode"):
        value = getattr(args, "out" if key == "output" else key, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return resolve.load_run(getattr(args, "config", None), overrides)


@contextmanager
def locked_run(args: argparse.Namespace, stages: Sequence[str]) -> Iterator[RunContext]:
    """The run context of the command's config, checked for ``stages``, holding its output
    root's lock."""
    ctx = context_from_args(args)
    preflight(ctx, stages)
    with lock.output_lock(ctx.output, stages, ctx.storage):
        yield ctx


def preflight(ctx: RunContext, stages: Sequence[str]) -> None:
    """The checks that need files, before Spark starts: the datasets (LLaMA-Factory
    dataset_info entries) for normalize, the tokenizer against the profile for tokenize."""
    if "normalize" in stages:
        from mmpack_udfs.normalize import datasets

        datasets.specs_of(ctx.config.datasets, ctx.storage)
    if "tokenize" in stages:
        from mmpack_udfs.tokenize.encoder import TokenizeSettings

        TokenizeSettings.from_config(ctx.config, ctx.model)


def input_bytes(ctx: RunContext, stages: Sequence[str]) -> int | None:
    """The bytes of the run's input files when it starts with normalize and ``spark.quick_jit``
    is left to the run (null); None otherwise."""
    if stages[0] != "normalize" or ctx.config.spark.quick_jit is not None:
        return None
    from mmpack_udfs.normalize import datasets, inputs

    specs = datasets.specs_of(ctx.config.datasets, ctx.storage)
    return sum(f.size for f in inputs.list_inputs(list(specs.values()), ctx.storage))


def run_stages(args: argparse.Namespace, stages: Sequence[str]) -> int:
    """Run the named stages in order in one SparkSession."""
    from mmpack_udfs.io.progress import stage_progress
    from mmpack_udfs.io.spark import get_spark

    with locked_run(args, stages) as ctx:  # one writer per root
        spark = get_spark(ctx.config.spark, args.master, args.verbose, input_bytes(ctx, stages))
        started = time.time()
        for number, name in enumerate(stages, start=1):
            if len(stages) > 1:
                elapsed = time.time() - started
                log.info("[%d/%d] %s ...  (%.0f s elapsed)", number, len(stages), name, elapsed)
            with stage_progress(spark, name, ctx.config.spark.progress_seconds):
                stage(name).run(spark, ctx)
    if len(stages) > 1:
        print(f"pipeline done: {', '.join(stages)} in {time.time() - started:.1f} s")
    return EXIT_OK


def run_report(args: argparse.Namespace) -> int:
    from mmpack_udfs.report import pack_report as report

    ctx = context_from_args(args)
    report.write_report(ctx.output, ctx.storage)
    return EXIT_OK


def run_balance_report(args: argparse.Namespace) -> int:
    from mmpack_udfs.pack import costs
    from mmpack_udfs.report import balance as balance_report
    from mmpack_udfs.report.pack_report import ReportError

    ctx = resolve.load_run(args.config, args.overrides)
    config, storage = ctx.config, ctx.storage
    if (args.out is None) == (args.index is None):
        raise ReportError("give exactly one of --out OUT and --index FILE.parquet")
    if args.out is not None:
        index, per_row_group, profile = balance_report.from_output(fs.normalize_uri(args.out), storage)
    else:
        index = balance_report.from_file(fs.normalize_uri(args.index), storage)
        per_row_group, profile = args.bins_per_row_group, config.tokenize.profile
    profile = args.profile or profile
    try:
        model = costs.CostModel.for_profile(config, profile)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    report = balance_report.build(index, per_row_group, model, args.world_size, args.micro_batches, args.seed)
    print(balance_report.as_json(report) if args.json else balance_report.format_text(report, profile))
    return EXIT_OK


def run_gc(args: argparse.Namespace) -> int:
    from mmpack_udfs.pack import gc

    with locked_run(args, ["gc"]) as ctx:
        print(gc.format_summary(gc.collect(ctx.output, ctx.storage, args.dry_run)))
    return EXIT_OK


def run_export_energon(args: argparse.Namespace) -> int:
    """A published pack → a Megatron-Energon dataset at --to (mmpack_udfs.export.energon)."""
    from mmpack_udfs.export import energon
    from mmpack_udfs.io.spark import get_spark

    ctx = context_from_args(args)
    splits = [s.strip() for s in args.splits.split(",")] if args.splits else None
    packs = energon.checked_packs(ctx, args.to, splits)  # refusals before Spark starts
    spark = get_spark(ctx.config.spark, args.master, verbose=args.verbose)
    energon.run(spark, ctx, args.to, splits, packs)
    return EXIT_OK


def run_export_rl(args: argparse.Namespace) -> int:
    """The tokenized samples → an RL prompt set at --to (mmpack_udfs.export.rl)."""
    from mmpack_udfs.export import rl
    from mmpack_udfs.io.spark import get_spark

    ctx = context_from_args(args)
    settings = rl.checked_settings(ctx, args.to, args.max_prompt_length, args.format)  # before Spark
    spark = get_spark(ctx.config.spark, args.master, verbose=args.verbose)
    rl.run(spark, ctx, args.to, args.max_prompt_length, args.format, settings)
    return EXIT_OK


def run_config(args: argparse.Namespace) -> int:
    """Print the configuration a run would use (or every key with its help)."""
    from mmpack_udfs.config import docs

    config = resolve.load_run(args.config, args.overrides).config
    print(docs.render_keys(config) if args.keys else docs.render_yaml(config), end="")
    return EXIT_OK


def run_demo_data(args: argparse.Namespace) -> int:
    from mmpack_udfs.demo import data as demo_data
    from mmpack_udfs.demo import preference

    if args.preference:
        pairs = preference.generate(args.dir, pairs=args.samples, seed=args.seed)
        print(f"preference demo: {pairs.records} records ({pairs.bad_records} bad) under {pairs.root}; "
              f"config: {pairs.config}")  # fmt: skip
        return EXIT_OK
    if args.media_reuse is not None and not 0 <= args.media_reuse < 1:
        raise ConfigError(f"--media-reuse must be at least 0 and below 1, not {args.media_reuse}")
    demo = demo_data.generate(args.dir, samples=args.samples, seed=args.seed, media_reuse=args.media_reuse)
    print(
        f"demo data: {demo.records} records ({demo.bad_records} bad, {demo.duplicates} duplicates) "
        f"under {demo.root}; config: {demo.config}"
    )
    return EXIT_OK


DEMO_STEPS_SHOWN = 3  # the demo's loader epoch: the first steps, then a summary


def run_demo(args: argparse.Namespace) -> int:
    """Generate demo data under OUT/input, run the pipeline on it into OUT and validate it."""
    from mmpack_udfs.demo import data as demo_data

    out = Path(args.out)
    demo = demo_data.generate(out / "input", samples=args.samples, seed=args.seed)
    print(f"demo data: {demo.records} records under {demo.root}")
    args.config, args.out = str(demo.config), str(out.resolve())
    run_stages(args, [*PIPELINE, "validate"])
    try:  # the training side is optional: the `train` extra brings torch
        from loader.__main__ import describe_epoch
    except ImportError as err:
        log.warning("skipping the loader epoch: %s", err)
        return EXIT_OK
    describe_epoch(str(out.resolve() / "packed"), show_steps=DEMO_STEPS_SHOWN)
    return EXIT_OK


RAW = argparse.RawDescriptionHelpFormatter  # descriptions keep their line breaks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmpack",
        description="Multimodal SFT data → Delta tables → packed training shards, on Spark.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, stages, about in STAGE_COMMANDS:
        p = commands.add_parser(
            name, help=about, description=stage_description(stages, about), formatter_class=RAW
        )
        add_stage_options(p, stages)
        p.set_defaults(func=partial(run_stages, stages=stages))

    p = commands.add_parser(
        "report",
        help="print and write the packing report of an output root",
        description="Reads OUT/packed/manifest.json, the cost index and OUT/report/*.json; writes "
        "OUT/report/pack.json, the plots (PNG) and OUT/report/index.html. No Spark.",
    )
    add_out_option(p)
    add_config_file_options(p, "s3.region=eu-west-1")
    add_verbose_option(p)
    p.set_defaults(func=run_report)

    p = commands.add_parser(
        "balance-report",
        help="straggler overhead of data-parallel steps: today's order vs the balanced plan",
        description="How much each step waits for its slowest rank (per phase and per step) and how "
        "many bins each rank reads per bin it trains, in today's order and in the balanced plan, "
        "from a cost index.",
    )
    p.add_argument("--out", metavar="DIR|s3://...", help="output root of a pack run (its cost index)")
    p.add_argument("--index", metavar="FILE.parquet", help="any Parquet file with the cost index columns")
    p.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (default 8)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--profile", help="cost model profile (default: the pack's, or tokenize.profile)")
    p.add_argument("--bins-per-row-group", type=int, default=32, help="with --index: bins per row group")
    p.add_argument("--seed", type=int, default=0, help="plan seed (default 0); the report is of epoch 0")
    p.add_argument("--json", action="store_true", help="write one JSON object to stdout")
    add_config_file_options(p, "balance.cost_model.qwen2_vl.llm_pair=1e6")
    add_verbose_option(p)
    p.set_defaults(func=run_balance_report)

    p = commands.add_parser(
        "gc",
        help="delete shard files of failed or superseded packs (never published ones)",
        description="Reads OUT/packed (the live manifest and the shard folders); deletes shard files "
        "that no published manifest names. No Spark.",
    )
    add_out_option(p)
    add_config_file_options(p, "s3.region=eu-west-1")
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    add_verbose_option(p)
    p.set_defaults(func=run_gc)

    p = commands.add_parser(
        "export",
        help="export for another trainer (energon: Megatron-Energon WebDataset; rl: verl prompt sets)",
        description="Reads OUT (a published pack, or the tables); writes a dataset another trainer reads.",
    )
    targets = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    t = targets.add_parser(
        "energon",
        help="a Megatron-Energon dataset: WebDataset tars (one sample per bin) + .nv-meta",
        description="Writes DEST/train/*.tar (and DEST/val/*.tar from the evaluation pack), one tar "
        "sample per bin with its media, Energon's .nv-meta (its own preparation) and "
        "DEST/mmpack_export.json. Train on it with loader.energon.MmpackTaskEncoder. Exit 2 when "
        "there is no published pack, DEST is not empty, or a split is unknown.",
    )
    add_config_file_options(t, "s3.region=eu-west-1")
    add_out_option(t)
    t.add_argument("--to", required=True, metavar="DEST|s3://...", help="an empty or new folder")
    t.add_argument(
        "--splits", metavar="S[,S]", help="Energon splits to export: train, val (default: what the pack has)"
    )
    add_master_option(t)
    add_verbose_option(t)
    t.set_defaults(func=run_export_energon)
    t = targets.add_parser(
        "rl",
        help="an RL prompt set (verl): prompts with their exact token counts, overlong ones left out",
        description="Reads OUT/tables (samples, tokenized); writes DEST/prompts-NNNNN.parquet (the rows "
        "verl's RLHFDataset reads: each prompt up to its last user turn, its images, the final answer "
        "as reward_model.ground_truth), DEST/excluded.parquet (every sample left out, with its reason) "
        "and DEST/mmpack_rl_export.json. Exit 2 when there is no tokenized table, DEST is not empty, "
        "or the model's prompts cannot be counted exactly.",
    )
    add_config_file_options(t, "s3.region=eu-west-1")
    add_out_option(t)
    t.add_argument("--to", required=True, metavar="DEST|s3://...", help="an empty or new folder")
    t.add_argument(
        "--format", default="verl", choices=["verl", "easyr1"],
        help="the trainer's dataset: verl (RLHFDataset) or easyr1 (problem/answer, one user turn)",
    )  # fmt: skip
    t.add_argument(
        "--max-prompt-length", type=int, required=True, metavar="N",
        help="the trainer's data.max_prompt_length: longer prompts are left out (too_long)",
    )  # fmt: skip
    add_master_option(t)
    add_verbose_option(t)
    t.set_defaults(func=run_export_rl)

    p = commands.add_parser(
        "config",
        help="print the configuration a run would use, with every key's help (--keys: one per line)",
        description="The defaults, merged with --config FILE and --set overrides, checked, as YAML "
        "with the help text of every key (a starting point for your own config file).",
    )
    add_config_file_options(p, "pack.budget=8192")
    p.add_argument("--keys", action="store_true", help="list every key, its value and what it does")
    add_verbose_option(p)
    p.set_defaults(func=run_config)

    p = commands.add_parser("demo-data", help="generate a realistic demo dataset with real media")
    p.add_argument("dir", help="directory to write the dataset into")
    p.add_argument("--samples", type=int, default=2000, help="good records to generate (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--media-reuse",
        type=float,
        metavar="R",
        help="a new media file per reference except a fraction R (0 ≤ R < 1) that repeat one already "
        "used, as in real data (default: a small pool, each file used many times)",
    )
    p.add_argument(
        "--preference",
        action="store_true",
        help="preference pairs (DPO) instead: --samples pairs in three formats, config mmpack-dpo.yaml",
    )
    add_verbose_option(p)
    p.set_defaults(func=run_demo_data)

    p = commands.add_parser(
        "demo",
        help="generate demo data, run the pipeline on it and validate it",
        description="Writes demo data to OUT/input, runs normalize → tokenize → pack → validate into OUT "
        "and reads one epoch with the loader (when torch is installed).",
    )
    add_out_option(p, default="demo-out")
    add_set_option(p, "pack.budget=8192")
    add_master_option(p)
    add_verbose_option(p)
    p.add_argument("--samples", type=int, default=2000, help="good records to generate (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(func=run_demo)
    return parser


def setup_logging(verbose: bool) -> None:
    """mmpack's log lines (not its summaries, which go to stdout): ``mmpack: ...`` on stderr,
    INFO and up (DEBUG with --verbose)."""
    logger = logging.getLogger("mmpack_udfs")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mmpack: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"mmpack: configuration error: {err}", file=sys.stderr)
        return err.exit_code
    except MmpackError as err:
        print(f"mmpack: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        if getattr(args, "verbose", False):
            raise
        print(f"mmpack: {operational_failure(err)}", file=sys.stderr)
        print("mmpack: run the command again with --verbose for the traceback", file=sys.stderr)
        return EXIT_FAILED


FAILURE_HINTS = [  # (texts in the error, what to do)
    (("No space left on device",), "free space on that disk or write to another output root"),
    (("ACCESS_DENIED", "AccessDenied"), "check the AWS credentials and that they may read/write the bucket"),
    (("NoSuchBucket", "bucket does not exist"), "check the bucket name, region and s3.endpoint_override"),
    (("NETWORK_CONNECTION",), "check the S3 endpoint (s3.endpoint_override) and the network"),
    (
        ("Parquet magic bytes not found", "Couldn't deserialize thrift"),
        "an input or table file is not Parquet, or is corrupt or truncated",
    ),
]


def operational_failure(err: BaseException) -> str:
    """One line saying what failed and, where we can tell, what to do."""
    text = f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # a Spark task's failure carries the Python traceback: its last "XxxError: ..." line says it
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    line = (raised[-1] if raised else f"{type(err).__name__}: {lines[0] if lines else ''}")[:400]
    for needles, advice in FAILURE_HINTS:
        if any(needle in text for needle in needles):
            return f"{line} ({advice})"
    return line


if __name__ == "__main__":
    sys.exit(main())
