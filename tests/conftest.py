"""Shared fixtures: one local SparkSession, one moto S3 server and one demo dataset per run."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmpack_udfs.context import RunContext
from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.demo import preference as preference_data
from mmpack_udfs.resolve import load_run
from tests import installs

# Fake credentials for the loopback S3 server, set before Spark starts so that its Python
# workers inherit them.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)


# `make test` runs the Spark tests in two pytest processes at once (the Makefile's lanes), the
# ``families`` tests and the others, so that a family's Spark run is made in one of them only, and
# the demo's runs (tokenized, packed, mixed, preference) in the other only (`--setup-plan` shows them).
FAMILY_FIXTURES = frozenset({"family_demo"})


@pytest.hookimpl(tryfirst=True)  # before the mark plugin's, which deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs the SparkSession (its fixtures do) is a ``spark`` test, marked or not:
    ``make test-fast`` (``-m "not spark and not slow"``) never starts Spark. A test that uses the
    family runs is a ``families`` test (``FAMILY_FIXTURES``)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "spark" in fixtures:
            item.add_marker(pytest.mark.spark)
        if FAMILY_FIXTURES & fixtures:
            item.add_marker(pytest.mark.families)


TEST_SPARK = {
    "master": "local[2]",
    "app_name": "mmpack-tests",
    "log_level": "ERROR",
    "quick_jit": True,  # one short-lived JVM on small data: start-up compiling is most of its CPU
    "conf": {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "2",
        "spark.driver.memory": "2g",
    },
}


HEAP_MALLOC: dict[str, str] = {}  # pytest's own malloc setting, for one process like it (below)


@pytest.fixture(scope="session", autouse=True)
def _default_malloc_below() -> None:
    """The processes this one starts (Spark, torchrun's ranks, pip) get glibc's default malloc:
    `make test` starts pytest keeping large blocks in the heap (the Makefile's TEST_ENV), which
    this process's tiny-model forwards need, and which in a torchrun test's six processes held
    16.7 GB at its peak where the default holds 7.4 GB. ``HEAP_MALLOC`` keeps it for a test that
    starts one such process (the benchmarks' smoke runner)."""
    if "GLIBC_TUNABLES" in os.environ:
        HEAP_MALLOC["GLIBC_TUNABLES"] = os.environ.pop("GLIBC_TUNABLES")


@pytest.fixture(scope="session", autouse=True)
def _background_installs(_default_malloc_below, request, tmp_path_factory) -> None:
    """Begin the virtualenvs the session's install tests use, in the background (tests/installs.py)."""
    installs.start_used(request.session.items, tmp_path_factory)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A build's virtualenv is deleted after the last test that uses it (tests/installs.py); the
    heap's free memory goes back to the system (``release_heap``)."""
    installs.release_after(item)
    release_heap()


def release_heap() -> None:
    """Under `make test`'s heap setting (``_default_malloc_below``), this process keeps what a test
    freed: a test's forwards reuse it, and ``malloc_trim`` hands it back when the test ends, so the
    process holds one test's peak, not the session's (which reached 18 GB with the machine's other
    processes by the end of the Spark tests)."""
    if HEAP_MALLOC:
        _libc().malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library this process runs on, opened once


MIN_FREE_DISK_GB = 2  # between tests; the spark-submit recipe takes ~7 GB more while it runs


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Stop the session, saying why, when the temporary directory's disk is nearly full: past
    that, tests fail far from the cause (a Spark job, a fixture's copy) or hang (a DataLoader
    worker whose batch could not be written is never heard from)."""
    temp = tempfile.gettempdir()
    free_gb = shutil.disk_usage(temp).free / 1e9
    if free_gb < MIN_FREE_DISK_GB:
        where = f"{free_gb:.1f} GB free under {temp} before {item.nodeid}"
        pytest.exit(f"{where}: the suite needs {MIN_FREE_DISK_GB} GB between tests, ~17 GB in all", 3)


@pytest.fixture(scope="session")
def training_env(tmp_path_factory) -> Path:
    """A fresh virtualenv with torch and ``mmpack[train]`` only (tests/installs.py)."""
    return installs.get("training_env", tmp_path_factory)


@pytest.fixture(scope="session")
def spark():
    from mmpack_udfs.config.model import SparkConfig
    from mmpack_udfs.io.spark import get_spark

    session = get_spark(SparkConfig(**TEST_SPARK))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> demo_data.DemoData:
    """A small demo dataset (real media, every kind of bad record), generated once."""
    return demo_data.generate(tmp_path_factory.mktemp("demo"), samples=150, seed=7)


def demo_run(demo: demo_data.DemoData, output, *overrides: str) -> RunContext:
    """The run context of the demo's config writing to ``output``, with ``overrides``."""
    return load_run(demo.config, [f"output={output}", *overrides])


def with_datasets(ctx: RunContext, datasets: list[dict]) -> RunContext:
    """``ctx`` with its ``datasets`` replaced (entries as in a config file)."""
    from mmpack_udfs.config.loading import checked

    return ctx.with_config(checked({**ctx.config.as_dict(), "datasets": datasets}))


def only_dataset(ctx: RunContext, name: str) -> RunContext:
    """``ctx`` reading only its dataset ``name``."""
    return with_datasets(ctx, [d for d in ctx.config.as_dict()["datasets"] if d["name"] == name])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(log=subprocess.DEVNULL):
    """A real S3 API (moto's server) on loopback, in its own process; yields its endpoint URL.
    ``log``: where its request log goes (one line per HTTP request).

    Its own process, not a thread: delta-rs holds the GIL while it waits on HTTP, so an
    in-process server thread could never answer it.
    """
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def s3_server():
    """The session's moto S3 server (``moto_server``); yields its endpoint URL."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the loopback S3 server; yields (endpoint, bucket name)."""
    import boto3

    name = "mmpack-" + request.node.name.lower().replace("_", "-")[:40]
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return s3_server, name


@pytest.fixture(scope="session")
def tokenized_demo(spark, demo, tmp_path_factory):
    """An output root holding the demo data's samples and tokenized tables (read-only for
    tests: copy its ``tables`` folder to pack into a fresh root)."""
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.tokenize import stage as tokenize

    out = tmp_path_factory.mktemp("tokenized-demo")
    config = demo_run(demo, out)
    normalize.run(spark, config)
    tokenize.run(spark, config)
    return out


def fresh_output(tokenized_demo, tmp_path):
    """A new output root with a copy of the demo's Delta tables."""
    out = tmp_path / "out"
    shutil.copytree(tokenized_demo / "tables", out / "tables")
    return out


def repacked(spark, demo: demo_data.DemoData, source: Path, root: Path, *overrides: str) -> RunContext:
    """``source``'s tokenized samples packed again under ``root``/out with PACKED_DEMO_SETTINGS
    and ``overrides`` (e.g. a smaller ``pack.budget``)."""
    from mmpack_udfs.pack import stage as pack

    ctx = demo_run(demo, fresh_output(source, root), *PACKED_DEMO_SETTINGS, *overrides)
    pack.run(spark, ctx)
    return ctx


PACKED_DEMO_SETTINGS = (
    "pack.budget=4096",
    "pack.oversize=skip",
    "pack.bins_per_row_group=2",
)
# The parity tests' bins: a tiny model's forward costs its tokens × the real vocabulary (the
# logits and the loss), and each sample runs again alone.
PARITY_BUDGET = 1024
TILED_PARITY_BUDGET = 2048  # InternVL, LLaVA-OneVision: a tile is 256 tokens, the demo's videos ≥ 853


def set_args(settings) -> list[str]:
    """``--set`` options of the CLI for ``settings`` (``key=value`` strings)."""
    return [arg for setting in settings for arg in ("--set", setting)]


@pytest.fixture(scope="session")
def packed_demo(spark, demo, tokenized_demo, tmp_path_factory):
    """An output root with the demo data packed into many small bins and row groups."""
    from mmpack_udfs.pack import stage as pack

    out = fresh_output(tokenized_demo, tmp_path_factory.mktemp("packed-demo"))
    pack.run(spark, demo_run(demo, out, *PACKED_DEMO_SETTINGS))
    return out


@pytest.fixture(scope="session")
def parity_demo(spark, demo, packed_demo, tmp_path_factory):
    """``packed_demo``'s samples packed again into PARITY_BUDGET-token bins (longer ones
    skipped): the small bins of the parity tests' forwards."""
    root = tmp_path_factory.mktemp("parity-demo")
    return Path(repacked(spark, demo, packed_demo, root, f"pack.budget={PARITY_BUDGET}").output)


CAP, EVAL_SAMPLES, FRACTION = 12, 4, 0.2  # the mixed demo's cap, held-out samples and eval fraction


def mixed_run(demo, out: Path) -> RunContext:
    """The demo packed with dataset weights, a cap and an evaluation split (``packed-eval``)."""
    ctx = demo_run(demo, out, *PACKED_DEMO_SETTINGS, f"eval.fraction={FRACTION}")
    datasets = ctx.config.as_dict()["datasets"]
    weights = {
        "sharegpt_jsonl": {"weight": 2.0},
        "openai_json": {"weight": 0.3},
        "custom_parquet": {"max_samples": CAP, "eval_samples": EVAL_SAMPLES},
    }
    return with_datasets(ctx, [{**d, **weights[d["name"]]} for d in datasets])


@pytest.fixture(scope="session")
def mixed_demo(spark, demo, tokenized_demo, tmp_path_factory) -> tuple[Path, RunContext]:
    """(output root, run context) of ``mixed_run``: packed once per session (read-only)."""
    from mmpack_udfs.pack import stage as pack

    out = fresh_output(tokenized_demo, tmp_path_factory.mktemp("mix"))
    ctx = mixed_run(demo, out)
    pack.run(spark, ctx)
    return out, ctx


LOSS_WEIGHTS = {"sharegpt_jsonl": 0.5, "custom_parquet": 3.0}  # the weighted demo's; openai_json: 1


@pytest.fixture(scope="session")
def weighted_demo(spark, demo, tokenized_demo, tmp_path_factory) -> tuple[Path, RunContext]:
    """(output root, run context) of ``mixed_run`` with datasets' ``loss_weight`` (``LOSS_WEIGHTS``):
    weighted copies and a weighted evaluation split; packed once per session (read-only)."""
    from mmpack_udfs.pack import stage as pack

    out = fresh_output(tokenized_demo, tmp_path_factory.mktemp("weighted"))
    ctx = mixed_run(demo, out)
    datasets = ctx.config.as_dict()["datasets"]
    ctx = with_datasets(ctx, [{**d, "loss_weight": LOSS_WEIGHTS.get(d["name"], 1.0)} for d in datasets])
    pack.run(spark, ctx)
    return out, ctx


def exporter(spark, output_of: Callable[[str], Path], tmp_path_factory) -> Callable[[str], Path]:
    """``export(name)``: the pack under ``output_of(name)`` exported as an Energon dataset
    (``mmpack export energon``), once per session."""
    from mmpack_udfs.export import energon

    exports: dict[str, Path] = {}

    def export(name: str) -> Path:
        if name not in exports:
            dest = tmp_path_factory.mktemp(f"energon-{name}") / "export"
            energon.run(spark, load_run(None, [f"output={output_of(name)}"]), str(dest))
            exports[name] = dest
        return exports[name]

    return export


@pytest.fixture(scope="session")
def energon_export(spark, packed_demo, mixed_demo, tmp_path_factory):
    """``energon_export(name)``: ``qwen2_vl`` (``packed_demo``) or ``mixed`` (``mixed_demo``: a
    val split) exported as an Energon dataset. The families' exports are ``family_export``'s:
    the demo's runs are the non-family lane's, the family runs the other's."""
    return exporter(spark, {"qwen2_vl": packed_demo, "mixed": mixed_demo[0]}.__getitem__, tmp_path_factory)


@pytest.fixture(scope="session")
def family_export(spark, family_run, tmp_path_factory):
    """``family_export(name)``: the family run ``name`` exported as an Energon dataset (e.g.
    ``qwen2_5_vl``: videos with ``second_per_grid_ts``)."""
    return exporter(spark, lambda name: family_run(name).output, tmp_path_factory)


PREFERENCE_SETTINGS = ("pack.budget=2048", "pack.oversize=skip", "pack.bins_per_row_group=2")


@pytest.fixture(scope="session")
def preference_demo(tmp_path_factory) -> preference_data.PreferenceDemo:
    """The preference demo (LLaMA-Factory ranking, TRL and OpenAI files with images)."""
    return preference_data.generate(tmp_path_factory.mktemp("dpo-demo"), pairs=48, seed=5)


@dataclass(frozen=True)
class PreferenceRun:
    output: Path
    ctx: RunContext
    summaries: dict


@pytest.fixture(scope="session")
def preference_run(spark, preference_demo, tmp_path_factory) -> PreferenceRun:
    """normalize → tokenize → pack of the preference demo (one Spark run shared by the pipeline
    tests and the DPO example's)."""
    from mmpack_udfs.normalize import stage as normalize
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize

    out = tmp_path_factory.mktemp("dpo-out")
    ctx = load_run(preference_demo.config, [f"output={out}", *PREFERENCE_SETTINGS])
    summaries = {name: stage.run(spark, ctx) for name, stage in
                 (("normalize", normalize), ("tokenize", tokenize), ("pack", pack))}  # fmt: skip
    return PreferenceRun(out, ctx, summaries)


# Model families run from a model directory (tokenize.model), each tokenized and packed once
# per session from the demo's samples table and shared by its parity tests.
FAMILY_MODELS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")


@dataclass(frozen=True)
class FamilyRun:
    name: str
    model_dir: Path
    output: Path
    ctx: RunContext


def family_runs(spark, demo: demo_data.DemoData, tokenized: Path, tmp_path_factory, prefix: str):
    """``run(name)``: ``demo`` (its tables under ``tokenized``) tokenized with the model
    directory ``name`` (tests/models/build.py) and packed into small bins; built on first use."""
    from mmpack_udfs.pack import stage as pack
    from mmpack_udfs.tokenize import stage as tokenize
    from tests.models.build import build_model_dir

    runs: dict[tuple[str, int | None], FamilyRun] = {}

    def run(name: str, budget: int | None = None) -> FamilyRun:
        """``budget``: the same tokenized samples packed again into bins of that many tokens
        (longer samples skipped), e.g. small bins for the parity tests' forwards."""
        if (name, None) not in runs:
            root = tmp_path_factory.mktemp(f"{prefix}-{name}")
            model = build_model_dir(name, root / "model")
            out = fresh_output(tokenized, root)
            ctx = demo_run(demo, out, f"tokenize.model={model}", *PACKED_DEMO_SETTINGS)
            tokenize.run(spark, ctx)
            pack.run(spark, ctx)
            runs[name, None] = FamilyRun(name, model, out, ctx)
        if (name, budget) not in runs:
            full, root = runs[name, None], tmp_path_factory.mktemp(f"{prefix}-{name}-{budget}")
            overrides = (f"tokenize.model={full.model_dir}", f"pack.budget={budget}")
            ctx = repacked(spark, demo, full.output, root, *overrides)
            runs[name, budget] = FamilyRun(name, full.model_dir, Path(ctx.output), ctx)
        return runs[name, budget]

    return run


@pytest.fixture(scope="session")
def family_demo(tmp_path_factory) -> demo_data.DemoData:
    """The families' and the trainings' demo: 60 samples (images, several images, videos, text
    only, bad records), the fewest that show every behaviour their tests check. Every family is
    tokenized from it once a session, and each test compares every sample, so its size is
    paid once per family."""
    return demo_data.generate(tmp_path_factory.mktemp("family-demo"), samples=60, seed=12)


@pytest.fixture(scope="session")
def family_tables(spark, family_demo, tmp_path_factory) -> Path:
    """An output root holding ``family_demo`` normalized (its ``samples`` table): what each
    family tokenizes (read-only: ``family_runs`` copies it)."""
    from mmpack_udfs.normalize import stage as normalize

    out = tmp_path_factory.mktemp("family-tables")
    normalize.run(spark, demo_run(family_demo, out))
    return out


@pytest.fixture(scope="session")
def family_run(spark, family_demo, family_tables, tmp_path_factory):
    """``family_run(name)``: ``family_demo`` tokenized for the family ``name`` and packed."""
    return family_runs(spark, family_demo, family_tables, tmp_path_factory, "family")
