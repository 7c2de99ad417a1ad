"""The fresh virtualenvs of the install tests, built in the background.

Each takes pip and the disk a minute (unpacking pyspark or torch), mostly on one core. When
the session starts with a test that uses one (tests/conftest.py), it is built in a thread
while the first tests run, one at a time; the fixture that hands it over waits for it.
"""

from __future__ import annotations

import shutil
import subprocess
import venv
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 1200
_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="installs")  # one pip at a time
_builds: dict[str, Future[Path]] = {}
_roots: dict[str, Path] = {}  # where each build lies
_last_users: dict[str, str] = {}  # build → node id of the last collected test that uses it


def pip(env: Path, *args: str) -> subprocess.CompletedProcess:
    """``pip install -q --no-compile ARGS`` into ``env`` (Python compiles what it imports when
    it imports it: compiling all of torch up front took ~20 s)."""
    command = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def checked(done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{done.args}: {done.stdout[-2000:]}{done.stderr[-3000:]}")


def wheel_env(root: Path) -> Path:
    """A virtualenv holding the wheel with its spark extra, and venv-pack."""
    from tools import make_dist

    wheel = make_dist.build_wheel(root / "dist")
    env = root / "env"
    venv.create(env, with_pip=True)
    checked(pip(env, f"{wheel}[spark]", "venv-pack"))
    return env


def env_archive(env: Path, root: Path) -> Path:
    """``env`` packed by venv-pack: what ``spark-submit --archives`` ships to executors."""
    archive = root / "mmpack-env.tar.gz"
    command = [env / "bin" / "venv-pack", "--quiet", "-p", env, "-o", archive, "--compress-level", "0"]
    # level 0: still the gzip that Spark unpacks, without deflating 1.7 GB (~33 s of a core at level 1)
    subprocess.run(command, check=True)
    return archive


def training_env(root: Path) -> Path:
    """A virtualenv with torch first (the README's step on CPU machines: its CPU wheel), then
    ``mmpack[train]`` from the checkout, and nothing else."""
    env = root / "train-venv"
    venv.create(env, with_pip=True)
    for args in (["torch==2.13.0"], [f"{ROOT}[train]"]):
        checked(pip(env, *args))
    return env


def _archive_installed(root: Path) -> Path:
    return env_archive(_builds["installed"].result(), root)


BUILDS: dict[str, Callable[[Path], Path]] = {
    "installed": wheel_env,
    "env_archive": _archive_installed,
    "training_env": training_env,
}
NEEDS = {"env_archive": "installed"}  # built first (the builder runs one build at a time)


def start(name: str, factory: pytest.TempPathFactory) -> Future[Path]:
    """Begin building ``name`` (a key of BUILDS), once, after what it needs."""
    if name not in _builds:
        if name in NEEDS:
            start(NEEDS[name], factory)
        _roots[name] = factory.mktemp(name)
        _builds[name] = _builder.submit(BUILDS[name], _roots[name])
    return _builds[name]


def start_used(items: list[pytest.Item], factory: pytest.TempPathFactory) -> None:
    """Begin every build a collected test uses, and note the last test that uses each."""
    for item in items:
        for name in BUILDS:
            if name in getattr(item, "fixturenames", ()):
                _last_users[name] = item.nodeid
    for name in BUILDS:
        if name in _last_users:
            start(name, factory)


def release_after(item: pytest.Item) -> None:
    """Delete the builds whose last user was ``item`` (together 3.5 GB of disk, which the rest of
    the session does not need)."""
    for name, last_user in _last_users.items():
        if last_user == item.nodeid and name in _builds and _builds[name].done():
            shutil.rmtree(_roots[name], ignore_errors=True)


def get(name: str, factory: pytest.TempPathFactory) -> Path:
    """The build ``name``, waited for (started now if it was not)."""
    return start(name, factory).result()
