"""Fixtures of the integration tests that install the package as a platform does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import installs
from tests.jvms import submit_env


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel with its spark extra, and venv-pack (tests/installs.py:
    built in the background from the session's start)."""
    return installs.get("installed", tmp_path_factory)


@pytest.fixture(scope="session")
def env_archive(installed, tmp_path_factory) -> Path:
    """``installed`` packed by venv-pack: what ``spark-submit --archives`` ships to executors."""
    return installs.get("env_archive", tmp_path_factory)


def clean_env(home: Path) -> dict[str, str]:
    """A shell with no virtualenv, no PYTHONPATH and no checkout: what a platform job gets (its
    JVMs tuned for the test machine: tests/jvms.py)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", **submit_env()}
