import pytest
import yaml
from pydantic import Field

from mmpack_udfs.config import Config, ConfigError, config_hash, docs, load_config
from mmpack_udfs.config.model import PackConfig


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


def test_a_dataset_of_inline_media_needs_no_media_root():
    """WebDataset tars, Parquet bytes, data: URIs: a record naming a path is quarantined instead."""
    assert load_config(None, ["datasets=[{name: a, paths: x.tar}]"]).datasets[0].media_root is None


def test_config_hash_ignores_spark_settings():
    a = load_config(None, ["spark.master=local[1]"])
    b = load_config(None, ["spark.master=local[4]"])
    c = load_config(None, ["normalize.split_bytes=7"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_generated_config_docs_are_current():
    """conf/defaults.yaml and the README's reference are what the model renders
    (`make config-docs` rewrites them)."""
    assert docs.stale_files() == []


def test_defaults_yaml_reads_back_as_the_defaults():
    written = yaml.safe_load(docs.DEFAULTS_FILE.read_text())
    assert written == Config().model_dump(by_alias=True)
    assert load_config(docs.DEFAULTS_FILE).as_dict() == load_config().as_dict()


def test_a_key_added_to_the_model_appears_in_every_generated_document():
    class Pack(PackConfig):
        compression: str = Field("zstd", description="shard compression codec")

    class WithKey(Config):
        pack: Pack = Pack()

    config = WithKey()
    assert "| `pack.compression` | `zstd` | shard compression codec |" in docs.render_table(config)
    assert "  compression: zstd" in docs.render_yaml(config)
    assert "pack.compression = zstd\n    shard compression codec" in docs.render_keys(config)
    assert yaml.safe_load(docs.render_yaml(config))["pack"]["compression"] == "zstd"


def test_text_overrides_are_verbatim_hash_is_not_a_comment():
    assert load_config(None, ["output=/data/run 1 #ü"]).output == "/data/run 1 #ü"
    assert load_config(None, ["output='/data/a #b'"]).output == "/data/a #b"
    assert load_config(None, ["pack.seed=5"]).pack.seed == 5
    assert load_config(None, ["pack.embed_media=false"]).pack.embed_media is False
    assert load_config(None, ["run_id=42"]).run_id == "42"  # a text key keeps the text
