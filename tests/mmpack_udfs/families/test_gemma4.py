"""Gemma 4's rules against transformers' own functions at the installed version: the
aspect-kept resize, frame sampling, the frame timestamps of Gemma4Processor, the image
processor's patches and positions, and what a model directory may set (families.model_dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loader import vision
from mmpack_udfs.config import load_config
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import make_family, model_dir
from mmpack_udfs.families.gemma4 import aspect_preserving_size
from mmpack_udfs.reasons import Rejected
from tests.models.build import build_model_dir

SIDES = [1, 2, 16, 47, 48, 49, 100, 333, 640, 1080, 1920, 4000, 30000]


def family(**video):
    profile = load_config().profiles["gemma4"].model_dump()
    profile["video"].update(video)
    return make_family("gemma4", profile)


@pytest.mark.parametrize("budget", [70, 280, 1120])
def test_the_resize_is_the_processors(budget):
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    for height in SIDES:
        for width in SIDES:
            args = dict(
                height=height, width=width, patch_size=16, max_patches=budget * 9, pooling_kernel_size=3
            )
            try:
                expected = get_aspect_ratio_preserving_size(**args)
            except ValueError:
                with pytest.raises(ValueError):
                    aspect_preserving_size(height, width, 16, budget * 9, 3)
                continue
            assert aspect_preserving_size(height, width, 16, budget * 9, 3) == expected, (height, width)


@pytest.mark.parametrize("width,height", [(640, 480), (30000, 1), (47, 47)])
def test_an_image_is_one_soft_token_per_pooled_block_of_patches(width, height):
    plan = family().plan_image(width, height)
    assert plan.num_tokens == (plan.resized[0] // 48) * (plan.resized[1] // 48) <= 280
    assert plan.grid == (1, plan.resized[0] // 16, plan.resized[1] // 16)


@pytest.mark.parametrize("total", [4, 5, 32, 33, 100, 901])
def test_frames_are_the_video_processors(total):
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    expected = default_sample_indices_fn(
        VideoMetadata(total_num_frames=total, fps=25.0), num_frames=4
    ).tolist()
    assert list(family(num_frames=4).sample_frames(total)) == expected


def test_a_clip_shorter_than_num_frames_is_refused_as_the_processor_fails():
    with pytest.raises(Rejected, match="cannot give 32 frames"):
        family().plan_video(31, 30.0, 640, 480)


@pytest.mark.parametrize("total,fps", [(4, 4.0), (120, 30.0), (4000, 29.97)])
def test_a_videos_text_is_gemma4_processors(total, fps):
    """Frames of ``mm:ss <|image>`` + video tokens + ``<image|>``, joined by spaces."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    gemma4 = family(num_frames=4)
    plan = gemma4.plan_video(total, fps, 320, 240)
    processor = Gemma4Processor.__new__(Gemma4Processor)
    processor.boi_token, processor.eoi_token, processor.video_token = "<|image>", "<image|>", "<|video|>"
    metadata = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(plan.frame_indices))
    inputs = {"num_soft_tokens_per_video": [plan.num_tokens // 4], "video_metadata": [metadata]}
    written = "".join(
        value if what in ("text", "token") else "<|video|>" * value
        for what, value in gemma4.media_layout(plan)
    )
    assert written == processor.replace_video_token(inputs, 0)


@pytest.mark.parametrize("size", [(640, 480), (47, 300), (1000, 50), (48, 48)])
def test_the_loaders_patches_and_positions_are_the_image_processors(size):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    expected = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[image])
    settings = family().settings
    plan = make_family(
        "gemma4", {**settings, "image": {**settings["image"], "max_soft_tokens": 70}}
    ).plan_image(*size)
    item = {"kind": "image", "resized_height": plan.resized[0], "resized_width": plan.resized[1]}
    patches, positions = vision.soft_patches8([image], item, 16, 70 * 9)
    scaled = vision.normalize(
        patches.reshape(1, 630, -1, 3), np.zeros(3, np.float32), np.ones(3, np.float32), -1
    )
    np.testing.assert_allclose(scaled.reshape(patches.shape), expected["pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(positions, expected["image_position_ids"])
    assert plan.num_tokens == expected["num_soft_tokens_per_image"][0]


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return build_model_dir("gemma4", tmp_path_factory.mktemp("gemma4"))


def test_the_published_directory_reads_as_its_processors(published):
    profile = model_dir.read(str(published)).profile
    assert profile["image"] == {"max_soft_tokens": 280, "patch_size": 16, "pooling_kernel_size": 3}
    assert profile["video"] == {
        "max_soft_tokens": 70,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "num_frames": 4,
    }
    assert (profile["image_token_id"], profile["video_token_id"]) == (258880, 258884)
    assert (profile["sliding_window"], profile["bidirectional_media"]) == (64, True)


def edited(source: Path, target: Path, file: str, change) -> Path:
    shutil.copytree(source, target)
    data = json.loads((target / file).read_text())
    change(data)
    (target / file).write_text(json.dumps(data))
    return target


@pytest.mark.parametrize(
    "file,change,message",
    [
        ("processor_config.json", lambda d: d.update(processor_class="Gemma3Processor"), "processor_class"),
        ("processor_config.json", lambda d: d["image_processor"].update(resample=2), "resample"),
        ("processor_config.json", lambda d: d["image_processor"].update(patch_size=14), "patch_size"),
        (
            "processor_config.json",
            lambda d: d["image_processor"].update(do_normalize=True, image_mean=[0.5] * 3),
            "mean/std",
        ),
        ("video_preprocessor_config.json", lambda d: d.update(fps=1.0), "num_frames sampling"),
        ("config.json", lambda d: d["text_config"].update(use_bidirectional_attention="all"), "'all'"),
        ("config.json", lambda d: d.update(image_token_id=258881), "image_token_id"),
    ],
)
def test_settings_mmpack_does_not_reproduce_are_refused(published, tmp_path, file, change, message):
    directory = edited(published, tmp_path / "model", file, change)
    with pytest.raises(ConfigError, match=message):
        model_dir.read(str(directory))


def test_a_checkpoint_without_bidirectional_vision_packs_without_masks(published, tmp_path):
    """E2B / E4B: ``use_bidirectional_attention`` null: causal everywhere, no media masks."""
    directory = edited(
        published,
        tmp_path / "model",
        "config.json",
        lambda d: d["text_config"].pop("use_bidirectional_attention"),
    )
    profile = model_dir.read(str(directory)).profile
    assert profile["bidirectional_media"] is False
    assert not make_family("gemma4", profile).blocks_media and family().blocks_media


def test_a_template_that_wraps_media_in_newlines_is_refused(published, tmp_path):
    """The launch revision of the template wrote ``\\n\\n<|image|>\\n\\n``: mmpack's renderer is
    the current revision's, and the template check refuses the other."""
    from mmpack_udfs import resolve

    directory = shutil.copytree(published, tmp_path / "model")
    template = (directory / "chat_template.jinja").read_text()
    wrapped = template.replace("{{- '<|image|>' -}}", "{{- '\\n\\n<|image|>\\n\\n' -}}")
    assert wrapped != template
    (directory / "chat_template.jinja").write_text(wrapped)
    with pytest.raises(ConfigError, match="does not reproduce"):
        resolve.load_run(None, [f"tokenize.model={directory}"])
