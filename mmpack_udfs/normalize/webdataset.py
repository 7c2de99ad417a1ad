"""WebDataset tar shards → raw records, streamed (a task holds one key's members at a time).

A tar holds samples as members named ``<key>.<extension>``: the key is the member's path up
to the first dot of its file name, and one key's members are consecutive (WebDataset's own
rule). Each key is one record:

- its ``json`` member is the record, in any dialect normalize reads (ShareGPT, OpenAI
  messages, alpaca; the dataset's ``columns`` and ``tags`` apply);
- its other members are the record's media, as inline bytes. A string of the record that
  names a member (``000001.jpg``, or its path in the tar) is that member, and so is an item
  of the dataset's images / videos / audios lists that gives only its extension (``jpg``,
  ``0.png``). A record that names none of its members gets them by extension, in tar
  order: images (``jpg``, ``png``, ...) as its images, videos (``mp4``, ...) as its videos,
  audio (``wav``, ``flac``, ``mp3``, ...) as its audios;
- its position is the byte offset of its first member's header in the tar.

A key with a member that is not a regular file (a link, a folder, a FIFO or a device named
like a member) is quarantined as ``media_unreadable`` naming it: nothing is followed. A key whose
``json`` is not UTF-8 is ``invalid_json``, as a ``.jsonl`` line is. A key without a ``json`` member
is quarantined as ``missing_conversation``; a tar that ends
early or is corrupt yields the keys before the damage and one ``tar_unreadable`` record for
the rest (the key being read when it broke included).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from mmpack_udfs.normalize.sharegpt import BLOB_KEY, DatasetSpec, detect_dialect
from mmpack_udfs.reasons import Reason

RECORD_EXTENSION = "json"
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm"})
VIDEO_EXTENSIONS = frozenset({"mp4", "webm", "avi", "mkv", "mov", "m4v"})
AUDIO_EXTENSIONS = frozenset({"wav", "flac", "mp3", "ogg", "opus", "m4a", "aac"})
DAMAGE = (tarfile.TarError, EOFError, OSError, zlib.error)


@dataclass
class Key:
    """The members of one key, in tar order: extension → (member name, bytes)."""

    name: str
    offset: int
    members: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    irregular: list[str] = field(default_factory=list)  # "name (a symbolic link)": members not read

    def summary(self) -> str:
        """What the key holds, for a quarantine row's ``raw``."""
        names = [n for n, _ in self.members.values()] + self.irregular
        return json.dumps({"key": self.name, "members": names})


@dataclass(frozen=True)
class Damage:
    """Where a tar stopped being readable, and why."""

    offset: int
    detail: str


def split_name(member: str) -> tuple[str, str]:
    """(key, extension) of a member name: the path up to the first dot of its file name."""
    folder, base = posixpath.split(member)
    stem, _, extension = base.partition(".")
    return posixpath.join(folder, stem), extension.lower()


class _EndChecked(tarfile.TarInfo):
    """A TarInfo that remembers on its TarFile when the tar ended without its end-of-archive
    blocks (cut at or inside a header), which tarfile itself takes as a normal end."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except (tarfile.TruncatedHeaderError, tarfile.EmptyHeaderError) as err:
            tar.mmpack_cut = f"it ends without its end-of-archive blocks ({err})"
            raise


def keys(stream: BinaryIO) -> Iterator[Key | Damage]:
    """The keys of a tar stream in order; a Damage last if the tar breaks (the key being read
    then is dropped from the keys and lies inside the damage)."""
    current: Key | None = None
    offset = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_EndChecked) as tar:
            for info in tar:
                offset = info.offset
                name, extension = split_name(info.name)
                if _a_folder_of_the_tar(info, extension, current, name):
                    continue
                if current is not None and current.name != name:
                    yield current
                    current = None
                if current is None:
                    current = Key(name, info.offset)
                if not info.isfile():
                    current.irregular.append(f"{info.name} ({_member_type(info)})")
                    continue
                data = tar.extractfile(info).read()
                if len(data) != info.size:
                    raise EOFError(f"member {info.name} has {len(data)} of its {info.size} bytes")
                current.members[extension] = (info.name, data)
            if getattr(tar, "mmpack_cut", None):
                raise EOFError(tar.mmpack_cut)
    except DAMAGE as err:
        where = current.offset if current is not None else offset
        yield Damage(where, f"the tar is unreadable from byte {where} on ({type(err).__name__}: {err})")
        return
    if current is not None:
        yield current


def _a_folder_of_the_tar(info: tarfile.TarInfo, extension: str, current: Key | None, name: str) -> bool:
    """Whether a member is the tar's own folder entry (``shards/``, skipped), not a stand-in for
    a key's member: a folder without an extension, or one that does not continue the key being
    read."""
    return info.isdir() and (not extension or current is None or current.name != name)


def _member_type(info: tarfile.TarInfo) -> str:
    kinds = (
        (info.issym(), "a symbolic link"),
        (info.islnk(), "a hard link"),
        (info.isdir(), "a directory"),
        (info.isfifo(), "a FIFO"),
        (info.ischr() or info.isblk(), "a device"),
    )
    return next((kind for found, kind in kinds if found), f"tar type {info.type!r}")


def record_of(key: Key, spec: DatasetSpec) -> tuple[str | None, str | None, list[bytes]]:
    """(record JSON text, error, inline bytes) of one key: its ``json`` member with the members
    it names (or, naming none, its media by extension) as blob markers."""
    if key.irregular:
        return (
            key.summary(),
            f"{Reason.MEDIA_UNREADABLE}: key {key.name}: {', '.join(key.irregular)} is not a regular "
            "file (tar links, folders, FIFOs and devices are not read)",
            [],
        )
    if RECORD_EXTENSION not in key.members:
        others = ", ".join(n for n, _ in key.members.values())
        return (
            key.summary(),
            f"{Reason.MISSING_CONVERSATION}: key {key.name} has no .json member ({others})",
            [],
        )
    data = key.members[RECORD_EXTENSION][1]
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        name = key.members[RECORD_EXTENSION][0]
        return (
            data.decode("utf-8", errors="replace"),
            f"{Reason.INVALID_JSON}: {name} is not UTF-8: {err}",
            [],
        )
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return text, None, []  # normalize quarantines it (invalid_json, with the parser's message)
    if not isinstance(record, dict):
        return text, None, []
    blobs: list[bytes] = []
    resolved = _MemberRefs(key, blobs).resolve(record, spec)
    return json.dumps(resolved, ensure_ascii=False), None, blobs


class _MemberRefs:
    """Turns references to a key's members into blob markers, each member's bytes once."""

    def __init__(self, key: Key, blobs: list[bytes]) -> None:
        self.key, self.blobs = key, blobs
        self.index: dict[str, int] = {}  # extension → its blob
        self.by_name: dict[str, str] = {}  # full name or file name → extension
        for extension, (name, _) in key.members.items():
            if extension != RECORD_EXTENSION:
                self.by_name[name] = self.by_name[posixpath.basename(name)] = extension

    def marker(self, extension: str) -> dict[str, Any]:
        if extension not in self.index:
            self.index[extension] = len(self.blobs)
            self.blobs.append(self.key.members[extension][1])
        name = self.key.members[extension][0]
        return {"bytes": {BLOB_KEY: self.index[extension]}, "path": name}

    def resolve(self, record: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
        columns = spec.mapping(detect_dialect(record, spec)).columns
        lists = {columns["images"], columns["image"], columns["videos"], columns["audios"]}
        record = {k: self._in_list(v) if k in lists else self._named(v) for k, v in record.items()}
        if not self.index:
            by_kind = (
                ("images", IMAGE_EXTENSIONS),
                ("videos", VIDEO_EXTENSIONS),
                ("audios", AUDIO_EXTENSIONS),
            )
            for kind, extensions in by_kind:
                found = [e for e in self.key.members if e.rpartition(".")[2] in extensions]
                if found and record.get(columns[kind]) in (None, []):
                    record[columns[kind]] = [self.marker(e) for e in found]
        return record

    def _in_list(self, value: Any) -> Any:
        """A media list (or one item): items naming a member by name or extension."""
        if isinstance(value, list):
            return [self._in_list(v) for v in value]
        if isinstance(value, str):
            extension = self.by_name.get(value, value.lower())
            if extension in self.key.members and extension != RECORD_EXTENSION:
                return self.marker(extension)
        return self._named(value)

    def _named(self, value: Any) -> Any:
        """``value`` with every string that names a member (by name) as its marker."""
        if isinstance(value, str):
            return self.marker(self.by_name[value]) if value in self.by_name else value
        if isinstance(value, list):
            return [self._named(v) for v in value]
        if isinstance(value, dict):
            return {k: self._named(v) for k, v in value.items()}
        return value
