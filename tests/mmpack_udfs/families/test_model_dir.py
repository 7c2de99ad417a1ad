"""A model directory → the profile: its files resolved as transformers resolves them, its chat
template reproduced by one of the family's renderers (or refused), errors before Spark starts."""

from __future__ import annotations

import json
import shutil

import pytest

from mmpack_udfs import cli
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import model_dir
from mmpack_udfs.resolve import load_run
from tests.models.build import MODELS, build_model_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every model directory of tests/models, built once (a tokenizer build takes seconds)."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_model_dir(name, root / name) for name in MODELS}


def copy_of(built, name, tmp_path):
    target = tmp_path / name
    shutil.copytree(built[name], target)
    return target


@pytest.mark.parametrize(
    "name,kind,chat,system",
    [
        ("qwen2_5_vl", "qwen2_5_vl", "chatml", "You are a helpful assistant."),
        ("qwen3_vl", "qwen3_vl", "qwen3", ""),
        ("qwen3_vl_thinking", "qwen3_vl", "qwen3_thinking", ""),
        ("qwen3_vl_moe", "qwen3_vl", "qwen3", ""),
        ("qwen3_5", "qwen3_5", "qwen3_5", ""),
        ("qwen3_5_moe", "qwen3_5", "qwen3_5", ""),
        ("internvl", "internvl", "internvl", ""),
    ],
)
def test_each_published_directory_resolves_to_its_family_and_renderer(built, name, kind, chat, system):
    config = load_run(None, [f"tokenize.model={built[name]}"]).config
    profile = config.profiles["model"]
    assert (config.tokenize.profile, profile.kind, profile.chat, profile.default_system) == (
        "model",
        kind,
        chat,
        system,
    )
    assert config.tokenize.tokenizer == str(built[name])
    assert config.balance.cost_model["model"] == config.balance.cost_model[kind]


def test_processor_values_come_from_the_files(built):
    qwen25 = load_run(None, [f"tokenize.model={built['qwen2_5_vl']}"]).config.profiles["model"]
    assert (qwen25.vision.patch_size, qwen25.image.min_pixels, qwen25.image.max_pixels) == (
        14,
        3136,
        12845056,
    )
    assert (
        qwen25.tokens_per_second == 2 and qwen25.video.fps == 2.0
    )  # no video config: mmpack's video defaults
    assert any(
        "no video_preprocessor_config.json" in n for n in model_dir.read(str(built["qwen2_5_vl"])).notes
    )
    qwen3 = load_run(None, [f"tokenize.model={built['qwen3_vl']}"]).config.profiles["model"]
    assert (qwen3.vision.patch_size, qwen3.image.min_pixels, qwen3.image.max_pixels) == (16, 65536, 16777216)
    assert (qwen3.video.min_pixels, qwen3.video.max_pixels, qwen3.image.mean) == (4096, 25165824, [0.5] * 3)


def test_keys_under_profiles_model_override_the_directory(built):
    config = load_run(
        None, [f"tokenize.model={built['qwen3_vl']}", "profiles.model.image.max_pixels=100000"]
    ).config
    assert config.profiles["model"].image.max_pixels == 100000
    two = ["profiles.model.video.fps=1", "profiles.model.video.max_frames=8"]  # one section, two --set
    video = load_run(None, [f"tokenize.model={built['qwen3_vl']}", *two]).config.profiles["model"].video
    assert (video.fps, video.max_frames) == (1, 8)
    with pytest.raises(ConfigError, match=r"unknown config key 'profiles\.model\.image\.nope'"):
        load_run(None, [f"tokenize.model={built['qwen3_vl']}", "profiles.model.image.nope=1"])


def test_min_and_max_pixels_keys_win_over_size(built, tmp_path):
    target = copy_of(built, "qwen3_vl", tmp_path)
    settings = json.loads((target / "preprocessor_config.json").read_text())
    (target / "preprocessor_config.json").write_text(json.dumps({**settings, "max_pixels": 200704}))
    assert load_run(None, [f"tokenize.model={target}"]).config.profiles["model"].image.max_pixels == 200704


def refusal(directory, file: str, changes: dict, tmp_path, capsys, monkeypatch) -> str:
    """What ``mmpack tokenize`` prints refusing a copy of ``directory`` whose JSON ``file`` has
    ``changes``: exit 2 before Spark starts."""
    target = tmp_path / "model"
    shutil.copytree(directory, target)
    settings = json.loads((target / file).read_text())
    (target / file).write_text(json.dumps({**settings, **changes}))
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: pytest.fail("Spark started"))
    code = cli.main(["tokenize", "--out", str(tmp_path / "out"), "--set", f"tokenize.model={target}"])
    assert code == cli.EXIT_BAD_CONFIG
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llava"})), "model_type 'llava'"),
        (lambda d: (d / "preprocessor_config.json").unlink(), "no preprocessor_config.json"),
        (lambda d: (d / "chat_template.jinja").unlink(), "no chat template"),
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({"model_type": "qwen3_vl", "vision_config": {"patch_size": 14}})
            ),
            "patch_size 16 differs from config.json vision_config.patch_size 14",
        ),
    ],
)
def test_a_directory_mmpack_cannot_take_exits_2_before_spark(
    built, tmp_path, capsys, monkeypatch, change, message
):
    target = copy_of(built, "qwen3_vl", tmp_path)
    change(target)
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: pytest.fail("Spark started"))
    code = cli.main(["tokenize", "--out", str(tmp_path / "out"), "--set", f"tokenize.model={target}"])
    assert code == cli.EXIT_BAD_CONFIG
    assert message in capsys.readouterr().err


def test_a_template_no_renderer_reproduces_is_refused_naming_the_difference(built, tmp_path):
    target = copy_of(built, "qwen3_vl", tmp_path)
    template = (target / "chat_template.jinja").read_text()
    (target / "chat_template.jinja").write_text(
        template.replace("'<|im_start|>' + message.role + '\\n'", "'<|im_start|>' + message.role + ':\\n'")
    )
    with pytest.raises(ConfigError, match="does not reproduce") as info:
        load_run(None, [f"tokenize.model={target}"])
    assert "differs at token" in str(info.value)


def test_a_changed_default_system_prompt_is_the_templates(built, tmp_path):
    target = copy_of(built, "qwen2_5_vl", tmp_path)
    data = json.loads((target / "chat_template.json").read_text())
    data["chat_template"] = data["chat_template"].replace("You are a helpful assistant.", "Be terse.")
    (target / "chat_template.json").write_text(json.dumps(data))
    assert load_run(None, [f"tokenize.model={target}"]).config.profiles["model"].default_system == "Be terse."


def test_profile_model_without_a_model_directory_is_an_error():
    with pytest.raises(ConfigError, match=r"tokenize\.model, which is not set"):
        load_run(None, ["tokenize.profile=model"])
