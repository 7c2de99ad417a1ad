"""Megatron-Energon over an mmpack export (``mmpack export energon``): ``MmpackTaskEncoder``
turns each exported bin into Megatron-Core's packed (THD) micro-batch, ``loader.megatron``'s.

    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from loader.energon import MmpackTaskEncoder

    encoder = MmpackTaskEncoder(export, cp_size=2)
    dataset = get_train_dataset(export, worker_config=WorkerConfig(rank, world_size, num_workers),
                                task_encoder=encoder, batch_size=None, **encoder.one_epoch)
    for batch in get_savable_loader(dataset):   # one bin per micro-batch
        loss_sum, tokens = loss_sum_and_tokens(model(**batch), batch)

The tar sample of a bin becomes a one-row table of the shard schema, and the item
``PackedDataset`` would yield for it (``loader.dataset.Bins``), so both loaders give the same
tokens, positions and pixels; ``megatron_batch`` then shifts, pads and bounds it. The export
records its profile (``mmpack_export.json``); every bin says which it was packed for, and a
bin of another profile (a blend of exports of different models) is refused.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import torch

from loader.dataset import IGNORE, Bins, Pixels, checked_pixel_dtype
from loader.megatron import INSTALL, megatron_batch, unexpressible
from mmpack_udfs import schemas
from mmpack_udfs.io import fs

try:
    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless
except ImportError as err:  # the module is only imported by users of Energon
    raise ImportError(f"loader.energon needs megatron-energon: {INSTALL} ({err})") from err

MEDIA_PART = ".media"
ONE_EPOCH = {  # get_train_dataset's options for one pass in file order, every bin once
    "repeat": False,
    "shuffle_buffer_size": None,
    "max_samples_per_sequence": None,
    "shuffle_over_epochs_multiplier": None,
    "parallel_shard_iters": 1,
}


def load_export(uri: str, storage: fs.Storage = fs.LOCAL) -> dict[str, Any]:
    """The export manifest of an export folder (``mmpack_export.json``), checked."""
    path = fs.join(fs.normalize_uri(uri).rstrip("/"), schemas.EXPORT_MANIFEST)
    try:
        manifest = json.loads(storage.read_bytes(path))
    except (FileNotFoundError, OSError) as err:
        raise FileNotFoundError(f"no mmpack export at {uri}: {path} is missing ({err})") from err
    if (manifest.get("format"), manifest.get("format_version")) != (
        schemas.EXPORT_FORMAT,
        schemas.EXPORT_FORMAT_VERSION,
    ):
        raise ValueError(
            f"{path} is not an mmpack Energon export of format version {schemas.EXPORT_FORMAT_VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('format_version')!r})"
        )
    return manifest


@dataclass
class ExportedBin(Sample):
    """One tar sample of an export, its parts parsed: the json record, the token arrays and
    the media items' bytes in order."""

    record: dict
    arrays: dict
    media: list


@stateless
def cook_bin(raw: dict) -> ExportedBin:
    """Energon cooker: the raw parts of a tar sample (``decoder = None``: bytes) → ExportedBin."""
    media = sorted((k for k in raw if k.endswith(MEDIA_PART)), key=lambda k: int(k.split(".")[0]))
    return ExportedBin(
        **basic_sample_keys(raw),
        record=json.loads(raw["json"]),
        arrays={
            name: np.load(io.BytesIO(raw[f"{name}.npy"]), allow_pickle=False)
            for name in schemas.EXPORT_ARRAYS
        },
        media=[raw[k] for k in media],
    )


def bin_table(exported: ExportedBin) -> pa.Table:
    """The bin as a one-row table of the shard schema (the columns ``Bins`` reads)."""
    shard = schemas.SHARD
    columns: dict[str, pa.Array] = {}
    for name, values in exported.arrays.items():
        offsets = pa.array([0, len(values)], pa.int32())
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(values, pa.int32()))
    for name in ("sample_ids", *schemas.ADDED_SHARD_COLUMNS):
        if name in exported.record:
            columns[name] = pa.array([exported.record[name]], shard.field(name).type)
    items = [
        {**item, "data": data} for item, data in zip(exported.record["media"], exported.media, strict=True)
    ]
    columns["media"] = pa.array([items], shard.field("media").type)
    return pa.table(columns)


class MmpackTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder of an mmpack export: one bin → one Megatron-Core micro-batch
    (``megatron_batch`` with these ``cp_size``, ``tp_size``, ``sequence_parallel`` and
    ``pad_token_id``; pixels in ``pixel_dtype``, or none with ``with_media=False``: tokens,
    positions and boundaries only). Use it with ``batch_size=None``."""

    decoder = None  # every part arrives as bytes: the cooker parses them
    cookers: ClassVar[list] = [Cooker(cook_bin)]

    def __init__(
        self,
        export: str,
        *,
        cp_size: int = 1,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        pad_token_id: int = 0,
        pixel_dtype: str = "float32",
        with_media: bool = True,
        storage: fs.Storage = fs.LOCAL,
    ) -> None:
        super().__init__()
        checked_pixel_dtype(pixel_dtype)
        manifest = load_export(export, storage)
        self.profile_name, self.profile = manifest["profile"], manifest["profile_settings"]
        self.profile_digest = schemas.profile_digest(self.profile)
        reason = unexpressible(self.profile)
        if reason:
            raise ValueError(f"{export}: {reason}")
        self.pixels = Pixels(pixel_dtype, manifest["media_encoding"] == "patches8") if with_media else None
        self.batch_options = {
            "cp_size": cp_size,
            "tp_size": tp_size,
            "sequence_parallel": sequence_parallel,
            "pad_token_id": pad_token_id,
        }

    one_epoch: ClassVar[dict[str, Any]] = ONE_EPOCH

    @stateless
    def encode_sample(self, sample: ExportedBin) -> dict[str, Any]:
        """The torch loader's item of the bin, as Megatron-Core's THD micro-batch; ``meta``
        adds the bin's Energon key, where it came from in the pack and the subflavors a
        metadataset gave its dataset (e.g. which export of a blend)."""
        came_from = sample.record["mmpack"]
        if came_from["profile_digest"] != self.profile_digest:
            raise ValueError(
                f"bin {sample.__key__} was packed for another model (profile {came_from['profile']!r}, "
                f"settings {came_from['profile_digest']}) than this encoder's export (profile "
                f"{self.profile_name!r}, settings {self.profile_digest}): a blend must mix exports of one "
                "model"
            )
        item = Bins(bin_table(sample), self.profile, self.pixels).item(0, fs.LOCAL)
        batch = megatron_batch(item, **self.batch_options)
        batch["meta"].update(key=sample.__key__, source=came_from, subflavors=sample.__subflavors__ or {})
        return batch


def epoch_loader(path: str | Any, encoder: MmpackTaskEncoder, rank: int, world_size: int, num_workers: int):
    """Energon's savable loader of one epoch (``ONE_EPOCH``) of an export or a metadataset
    for data-parallel ``rank``; a failing bin raises instead of being skipped."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, reraise_exception

    config = WorkerConfig(
        rank=rank, world_size=world_size, num_workers=num_workers, global_error_handler=reraise_exception
    )
    dataset = get_train_dataset(
        str(path), worker_config=config, task_encoder=encoder, batch_size=None, **ONE_EPOCH
    )
    return get_savable_loader(dataset)


def steps_per_rank(
    export: str, world_size: int, num_workers: int, split: str = "train", storage: fs.Storage = fs.LOCAL
) -> int:
    """The most bins Energon's sharding (its ``Sharder.split_samples_to_workers``) gives one
    rank in an epoch of ``split``: the steps ``EqualSteps`` gives every rank."""
    from megatron.energon import WorkerConfig
    from megatron.energon.flavors.webdataset.sharder import Sharder

    bins = load_export(export, storage)["splits"][split]["bins"]
    shares = []
    for rank in range(world_size):
        config = WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers)
        offsets = Sharder.split_samples_to_workers(0, bins, config)
        shares.append(offsets[-1] - offsets[0])
    return max(shares)


def as_filler(batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch that keeps a rank in step and trains nothing: ``batch`` with every label
    masked (its loss and token count are 0), ``meta["filler"]`` True."""
    labels = torch.full_like(batch["labels"], IGNORE)
    meta = {**batch["meta"], "filler": True, "sample_ids": [], "supervised_tokens": 0}
    return {**batch, "labels": labels, "loss_mask": torch.zeros_like(batch["loss_mask"]), "meta": meta}


class EqualSteps:
    """One epoch of Energon's loader as ``steps`` micro-batches on every data-parallel rank:
    the rank's own bins (Energon gives each rank a contiguous share; shares differ by up to a
    bin per worker), then fillers (``as_filler`` of its last bin), as ``PackedDataset`` does.
    ``steps``: ``steps_per_rank(...)``. Save and restore through it (``save_state_rank``)."""

    def __init__(self, loader: Any, steps: int) -> None:
        self.loader, self.steps = loader, steps
        self._taken, self._last = 0, None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        restored_after_bins = self._last is not None  # the loader's share is done: fillers only
        for batch in () if restored_after_bins else self.loader:
            if self._taken == self.steps:
                raise ValueError(f"this rank has more than {self.steps} bins: steps is too small")
            self._taken, self._last = self._taken + 1, batch
            yield batch
        if self._taken < self.steps and self._last is None:
            raise ValueError("this rank got no bin this epoch: fewer bins than ranks × workers")
        while self._taken < self.steps:
            self._taken += 1
            yield as_filler(self._last)
        self._taken, self._last = 0, None

    def save_state_rank(self) -> dict[str, Any]:
        """The loader's state and the steps taken; once the rank's bins ran out (``len`` of
        Energon's loader: the rank's share), also the bin the remaining fillers copy."""
        bins_done = self._taken >= len(self.loader)
        last = self._last if bins_done else None
        return {"loader": self.loader.save_state_rank(), "taken": self._taken, "last": last}

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Resume where ``save_state_rank`` was called (before iterating)."""
        self.loader.restore_state_rank(state["loader"])
        self._taken, self._last = state["taken"], state["last"]
