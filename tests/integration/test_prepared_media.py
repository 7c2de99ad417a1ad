"""Prepared media (pack.media: prepared) and the loader's uint8 pixels: the same pixel values
as decoding the original files, exactly."""

from __future__ import annotations

import json

import pytest
import torch

from loader import PackedDataset, normalize_pixel_values
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run, fresh_output

pytestmark = pytest.mark.spark
PIXELS = ("pixel_values", "pixel_values_videos")


@pytest.fixture(scope="module")
def prepared_demo(spark, demo, tokenized_demo, tmp_path_factory):
    """The demo's tokenized tables packed like ``packed_demo``, with prepared media."""
    from mmpack_udfs.pack import stage as pack

    out = fresh_output(tokenized_demo, tmp_path_factory.mktemp("prepared-demo"))
    pack.run(spark, demo_run(demo, out, *PACKED_DEMO_SETTINGS, "pack.media=prepared"))
    return out


def items(packed, **options) -> list[dict]:
    return list(PackedDataset(str(packed), shuffle=False, balance=False, **options))


def test_prepared_shards_give_the_pixels_the_original_files_give(packed_demo, prepared_demo):
    original = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    prepared = json.loads((prepared_demo / "packed" / "manifest.json").read_text())
    assert (original["media_encoding"], prepared["media_encoding"]) == ("file", "patches8")
    assert prepared["totals"]["bins"] == original["totals"]["bins"]
    assert prepared["totals"]["bytes"] > original["totals"]["bytes"]  # resized 8-bit patches
    from_files, from_prepared = items(packed_demo / "packed"), items(prepared_demo / "packed")
    assert [i["sample_ids"] for i in from_files] == [i["sample_ids"] for i in from_prepared]
    compared = {key: 0 for key in PIXELS}
    for a, b in zip(from_files, from_prepared, strict=True):
        for key in PIXELS:
            assert (key in a) == (key in b)
            if key in a:
                assert torch.equal(a[key], b[key]) and a[key].dtype == torch.float32
                compared[key] += 1
    assert compared["pixel_values"] > 10 and compared["pixel_values_videos"] > 0  # images and videos


@pytest.mark.parametrize("packed_name", ["packed_demo", "prepared_demo"])
def test_uint8_pixels_normalized_on_the_model_side_equal_the_float_pixels(packed_name, request):
    packed = request.getfixturevalue(packed_name) / "packed"
    floats, raw = items(packed)[:12], items(packed, pixel_dtype="uint8")[:12]
    bf16 = items(packed, pixel_dtype="bfloat16")[:12]
    seen = 0
    for f, u, b in zip(floats, raw, bf16, strict=True):
        for key in PIXELS:
            if key in f:
                assert u[key].dtype == torch.uint8 and b[key].dtype == torch.bfloat16
                assert torch.equal(normalize_pixel_values(u[key]), f[key])
                assert torch.equal(b[key], f[key].to(torch.bfloat16))
                seen += 1
    assert seen > 0


def test_a_bad_pixel_dtype_is_refused(packed_demo):
    with pytest.raises(ValueError, match="pixel_dtype must be one of float32, bfloat16, uint8"):
        PackedDataset(str(packed_demo / "packed"), pixel_dtype="int8")


def test_prepared_media_need_embedding_and_a_qwen_vl_profile():
    from mmpack_udfs.config import ConfigError, load_config

    needs = r"pack\.media: prepared needs pack\.embed_media true and a Qwen-VL profile"
    for other in ("pack.embed_media=false", "tokenize.profile=internvl_chat"):
        with pytest.raises(ConfigError, match=needs):
            load_config(None, ["pack.media=prepared", other])
    assert load_config(None, ["pack.media=prepared"]).pack.media == "prepared"


def test_a_media_encoding_this_loader_does_not_know_is_refused(packed_demo, tmp_path):
    import shutil

    copy = tmp_path / "packed"
    shutil.copytree(packed_demo / "packed", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "media_encoding": "rgb8"}))
    with pytest.raises(ValueError, match="media_encoding 'rgb8' is not one this loader reads"):
        PackedDataset(str(copy))
