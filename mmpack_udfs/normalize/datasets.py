"""Configured datasets → the specs normalize reads: ``paths`` entries as they are, and the
entries of a LLaMA-Factory ``dataset_info.json`` as LLaMA-Factory reads them.

Runs on the driver before Spark starts: a dataset_info entry mmpack cannot take (a hub
dataset, an unknown column) is a configuration error naming it; ``ranking: true`` entries
are preference pairs (normalize.preference).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from mmpack_udfs.config.loading import describe
from mmpack_udfs.config.model import ColumnsConfig, DatasetConfig, TagsConfig
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.io import fs
from mmpack_udfs.normalize.sharegpt import DatasetSpec

DATASET_INFO = "dataset_info.json"
FORMATTINGS = {"alpaca", "sharegpt", "openai"}  # LLaMA-Factory's, all readable as mmpack dialects
ENTRY_KEYS = {"file_name", "formatting", "columns", "tags", "ranking", "split", "file_sha1"}
HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
COLUMN_NAMES = {  # LLaMA-Factory column → mmpack column (tags take LLaMA-Factory's names as they are)
    "messages": "messages", "system": "system", "images": "images", "videos": "videos", "audios": "audios",
    "prompt": "prompt", "query": "query", "response": "response", "history": "history",
    "chosen": "chosen", "rejected": "rejected",
}  # fmt: skip


def specs_of(datasets: Iterable[DatasetConfig], storage: fs.Storage = fs.LOCAL) -> dict[str, DatasetSpec]:
    """Every dataset normalize reads, by name (dataset_info entries: ``<name>/<entry>``)."""
    datasets = list(datasets)
    if not datasets:
        raise ConfigError(
            "datasets: none configured; give a config file with a 'datasets' list (--config FILE; "
            "README, 'Quickstart')"
        )
    specs: dict[str, DatasetSpec] = {}
    for entry in datasets:
        for spec in _expand(entry, storage):
            if spec.name in specs:
                raise ConfigError(f"datasets: two datasets are named '{spec.name}'")
            if spec.ranking and entry.loss_weight != 1:
                raise ConfigError(
                    f"datasets '{entry.name}': preference pairs take no loss_weight (mmpack's DPO loss "
                    "has no per-sample weight)"
                )
            specs[spec.name] = spec
    ranking = sorted(name for name, spec in specs.items() if spec.ranking)
    if ranking and len(ranking) != len(specs):
        others = sorted(set(specs) - set(ranking))
        raise ConfigError(
            f"datasets: {', '.join(ranking)} hold preference pairs (ranking: true) and {', '.join(others)} "
            "SFT conversations; a pack holds one kind: run them as two pipelines"
        )
    return specs


def _expand(entry: DatasetConfig, storage: fs.Storage) -> list[DatasetSpec]:
    base = entry.base_dir or os.getcwd()
    if entry.dataset_info is None:
        paths = entry.paths if isinstance(entry.paths, list) else [entry.paths]
        return [
            DatasetSpec(
                name=entry.name,
                paths=tuple(_resolve(p, base) for p in paths),
                media_root=_resolve(entry.media_root, base) if entry.media_root else None,
                format=entry.format,
                dialect=entry.dialect,
                columns=_items(entry.columns),
                tags=_items(entry.tags),
                ranking=entry.ranking,
            )
        ]
    info_uri = _resolve(entry.dataset_info, base)
    if not info_uri.endswith(".json"):
        info_uri = fs.join(info_uri, DATASET_INFO)
    folder = info_uri.rsplit("/", 1)[0]
    info = _read_info(info_uri, storage, entry.name)
    media_root = _resolve(entry.media_root, base) if entry.media_root else folder
    missing = [n for n in entry.names or [] if n not in info]
    if missing:
        known = ", ".join(sorted(info)) or "none"
        raise ConfigError(
            f"datasets '{entry.name}': {info_uri} has no entry {', '.join(missing)} (it has: {known})"
        )
    return [_entry_spec(entry, name, info[name], folder, media_root) for name in entry.names or []]


def _read_info(uri: str, storage: fs.Storage, dataset: str) -> dict[str, Any]:
    try:
        info = json.loads(storage.read_bytes(uri))
    except FileNotFoundError:
        raise ConfigError(f"datasets '{dataset}': no dataset_info file at {uri}") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"datasets '{dataset}': {uri} is not readable JSON: {err}") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise ConfigError(f"datasets '{dataset}': {uri} must map dataset names to entries")
    return info


def _entry_spec(
    entry: DatasetConfig, name: str, attrs: Mapping[str, Any], folder: str, media_root: str
) -> DatasetSpec:
    """One dataset_info entry as a spec; ConfigError naming what mmpack cannot read."""
    where = f"datasets '{entry.name}': dataset_info entry '{name}'"
    hub = [k for k in HUB_KEYS if attrs.get(k)]
    if "file_name" not in attrs:
        detail = f" ({', '.join(hub)})" if hub else ""
        raise ConfigError(f"{where} has no file_name{detail}: mmpack reads files (local or s3://) only")
    unknown = sorted(set(attrs) - ENTRY_KEYS - set(HUB_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: mmpack does not support {', '.join(unknown)} (it reads {sorted(ENTRY_KEYS)})"
        )
    if attrs.get("split", "train") != "train":
        raise ConfigError(
            f"{where}: split {attrs['split']!r} applies to hub datasets; mmpack reads the whole file"
        )
    formatting = attrs.get("formatting", "alpaca")  # LLaMA-Factory's default
    if formatting not in FORMATTINGS:
        raise ConfigError(
            f"{where}: formatting {formatting!r} (mmpack reads {', '.join(sorted(FORMATTINGS))})"
        )
    columns = dict(attrs.get("columns") or {})
    unmapped = sorted(set(columns) - set(COLUMN_NAMES))
    if unmapped:
        raise ConfigError(
            f"{where}: column(s) {', '.join(unmapped)} not supported (mmpack reads {sorted(COLUMN_NAMES)})"
        )
    try:
        mapped_columns = ColumnsConfig.model_validate({COLUMN_NAMES[k]: v for k, v in columns.items()})
        tags = TagsConfig.model_validate(attrs.get("tags") or {})
    except ValidationError as err:
        raise ConfigError(f"{where}: {describe(err)}") from None
    return DatasetSpec(
        name=f"{entry.name}/{name}",
        paths=(fs.join(folder, attrs["file_name"]),),
        media_root=media_root,
        format=entry.format,
        dialect=formatting,
        columns=_items(mapped_columns),
        tags=_items(tags),
        ranking=bool(attrs.get("ranking")) or entry.ranking,
    )


def _items(section: ColumnsConfig | TagsConfig) -> tuple[tuple[str, Any], ...]:
    """A section's given keys as sorted, hashable items (lists of tags as tuples)."""
    values = section.model_dump(exclude_none=True)
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items()))


def _resolve(path: str, base: str) -> str:
    """``path`` against the config file's folder, unless absolute or on S3 (as s3://)."""
    if fs.is_s3(path):
        return fs.normalize_uri(path)
    if os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))
