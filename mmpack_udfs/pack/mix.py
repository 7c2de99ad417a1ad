"""Data mixtures and the evaluation split: which tokenized rows train, how often, and which
are held out for evaluation. Pure and Spark-free: the pack stage and validate both call
``choose`` on the same rows and get the same answer.

Per dataset, on conversations (a conversation split into several rows by
``tokenize.over_length=split`` moves as one; exact duplicates were merged into one
conversation by normalize), in this order:

1. **eval**: the ``eval_samples`` conversations with the smallest eval hash, or (without
   ``eval_samples``) every conversation whose eval hash falls below ``eval.fraction``: a
   conversation's side never changes when data is added.
2. **max_samples**: of the rest, the ``max_samples`` with the smallest pick hash.
3. **weight** ``w``: every kept conversation ``floor(w)`` times, plus one more copy for the
   ``round(frac(w) · n)`` with the smallest pick hash (``round`` halves up).

Both hashes are splitmix64 of (seed, salt, the conversation id's first 64 bits): the ids are
SHA-256 hex digests (normalize), so this is vectorized and independent of the order rows
arrive in. Choosing "the k smallest" makes choices nested: a larger k (more data, a higher
weight) keeps every conversation a smaller one chose that is still among the k smallest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmpack_udfs.errors import MmpackError

EVAL_SALT, PICK_SALT = 0x6576616C, 0x7069636B  # "eval", "pick"


class MixError(MmpackError, ValueError):
    """Rows whose conversation ids are not mmpack's (SHA-256 hex), so no stable choice exists."""


@dataclass(frozen=True)
class DatasetMix:
    """One configured dataset's share of the mix."""

    name: str
    weight: float = 1.0
    max_samples: int | None = None
    eval_samples: int | None = None
    loss_weight: float = 1.0  # multiplies each of its samples' own loss weight in the shards

    def chooses_nothing(self, settings: MixSettings) -> bool:
        """Whether every row just trains int(weight) times: a whole weight, no cap, no held-out rows."""
        no_eval = self.eval_samples is None and settings.eval_fraction == 0
        return self.max_samples is None and no_eval and float(self.weight).is_integer()


@dataclass(frozen=True)
class MixSettings:
    datasets: tuple[DatasetMix, ...]
    eval_fraction: float
    eval_seed: int
    seed: int

    @classmethod
    def from_config(cls, config: Any) -> MixSettings:
        """From the checked config (``Config``)."""
        return cls.from_manifest_config(config.as_dict())

    @classmethod
    def from_manifest_config(cls, config: Mapping[str, Any]) -> MixSettings:
        """From the plain config a manifest records (``Config.as_dict``: a dataset keeps only the
        keys its entry gave)."""
        return cls(
            datasets=tuple(
                DatasetMix(
                    d["name"],
                    d.get("weight", 1.0),
                    d.get("max_samples"),
                    d.get("eval_samples"),
                    d.get("loss_weight", 1.0),
                )
                for d in config["datasets"]
            ),
            eval_fraction=config.get("eval", {}).get("fraction", 0.0),
            eval_seed=config.get("eval", {}).get("seed", 0),
            seed=config["pack"]["seed"],
        )

    def of(self, dataset: str) -> DatasetMix:
        """The settings of a row's dataset: its entry by name, or by the ``<name>/`` prefix a
        LLaMA-Factory ``dataset_info`` entry gets; a dataset not in the config trains once."""
        by_name = {d.name: d for d in self.datasets}
        return by_name.get(dataset) or by_name.get(dataset.split("/", 1)[0]) or DatasetMix(dataset)

    def sample_weights(self, datasets: pa.ChunkedArray, weights: pa.ChunkedArray) -> pa.Array:
        """Each row's loss weight in the shards: its own (``weight``) times its dataset's
        ``loss_weight``."""
        encoded = pc.dictionary_encode(datasets).combine_chunks()
        factors = np.array([self.of(name).loss_weight for name in encoded.dictionary.to_pylist()], np.float64)
        own = weights.combine_chunks().to_numpy(zero_copy_only=False)
        return pa.array(own * factors[encoded.indices.to_numpy(zero_copy_only=False)], pa.float64())

    def facts(self) -> dict[str, Any]:
        """What a run id depends on."""
        return asdict(self)


@dataclass(frozen=True)
class Mix:
    """Per row of the counts table: training copies (0: not trained) and whether it evaluates."""

    copies: np.ndarray  # int64
    eval: np.ndarray  # bool

    def dropped(self) -> np.ndarray:
        """Rows neither trained nor evaluated (a weight below 1 or ``max_samples``)."""
        return (self.copies == 0) & ~self.eval


@dataclass(frozen=True)
class Conversations:
    """Each row's conversation as a number: conversations numbered in the code point order of
    their ids, so sorted numbers are sorted ids. Found by sorting, not hashing: at 10 M rows a
    hash set of the ids held ~130 bytes a row, this 12."""

    code: np.ndarray  # per row (int32 below 2**31 rows)
    first_row: np.ndarray  # int64 per conversation: a row of it

    @classmethod
    def of(cls, rows: pa.Table, chunk_rows: int = 1 << 20) -> Conversations:
        """From the ``parent_id`` column (compared a chunk of sorted ids at a time)."""
        parents = rows.column("parent_id")
        order = pc.sort_indices(parents).to_numpy()
        starts = np.ones(len(order), bool)
        for start in range(0, len(order), chunk_rows):
            ids = parents.take(pa.array(order[start : start + chunk_rows + 1]))
            starts[start + 1 : start + 1 + len(ids) - 1] = pc.not_equal(ids[1:], ids[:-1]).to_numpy(
                zero_copy_only=False
            )
        code = np.empty(len(order), np.int32 if len(order) < 2**31 else np.int64)
        code[order] = np.cumsum(starts, dtype=code.dtype) - 1
        return cls(code, order[starts])

    def ids(self, rows: pa.Table, conversations: np.ndarray) -> pa.Array:
        """The ids of ``conversations`` (numbers), in their order."""
        return rows.column("parent_id").take(pa.array(self.first_row[conversations])).combine_chunks()


def choose(
    rows: pa.Table,
    settings: MixSettings,
    excluded: np.ndarray | None = None,
    conversations: Conversations | None = None,
) -> Mix:
    """The mix of ``rows`` (``parent_id`` and ``dataset`` columns). ``excluded`` rows (over the
    pack budget) take part in no choice: their conversations are neither trained nor held out.
    ``conversations``: ``Conversations.of(rows)`` where the caller has it."""
    n = rows.num_rows
    copies, held_out = np.zeros(n, np.int64), np.zeros(n, bool)
    keep = np.ones(n, bool)
    if excluded is not None:
        keep[excluded] = False
    names, codes = _dataset_codes(rows)
    for code in sorted(set(codes[keep].tolist()), key=names.__getitem__):
        mine = np.flatnonzero((codes == code) & keep)
        dataset = settings.of(names[code])
        if dataset.chooses_nothing(settings):  # every row trains int(weight) times: no ids needed
            copies[mine] = int(dataset.weight)
            continue
        conversations = conversations or Conversations.of(rows)
        numbers, row_of = np.unique(conversations.code[mine], return_inverse=True)
        per_conversation = _choose_one(conversations.ids(rows, numbers), dataset, settings)
        copies[mine] = per_conversation.copies[row_of]
        held_out[mine] = per_conversation.eval[row_of]
    return Mix(copies, held_out)


def dataset_names(rows: pa.Table) -> list[str]:
    """The datasets ``rows`` hold."""
    return _dataset_codes(rows)[0]


def _dataset_codes(rows: pa.Table) -> tuple[list[str], np.ndarray]:
    """The dataset names, and each row's index among them (Arrow: no Python str per row)."""
    datasets = pc.dictionary_encode(rows.column("dataset")).combine_chunks()  # codes combined, not names
    return datasets.dictionary.to_pylist(), datasets.indices.to_numpy(zero_copy_only=False)


def _choose_one(conversations: pa.Array, mix: DatasetMix, settings: MixSettings) -> Mix:
    """One dataset's conversations (sorted, unique) → copies and eval per conversation. Hashes
    are computed only where a choice is made (a plain dataset takes any ids)."""
    n = len(conversations)
    held_out = np.zeros(n, bool)
    if mix.eval_samples is not None:
        if mix.eval_samples:
            held_out = _smallest(
                conversation_hash(conversations, settings.eval_seed, EVAL_SALT), min(mix.eval_samples, n)
            )
    elif settings.eval_fraction > 0:
        eval_hash = conversation_hash(conversations, settings.eval_seed, EVAL_SALT)
        held_out = (eval_hash >> np.uint64(11)).astype(np.float64) * 2.0**-53 < settings.eval_fraction
    pool = np.flatnonzero(~held_out)
    whole, part = divmod(mix.weight, 1.0)
    copies = np.zeros(n, np.int64)
    if mix.max_samples is None and not part:
        copies[pool] = int(whole)
        return Mix(copies, held_out)
    pick_hash = conversation_hash(conversations, settings.seed, PICK_SALT)
    if mix.max_samples is not None:
        pool = pool[_smallest(pick_hash[pool], min(mix.max_samples, len(pool)))]
    copies[pool] = int(whole)
    copies[pool[_smallest(pick_hash[pool], math.floor(part * len(pool) + 0.5))]] += 1
    return Mix(copies, held_out)


def _smallest(hashes: np.ndarray, k: int) -> np.ndarray:
    """A mask of the ``k`` smallest hashes (ties, vanishingly rare, by position: ids are sorted)."""
    chosen = np.zeros(len(hashes), bool)
    chosen[np.argsort(hashes, kind="stable")[:k]] = True
    return chosen


def conversation_hash(ids: pa.Array | np.ndarray, seed: int, salt: int) -> np.ndarray:
    """uint64 per id: splitmix64 of its first 16 hex digits mixed with (seed, salt)."""
    if not len(ids):
        return np.zeros(0, np.uint64)
    ids = ids if isinstance(ids, pa.Array) else pa.array(ids, pa.string())
    prefix = pc.utf8_slice_codeunits(ids, 0, 16)
    digits = np.frombuffer(prefix.buffers()[2], np.uint8)[: 16 * len(ids)]
    nibbles = _HEX[digits]
    if (
        len(digits) != 16 * len(ids)
        or (pc.utf8_length(prefix).to_numpy() != 16).any()
        or (nibbles > 15).any()
    ):
        raise MixError(
            "a weight, max_samples or evaluation split needs mmpack's sample ids (SHA-256 hex, from "
            "normalize); these rows have others"
        )
    value = np.zeros(len(ids), np.uint64)
    for column in range(16):
        value = (value << np.uint64(4)) | nibbles[column::16].astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed_seed = _splitmix64(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt))
    return _splitmix64(value ^ mixed_seed)


def _splitmix64(x: np.ndarray | np.uint64) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


_HEX = np.full(256, 255, np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def summary(
    rows: pa.Table, mix: Mix, skipped: np.ndarray, conversations: Conversations | None = None
) -> dict[str, dict[str, int]]:
    """Per dataset: samples (conversations) and tokens before the mix, and what each side got."""
    names, datasets = _dataset_codes(rows)
    conversations = conversations or Conversations.of(rows)
    parents = conversations.code

    def count(rows_mask: np.ndarray) -> int:  # conversations with a row in the mask
        seen = np.zeros(len(conversations.first_row), bool)
        seen[parents[rows_mask]] = True
        return int(seen.sum())

    tokens = rows.column("num_tokens").to_numpy().astype(np.int64)
    over = np.zeros(rows.num_rows, bool)
    over[skipped] = True
    out = {}
    for name in sorted(names):
        mine = datasets == names.index(name)
        trained = mine & (mix.copies > 0)
        out[name] = {
            "samples": count(mine),
            "rows": int(mine.sum()),
            "tokens": int(tokens[mine].sum()),
            "train_samples": count(trained),
            "train_rows": int(trained.sum()),
            "train_copies": int(mix.copies[mine].sum()),
            "train_tokens": int((tokens * mix.copies)[mine].sum()),
            "eval_samples": count(mine & mix.eval),
            "eval_rows": int((mine & mix.eval).sum()),
            "eval_tokens": int(tokens[mine & mix.eval].sum()),
            "dropped_rows": int((mine & mix.dropped() & ~over).sum()),
            "over_budget_rows": int((mine & over).sum()),
        }
    return out
