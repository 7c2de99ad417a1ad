"""ShareGPT records with media files → WebDataset tar shards holding the same samples.

``write_tars(records, media_root, out_dir, keys_per_tar)`` writes ``shard-NNNNN.tar`` files,
one key per record: ``<key>.json`` (the record) and each media file as a member. The record
finds its media in one of three ways, by turns, so a reader must take all of them:
by member name (``images: ["000007.0.jpg"]``), by extension only (``images: ["0.jpg"]``),
or not at all (no ``images`` / ``videos`` key: the members by extension, in order).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

REFERENCE_FORMS = ("name", "extension", "none")


def write_tars(
    records: Sequence[dict], media_root: str | os.PathLike, out_dir: str | os.PathLike, keys_per_tar: int
) -> list[Path]:
    """Write ``records`` as tars of ``keys_per_tar`` keys each; the tar paths, in order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for first in range(0, len(records), keys_per_tar):
        paths.append(out / f"shard-{first // keys_per_tar:05d}.tar")
        indices = range(first, min(first + keys_per_tar, len(records)))
        paths[-1].write_bytes(
            tar_bytes([m for i in indices for m in key_members(records[i], Path(media_root), i)])
        )
    return paths


def key_members(record: dict, media_root: Path, index: int) -> list[tuple[str, bytes]]:
    """The members of record ``index``'s key: media files, then the JSON naming them."""
    key, form = f"{index:06d}", REFERENCE_FORMS[index % len(REFERENCE_FORMS)]
    record = dict(record)
    members: list[tuple[str, bytes]] = []
    for kind in ("images", "videos"):
        references = []
        for path in record.pop(kind, []):
            extension = f"{len(members)}{Path(path).suffix.lower()}"
            members.append((f"{key}.{extension}", (media_root / path).read_bytes()))
            references.append(f"{key}.{extension}" if form == "name" else extension)
        if references and form != "none":
            record[kind] = references
    return [*members, (f"{key}.json", json.dumps(record, ensure_ascii=False).encode())]


def tar_bytes(members: Sequence[tuple[str, bytes]]) -> bytes:
    """A tar of ``members`` (name, bytes) with no time, owner or mode: the same members give
    the same bytes."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
