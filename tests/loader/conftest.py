"""Fixtures of the loader's attention tests: mmpack_varlen's registration restored after a test,
and a machine that reads as one with a CUDA GPU of a given compute capability."""

from __future__ import annotations

import pytest
import torch

from loader import attention, varlen_kernels


@pytest.fixture
def varlen_kernel():
    """``register_varlen(kernel)`` for one test; the registration before comes back after."""
    before = dict(attention._STATE)
    yield lambda kernel=None: attention.register_varlen(kernel)
    attention._STATE.clear()
    attention._STATE.update(before)


@pytest.fixture
def fake_gpu(monkeypatch, varlen_kernel):
    """``fake_gpu((9, 0))``: resolution sees a CUDA device of that capability (an H100), with
    neither flash-attn package installed unless a test installs fakes of them
    (``varlen_kernels._fa4_function`` / ``_flash_attn_function``)."""

    def gpu(capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a faked GPU")
        monkeypatch.setattr(varlen_kernels, "_fa4_function", lambda: None)
        monkeypatch.setattr(varlen_kernels, "_flash_attn_function", lambda: None)

    return gpu
