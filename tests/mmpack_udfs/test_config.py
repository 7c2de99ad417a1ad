import json
import re
from pathlib import Path

import pytest

from mmpack_udfs.config import ConfigError, config_hash, load_config


def test_defaults_load_and_validate():
    config = load_config()
    assert config.mode == "overwrite"
    assert config.spark.master == "local[*]"
    assert config.normalize.max_image_pixels > 0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("output: /data/out\nnormalize:\n  split_bytes: 1024\n")
    config = load_config(path, ["normalize.split_bytes=2048", "spark.conf.spark.foo=bar"])
    assert config.output == "/data/out"
    assert config.normalize.split_bytes == 2048
    assert config.spark.conf["spark.foo"] == "bar"
    assert config.normalize.rows_per_file == 100000  # untouched defaults survive


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["normalize.max_pixels=3"], "unknown config key 'normalize.max_pixels'"),
        (["mode=upsert"], "mode must be"),
        (["normalize.split_bytes=-1"], "normalize.split_bytes must be a positive integer"),
        (["output"], "key=value"),
        (["datasets=[{name: a}]"], "'paths' is required"),
        (
            ["datasets=[{name: a, paths: x, media_root: m, colums: {}}]"],
            r"unknown config key 'datasets\[0\].colums'",
        ),
        (["datasets=[{name: a, paths: x, media_root: m, format: csv}]"], "format must be"),
        (["pack.budget=0"], "pack.budget must be a positive integer"),
        (["pack.oversize=truncate"], "pack.oversize must be one of error, skip"),
        (["pack.second_budget_by=media_items"], "pack.second_budget must be a positive integer"),
        (["pack.second_budget_by=frames"], "pack.second_budget_by must be one of"),
        (["pack.embed_media=yes please"], "pack.embed_media must be true or false"),
        (["pack.seed=-1"], "pack.seed must be a non-negative integer"),
    ],
)
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_missing_or_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_dataset_paths_are_relative_to_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("datasets:\n- {name: a, paths: [d/*.jsonl], media_root: media}\n")
    assert load_config(path).datasets[0].base_dir == str(tmp_path)


def test_config_hash_ignores_spark_settings():
    a = load_config(None, ["spark.master=local[1]"])
    b = load_config(None, ["spark.master=local[4]"])
    c = load_config(None, ["normalize.split_bytes=7"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def _leaves(config: dict, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, dict) and value and prefix + key != "spark.conf":
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def test_the_readme_reference_names_every_key_with_its_default():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    reference = readme.split("## Configuration reference", 1)[1]
    documented = dict(re.findall(r"^\| `([^`]+)` \| ([^|]*) \|", reference, re.MULTILINE))
    for key, value in _leaves(load_config().as_dict()):
        generic = re.sub(r"^profiles\.\w+\.(kind|default_system)$", r"profiles.<name>.\1", key)
        generic = re.sub(r"^(balance\.cost_model)\.\w+\.(llm_\w+)$", r"\1.<profile>.\2", generic)
        assert generic in documented, f"README's configuration reference lacks {key}"
        if generic == key and not isinstance(value, dict):
            shown = value if isinstance(value, str) else json.dumps(value)
            assert documented[key] == f"`{shown}`", f"README gives {key} the default {documented[key]}"


def test_text_overrides_are_verbatim_hash_is_not_a_comment():
    assert load_config(None, ["output=/data/run 1 #ü"]).output == "/data/run 1 #ü"
    assert load_config(None, ["output='/data/a #b'"]).output == "/data/a #b"
    assert load_config(None, ["pack.seed=5"]).pack.seed == 5
    assert load_config(None, ["pack.embed_media=false"]).pack.embed_media is False
    assert load_config(None, ["run_id=42"]).run_id == "42"  # a text key keeps the text
