"""Configuration: conf/defaults.yaml, then a user's --config file, then --set overrides.

Every key a user may set appears in conf/defaults.yaml; anything else is an error with
the list of keys that would have been valid. Free-form maps (``spark.conf``) and the
``datasets`` list are the only places where new keys are accepted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mmpack_udfs.errors import ConfigError

CONF_DIR = Path(os.environ.get("MMPACK_CONF_DIR", Path(__file__).resolve().parent.parent / "conf"))
FREE_FORM_KEYS = {"spark.conf"}  # maps whose keys contain dots (Spark settings)
OPEN_MAPS = FREE_FORM_KEYS | {
    "profiles",
    "balance.cost_model",
}  # maps that accept new keys (a new model profile)
SPARK_LOG_LEVELS = {"ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN"}
DATASET_KEYS = {"name", "paths", "format", "dialect", "columns", "tags", "media_root"}


def load_config(
    config_file: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
) -> dict[str, Any]:
    """Defaults, merged with ``config_file`` (if any), then ``key=value`` overrides."""
    config = _defaults()
    if config_file is not None:
        user = _read_yaml(Path(config_file))
        base_dir = Path(config_file).resolve().parent
        for dataset in user.get("datasets") or []:
            if isinstance(dataset, dict):
                dataset.setdefault("_base_dir", str(base_dir))
        config = merge(config, user, where=str(config_file))
    for item in overrides:
        config = apply_override(config, item)
    validate(config)
    return config


def _defaults() -> dict[str, Any]:
    """conf/defaults.yaml; inside the spark-submit zip, the copy ``make dist`` puts in it."""
    path = CONF_DIR / "defaults.yaml"
    if path.exists():
        return _read_yaml(path)
    import pkgutil

    try:
        data = pkgutil.get_data("mmpack_udfs", "conf/defaults.yaml")
    except OSError:
        data = None
    if data is None:
        raise ConfigError(f"no config defaults at {path} (set MMPACK_CONF_DIR)")
    return yaml.safe_load(data)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], update: Mapping[str, Any], where: str = "", prefix: str = "") -> dict:
    """Deep-merge ``update`` into a copy of ``base``; unknown keys raise ConfigError."""
    result = copy.deepcopy(dict(base))
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in base and prefix.rstrip(".") not in OPEN_MAPS:
            valid = ", ".join(sorted(f"{prefix}{k}" for k in base))
            raise ConfigError(f"{where}: unknown config key '{dotted}' (valid here: {valid})")
        if isinstance(base.get(key), dict) and isinstance(value, dict):
            result[key] = merge(base[key], value, where, f"{dotted}.")
        else:
            result[key] = copy.deepcopy(value)
    return result


def apply_override(config: dict[str, Any], item: str) -> dict[str, Any]:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (numbers, bools, lists),
    except that text YAML would read as a plain string is taken verbatim: ``#`` in a path is
    not a comment (``--out "run 1 #2"`` must not write to ``run 1``)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    dotted, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw  # e.g. "a: b #c" or "[x": text, not YAML
    if isinstance(value, str) and not _quoted(raw):
        value = raw.strip()
    path = _key_path(dotted.strip())
    value = _as_type_of(_current(config, path), value)
    update: Any = value
    for part in reversed(path):
        update = {part: update}
    return merge(config, update, where=f"--set {item}")


def _current(config: Mapping[str, Any], path: list[str]) -> Any:
    """The value at ``path`` now (None where there is none)."""
    node: Any = config
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _as_type_of(current: Any, value: Any) -> Any:
    """``value`` as a number when the key holds one and the text is one: YAML reads ``1e8``
    as text, ``--set normalize.max_image_pixels=1e8`` means 100000000."""
    if not isinstance(value, str) or isinstance(current, bool) or not isinstance(current, int | float):
        return value
    try:
        number = float(value)
    except ValueError:
        return value  # validation names the key and the expected type
    if isinstance(current, int) and number.is_integer():
        return int(number)
    return number if isinstance(current, float) else value


def _quoted(raw: str) -> bool:
    text = raw.strip()
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def _key_path(dotted: str) -> list[str]:
    """``a.b.c`` → [a, b, c]; inside a free-form map the rest stays one key (Spark's dots)."""
    for free in FREE_FORM_KEYS:
        if dotted.startswith(free + "."):
            return [*free.split("."), dotted[len(free) + 1 :]]
    return dotted.split(".")


def validate(config: Mapping[str, Any]) -> None:
    """Check the types and ranges a job relies on; raise ConfigError naming the key."""
    if config["mode"] not in ("overwrite", "append"):
        raise ConfigError(f"mode must be 'overwrite' or 'append', got {config['mode']!r}")
    if not isinstance(config["output"], str) or not config["output"]:
        raise ConfigError("output must be a non-empty path or s3:// URI")
    norm = config["normalize"]
    for key in ("max_image_pixels", "split_bytes", "rows_per_file", "max_raw_chars"):
        _positive_int(norm[key], f"normalize.{key}")
    _positive_int(norm["video_check_frames"], "normalize.video_check_frames")
    _validate_tokenize(config)
    _validate_pack(config["pack"])
    _validate_balance(config)
    _validate_s3(config["s3"])
    _validate_spark(config["spark"])
    if not isinstance(config["datasets"], list):
        raise ConfigError("datasets must be a list")
    names = set()
    for i, dataset in enumerate(config["datasets"]):
        _validate_dataset(dataset, i)
        if dataset["name"] in names:
            raise ConfigError(f"datasets[{i}]: duplicate dataset name '{dataset['name']}'")
        names.add(dataset["name"])


def _validate_tokenize(config: Mapping[str, Any]) -> None:
    section = config["tokenize"]
    _positive_int(section["max_tokens"], "tokenize.max_tokens")
    _positive_int(section["rows_per_file"], "tokenize.rows_per_file")
    choices = {"over_length": ("drop", "truncate", "split"), "loss": ("assistant", "all", "last")}
    for key, allowed in choices.items():
        if section[key] not in allowed:
            raise ConfigError(f"tokenize.{key} must be one of {', '.join(allowed)}, got {section[key]!r}")
    tokenizer = section["tokenizer"]
    if tokenizer is not None and not (isinstance(tokenizer, str) and tokenizer):
        raise ConfigError(f"tokenize.tokenizer must be a directory path or null, got {tokenizer!r}")
    if tokenizer and not tokenizer.startswith("s3://") and not os.path.isdir(tokenizer):
        raise ConfigError(
            f"tokenize.tokenizer: no tokenizer directory at {tokenizer} (a local Hugging Face "
            "tokenizer directory, present on the driver and every executor; null: the built-in Qwen2)"
        )
    if section["profile"] not in config["profiles"]:
        known = ", ".join(sorted(config["profiles"]))
        raise ConfigError(f"tokenize.profile '{section['profile']}' is not a profile (known: {known})")


def _validate_s3(section: Mapping[str, Any]) -> None:
    for key in ("endpoint_override", "region"):
        if section[key] is not None and (not isinstance(section[key], str) or not section[key]):
            raise ConfigError(f"s3.{key} must be a non-empty string or null, got {section[key]!r}")
    if section["scheme"] not in (None, "http", "https"):
        raise ConfigError(f"s3.scheme must be http, https or null, got {section['scheme']!r}")
    for key in ("connect_timeout", "request_timeout"):
        value = section[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"s3.{key} must be a positive number of seconds, got {value!r}")
    _positive_int(section["retries"], "s3.retries")


def _validate_spark(section: Mapping[str, Any]) -> None:
    for key in ("master", "app_name"):
        if not isinstance(section[key], str) or not section[key]:
            raise ConfigError(f"spark.{key} must be a non-empty string, got {section[key]!r}")
    if str(section["log_level"]).upper() not in SPARK_LOG_LEVELS:
        levels = ", ".join(sorted(SPARK_LOG_LEVELS))
        raise ConfigError(f"spark.log_level must be one of {levels}, got {section['log_level']!r}")
    if not isinstance(section["conf"], dict):
        raise ConfigError("spark.conf must be a mapping of Spark settings")
    for key, value in section["conf"].items():
        if not isinstance(value, str | int | float | bool):
            raise ConfigError(f"spark.conf.{key} must be a string, number or boolean, got {value!r}")


def _validate_pack(section: Mapping[str, Any]) -> None:
    if section["budget"] is not None:
        _positive_int(section["budget"], "pack.budget")
    for key in ("bins_per_shard", "bins_per_row_group"):
        _positive_int(section[key], f"pack.{key}")
    choices = {"second_budget_by": ("none", "media_items", "vision_patches"), "oversize": ("error", "skip")}
    for key, allowed in choices.items():
        if section[key] not in allowed:
            raise ConfigError(f"pack.{key} must be one of {', '.join(allowed)}, got {section[key]!r}")
    if section["second_budget_by"] != "none":
        _positive_int(section["second_budget"], "pack.second_budget")
    if not isinstance(section["embed_media"], bool):
        raise ConfigError(f"pack.embed_media must be true or false, got {section['embed_media']!r}")
    if not isinstance(section["seed"], int) or isinstance(section["seed"], bool) or section["seed"] < 0:
        raise ConfigError(f"pack.seed must be a non-negative integer, got {section['seed']!r}")


def _validate_balance(config: Mapping[str, Any]) -> None:
    """Every profile has a cost model of four numbers >= 0 (text such as 1e10 counts)."""
    from mmpack_udfs.pack.costs import CostModel

    models = config["balance"]["cost_model"]
    if not isinstance(models, dict):
        raise ConfigError("balance.cost_model must map profile names to cost models")
    for name in config["profiles"]:
        if name not in models:
            raise ConfigError(f"balance.cost_model.{name}: profile '{name}' has no cost model")
    for name, model in models.items():
        if not isinstance(model, dict):
            raise ConfigError(f"balance.cost_model.{name} must be a mapping")
        try:
            CostModel.from_mapping(model)
        except ValueError as err:
            raise ConfigError(f"balance.cost_model.{name}: {err}") from None


def _validate_dataset(dataset: Any, i: int) -> None:
    where = f"datasets[{i}]"
    if not isinstance(dataset, dict):
        raise ConfigError(f"{where}: each dataset must be a mapping")
    unknown = set(dataset) - DATASET_KEYS - {"_base_dir"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} (valid: {sorted(DATASET_KEYS)})")
    for key in ("name", "paths", "media_root"):
        if not dataset.get(key):
            raise ConfigError(f"{where}: '{key}' is required")
    if dataset.get("format", "auto") not in ("auto", "json", "jsonl", "parquet"):
        raise ConfigError(f"{where}: format must be auto, json, jsonl or parquet")
    if dataset.get("dialect", "auto") not in ("auto", "sharegpt", "openai"):
        raise ConfigError(f"{where}: dialect must be auto, sharegpt or openai")
    for key in ("columns", "tags"):
        if not isinstance(dataset.get(key, {}), dict):
            raise ConfigError(f"{where}: '{key}' must be a mapping")


def _positive_int(value: Any, key: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


def config_hash(config: Mapping[str, Any]) -> str:
    """A stable hash of the parts of the config that change outputs (not Spark settings)."""
    relevant = {k: v for k, v in config.items() if k not in ("spark", "s3", "run_id")}
    blob = json.dumps(relevant, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
