"""One raw record → one row of the ``samples`` or ``quarantine`` table. Runs on executors.

``RecordNormalizer`` is built once per task (it holds the media probe cache) and
turns every raw record into exactly one output row; nothing is dropped here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from mmpack_udfs.io import fs
from mmpack_udfs.normalize import media, sample_runs
from mmpack_udfs.normalize.preference import parse_preference
from mmpack_udfs.normalize.sharegpt import (
    Blob,
    Conversation,
    DatasetSpec,
    MediaRef,
    parse_conversation,
    sample_id,
)
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import (
    NORMALIZED,
    ROW_KIND_QUARANTINE,
    ROW_KIND_RUN,
    ROW_KIND_SAMPLE,
    ROW_KIND_SPLIT,
    SAMPLES,
)

if TYPE_CHECKING:
    from mmpack_udfs.config.model import NormalizeConfig

LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
CHUNK_ROWS = 500  # records a task holds as Python objects at a time (Spark's batches: up to 10,000)
FILE_PROBES_KEPT = 1 << 16  # media files' probe results a Python worker keeps (~30 MB at most)

ProbeCache = OrderedDict  # key -> media.MediaInfo | Rejected, the oldest first

# Media files' probe results, kept by the Python worker across its tasks (Spark reuses a worker
# for task after task): a file that several records name, in any of the worker's tasks, is
# decoded once. Keyed by the file's size and modification time as well as its URI, so that a
# file changed between two runs in one worker is probed again.
_file_probes: ProbeCache = OrderedDict()


def parse_record(record: Any, spec: DatasetSpec) -> Conversation:
    """Validate one decoded record; raise Rejected with a reason code if it is unusable. A
    ranking dataset's record is a preference pair (``preference.parse_preference``)."""
    return parse_preference(record, spec) if spec.ranking else parse_conversation(record, spec)


@dataclass(frozen=True)
class NormalizeSettings:
    probe: media.ProbeSettings
    media_dir: str = ""  # where inline media (bytes in the input, data: URIs) are written
    max_raw_chars: int = 1 << 20
    probe_cache_size: int = 4096  # inline media's probe results a task keeps

    @classmethod
    def from_config(
        cls, section: NormalizeConfig, media_dir: str, video_audio: bool = False
    ) -> NormalizeSettings:
        """What the executors need of the (checked) ``normalize`` section (``video_audio``:
        ``tokenize.use_audio_in_video``)."""
        probe = media.ProbeSettings(
            max_image_pixels=section.max_image_pixels,
            decode_images=section.decode_images,
            video_check_frames=section.video_check_frames,
            max_audio_seconds=float(section.max_audio_seconds),
            video_audio=video_audio,
        )
        return cls(probe=probe, media_dir=media_dir, max_raw_chars=section.max_raw_chars)


class RecordNormalizer:
    """Validates, resolves and probes records; caches probe results per media URI."""

    def __init__(
        self,
        specs: Mapping[str, DatasetSpec],
        settings: NormalizeSettings,
        storage: fs.Storage = fs.LOCAL,
    ) -> None:
        self.specs = specs
        self.settings = settings
        self.storage = storage
        self._probed: ProbeCache = OrderedDict()  # inline media, by content
        self._written: set[str] = set()  # inline media files this worker has put in place
        self._real_dirs: dict[str, str] = {}  # media directories' real paths (media.resolve)

    def __call__(self, raw: Mapping) -> dict:
        """The output row for one raw record (see ``schemas.NORMALIZED``)."""
        if raw["records_read"] is not None:
            return {**_base(raw), "kind": ROW_KIND_SPLIT, "records_read": raw["records_read"]}
        try:
            return self._sample(raw)
        except Rejected as rejected:
            return self._quarantine(raw, rejected)
        except Exception as err:  # a bug, not bad data: fail loudly with the location
            where = f"{raw['source_file']} at position {raw['source_position']}"
            raise RuntimeError(f"normalize failed on {where}: {err!r}") from err

    def _sample(self, raw: Mapping) -> dict:
        if raw["error"]:
            reason, _, detail = raw["error"].partition(": ")
            raise Rejected(Reason(reason), detail)
        record = parse_json(raw["raw"])
        spec = self.specs[raw["dataset"]]
        conversation = parse_record(record, spec)
        found = [self._media(kind, ref, spec, raw.get("blobs") or []) for kind, ref in conversation.media]
        identities, infos = [identity for identity, _ in found], [info for _, info in found]
        return {
            **_base(raw),
            "kind": ROW_KIND_SAMPLE,
            "sample_id": sample_id(conversation, identities),
            "system": conversation.system,
            "turns": [{"role": r, "text": t} for r, t in conversation.turns],
            "media": [info.as_row() for info in infos],
            "rejected": conversation.rejected,
            "weight": conversation.weight,
        }

    def _media(
        self, kind: str, ref: MediaRef, spec: DatasetSpec, blobs: list[bytes]
    ) -> tuple[str, media.MediaInfo]:
        """(identity for the sample id, probed media) of one reference: a file under the
        dataset's media root (identity: its URI), or inline bytes (identity: their sha256)."""
        if isinstance(ref, Blob):
            if ref.index >= len(blobs):
                raise Rejected(Reason.MALFORMED_MEDIA_FIELD, f"inline {kind} #{ref.index} has no bytes")
            return self._inline(kind, blobs[ref.index], ref.name)
        if media.is_data_uri(ref):
            return self._inline(kind, media.data_uri_bytes(ref), "")
        if spec.media_root is None:
            raise Rejected(
                Reason.MEDIA_MISSING,
                f"{kind} {ref[:80]!r} is a path, and dataset '{spec.name}' has no media_root to find it "
                "under (set media_root; inline media need none)",
            )
        uri = media.resolve(ref, spec.media_root, self._real_dirs)
        status = media.file_status(uri, self.storage)
        key = (kind, uri, status.size, status.mtime_ns, self.settings.probe)
        probe = partial(media.probe_file, kind, uri, status, self.settings.probe, self.storage)
        return uri, _cached(_file_probes, FILE_PROBES_KEPT, key, probe)

    def _inline(self, kind: str, data: bytes, name: str) -> tuple[str, media.MediaInfo]:
        """Probe inline bytes like a file, then keep them as a content-addressed file under
        ``OUT/media`` (written once, atomically), which the sample references."""
        digest = hashlib.sha256(data).hexdigest()

        def probe() -> media.MediaInfo:
            info, suffix = media.probe_data(
                kind, data, name, f"inline {kind} sha256:{digest[:16]}", self.settings.probe
            )
            uri = fs.join(self.settings.media_dir, digest[:2], digest + suffix)
            if uri not in self._written:
                if not self.storage.exists(uri):
                    self.storage.write_bytes(uri, data)
                self._written.add(uri)
            return dataclasses.replace(info, uri=uri)

        key = (kind, f"sha256:{digest}")
        return key[1], _cached(self._probed, self.settings.probe_cache_size, key, probe)

    def _quarantine(self, raw: Mapping, rejected: Rejected) -> dict:
        text = raw["raw"] or ""
        limit = self.settings.max_raw_chars
        return {
            **_base(raw),
            "kind": ROW_KIND_QUARANTINE,
            "reason": str(rejected.reason),
            "detail": rejected.detail,
            "raw": text[:limit],
            "raw_truncated": len(text) > limit,
        }


def _cached(
    cache: ProbeCache, kept: int, key: tuple, probe: Callable[[], media.MediaInfo]
) -> media.MediaInfo:
    """The probe result of ``key`` (a media item), probing it at most once while ``cache`` keeps
    it (its ``kept`` latest items); raise the Rejected that probing raised."""
    if key not in cache:
        try:
            cache[key] = probe()
        except Rejected as rejected:
            cache[key] = rejected
        if len(cache) > kept:
            cache.popitem(last=False)
    result = cache[key]
    if isinstance(result, Rejected):
        raise result
    return result


def parse_json(text: str) -> Any:
    """A record's JSON, or Rejected(invalid_json): also for nesting too deep to parse and for
    text with a lone UTF-16 surrogate (``"\\ud800"``), which no UTF-8 writer can store."""
    try:
        record = json.loads(text)
    except ValueError as err:
        raise Rejected(Reason.INVALID_JSON, str(err)) from err
    except RecursionError as err:
        raise Rejected(Reason.INVALID_JSON, "nested too deeply to parse") from err
    if "\\u" in text and LONE_SURROGATE_ESCAPE.search(text):  # cheap test first: escapes are rare
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise Rejected(
                Reason.INVALID_JSON, f"a string holds a lone UTF-16 surrogate: {err.reason}"
            ) from err
    return record


def _base(raw: Mapping) -> dict:
    return {
        "dataset": raw["dataset"],
        "source_file": raw["source_file"],
        "source_position": raw["source_position"],
    }


def normalize_batches(
    batches: Iterator[pa.RecordBatch],
    specs: Mapping[str, DatasetSpec],
    settings: NormalizeSettings,
    storage: fs.Storage = fs.LOCAL,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: raw record batches in, NORMALIZED batches out (one row per record),
    ``CHUNK_ROWS`` records at a time whatever the size of Spark's batches."""
    normalizer = RecordNormalizer(specs, settings, storage)
    for batch in batches:
        for start in range(0, batch.num_rows, CHUNK_ROWS):
            rows = [normalizer(raw) for raw in batch.slice(start, CHUNK_ROWS).to_pylist()]
            yield pa.RecordBatch.from_pylist(rows, schema=NORMALIZED)


def read_and_normalize(
    batches: Iterator[pa.RecordBatch],
    read: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    normalize: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: split rows in, NORMALIZED batches out, read and normalized in one pass
    (``read``: ``inputs.read_splits_batches``, ``normalize``: ``normalize_batches`` or
    ``samples_as_runs``, bound)."""
    return normalize(read(batches))


def samples_as_runs(
    batches: Iterator[pa.RecordBatch],
    normalize: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    runs_dir: str,
    storage: fs.Storage = fs.LOCAL,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: raw records in, NORMALIZED batches out, but the samples ``normalize``
    makes of them go to sorted runs under ``runs_dir`` (``sample_runs.RunWriter``): Spark gets
    the other rows and one ``run`` row per run and dataset, the count of its samples."""
    from pyspark import TaskContext

    writer = sample_runs.RunWriter(runs_dir, TaskContext.get().partitionId(), storage)
    for batch in normalize(batches):
        is_sample = pc.equal(batch.column("kind"), ROW_KIND_SAMPLE)
        writer.add(batch.filter(is_sample).select(SAMPLES.names))
        others = batch.filter(pc.invert(is_sample))
        if others.num_rows:
            yield others
    rows = [
        {"kind": ROW_KIND_RUN, "dataset": dataset, "source_file": uri, "samples": count}
        for uri, per_dataset in writer.close()
        for dataset, count in sorted(per_dataset.items())
    ]
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=NORMALIZED)
