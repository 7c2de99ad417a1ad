"""Fixtures of the integration tests that install the package as a platform does."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

from tools import make_dist


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel with its spark extra, and venv-pack.
    Slow: pip installs the wheel's `spark` extra (from the registry, or pip's cache)."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = make_dist.build_wheel(root / "dist")
    env = root / "env"
    venv.create(env, with_pip=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{wheel}[spark]", "venv-pack"]
    subprocess.run(pip, check=True, timeout=1200)
    return env


@pytest.fixture(scope="session")
def env_archive(installed, tmp_path_factory) -> Path:
    """``installed`` packed by venv-pack: what ``spark-submit --archives`` ships to executors."""
    archive = tmp_path_factory.mktemp("archive") / "mmpack-env.tar.gz"
    command = [installed / "bin" / "venv-pack", "--quiet", "-p", installed, "-o", archive]
    subprocess.run([*command, "--compress-level", "1"], check=True)  # packed once, unpacked often
    return archive


def clean_env(home: Path) -> dict[str, str]:
    """A shell with no virtualenv, no PYTHONPATH and no checkout: what a platform job gets."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
