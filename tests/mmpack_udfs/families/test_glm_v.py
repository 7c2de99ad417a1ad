"""The GLM-V line's rules against transformers' own functions at the installed version: frame
sampling of both video processors, the image resize with its two temporal copies, the frame
labels of both processors, and what a model directory may set (families.model_dir)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmpack_udfs.config import load_config
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import make_family, model_dir
from mmpack_udfs.families.base import MediaPlan
from mmpack_udfs.reasons import Rejected
from tests.models.build import build_model_dir

ROOT = Path(__file__).resolve().parents[3]
TORCHVISION = ROOT / ".venv" / "torchvision-cpu"
SIZES = [1, 2, 13, 27, 28, 29, 55, 57, 100, 224, 333, 480, 640, 1080, 1920, 4000, 9000]
# (frames, fps): short clips, the demo's, one at each of GLM-4.6V's rate limits, and past them
CLIPS = [
    (1, 30.0), (2, 4.0), (8, 4.0), (9, 12.0), (48, 24.0), (61, 29.97), (900, 30.0), (901, 30.0),
    (9000, 30.0), (9030, 29.97), (12000, 25.0), (72001, 30.0), (90000, 24.0),
]  # fmt: skip


def family(**settings):
    profile = load_config().profiles["glm4v"].model_dump()
    for key, value in settings.items():
        if isinstance(value, dict):
            profile[key].update(value)
        else:
            profile[key] = value
    return make_family("glm4v", profile)


def processor(cls):
    return cls.__new__(cls)  # sample_frames reads class defaults only


@pytest.mark.parametrize("total,fps", CLIPS)
def test_glm4v_frames_are_its_video_processors(total, fps):
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    expected = processor(Glm4vVideoProcessor).sample_frames(metadata).tolist()
    assert list(family(video={"sampling": "glm4v"}).sample_frames(total, fps)) == expected


GLM46V_FRAMES = """
import json, sys
from transformers.models.glm46v.video_processing_glm46v import Glm46VVideoProcessor
from transformers.video_utils import VideoMetadata
processor = Glm46VVideoProcessor.__new__(Glm46VVideoProcessor)
clips = json.load(sys.stdin)
print(json.dumps([processor.sample_frames(VideoMetadata(total_num_frames=t, fps=f, duration=t / f)).tolist()
                  for t, f in clips]))
"""


def test_glm46v_frames_are_its_video_processors():
    """Glm46VVideoProcessor's module imports torchvision: it runs where the tests' torchvision is."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests/oracles/torchvision_boot"), str(TORCHVISION), str(ROOT)]
        ),
    }
    done = subprocess.run(
        [sys.executable, "-c", GLM46V_FRAMES], input=json.dumps(CLIPS), capture_output=True, text=True,
        env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ours = family(video={"sampling": "glm46v"})
    for (total, fps), expected in zip(CLIPS, json.loads(done.stdout), strict=True):
        if not expected:  # a clip shorter than its sampling clock: no frames, which the processor cannot take
            with pytest.raises(Rejected, match="too short"):
                ours.sample_frames(total, fps)
            continue
        assert list(ours.sample_frames(total, fps)) == expected, (total, fps)


def test_an_image_is_resized_as_its_two_temporal_copies():
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as theirs

    ours = family(image={"min_pixels": 12544, "max_pixels": 9633792})
    for h, w in itertools.product(SIZES, SIZES):
        try:
            expected = theirs(2, h, w, temporal_factor=2, factor=28, min_pixels=12544, max_pixels=9633792)
        except ValueError:
            with pytest.raises(Rejected):
                ours.plan_image(w, h)
            continue
        plan = ours.plan_image(w, h)
        assert plan.resized == expected, (h, w)
        assert plan.num_tokens == expected[0] * expected[1] // 28**2


@pytest.mark.parametrize("label,cls", [("integer", "Glm4vProcessor"), ("seconds", "Glm46VProcessor")])
def test_a_videos_frames_are_labelled_as_its_processor_writes_them(label, cls):
    import importlib

    module = "glm4v.processing_glm4v" if cls == "Glm4vProcessor" else "glm46v.processing_glm46v"
    theirs = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    ours, theirs_object = family(frame_label=label), processor(theirs)
    theirs_object.image_token = "<|image|>"
    plan = MediaPlan("video", (2, 4, 6), 12, (56, 84), (0, 1, 37, 38), None, (0.0, 1.5416))
    text = "".join(v if kind != "pad" else "<|image|>" * v for kind, v in ours.media_layout(plan))
    expected = "".join(
        theirs_object.replace_frame_token_id(stamp, num_image_tokens=6) for stamp in plan.timestamps
    )
    assert text == "<|begin_of_video|>" + expected + "<|end_of_video|>"


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return build_model_dir("glm46v", tmp_path_factory.mktemp("glm46v"))


def edited(glm_dir, tmp_path, name: str, **changes):
    target = tmp_path / "model"
    shutil.copytree(glm_dir, target)
    settings = json.loads((target / name).read_text())
    settings.update(changes)
    (target / name).write_text(json.dumps(settings))
    return str(target)


def test_a_directory_gives_its_processors_settings(glm_dir):
    found = model_dir.read(str(glm_dir))
    assert (found.kind, found.profile["frame_label"], found.profile["video"]["sampling"]) == (
        "glm4v",
        "seconds",
        "glm46v",
    )
    assert (found.profile["image"]["min_pixels"], found.profile["image"]["max_pixels"]) == (12544, 9633792)
    assert found.profile["video"]["max_pixels"] == 47040000


@pytest.mark.parametrize(
    "file,changes,message",
    [
        ("video_preprocessor_config.json", {"do_sample_frames": False}, "do_sample_frames false"),
        ("video_preprocessor_config.json", {"image_mean": [0.5, 0.5, 0.5]}, "image_mean"),
        (
            "video_preprocessor_config.json",
            {"video_processor_type": "Qwen2VLVideoProcessor"},
            "Glm4vVideoProcessor",
        ),
        ("preprocessor_config.json", {"processor_class": "Qwen2VLProcessor"}, "Glm46VProcessor"),
        ("preprocessor_config.json", {"resample": 2}, "resample"),
        ("config.json", {"image_token_id": 151343}, "image_token_id 151343"),
    ],
)
def test_settings_mmpack_does_not_reproduce_are_refused(glm_dir, tmp_path, file, changes, message):
    with pytest.raises(ConfigError, match=message):
        model_dir.read(edited(glm_dir, tmp_path, file, **changes))


def test_glm41v_writes_answers_as_they_are_and_refuses_samples_its_template_drops_turns_of(tmp_path):
    """GLM-4.1V-9B-Thinking's template (renderer ``glm41v``): an answer's think tags as its
    tokenizer reads them, the conversation closed by ``<|user|>``; a tool turn, which the
    template silently drops, quarantines its sample."""
    from mmpack_udfs.families.model_dir import load_tokenizer
    from mmpack_udfs.resolve import load_run
    from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
    from mmpack_udfs.tokenize.template_check import messages  # text turns as strings, as users write them

    directory = build_model_dir("glm4v", tmp_path / "glm4v")
    config = load_run(None, [f"tokenize.model={directory}", f"output={tmp_path / 'out'}"]).config
    assert config.profile.chat == "glm41v"
    tok, hf = SampleTokenizer(TokenizeSettings.from_config(config)), load_tokenizer(str(directory))
    turns = [{"role": "user", "text": "Why?"}, {"role": "assistant", "text": "<think>Because.</think>It is."}]
    tool = [
        {"role": "user", "text": "Weather?"},
        {"role": "tool", "text": "20"},
        {"role": "assistant", "text": "Warm."},
    ]
    base = {"dataset": "d", "source_file": "f", "source_position": 0, "system": None, "media": []}
    (row,), quarantined = tok.tokenize(
        [{**base, "sample_id": "a", "turns": turns}, {**base, "sample_id": "b", "turns": tool}]
    )
    text = hf.apply_chat_template(
        messages(None, turns), chat_template=(directory / "chat_template.jinja").read_text(), tokenize=False
    )
    assert row.input_ids.tolist() == hf(text + "<|user|>", add_special_tokens=False).input_ids
    assert hf.convert_tokens_to_ids("<think>") in row.labels.tolist()  # the answer, its think tags by id
    assert [(q["sample_id"], q["reason"]) for q in quarantined] == [("b", "template_refuses")]
