"""``PackedDataset``: a torch IterableDataset over the bins of a manifest.

Per bin it yields ``input_ids``, ``labels`` (first token of every sample masked),
``position_ids`` (restarting at 0 per sample), ``cu_seqlens`` (int32, [n + 1]),
``max_seqlen``, ``sample_ids``, ``sample_datasets`` and ``sample_pair_sides`` (when the
shards record them; a preference pair's ``chosen`` / ``rejected`` side, None otherwise),
``filler``; for the Qwen-VL families the exact 3-row ``mrope_position_ids`` (the family's
positions from the stored grids and offsets, with or without pixels) and, for
linear-attention models (Qwen3.5), ``seq_idx``; with media, the
vision tensors (Qwen-VL: ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` +
``video_grid_thw`` (+ ``second_per_grid_ts``); internvl: ``pixel_values`` tiles +
``num_tiles``). The manifest's profile says the family (``mmpack_udfs.families``). A filler (see
``loader.plan``) is a real bin with every label masked, no ``sample_ids`` and no datasets.
``collate_packed`` turns items into what a model takes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from loader import audio, balance, plan, vision
from loader.source import ShardError, ShardSource, load_manifest
from mmpack_udfs import schemas
from mmpack_udfs.constants import IGNORE_INDEX as IGNORE
from mmpack_udfs.families import Family, make_family
from mmpack_udfs.io import fs
from mmpack_udfs.pack import costs

MEDIA_ENCODINGS = ("file", "patches8")  # docs/FORMAT.md: what media[].data holds
TOKEN_COLUMNS = ["input_ids", "labels", "cu_seqlens", "sample_ids", "num_tokens"]
PER_SAMPLE_COLUMNS = schemas.ADDED_SHARD_COLUMNS  # sample_datasets, _pair_sides, _weights: when present
SPLITS = ("train", "eval")
# what mRoPE reads of media (the fields of families' ``vision_blocks``)
MROPE_FIELDS = [
    "sample_index",
    "kind",
    "grid_t",
    "grid_h",
    "grid_w",
    "token_offset",
    "second_per_grid_t",
    "group_starts",
]


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) from torch.distributed, else RANK/WORLD_SIZE, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


PIXEL_DTYPES = ("float32", "bfloat16", "uint8")


def checked_pixel_dtype(pixel_dtype: str) -> str:
    """``pixel_dtype`` if it is one the loaders hand pixels over in (``PIXEL_DTYPES``)."""
    if pixel_dtype not in PIXEL_DTYPES:
        raise ValueError(f"pixel_dtype must be one of {', '.join(PIXEL_DTYPES)}, got {pixel_dtype!r}")
    return pixel_dtype


class PackedDataset(IterableDataset):
    """Bins of ``manifest_uri`` (a manifest.json, its folder, or s3://...), each trained exactly
    once per epoch across ranks × workers, in a deterministic (seed, epoch) order; every
    rank yields the same number of items (see ``loader.plan``).

    ``balance`` (default: on when the manifest has a cost index) gives every position the
    ranks' near-equal bins in both phases (``loader.balance``), priced by ``cost_model``
    (default: the manifest's ``balance.cost_model`` of its profile); ``shuffle_buffer`` then
    does not apply (the plan orders each rank). ``balance=False``: today's order.

    ``split="eval"`` reads the run's evaluation pack (``OUT/packed-eval``, which the training
    manifest names) instead: every evaluation sample once across ranks, equal steps per
    rank; pass ``shuffle=False`` for the same order every time.
    """

    def __init__(
        self,
        manifest_uri: str,
        *,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 256,
        rank: int | None = None,
        world_size: int | None = None,
        drop_remainder: bool = False,
        s3: fs.S3Options | Mapping[str, Any] | None = None,
        verify: bool = True,
        with_media: bool = True,
        balance: bool | None = None,
        cost_model: costs.CostModel | Mapping[str, Any] | None = None,
        pixel_dtype: str = "float32",
        split: str = "train",
    ) -> None:
        super().__init__()
        self.pixel_dtype = checked_pixel_dtype(pixel_dtype)
        self.storage = fs.Storage(s3 if isinstance(s3, fs.S3Options) else fs.S3Options.from_config(s3))
        self.manifest = load_split(fs.normalize_uri(manifest_uri), split, self.storage)
        self.media_encoding = self.manifest.get("media_encoding", "file")
        if self.media_encoding not in MEDIA_ENCODINGS:
            raise ValueError(
                f"{manifest_uri}: media_encoding {self.media_encoding!r} is not one this loader "
                f"reads ({', '.join(MEDIA_ENCODINGS)}); repack the shards or upgrade mmpack"
            )
        if with_media:
            audio.require_decoder(self.manifest.get("audio_decoder"), manifest_uri)
        default_rank, default_world = distributed_rank()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.drop_remainder = drop_remainder
        self.verify, self.with_media = verify, with_media
        self.units = plan.units_of(self.manifest["shards"], self.manifest["bins_per_row_group"])
        self.profile = self.manifest["config"]["profiles"][self.manifest["profile"]]
        self.datasets: list[str] = self.manifest.get("datasets", [])  # sorted: per-dataset losses
        self.preference: bool = self.manifest.get("preference", False)  # bins of DPO pairs
        self.epoch, self._consumed, self._resume = 0, 0, None
        self._source: ShardSource | None = None
        plan.Slot(self.rank, self.world_size)  # validates rank < world size
        self.balance = "cost_index" in self.manifest if balance is None else balance
        self.cost_model = self._cost_model(cost_model) if self.balance else None
        self._costs: tuple[np.ndarray, np.ndarray] | None = None

    def _cost_model(self, given: costs.CostModel | Mapping[str, Any] | None) -> costs.CostModel:
        if "cost_index" not in self.manifest:
            raise ValueError("balance=True needs a cost index, which this manifest lacks: re-run pack")
        if given is not None:
            return given if isinstance(given, costs.CostModel) else costs.CostModel.from_mapping(given)
        try:
            return costs.CostModel.for_profile(self.manifest["config"], self.manifest["profile"])
        except ValueError as err:
            raise ValueError(f"{err}; pass cost_model=") from err

    # -- epochs and resumption ------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Items this rank yields per epoch (all workers together; the same on every rank)."""
        return plan.items_per_rank(sum(u.rows for u in self.units), self.world_size, self.drop_remainder)

    def num_batches(self, batch_size: int, num_workers: int, drop_last: bool = False) -> int:
        """Steps per epoch of ``DataLoader(self, batch_size=…, num_workers=…)``, on every rank."""
        return plan.batches_per_epoch(len(self), num_workers, batch_size, drop_last)

    def state_dict(self) -> dict[str, Any]:
        """Where this reader (this worker, under a DataLoader) stands in its epoch."""
        return {"epoch": self.epoch, "consumed": self._consumed, "seed": self.seed, "plan": self._plan_key()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration continues the saved epoch after its consumed bins."""
        if state["seed"] != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.seed}")
        self.epoch, self._resume = state["epoch"], dict(state)

    def _slot(self) -> plan.Slot:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return plan.Slot(self.rank, self.world_size, worker, workers)

    def _plan_key(self) -> list:
        """What the order depends on besides seed and epoch: a resume must match it."""
        slot = self._slot()
        return [
            slot.rank,
            slot.world_size,
            slot.worker,
            slot.num_workers,
            self.drop_remainder,
            self.shuffle,
            self.balance,
            *(astuple(self.cost_model) if self.cost_model else ()),
        ]

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        slot = self._slot()
        skip = 0
        if self._resume is not None:
            if self._resume.get("plan") != self._plan_key():
                raise ValueError(
                    f"state was saved by reader {self._resume.get('plan')} (rank, world size, worker, "
                    f"workers, drop_remainder, shuffle, balance), this one is {self._plan_key()}; "
                    "resume with the same ranks, workers and options"
                )
            skip, self._resume = self._resume["consumed"], None
        if self._source is None:
            self._source = ShardSource(self.manifest, self.storage, self.verify)
        order = self._items(slot, self._source)
        remaining = Counter(item.unit for item in order[skip:])
        loaded: dict[int, Bins] = {}
        self._consumed = skip
        for item in order[skip:]:
            if item.unit not in loaded:
                loaded[item.unit] = Bins.read(
                    self._source,
                    self.units[item.unit],
                    self.profile,
                    self._pixels() if self.with_media else None,
                )
            out = loaded[item.unit].item(item.row, self._source.storage)
            remaining[item.unit] -= 1
            if not remaining[item.unit]:
                del loaded[item.unit]
            self._consumed += 1
            yield _as_filler(out) if item.filler else out
        self._consumed = 0

    def _pixels(self) -> Pixels:
        return Pixels(self.pixel_dtype, self.media_encoding == "patches8")

    def _items(self, slot: plan.Slot, source: ShardSource) -> list[plan.Item]:
        """This reader's items of the epoch, in order."""
        args = (self.seed, self.epoch)
        if self.balance:
            vision, llm = self._phases(source)
            return balance.worker_items(
                vision, llm, self.units, slot, *args, self.shuffle, self.drop_remainder
            )
        mine = plan.worker_items(self.units, slot, *args, self.shuffle, self.drop_remainder)
        return plan.shuffled(mine, slot, *args, self.shuffle_buffer, self.shuffle)

    def _phases(self, source: ShardSource) -> tuple[np.ndarray, np.ndarray]:
        """Each bin's (vision, llm) cost, from the cost index (read once)."""
        if self._costs is None:
            self._costs = self.cost_model.phases(source.cost_index())
        return self._costs


def load_split(manifest_uri: str, split: str, storage: fs.Storage) -> dict[str, Any]:
    """The manifest of ``split`` of the run whose (training) manifest is ``manifest_uri``: the
    evaluation pack lives beside the training one (``packed-eval/``) and carries its run id."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    manifest = load_manifest(manifest_uri, storage)
    if split == "train" or manifest.get("split") == "eval":
        return manifest
    named = manifest.get("eval")
    if not named:
        raise ShardError(
            f"{manifest_uri}: this run has no evaluation split (set eval.fraction or datasets[].eval_samples "
            "and re-run pack)"
        )
    eval_manifest = load_manifest(schemas.packed_eval_uri(manifest["_root"].rsplit("/", 1)[0]), storage)
    if eval_manifest.get("run_id") != named["run_id"]:
        raise ShardError(
            f"the evaluation pack beside {manifest_uri} is of run {eval_manifest.get('run_id')}, the "
            f"training manifest names run {named['run_id']}: re-run pack"
        )
    return eval_manifest


def _as_filler(item: dict[str, Any]) -> dict[str, Any]:
    """A real bin that keeps a short rank in step and trains nothing: all labels masked."""
    return {
        **item,
        "labels": torch.full_like(item["labels"], IGNORE),
        "sample_ids": [],
        **{name: [] for name in PER_SAMPLE_COLUMNS},
        "filler": True,
    }


@dataclass(frozen=True)
class Pixels:
    """How pixels are handed over: ``dtype`` (float32, bfloat16, or uint8 for the model side
    to normalize: ``loader.normalize_pixel_values``), and whether the shard's media are
    prepared (8-bit patches already at their grid; the manifest's ``media_encoding``)."""

    dtype: str
    prepared: bool

    @property
    def computed(self) -> str:
        """What numpy computes: uint8 values, or float32 (cast to bfloat16 afterwards)."""
        return "uint8" if self.dtype == "uint8" else "float32"

    def tensor(self, values: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(values)
        return out.to(torch.bfloat16) if self.dtype == "bfloat16" else out


class _MediaColumn:
    """A row group's ``media`` lists, item by item: the small fields as Python values and
    ``data`` as bytes, or with ``views`` as numpy views into the Arrow buffer (prepared
    patches are read without a copy)."""

    def __init__(self, column: pa.ListArray, views: bool) -> None:
        self.offsets, self.views = column.offsets.to_numpy(), views
        items: pa.StructArray = column.values
        fields = dict(zip([f.name for f in items.type], items.flatten(), strict=True))
        data = fields.pop("data", None)
        self.meta = pa.StructArray.from_arrays(list(fields.values()), list(fields))
        self.data = None
        if data is not None:
            self.data = (
                np.frombuffer(data.buffers()[1], np.int32)[data.offset :],
                np.frombuffer(data.buffers()[2] or b"", np.uint8),
                data.is_valid().to_numpy(zero_copy_only=False),
            )

    def row(self, row: int) -> list[dict[str, Any]]:
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        items = self.meta.slice(start, end - start).to_pylist()
        if self.data is None:  # read without the media bytes
            return items
        offsets, values, valid = self.data
        for index, item in enumerate(items, start):
            view = values[offsets[index] : offsets[index + 1]]
            item["data"] = None if not valid[index] else view if self.views else view.tobytes()
        return schemas.shared_media_data(items)


class Bins:
    """The bins of one Arrow table with the shard schema (a shard's row group, or one exported
    bin: ``loader.energon``), as numpy views to cut items out of without per-token work.
    ``media`` may be absent (text-only reads) or hold only the mRoPE fields (no pixels)."""

    def __init__(self, table: pa.Table, profile: Mapping[str, Any], pixels: Pixels | None) -> None:
        self.profile, self.pixels = profile, pixels
        self.family = make_family(profile["kind"], profile)
        table = table.combine_chunks()
        self.lists = {}
        for name in ("input_ids", "labels", "cu_seqlens"):
            array = table.column(name).chunk(0)
            self.lists[name] = (array.offsets.to_numpy(), array.values.to_numpy())
        self.sample_ids = table.column("sample_ids").chunk(0)
        # shards written before a per-sample column lack it
        self.columns = {c: table.column(c).chunk(0) for c in PER_SAMPLE_COLUMNS if c in table.column_names}
        self.media = None
        if "media" in table.column_names:
            self.media = _MediaColumn(table.column("media").chunk(0), views=bool(pixels and pixels.prepared))

    @classmethod
    def read(
        cls, source: ShardSource, unit: plan.Unit, profile: Mapping[str, Any], pixels: Pixels | None
    ) -> Bins:
        """One row group of a shard, with the columns an item needs."""
        media_columns: list[str] = []
        if pixels is not None:
            media_columns = ["media"]
        elif make_family(profile["kind"], profile).mrope:  # mRoPE needs the grids and offsets, not the pixels
            media_columns = source.nested_columns(unit.shard, "media", MROPE_FIELDS)
        per_sample = [c for c in PER_SAMPLE_COLUMNS if source.has_column(unit.shard, c)]  # added since
        table = source.read(unit.shard, unit.row_group, TOKEN_COLUMNS + per_sample + media_columns)
        return cls(table, profile, pixels)

    def _list(self, name: str, row: int) -> np.ndarray:
        offsets, values = self.lists[name]
        return values[offsets[row] : offsets[row + 1]]

    def item(self, row: int, storage: fs.Storage) -> dict[str, Any]:
        ids = torch.from_numpy(self._list("input_ids", row).astype(np.int64))
        labels = self._list("labels", row).astype(np.int64)
        cu = self._list("cu_seqlens", row)
        lengths = np.diff(cu)
        labels[cu[:-1]] = IGNORE  # a sample's first token is never the target of the previous one
        positions = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
        item = {
            "input_ids": ids,
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
            "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
            "max_seqlen": int(lengths.max()),
            "sample_ids": self.sample_ids[row].as_py(),
            "filler": False,
        }
        for name, column in self.columns.items():
            item[name] = column[row].as_py()
        media = self.media.row(row) if self.media is not None else []
        if not self.family.boundary_kwargs:
            item["boundary_kwargs"] = False
        if self.family.linear_attention:  # which sample each token is (the causal conv's seq_idx)
            item["seq_idx"] = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths))
        if self.family.mrope:
            item["mrope_position_ids"] = _mrope(self.family, media, cu, positions)
            if self.pixels is not None:
                item.update(_qwen_pixels(media, self.family, storage, self.pixels))
                clips = [m for m in media if m["kind"] == "audio"]
                if clips:  # the Omni thinkers
                    item.update(_audio_media(clips, self.family, storage, self.pixels))
        elif media:
            inputs = {
                "tiles": _internvl_media,
                "anyres": _llava_onevision_media,
                "squares": _square_media,
                "soft_patches": _soft_patches_media,
                "audio": _audio_media,
            }
            item.update(inputs[self.family.pixel_layout](media, self.family, storage, self.pixels))
        if self.family.blocks_media:  # what collate_packed builds the attention masks from
            media_ids = [
                self.profile[key] for key in ("image_token_id", "video_token_id") if key in self.profile
            ]
            item["media_token_mask"] = torch.isin(ids, torch.tensor(media_ids))
            item["sliding_window"] = self.profile["sliding_window"]
            item["global_media_blocks"] = self.family.media_blocks_on_global_layers
        return item


def _media_bytes(item: Mapping[str, Any], storage: fs.Storage) -> bytes | np.ndarray:
    return item["data"] if item["data"] is not None else storage.read_bytes(item["uri"])


def _frames(item: Mapping[str, Any], storage: fs.Storage) -> list:
    data = _media_bytes(item, storage)
    if item["kind"] == "image":
        return [vision.decode_image(data)]
    return vision.decode_frames(data, item["frame_indices"], item["uri"])


def _qwen_pixels(media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels) -> dict[str, Any]:
    """Pixel patches and grids per kind, as transformers' Qwen-VL models take them (or their
    uint8 values, ``pixel_dtype="uint8"``): every item's 8-bit patches written into one
    array, then normalized once with the profile's mean/std of that kind. A family whose
    videos reach the vision tower as images (GLM-V: ``Family.videos_as_images``) gets every
    item as ``pixel_values`` in token order, a video as one [1, h, w] grid per temporal patch."""
    out: dict[str, Any] = {}
    profile = family.settings
    if family.videos_as_images:
        groups = [("image", "pixel_values", "image_grid_thw", media)]
    else:
        groups = [
            (kind, pixels_key, grid_key, [m for m in media if m["kind"] == kind])
            for kind, pixels_key, grid_key in (
                ("image", "pixel_values", "image_grid_thw"),
                ("video", "pixel_values_videos", "video_grid_thw"),
            )
        ]
    for kind, pixels_key, grid_key, items in groups:
        if items:
            rows = np.cumsum([0] + [vision.qwen2_vl_rows(m) for m in items])
            patches = np.empty((rows[-1], vision.row_values(items[0])), np.uint8)
            for m, start, end in zip(items, rows[:-1], rows[1:], strict=True):
                vision.expand_patches8(_qwen2_vl_patches8(m, storage, pixels), patches[start:end])
            settings = profile[kind]
            values = (
                patches
                if pixels.computed == "uint8"
                else vision.normalize_qwen_patches(patches, settings["mean"], settings["std"])
            )
            out[pixels_key] = pixels.tensor(values)
            if pixels.computed == "uint8":  # what normalize_pixel_values needs on the device
                out.setdefault("pixel_norm", {})[pixels_key] = (settings["mean"], settings["std"])
            if family.videos_as_images:
                grids = [[1, m["grid_h"], m["grid_w"]] for m in items for _ in range(m["grid_t"])]
            else:
                grids = [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in items]
            out[grid_key] = torch.tensor(grids)
            if kind == "video":  # what the model would derive Qwen2.5-VL's time positions from
                spans = [m["second_per_grid_t"] for m in items]
                out["second_per_grid_ts"] = torch.tensor([s if s is not None else 1.0 for s in spans])
    return out


def _mrope(family: Family, media: list[dict], cu: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """[3, T] (``Family.position_dtype``): text-only samples count 0, 1, 2, … on all three rows;
    samples with media get their 3-D positions (the family's, computed per sample, as if it were
    alone)."""
    positions = positions.astype(family.position_dtype, copy=False)  # float32: Qwen3-Omni's
    if not media:
        return torch.from_numpy(positions).expand(3, -1)
    rows = np.tile(positions, (3, 1))
    for i in sorted({m["sample_index"] for m in media}):
        mine = [{**m, "token_offset": m["token_offset"] - cu[i]} for m in media if m["sample_index"] == i]
        rows[:, cu[i] : cu[i + 1]] = family.positions(int(cu[i + 1] - cu[i]), mine)
    return torch.from_numpy(rows)


def _qwen2_vl_patches8(item: dict, storage: fs.Storage, pixels: Pixels) -> np.ndarray:
    """One item's compact 8-bit patches: stored as such (prepared media) or from the
    original file (decoded and resized first)."""
    if pixels.prepared:
        return vision.compact_patches8(_media_bytes(item, storage), item)
    return vision.qwen2_vl_patches8(_frames(item, storage), item)


def _norms(profile: Mapping[str, Any]) -> dict[str, tuple]:
    """(mean, std) per media kind (ImageNet's where a profile has none: the original InternVL)."""
    return {
        kind: (profile[kind].get("mean", vision.IMAGENET_MEAN), profile[kind].get("std", vision.IMAGENET_STD))
        for kind in ("image", "video")
    }


def _internvl_media(media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels) -> dict[str, Any]:
    """Every item's tiles in order (images and video frames together, as transformers' processor
    concatenates them), normalized with the mean/std of the item's kind."""
    image, native = family.settings["image"], family.video_processor_resize
    norms = _norms(family.settings)
    tiles = []
    for m in media:
        raw = vision.internvl_tiles(
            _frames(m, storage), m, image["tile_size"], image["thumbnail"], "uint8", video_processor=native
        )
        tiles.append(raw if pixels.computed == "uint8" else vision.normalize_internvl(raw, *norms[m["kind"]]))
    out: dict[str, Any] = {
        "pixel_values": pixels.tensor(np.concatenate(tiles)),
        "num_tiles": torch.tensor([len(t) for t in tiles]),
    }
    if pixels.computed == "uint8":  # what normalize_pixel_values needs on the device
        kinds = {m["kind"] for m in media}
        if len({tuple(map(tuple, norms[k])) for k in kinds}) > 1:
            raise ValueError(
                "pixel_dtype='uint8': this profile normalizes image and video tiles differently, and "
                "they share one pixel_values tensor; use pixel_dtype float32 or bfloat16"
            )
        out["pixel_norm"] = {"pixel_values": norms[next(iter(kinds))]}
    return out


def _square_media(media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels) -> dict[str, Any]:
    """Gemma 3's input: every image resized to one square (bilinear, aspect not kept) in
    ``pixel_values`` [images, 3, S, S]."""
    image = family.settings["image"]
    size, norm = image["size"], (image["mean"], image["std"])
    squares = np.concatenate(
        [vision.resized_rgb8(_frames(m, storage), size, size, Image.Resampling.BILINEAR) for m in media]
    ).transpose(0, 3, 1, 2)
    out: dict[str, Any] = {"pixel_values": _handed_over(pixels, squares, norm, axis=1)}
    if pixels.computed == "uint8":  # normalized on the device (normalize_pixel_values)
        out["pixel_norm"] = {"pixel_values": norm}
    return out


def _audio_media(media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels) -> dict[str, Any]:
    """Each clip's log-mel ``input_features`` [clips, mel bins, frames] and ``feature_attention_mask``
    [clips, frames], computed from its FFmpeg waveform as the processor computes them for the
    clip's sample alone (``Family.audio_features``): padded to the feature extractor's chunk
    (Qwen2-Audio); the clip's own frames of that chunk, where the encoder reads only those
    (Qwen2.5-Omni); the clip zero-padded to its sample's longest clip (Qwen3-Omni). The clips are
    zero-padded to the longest and masked. A clip whose frames differ from the shard's plan
    (decoded by another FFmpeg than the pack's) raises MediaDecodeError."""
    settings = family.settings["audio"]
    waveforms = []
    for item in media:
        data = _media_bytes(item, storage)
        waveforms.append(audio.decode(data if isinstance(data, bytes) else data.tobytes()))
    longest: dict[int, int] = {}  # per sample: its clips are padded to its longest (Qwen3-Omni)
    for item, waveform in zip(media, waveforms, strict=True):
        longest[item["sample_index"]] = max(longest.get(item["sample_index"], 0), len(waveform))
    features, masks = [], []
    for item, waveform in zip(media, waveforms, strict=True):
        feature, mask = audio.whisper_features(
            waveform, settings, family.audio_features, longest[item["sample_index"]]
        )
        frames = int(mask.sum())
        if frames != item["grid_t"]:
            raise vision.MediaDecodeError(
                f"{item['uri']}: {frames} feature frames, the pack planned {item['grid_t']} "
                f"(this loader decodes with {audio.decoder()})"
            )
        features.append(feature)
        masks.append(mask)
    width = max(len(m) for m in masks)
    stacked = np.zeros((len(features), features[0].shape[0], width), np.float32)
    stacked_masks = np.zeros((len(masks), width), np.int64)
    for row, (feature, mask) in enumerate(zip(features, masks, strict=True)):
        stacked[row, :, : feature.shape[1]] = feature
        stacked_masks[row, : len(mask)] = mask
    return {
        "input_features": pixels.tensor(stacked),
        "feature_attention_mask": torch.from_numpy(stacked_masks),
    }


ZERO_ONE = (np.zeros(3, np.float32), np.ones(3, np.float32))  # Gemma 4's pixels: x / 255, no mean/std


def _soft_patches_media(
    media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels
) -> dict[str, Any]:
    """Gemma 4's inputs: every image's (video frame's) patches as rows of p · p · 3 values in [0,
    1], padded with zeros to its kind's budget of patches, and each patch's (x, y) (-1: padding):
    ``pixel_values`` + ``image_position_ids`` [images, patches, …], ``pixel_values_videos`` +
    ``video_position_ids`` [frames, patches, …] and ``num_frames_per_video``."""
    out: dict[str, Any] = {}
    for kind, pixels_key, positions_key in (
        ("image", "pixel_values", "image_position_ids"),
        ("video", "pixel_values_videos", "video_position_ids"),
    ):
        items = [m for m in media if m["kind"] == kind]
        if not items:
            continue
        cfg = family.settings[kind]
        budget = cfg["max_soft_tokens"] * cfg["pooling_kernel_size"] ** 2
        frames = [vision.soft_patches8(_frames(m, storage), m, cfg["patch_size"], budget) for m in items]
        patches = np.concatenate([f for f, _ in frames])
        if pixels.computed == "uint8":
            out[pixels_key] = pixels.tensor(patches)
        else:  # x / 255 (the profile's mean 0, std 1), channel last
            scaled = vision.normalize(patches.reshape(*patches.shape[:-1], -1, 3), *ZERO_ONE, axis=-1)
            out[pixels_key] = pixels.tensor(scaled.reshape(patches.shape))
        out[positions_key] = torch.from_numpy(np.concatenate([p for _, p in frames]))
        if kind == "video":
            out["num_frames_per_video"] = torch.tensor([len(f) for f, _ in frames])
    if pixels.computed == "uint8":  # rescaled on the device (normalize_pixel_values)
        keys = ("pixel_values", "pixel_values_videos")
        out["pixel_norm"] = {key: tuple(v.tolist() for v in ZERO_ONE) for key in keys if key in out}
    return out


def _handed_over(pixels: Pixels, raw: np.ndarray, norm: tuple, axis: int) -> torch.Tensor:
    """uint8 pixels as they are (``pixel_dtype="uint8"``), else normalized with ``norm`` (mean,
    std; channels along ``axis``) in the loader's dtype."""
    if pixels.computed == "uint8":
        return pixels.tensor(raw)
    mean, std = (np.asarray(v, np.float32) for v in norm)
    return pixels.tensor(vision.normalize(raw, mean, std, axis=axis))


def _llava_onevision_media(
    media: list[dict], family: Family, storage: fs.Storage, pixels: Pixels
) -> dict[str, Any]:
    """LLaVA-OneVision's inputs: every image's crops in order in one ``pixel_values`` [crops, 3, S,
    S] (4-D: the model takes it as is), ``image_sizes`` (original height, width),
    ``batch_num_images`` (images per sample: one image is cut into anyres crops, several are one
    square crop each), and ``pixel_values_videos`` [videos, frames, 3, H, W] (a fixed frame count:
    ``LlavaOnevision.plan_video``)."""
    settings, norms = family.settings, _norms(family.settings)
    out: dict[str, Any] = {}
    images = [m for m in media if m["kind"] == "image"]
    videos = [m for m in media if m["kind"] == "video"]
    if images:
        image = settings["image"]
        crops = np.concatenate(
            [
                vision.llava_onevision_crops(_frames(m, storage)[0], m, image["crop_size"], image["mean"])
                for m in images
            ]
        )
        out["pixel_values"] = _handed_over(pixels, crops, norms["image"], axis=1)
        out["image_sizes"] = torch.tensor([[m["height"], m["width"]] for m in images])
        per_sample = Counter(m["sample_index"] for m in images)
        out["batch_num_images"] = torch.tensor([per_sample[i] for i in sorted(per_sample)])
    if videos:
        size = (videos[0]["resized_height"], videos[0]["resized_width"])
        clips = np.stack(
            [vision.resized_video_rgb8(_frames(m, storage), *size).transpose(0, 3, 1, 2) for m in videos]
        )
        out["pixel_values_videos"] = _handed_over(pixels, clips, norms["video"], axis=2)
    if pixels.computed == "uint8":  # what normalize_pixel_values needs on the device
        out["pixel_norm"] = {
            key: norms[kind]
            for key, kind in (("pixel_values", "image"), ("pixel_values_videos", "video"))
            if key in out
        }
    return out
