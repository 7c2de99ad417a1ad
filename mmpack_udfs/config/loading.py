"""Loading a configuration: the model's defaults, then a user's --config file, then --set
overrides; checked by the model (``config.model``), errors naming the key."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from mmpack_udfs.config.model import MODEL_PROFILE, PROFILE_KINDS, Config
from mmpack_udfs.errors import ConfigError

FREE_FORM_KEYS = {"spark.conf"}  # maps whose keys contain dots (Spark settings)
OPEN_MAPS = FREE_FORM_KEYS | {"profiles", "balance.cost_model"}  # maps that accept new keys
MODEL_KEYS = f"profiles.{MODEL_PROFILE}."


class ModelReading(Protocol):
    """What reading a model directory gives the configuration (``families.model_dir``)."""

    path: str  # the local directory (tokenize.tokenizer unless one is given)
    kind: str  # the family
    profile: dict[str, Any]  # the directory's settings of profiles.model


ModelReader = Callable[[Config], ModelReading]


def load_config(
    config_file: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    read_model: ModelReader | None = None,
) -> Config:
    """Defaults, merged with ``config_file`` (if any), then ``key=value`` overrides; checked.

    With ``tokenize.model`` set, ``read_model`` reads that directory (``resolve.load_run``
    passes it: configuration is data and reads no model itself)."""
    config = defaults()
    if config_file is not None:
        user = read_yaml(Path(config_file))
        base_dir = Path(config_file).resolve().parent
        for dataset in user.get("datasets") or []:
            if isinstance(dataset, dict):
                dataset.setdefault("_base_dir", str(base_dir))
        config = merge(config, user, where=str(config_file))
    for item in overrides:
        config = apply_override(config, item)
    return with_model(config, read_model)


def with_model(data: dict[str, Any], read_model: ModelReader | None = None) -> Config:
    """The checked config; with ``tokenize.model``, its profile ``profiles.model`` is the
    directory's settings (``read_model``) with the keys given under ``profiles.model`` over
    them, the tokenizer is the directory's (unless ``tokenize.tokenizer`` names another), and
    the family's cost model is ``balance.cost_model.model`` unless one is given."""
    if data["tokenize"].get("model") is None:
        if data["tokenize"].get("profile") == MODEL_PROFILE or MODEL_PROFILE in data["profiles"]:
            raise ConfigError(f"profiles.{MODEL_PROFILE} is built from tokenize.model, which is not set")
        return checked(data)
    if read_model is None:
        raise ConfigError(
            "tokenize.model is read where a run starts: load the config with "
            "mmpack_udfs.resolve.load_run (or load_config's read_model)"
        )
    # first the keys the directory's reading needs (tokenize.model, s3), without the profile it makes
    profiles = {k: v for k, v in data["profiles"].items() if k != MODEL_PROFILE}
    tokenize = {**data["tokenize"], "profile": Config().tokenize.profile, "use_audio_in_video": False}
    found = read_model(checked({**data, "profiles": profiles, "tokenize": tokenize}))
    data = copy.deepcopy(data)
    data["profiles"][MODEL_PROFILE] = merge(
        found.profile,
        data["profiles"].get(MODEL_PROFILE, {}),
        where=f"profiles.{MODEL_PROFILE}",
        prefix=f"profiles.{MODEL_PROFILE}.",
    )
    data["profiles"][MODEL_PROFILE]["kind"] = found.kind
    data["balance"]["cost_model"].setdefault(MODEL_PROFILE, data["balance"]["cost_model"][found.kind])
    data["tokenize"]["profile"] = MODEL_PROFILE
    if data["tokenize"].get("tokenizer") is None:
        data["tokenize"]["tokenizer"] = found.path
    return checked(data)


def defaults() -> dict[str, Any]:
    """Every key with its default, as plain data."""
    return Config().model_dump(by_alias=True)


def checked(data: Mapping[str, Any]) -> Config:
    """The model of ``data``; a ConfigError naming every wrong key."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe(err)) from None


def describe(err: ValidationError) -> str:
    """Every error of a validation, each a sentence that starts with its key."""
    return "; ".join(_message(e) for e in err.errors())


def read_yaml(path: Path) -> dict[str, Any]:
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
        # keys under profiles.model are checked once the model directory's profile is there
        if key not in base and prefix.rstrip(".") not in OPEN_MAPS and not prefix.startswith(MODEL_KEYS):
            valid = ", ".join(sorted(f"{prefix}{k}" for k in base))
            raise ConfigError(f"{where}: unknown config key '{dotted}' (valid here: {valid})")
        if isinstance(base.get(key), dict) and isinstance(value, dict):
            result[key] = merge(base[key], value, where, f"{dotted}.")
        else:
            result[key] = copy.deepcopy(value)
    return result


def apply_override(config: dict[str, Any], item: str) -> dict[str, Any]:
    """Apply one ``a.b.c=value`` override. The value is read as YAML (numbers, bools, lists,
    null), then by the key's type: a number for a number (``1e8``), the text as written for a
    text key (``#`` in a path is not a comment, ``--set run_id=42`` is the text ``42``)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    dotted, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw  # e.g. "a: b #c" or "[x": text, not YAML
    path = _key_path(dotted.strip())
    if not _quoted(raw) and (isinstance(value, str) or (value is not None and _is_text(path))):
        value = raw.strip()
    update: Any = value
    for part in reversed(path):
        update = {part: update}
    return merge(config, update, where=f"--set {item}")


def _is_text(path: list[str]) -> bool:
    """Whether the key at ``path`` holds text (a plain field of type str or str | None)."""
    section = _section_at(path[:-1])
    field = section.model_fields.get(path[-1]) if section is not None else None
    return field is not None and field.annotation in (str, str | None)


def _quoted(raw: str) -> bool:
    text = raw.strip()
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def _key_path(dotted: str) -> list[str]:
    """``a.b.c`` → [a, b, c]; inside a free-form map the rest stays one key (Spark's dots)."""
    for free in FREE_FORM_KEYS:
        if dotted.startswith(free + "."):
            return [*free.split("."), dotted[len(free) + 1 :]]
    return dotted.split(".")


def _message(error: Mapping[str, Any]) -> str:
    """One pydantic error as a sentence that starts with the key."""
    loc = list(error["loc"])
    if len(loc) > 2 and loc[0] == "profiles" and loc[2] in PROFILE_KINDS:
        del loc[2]  # the discriminator's branch is not part of the key
    key = _dotted(loc)
    kind, value = error["type"], error.get("input")
    if kind == "mmpack_named":
        return error["msg"]
    if kind == "mmpack":
        return f"{key} {error['msg']}, got {value!r}"
    if kind == "mmpack_here":
        return f"{key}: {error['msg']}"
    if kind == "missing":
        return f"{_dotted(loc[:-1]) or 'the config'}: '{loc[-1]}' is required"
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        return f"unknown config key '{key}'" + (f" (valid here: {', '.join(valid)})" if valid else "")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return f"{key}.kind must be one of {', '.join(PROFILE_KINDS)} (the profile's model family)"
    return f"{key}: {error['msg']} (got {value!r})"


def _valid_keys(loc: list[Any]) -> list[str]:
    """The keys the model accepts at ``loc`` (a section, a list entry or a map entry)."""
    section = _section_at(loc)
    if section is None:
        return []
    return [n for n, f in section.model_fields.items() if not (f.alias or "").startswith("_")]


def _section_at(path: list[Any]) -> type[BaseModel] | None:
    """The section model at ``path`` (through list entries and map entries), or None where
    the path leads to a value or to no section."""
    model: Any = Config
    parts = list(path)
    while parts:
        part = parts.pop(0)
        if not _is_section(model) or part not in model.model_fields:
            return None
        model = model.model_fields[part].annotation
        if get_origin(model) in (list, dict):  # skip the index or the map key
            model, parts = get_args(model)[-1], parts[1:]
    return model if _is_section(model) else None


def _is_section(model: Any) -> bool:
    return isinstance(model, type) and issubclass(model, BaseModel)


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def config_hash(config: Config) -> str:
    """A stable hash of the parts of the config that change outputs (not Spark or S3 settings)."""
    relevant = {k: v for k, v in config.as_dict().items() if k not in ("spark", "s3", "run_id")}
    blob = json.dumps(relevant, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
