"""The pack stage: Delta ``tokenized`` → Parquet packed shards + manifest.json + report.

    driver: the count columns of every row (ids, lengths, media grids) → oversize check
        → first-fit-decreasing over all rows → bins in cost-stratified row groups
        (costs.stratified_order) → where each row goes: (shard, bin row, position), written
        as Parquet parts beside the run's shards (_placement/, removed once they are written)
    Spark:  rows ⋈ placement ──repartition(shards, shard), sorted by (shard, bin, position)──▶
        tasks that build and write whole shards (packed/shards/<run tag>/s<shard>.parquet),
        one row group at a time, and their cost index rows
    driver: reconcile (rows in = packed + skipped), write manifest.json last, report

The driver holds only counts (~0.2 KB a row: README "Sizing") and packs them in one
first-fit-decreasing (numba: ~1 s per million rows), so the layout is global: every row
group holds one bin of each cost stratum of the whole run, which is what lets a loader
balance ranks while reading whole row groups (loader.balance). A retried task rewrites
identical files (names and content depend only on the placement and the rows); a reader
only ever opens what the manifest names.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import mmpack_udfs
from loader import audio
from mmpack_udfs import runs, schemas
from mmpack_udfs.config import Config, config_hash
from mmpack_udfs.constants import VISION_PATCHES_PER_TOKEN
from mmpack_udfs.context import RunContext
from mmpack_udfs.errors import MmpackError
from mmpack_udfs.families import FAMILIES
from mmpack_udfs.io import fs, tables
from mmpack_udfs.io.ahead import read_ahead
from mmpack_udfs.io.memory import release_memory, releasing
from mmpack_udfs.io.spark import one_task_per_row
from mmpack_udfs.pack import costs, mix, pairs, shards
from mmpack_udfs.pack.ffd import first_fit_decreasing
from mmpack_udfs.report import pack_report as report

log = logging.getLogger(__name__)

REPORT_NAME = "pack.json"
SKIPPED_NAME = "pack_skipped.json"
BROADCAST_ROWS = 1_000_000  # placements up to this many rows (~50 MB) are broadcast to the join
# A run of one shard with up to this many placed tokens (a shard at the default budget and
# bins_per_shard; ~8 bytes a token as rows) is written by one task that reads the tokenized
# files itself: no rows through the JVM (write_one_shard)
ONE_TASK_TOKENS = 1 << 25
PLACEMENT_PART_ITEMS = 1_000_000  # items per Parquet file of the placement handed to the shard tasks
PLACEMENT_DIR = "_placement"  # beside a run's shards while its tasks run (gc removes a killed run's)
COUNT_COLUMNS = ["sample_id", "parent_id", "dataset", "num_tokens", "image_tokens", "video_tokens", "media",
                 "pair_side"]  # fmt: skip

WRITTEN = pa.struct(  # shards.WrittenShard
    [
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("samples", pa.int64()),
        ("tokens", pa.int64()),
        ("bytes", pa.int64()),
        ("sha256", pa.string()),
        ("row_groups", pa.int64()),
        ("weighted_samples", pa.int64()),
    ]
)
SHARD_RESULT = pa.schema(
    [
        ("shard", pa.int32()),
        ("rows_in", pa.int64()),  # tokenized rows the task received
        ("written", WRITTEN),
        ("costs", pa.binary()),  # the shard's cost index rows (costs.shard_rows), Arrow IPC
        ("seconds", pa.float64()),
    ]
)
PLACEMENT = pa.schema([("sample_id", pa.string()), ("shard", pa.int32()), ("bin_row", pa.int32()),
                       ("position", pa.int32())])  # fmt: skip


class PackError(MmpackError, RuntimeError):
    """The pack job cannot run as configured (e.g. samples over the budget) or did not reconcile."""


@dataclass(frozen=True)
class PackSettings:
    budget: int
    second_by: str  # none | media_items | vision_patches | audio_tokens
    second_budget: int | None
    oversize: str
    bins_per_shard: int
    bins_per_row_group: int
    embed_media: bool
    media: str  # original | prepared
    seed: int
    profile: Mapping[str, Any]  # the model profile the rows were tokenized with
    cost_model: costs.CostModel  # orders the bins into cost-stratified row groups
    mix: mix.MixSettings  # dataset weights and caps, the evaluation split

    @classmethod
    def from_config(cls, config: Config) -> PackSettings:
        """What the shard tasks need of the checked config."""
        p = config.pack
        return cls(
            budget=config.pack_budget,
            second_by=p.second_budget_by,
            second_budget=p.second_budget if p.second_budget_by != "none" else None,
            oversize=p.oversize,
            bins_per_shard=p.bins_per_shard,
            bins_per_row_group=p.bins_per_row_group,
            embed_media=p.embed_media,
            media=p.media,
            seed=p.seed,
            profile=config.profile.model_dump(),
            cost_model=costs.CostModel.for_profile(config, config.tokenize.profile),
            mix=mix.MixSettings.from_config(config),
        )

    def second_sizes(self, rows: pa.Table) -> np.ndarray | None:
        """The second size of each row, or None without a second budget."""
        if self.second_by == "media_items":
            return shards.list_lengths(rows.column("media"))
        if self.second_by == "vision_patches":
            return vision_tokens(rows) * VISION_PATCHES_PER_TOKEN
        if self.second_by == "audio_tokens":
            return audio_tokens(rows)
        return None

    def oversize_mask(self, lengths: np.ndarray, second: np.ndarray | None) -> np.ndarray:
        too_big = lengths > self.budget
        if second is not None:
            too_big |= second > self.second_budget
        return too_big


def derive_run_id(config: Config, tokenized_uri: str, version: int) -> str:
    facts = {
        "tokenized": [tokenized_uri, version],
        "pack": config.pack.model_dump(),
        "tokenize": config.tokenize.model_dump(),
        "cost_model": config.balance.cost_model[config.tokenize.profile].model_dump(),  # orders the bins
        "mix": mix.MixSettings.from_config(config).facts(),
    }
    return runs.run_id_from("pack", facts)


# -- driver: where every row goes ---------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where each packed item goes: a row of the counts table, or one of its copies (a dataset
    weight); copies of one row are in different bins. Items hold row numbers, not ids: the
    ids are taken a part at a time when the placement is written for the shard tasks."""

    ids: pa.Array  # sample_id of each row of the counts table
    row: np.ndarray  # int64 per item: its row
    shard: np.ndarray  # int32 per item: shard number
    bin_row: np.ndarray  # int32: row of its bin in the shard
    position: np.ndarray  # int32: its place in the bin (longest first)
    shard_bins: list[int]  # bins per shard
    tokens: int  # the items' tokens

    @property
    def items(self) -> int:
        return len(self.shard)

    @property
    def sample_id(self) -> pa.Array:
        """The sample id of each item."""
        return self.ids.take(pa.array(self.row))

    def parts(self, items_per_part: int = PLACEMENT_PART_ITEMS) -> Iterator[pa.Table]:
        """(sample_id, shard, bin_row, position) of every item, ``items_per_part`` at a time."""
        for start in range(0, self.items, items_per_part):
            part = slice(start, start + items_per_part)
            columns = [self.ids.take(pa.array(self.row[part])).cast(pa.string())] + [
                pa.array(a[part]) for a in (self.shard, self.bin_row, self.position)
            ]
            yield pa.Table.from_arrays(columns, schema=PLACEMENT)


def read_counts(tokenized_uri: str, snap: tables.Snapshot, storage: fs.Storage) -> pa.Table:
    """The count columns of every row, sorted by sample_id (arrival order must not matter). A
    table tokenized before preference pairs existed has no ``pair_side``: it holds no pairs.
    Sorted a column at a time, so the driver holds one column twice, never the table."""
    present = [c for c in COUNT_COLUMNS if c in snap.schema.names]
    table = tables.read_arrow(tokenized_uri, storage, columns=present, snap=snap)
    columns: dict[str, pa.Array] = {}
    for name in present:  # each column made contiguous in turn (sorting chunks would copy them)
        columns[name] = _count_column(name, table.column(name))
        table = table.drop_columns([name])
    del table
    if "pair_side" not in columns:
        columns["pair_side"] = pa.nulls(len(columns["sample_id"]), pa.string())
    order = pc.sort_indices(columns["sample_id"])
    for name in columns:  # each replaced in turn, the unsorted one dropped
        columns[name] = columns[name].take(order)
    return pa.table(columns)


def _count_column(name: str, column: pa.ChunkedArray) -> pa.Array:
    """A count column as one array: ids as ``large_string`` (100 M ids of 32 hex digits
    pass the 2 GiB a ``string`` array can hold), datasets dictionary-encoded (4 bytes a row)."""
    if name in ("sample_id", "parent_id"):
        column = column.cast(pa.large_string())
    elif name == "dataset":
        column = pc.dictionary_encode(column)
    return column.combine_chunks()


def read_rows(spark, files: list[str], storage: fs.Storage):
    """The tokenized rows of ``files`` the shard tasks build bins from (``shards.TOKENIZED_ROWS``):
    read by Python tasks (two a core, each a run of the files), the token columns as bytes;
    ``pair_side`` null and ``weight`` 1 where the table predates them."""
    from pyspark.sql.pandas.types import from_arrow_schema

    tasks = min(len(files), 2 * spark.sparkContext.defaultParallelism)
    groups = [list(run) for run in np.array_split(np.array(files, dtype=object), tasks)] if tasks else []
    listing = one_task_per_row(spark, pa.table({"uris": pa.array(groups, pa.list_(pa.string()))}))
    read = partial(shards.read_tokenized_files, storage=storage)
    return listing.mapInArrow(releasing(read), from_arrow_schema(shards.TOKENIZED_ROWS))


def unit_sizes(counts: pa.Table, settings: PackSettings) -> tuple[pairs.Units, np.ndarray, np.ndarray | None]:
    """The packing units of ``counts`` (a row, or a preference pair's two rows) and each unit's
    tokens and second size (None without a second budget)."""
    units = pairs.units_of(counts)
    second = settings.second_sizes(counts)
    lengths = units.total(counts.column("num_tokens").to_numpy())
    return units, lengths, units.total(second) if second is not None else None


def check_oversize(counts: pa.Table, settings: PackSettings) -> np.ndarray:
    """Indices of rows over a budget (both rows of a pair over it together).

    Raises PackError when any row is over a budget and the policy is ``error``, or when every
    row is (nothing would be published).
    """
    units, lengths, second = unit_sizes(counts, settings)
    too_big = settings.oversize_mask(lengths, second)[units.unit_of_rows()]
    over = counts.column("sample_id").filter(pa.array(too_big)).to_pylist()
    if over and settings.oversize == "error":
        raise PackError(
            f"{len(over)} tokenized row(s) exceed the pack budget ({settings.budget} tokens"
            + (f", {settings.second_budget} {settings.second_by}" if settings.second_by != "none" else "")
            + f"), e.g. {', '.join(over[:5])}. Raise pack.budget (or tokenize with a smaller "
            "tokenize.max_tokens), or set pack.oversize=skip to leave them out."
        )
    if over and len(over) == counts.num_rows:  # an empty packing is a failed run, not a success
        raise PackError(
            f"every one of the {counts.num_rows} tokenized rows is over the pack budget ({settings.budget} "
            f"tokens), so nothing would be published. Raise pack.budget (the longest row has "
            f"{int(lengths.max())} tokens) or tokenize with a smaller tokenize.max_tokens."
        )
    return np.flatnonzero(too_big)


def place(counts: pa.Table, settings: PackSettings, copies: np.ndarray | None = None) -> Placement:
    """Pack ``copies`` of every row (default: one; rows within the budgets) by first-fit-decreasing,
    ties in sample_id order, copies of a row in different bins, a preference pair's two rows
    as one unit (side by side in one bin, chosen first), and lay the bins out in
    cost-stratified row groups, ``bins_per_shard`` per shard."""
    units, unit_lengths, unit_second = unit_sizes(counts, settings)
    if copies is None:
        unit_copies = (~settings.oversize_mask(unit_lengths, unit_second)).astype(np.int64)
    else:
        unit_copies = np.asarray(copies, np.int64)[units.first]
    item_unit = np.repeat(np.arange(units.count), unit_copies)  # an item: one copy of a unit
    del unit_copies  # the driver's peak is in here: every per-item array is dropped once used
    lengths = unit_lengths[item_unit]
    tokens = int(lengths.sum())
    packing = first_fit_decreasing(
        lengths,
        settings.budget,
        second=unit_second[item_unit] if unit_second is not None else None,
        second_budget=settings.second_budget,
        groups=item_unit,
    )
    del unit_lengths, unit_second
    if units.paired:  # the items' rows, a pair's chosen row first
        item, row, side = units.rows(item_unit)
    else:  # a row per item: per-item arrays are per-row already
        item, row, side = None, units.first[item_unit], 0
    del item_unit

    def to_rows(per_item: np.ndarray) -> np.ndarray:
        """A per-item array, per row of the placement."""
        return per_item if item is None else per_item[item]

    order = cost_stratified_order(counts, row, to_rows(packing.bin_of), packing.num_bins, settings)
    lay = shards.layout(packing.bin_of, lengths, order)
    del lengths, order, packing
    per_bin = np.diff(lay.bin_starts)
    written = np.empty(len(lay.rows), np.int64)  # the bin each item is written in
    written[lay.rows] = np.repeat(np.arange(lay.num_bins), per_bin)
    written = to_rows(written)
    shard = (written // settings.bins_per_shard).astype(np.int32)
    bin_row = (written % settings.bins_per_shard).astype(np.int32)
    del written
    position = np.empty(len(lay.rows), np.int64)
    position[lay.rows] = np.arange(len(lay.rows)) - np.repeat(lay.bin_starts[:-1], per_bin)
    position = (to_rows(position) * units.width + side).astype(np.int32)
    shard_bins = [min(settings.bins_per_shard, lay.num_bins - first)
                  for first in range(0, lay.num_bins, settings.bins_per_shard)]  # fmt: skip
    ids = _one_array(counts.column("sample_id"))
    return Placement(ids, row, shard, bin_row, position, shard_bins, tokens)


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its chunk when it has one (``combine_chunks`` would copy it)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def cost_stratified_order(
    counts: pa.Table, row: np.ndarray, bin_of: np.ndarray, num_bins: int, settings: PackSettings
) -> np.ndarray:
    """The order to write the bins in: row groups stratified by cost (costs.write_order), from
    the placed items (``row``: each one's row of ``counts``) and the bin of each."""
    tokens = counts.column("num_tokens").to_numpy()[row]
    squares = _per_item(costs.media_squares(_one_array(counts.column("media")), settings.profile), row)
    figures = costs.bin_figures(bin_of, num_bins, tokens, _per_item(vision_tokens(counts), row), squares)
    return costs.write_order(figures, settings.cost_model, settings.bins_per_row_group, settings.seed)


def _per_item(per_row: np.ndarray, row: np.ndarray) -> np.ndarray:
    """``per_row[row]``; a view of zeros when every value is zero (text: no copy per item)."""
    return per_row[row] if per_row.any() else np.broadcast_to(per_row.dtype.type(0), len(row))


def vision_tokens(rows: pa.Table) -> np.ndarray:
    """Image + video tokens of each row."""
    return rows.column("image_tokens").to_numpy().astype(np.int64) + rows.column("video_tokens").to_numpy()


def audio_tokens(rows: pa.Table) -> np.ndarray:
    """Audio tokens of each row: the ``num_tokens`` of its media items of kind audio."""
    media = rows.column("media").combine_chunks()
    items = pc.list_flatten(media)
    is_audio = pc.equal(pc.struct_field(items, "kind"), "audio").to_numpy(zero_copy_only=False)
    tokens = pc.struct_field(items, "num_tokens").to_numpy(zero_copy_only=False)
    owners = shards.owner_of_elements(shards.list_lengths(media))
    return np.bincount(owners[is_audio], weights=tokens[is_audio], minlength=len(rows)).astype(np.int64)


# -- executors: build and write whole shards ----------------------------------------------
def shard_path(shard_dir: str, shard: int) -> str:
    return f"{shard_dir}/s{shard:05d}.parquet"


def write_shards(
    batches: Iterator[pa.RecordBatch],
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    storage: fs.Storage,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the placed rows of some shards, sorted by (shard, bin_row, position)
    → those shards, one result row each. One row group's rows are held at a time, however
    many shards the partition holds (hash partitioning puts several in some) and however
    large a shard is."""
    runs = rows_by_row_group(map(shards.rows_as_lists, batches), settings.bins_per_row_group)
    for shard, groups in itertools.groupby(runs, key=lambda run: run[0]):
        yield write_placed_shard(
            (rows for _, rows in groups), shard, settings, packed_root, shard_dir, storage
        )


def write_one_shard(
    batches: Iterator[pa.RecordBatch],
    parts: list[str],
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    storage: fs.Storage,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the tokenized files' URIs in (``uris``), the run's one shard out (its
    result row), written from the files' rows that the placement's ``parts`` name, as
    ``write_shards`` writes it from the join. Holds those rows and one row group's copy."""
    placed = pa.concat_tables(_read_parquet(part, storage) for part in parts)
    placed = placed.take(pc.sort_indices(placed, [("bin_row", "ascending"), ("position", "ascending")]))
    wanted = pc.unique(placed.column("sample_id"))
    kept = []  # the placed rows of each file
    for batch in batches:
        for uri in itertools.chain.from_iterable(batch.column("uris").to_pylist()):
            rows = pa.Table.from_batches(shards.tokenized_batches(uri, storage), shards.TOKENIZED_LISTS)
            kept.append(rows.filter(pc.is_in(rows.column("sample_id"), value_set=wanted)))
    # one chunk: a take from a chunked column joins its chunks first, at every row group
    rows = pa.concat_tables(kept).combine_chunks() if kept else shards.TOKENIZED_LISTS.empty_table()
    del kept
    at = pc.index_in(placed.column("sample_id"), value_set=_one_array(rows.column("sample_id")))
    if at.null_count:
        raise PackError(f"the placement names {at.null_count} rows that the tokenized files do not hold")
    placed = placed.append_column("row", at)

    def row_tables() -> Iterator[pa.Table]:
        for _, group in rows_by_row_group(placed.to_batches(), settings.bins_per_row_group):
            taken = rows.take(group.column("row"))
            for name in ("shard", "bin_row", "position"):
                taken = taken.append_column(name, group.column(name))
            yield taken

    yield write_placed_shard(row_tables(), 0, settings, packed_root, shard_dir, storage)


def _read_parquet(uri: str, storage: fs.Storage) -> pa.Table:
    filesystem, path = storage.filesystem(uri)
    return pq.read_table(path, filesystem=filesystem)


def rows_by_row_group(
    batches: Iterable[pa.RecordBatch], bins_per_row_group: int
) -> Iterator[tuple[int, pa.Table]]:
    """(shard, its rows of one row group) for batches sorted by ``shard`` then ``bin_row``, one
    row group (``bins_per_row_group`` consecutive bins of a shard) at a time."""
    held: list[pa.RecordBatch] = []
    current: tuple[int, int] | None = None
    for batch in batches:
        if batch.num_rows == 0:
            continue
        shard = batch.column("shard").to_numpy()
        group = batch.column("bin_row").to_numpy() // bins_per_row_group
        changes = (np.diff(shard) != 0) | (np.diff(group) != 0)
        cuts = [0, *(np.flatnonzero(changes) + 1).tolist(), len(shard)]
        for start, end in itertools.pairwise(cuts):
            key = (int(shard[start]), int(group[start]))
            if held and key != current:
                yield current[0], pa.Table.from_batches(held)
                held = []
            current = key
            held.append(batch.slice(start, end - start))
    if held:
        yield current[0], pa.Table.from_batches(held)


def write_placed_shard(
    row_tables: Iterable[pa.Table],
    shard: int,
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    storage: fs.Storage,
) -> pa.RecordBatch:
    """Build one shard's bins from its placed rows and write it; what was written and its cost
    index rows, as one result row. ``row_tables`` come in bin order, each holding whole bins
    (rows in any order within it), and are read one at a time."""
    started = time.perf_counter()
    name = shard_path(shard_dir, shard)
    prepared = settings.media == "prepared"
    cost_rows: list[pa.Table] = []
    rows_in = 0

    def row_groups() -> Iterator[pa.RecordBatch]:
        """The shard's bins one row group at a time: a task holds one table's rows and one row
        group's embedded media however large the shard."""
        nonlocal rows_in
        per_group = settings.bins_per_row_group
        for rows in row_tables:
            rows_in += rows.num_rows
            weights = settings.mix.sample_weights(rows.column("dataset"), rows.column("weight"))
            rows = rows.set_column(rows.schema.get_field_index("weight"), "weight", weights)
            order = pc.sort_indices(rows, [("bin_row", "ascending"), ("position", "ascending")])  # no copy
            bin_rows = rows.column("bin_row").to_numpy()
            per_bin = np.bincount(bin_rows)  # zero for the shard's bins before this table's
            lay = shards.BinLayout(
                rows=order.to_numpy(), bin_starts=np.concatenate([[0], np.cumsum(per_bin)])
            )
            for first in range(int(bin_rows.min()), lay.num_bins, per_group):
                end = min(first + per_group, lay.num_bins)
                read_media = _media_reader(storage, prepared) if settings.embed_media else None
                batch = shards.build_bins(
                    rows, lay, first, end, group=0, read_media=read_media, share_files=not prepared
                )
                cost_rows.append(
                    costs.shard_rows(pa.Table.from_batches([batch]), name, settings.profile, first)
                )
                yield batch

    # the next row group built while this one is written; not with embedded media, which would
    # hold two row groups' files
    groups = row_groups() if settings.embed_media else read_ahead(row_groups())
    written = shards.write_shard(packed_root, name, groups, settings.bins_per_row_group, storage)
    result = {
        "shard": shard,
        "rows_in": rows_in,
        "written": asdict(written),
        "costs": costs.to_ipc(pa.concat_tables(cost_rows)),  # a placed shard has bins
        "seconds": time.perf_counter() - started,
    }
    return pa.RecordBatch.from_pylist([result], schema=SHARD_RESULT)


def _media_reader(storage: fs.Storage, prepared: bool) -> Callable[[dict], bytes]:
    """The bytes to embed for a media item: its file's, read once per file by this reader; or,
    ``prepared``, its 8-bit Qwen2-VL patches at the item's grid, in transformers' order
    (``loader.vision.qwen2_vl_patches8``: the loader only copies them out)."""
    from loader import vision  # shipped in the executor zip; numpy and Pillow only

    cache: dict[str, bytes] = {}

    def read(uri: str) -> bytes:
        if uri not in cache:
            cache[uri] = storage.read_bytes(uri)
        return cache[uri]

    def prepare(item: dict) -> bytes:
        data = read(item["uri"])
        if item["kind"] == "image":
            frames = [vision.decode_image(data)]
        else:
            frames = vision.decode_frames(data, item["frame_indices"], item["uri"])
        return vision.qwen2_vl_patches8(frames, item).tobytes()

    return prepare if prepared else (lambda item: read(item["uri"]))


def published_run(packed_root: str, run_id: str, storage: fs.Storage) -> dict | None:
    """The live manifest if it belongs to ``run_id`` and every shard it names is in place."""
    uri = fs.join(packed_root, schemas.MANIFEST_NAME)
    if not storage.exists(uri):
        return None
    manifest = json.loads(storage.read_bytes(uri))
    if manifest.get("run_id") != run_id:
        return None
    for shard in manifest["shards"]:
        info = storage.file_info(fs.join(packed_root, shard["path"]))
        if info.size != shard["bytes"]:
            return None
    return manifest


def run(spark, ctx: RunContext) -> dict[str, Any]:
    """Run the stage; return (and write, and print) the summary. Raises PackError."""
    started = time.time()
    config, storage, packed_root = ctx.config, ctx.storage, ctx.packed
    tokenized_uri = ctx.table("tokenized")
    settings = PackSettings.from_config(config)
    snap = tables.snapshot(tokenized_uri, storage)  # one version for the checks, the read and the manifest
    run_id = ctx.run_id or derive_run_id(config, tokenized_uri, snap.version)

    if published_run(packed_root, run_id, storage) is not None:
        log.info("pack: run %s is already published; nothing to do", run_id)
        return report.write_report(ctx.output, storage)

    counts = read_counts(tokenized_uri, snap, storage)
    release_memory()  # the driver's peak is what it holds, not what it held before
    over = check_oversize(counts, settings)
    conversations = mix.Conversations.of(counts)  # for the mix and its summary
    try:
        chosen = mix.choose(counts, settings.mix, excluded=over, conversations=conversations)
    except mix.MixError as err:
        raise PackError(str(err)) from err
    release_memory()  # 10 M rows: −1.3 GB resident after mix
    if counts.num_rows and not chosen.copies.any():
        raise PackError(
            "the dataset weights, max_samples and evaluation split leave no sample to train on: "
            "give some dataset a weight above 0"
        )
    preference = pairs.units_of(counts).paired  # the pack holds preference pairs (DPO)
    shard_dir = f"shards/{tables.run_tag(run_id)}"
    source = {"table": tokenized_uri, "version": snap.version}
    evaluation = None
    if chosen.eval.any():
        eval_root = schemas.packed_eval_uri(ctx.output)
        eval_placement = place(counts, settings, chosen.eval.astype(np.int64))
        eval_results = write_placement(
            spark, snap.files, eval_placement, settings, eval_root, shard_dir, storage
        )
        reconcile(eval_placement, eval_results)
        del eval_placement
        eval_manifest = build_manifest(ctx, settings, run_id, source, eval_results, skipped=0)
        eval_manifest.update(split="eval", datasets=sorted(mix.dataset_names(counts)), preference=preference)
        eval_manifest["cost_index"] = write_cost_index(
            eval_root, shard_dir, eval_manifest, eval_results, storage
        )
        publish_manifest(eval_root, eval_manifest, storage)
        evaluation = {
            "run_id": run_id,
            **{k: eval_manifest["totals"][k] for k in ("bins", "samples", "tokens")},
        }
    placement = place(counts, settings, chosen.copies) if counts.num_rows else None
    release_memory()
    results = write_placement(spark, snap.files, placement, settings, packed_root, shard_dir, storage)
    tasks_done = time.time()
    skipped = skipped_rows(counts, over, settings)
    reconcile(placement, results)
    del placement
    release_memory()
    mixture = mix.summary(counts, chosen, over, conversations)
    check_rows(counts.num_rows, mixture)
    manifest = build_manifest(ctx, settings, run_id, source, results, len(skipped))
    manifest.update(
        split="train", datasets=sorted(mixture), mix=mixture, eval=evaluation, preference=preference
    )
    manifest["cost_index"] = write_cost_index(packed_root, shard_dir, manifest, results, storage)
    storage.write_bytes(ctx.report(SKIPPED_NAME), _json(skipped))
    publish_manifest(packed_root, manifest, storage)
    summary = report.write_report(ctx.output, storage)
    summary["stage_seconds"] = {
        "tasks": round(tasks_done - started, 2),
        "total": round(time.time() - started, 2),
    }
    return summary


def write_placement(
    spark,
    files: list[str],
    placement: Placement | None,
    settings: PackSettings,
    packed_root: str,
    shard_dir: str,
    storage,
) -> list[dict]:
    """Spark: the rows of the tokenized ``files`` at their places (a row once per copy), written
    as whole shards; each shard's result row (``SHARD_RESULT``), by shard. The placement reaches
    the tasks as Parquet files beside the shards (removed once they are written), so neither
    the driver's Python nor its JVM holds it whole. A run of one small shard is written by one
    task that reads the files itself (``write_one_shard``), any other by a join in Spark."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    if placement is None:
        return []
    folder = fs.join(packed_root, shard_dir, PLACEMENT_DIR)
    parts = write_placement_parts(placement, folder, storage)
    where = {"settings": settings, "packed_root": packed_root, "shard_dir": shard_dir, "storage": storage}
    if in_one_task(placement):
        listing = one_task_per_row(spark, pa.table({"uris": pa.array([files], pa.list_(pa.string()))}))
        written = listing.mapInArrow(
            releasing(partial(write_one_shard, parts=parts, **where)), from_arrow_schema(SHARD_RESULT)
        )
    else:
        placed = tables.read_parquet(spark, parts, PLACEMENT, storage)
        if placement.items <= BROADCAST_ROWS:  # one shuffle of the full rows instead of two
            placed = F.broadcast(placed)
        rows = read_rows(spark, files, storage)
        by_shard = rows.join(placed, "sample_id").repartition(len(placement.shard_bins), "shard")
        by_shard = by_shard.sortWithinPartitions("shard", "bin_row", "position")  # a task holds one row group
        task = releasing(partial(write_shards, **where))
        written = by_shard.mapInArrow(task, from_arrow_schema(SHARD_RESULT))
    results = [r.asDict(recursive=True) for r in written.collect()]
    storage.delete_dir(folder)
    return sorted(results, key=lambda r: r["shard"])


def in_one_task(placement: Placement) -> bool:
    """Whether one task writes the run's shards, reading the tokenized files itself: one shard
    of at most ``ONE_TASK_TOKENS`` tokens (the join's tasks would write it in one task anyway)."""
    return len(placement.shard_bins) == 1 and placement.tokens <= ONE_TASK_TOKENS


def write_placement_parts(placement: Placement, folder: str, storage: fs.Storage) -> list[str]:
    """Write the placement as Parquet files under ``folder``, a part at a time; their uris."""
    uris = []
    for number, part in enumerate(placement.parts()):
        uris.append(fs.join(folder, f"part-{number:05d}.parquet"))
        with storage.atomic_output(uris[-1]) as stream:
            pq.write_table(part, stream)
    return uris


def skipped_rows(counts: pa.Table, over: np.ndarray, settings: PackSettings) -> list[dict[str, Any]]:
    """The rows left out as over a budget, with their sizes (a pair's row: the pair's) and
    reason, by sample_id."""
    units, lengths, second = unit_sizes(counts, settings)
    unit_of = units.unit_of_rows()
    lengths, second = lengths[unit_of], second[unit_of] if second is not None else None
    ids = counts.column("sample_id").take(pa.array(over, pa.int64())).to_pylist()
    return [
        {
            "sample_id": sid,
            "num_tokens": int(lengths[i]),
            "second": int(second[i]) if second is not None else 0,
            "reason": "over_budget" if lengths[i] > settings.budget else f"over_{settings.second_by}_budget",
        }
        for sid, i in zip(ids, over, strict=True)
    ]


def reconcile(placement: Placement | None, results: list[dict]) -> None:
    """Items placed = rows the shard tasks received = rows in the shards; every planned shard
    written with its planned bins."""
    planned_items = placement.items if placement is not None else 0
    received = sum(r["rows_in"] for r in results)
    in_shards = sum(r["written"]["samples"] for r in results)
    problems = []
    if not planned_items == received == in_shards:
        problems.append(
            f"{planned_items} rows (copies included) were placed; the shard tasks received {received} "
            f"and wrote {in_shards}"
        )
    planned = placement.shard_bins if placement is not None else []
    if [r["written"]["rows"] for r in results] != planned or [r["shard"] for r in results] != list(
        range(len(planned))
    ):
        wrote = [r["written"]["rows"] for r in results]
        problems.append(f"planned {len(planned)} shards of {planned} bins, wrote {wrote}")
    if problems:
        raise PackError("pack reconciliation failed: " + "; ".join(problems))


def check_rows(rows_in: int, mixture: Mapping[str, Mapping[str, int]]) -> None:
    """Every row of the table is trained, evaluated, left out by the mix or over budget: once."""
    parts = ("train_rows", "eval_rows", "dropped_rows", "over_budget_rows")
    accounted = sum(d[part] for d in mixture.values() for part in parts)
    if accounted != rows_in:
        raise PackError(
            f"pack reconciliation failed: the table has {rows_in} rows; trained, evaluated, left out "
            f"by the mix and over budget add up to {accounted}"
        )


def build_manifest(
    ctx: RunContext,
    settings: PackSettings,
    run_id: str,
    source: dict[str, Any],
    results: list[dict],
    skipped: int,
) -> dict[str, Any]:
    config = ctx.config
    shard_list = [r["written"] for r in sorted(results, key=lambda r: r["shard"])]
    tokens = sum(s["tokens"] for s in shard_list)
    bins = sum(s["rows"] for s in shard_list)
    return {
        "format": schemas.SHARD_FORMAT,
        "format_version": schemas.SHARD_FORMAT_VERSION,
        "tool": {"name": "mmpack", "version": mmpack_udfs.__version__},
        "run_id": run_id,
        "source": source,
        "profile": config.tokenize.profile,
        "model": ctx.model_record(),
        "budget": settings.budget,
        "second_budget": {"by": settings.second_by, "max": settings.second_budget},
        "media_embedded": settings.embed_media,
        "media_encoding": "patches8" if settings.media == "prepared" else "file",
        "audio_decoder": audio_decoder(config),
        "bins_per_row_group": settings.bins_per_row_group,
        "totals": {
            "shards": len(shard_list),
            "bins": bins,
            "samples": sum(s["samples"] for s in shard_list),
            "tokens": tokens,
            "bytes": sum(s["bytes"] for s in shard_list),
            "skipped": skipped,
            "weighted_samples": sum(s["weighted_samples"] for s in shard_list),
            "lower_bound_bins": -(-tokens // settings.budget),
            "fill": round(tokens / (bins * settings.budget), 6) if bins else 0.0,
        },
        "shards": shard_list,
        "config": config.as_dict(),
        "config_hash": config_hash(config),
    }


def audio_decoder(config: Config) -> str | None:
    """The FFmpeg build (``loader.audio.decoder()``) that counted the clips' samples, which the
    loader must decode with too; None for a family that encodes no audio."""
    return audio.decoder() if "audio" in FAMILIES[config.profile.kind].modalities else None


def write_cost_index(
    packed_root: str, shard_dir: str, manifest: Mapping[str, Any], results: list[dict], storage
) -> dict[str, Any]:
    """Write the run's per-bin cost index (rows the shard tasks computed) beside its shards;
    the manifest entry naming it."""
    parts = [costs.from_ipc(r["costs"]) for r in results]
    data = costs.index_bytes(costs.assemble(parts, manifest["shards"]))
    path = f"{shard_dir}/{schemas.COST_INDEX_NAME}"
    storage.write_bytes(fs.join(packed_root, path), data)
    return {"path": path, "rows": manifest["totals"]["bins"], "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def publish_manifest(packed_root: str, manifest: Mapping[str, Any], storage: fs.Storage) -> None:
    """Write manifest.json: the step that makes the run visible to readers (atomically)."""
    storage.write_bytes(fs.join(packed_root, schemas.MANIFEST_NAME), _json(manifest))


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, default=str) + "\n").encode()
