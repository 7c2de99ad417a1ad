"""Profiles: transformers' smart_resize compiled from its source is the imported function."""

from __future__ import annotations

import dis
import importlib

import pytest

from mmpack_udfs.tokenize import profiles


def instructions(function) -> list[tuple[str, object]]:
    return [(i.opname, i.argval) for i in dis.get_instructions(function)]


def test_smart_resize_from_source_is_transformers_own_code():
    compiled = profiles.smart_resize_from_source()
    imported = importlib.import_module(profiles.SMART_RESIZE_MODULE).smart_resize
    assert compiled is not imported
    assert compiled.__code__.co_code == imported.__code__.co_code
    assert instructions(compiled) == instructions(imported)
    assert compiled.__code__.co_consts == imported.__code__.co_consts
    assert compiled.__defaults__ == imported.__defaults__
    for height, width in [(1, 1), (480, 640), (8000, 8000), (28, 5000), (57, 55)]:
        assert compiled(height, width) == imported(height, width)


def test_smart_resize_falls_back_to_the_import(monkeypatch):
    def missing():
        raise LookupError("no plain smart_resize function")

    monkeypatch.setattr(profiles, "smart_resize_from_source", missing)
    profiles._smart_resize.cache_clear()
    try:
        imported = importlib.import_module(profiles.SMART_RESIZE_MODULE).smart_resize
        assert profiles._smart_resize() is imported
    finally:
        profiles._smart_resize.cache_clear()


def test_a_function_needing_more_than_imports_and_builtins_is_refused(tmp_path, monkeypatch):
    module = tmp_path / "transformers" / "models" / "qwen2_vl"
    module.mkdir(parents=True)
    (tmp_path / "transformers" / "__init__.py").write_text("")
    (module / "image_processing_pil_qwen2_vl.py").write_text(
        "import math\nFACTOR = 28\n\ndef smart_resize(height, width):\n    return FACTOR, math.pi\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(importlib.sys.modules, "transformers", raising=False)
    with pytest.raises(LookupError, match="FACTOR"):
        profiles.smart_resize_from_source()


def test_frame_positions_equal_torch_arange_without_torch():
    """The pipeline has no torch; its frame positions equal transformers' torch.arange rule."""
    import torch

    from mmpack_udfs.tokenize.profiles import torch_arange_int

    for total in range(1, 700, 3):
        for count in range(2, total + 1, 2):
            expected = torch.arange(0, total, total / count).int().tolist()
            assert torch_arange_int(total, total / count) == expected, (total, count)
