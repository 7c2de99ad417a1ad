"""ShareGPT records → validated conversations. Pure Python, no Spark, no I/O.

Two dialects are built in, and a dataset may rename any key or role tag:

- ``sharegpt``: ``conversations: [{from: human|gpt|system|function_call|observation, value}]``
- ``openai``:   ``messages: [{role: user|assistant|system|function_call|tool, content}]``

Both take media as ``images``/``videos`` lists (or one string), or a single ``image``.
Roles are normalized to ``system``, ``user``, ``assistant``, ``function_call`` (model
side) and ``tool`` (observation, user side).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

if TYPE_CHECKING:
    from mmpack_udfs.config.model import DatasetConfig

USER_SIDE = frozenset({"user", "tool"})
MODEL_SIDE = frozenset({"assistant", "function_call"})

COLUMN_DEFAULTS = {"system": "system", "images": "images", "videos": "videos", "image": "image"}
DIALECTS: dict[str, dict[str, dict[str, Any]]] = {
    "sharegpt": {
        "columns": {"messages": "conversations", **COLUMN_DEFAULTS},
        "tags": {
            "role_key": "from",
            "content_key": "value",
            "user": "human",
            "assistant": "gpt",
            "system": "system",
            "function_call": "function_call",
            "observation": "observation",
        },
    },
    "openai": {
        "columns": {"messages": "messages", **COLUMN_DEFAULTS},
        "tags": {
            "role_key": "role",
            "content_key": "content",
            "user": "user",
            "assistant": "assistant",
            "system": "system",
            "function_call": "function_call",
            "observation": "tool",
        },
    },
}
PLACEHOLDER_DEFAULTS = {
    "image_placeholder": IMAGE_PLACEHOLDER,
    "video_placeholder": VIDEO_PLACEHOLDER,
}
CANONICAL_ROLE = {"observation": "tool"}


@dataclass(frozen=True)
class KeyMap:
    """Resolved key and tag names for one dialect of one dataset."""

    columns: dict[str, str]
    role_key: str
    content_key: str
    roles: dict[str, str]  # tag value in the data → canonical role
    image_placeholder: str
    video_placeholder: str


@dataclass(frozen=True)
class DatasetSpec:
    """One input dataset as configured: where it is, how to read it, how to map it."""

    name: str
    paths: tuple[str, ...]
    media_root: str
    format: str = "auto"
    dialect: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_config(cls, entry: DatasetConfig) -> DatasetSpec:
        """The spec of one ``datasets`` entry, its paths resolved against the config's folder."""
        base = entry.base_dir or os.getcwd()
        paths = entry.paths if isinstance(entry.paths, list) else [entry.paths]
        return cls(
            name=entry.name,
            paths=tuple(_resolve(p, base) for p in paths),
            media_root=_resolve(entry.media_root, base),
            format=entry.format,
            dialect=entry.dialect,
            columns=tuple(sorted(entry.columns.items())),
            tags=tuple(sorted((k, _hashable(v)) for k, v in entry.tags.items())),
        )

    def mapping(self, dialect: str) -> KeyMap:
        return _key_map(self, dialect)


@lru_cache(maxsize=64)
def _key_map(spec: DatasetSpec, dialect: str) -> KeyMap:
    preset = DIALECTS[dialect]
    columns = {**preset["columns"], **dict(spec.columns)}
    tags = {**preset["tags"], **PLACEHOLDER_DEFAULTS, **dict(spec.tags)}
    roles: dict[str, str] = {}
    for canonical in ("user", "assistant", "system", "function_call", "observation"):
        values = tags[canonical] if isinstance(tags[canonical], tuple) else [tags[canonical]]
        for value in values:
            roles[str(value)] = CANONICAL_ROLE.get(canonical, canonical)
    return KeyMap(
        columns=columns,
        role_key=tags["role_key"],
        content_key=tags["content_key"],
        roles=roles,
        image_placeholder=tags["image_placeholder"],
        video_placeholder=tags["video_placeholder"],
    )


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _resolve(path: str, base: str) -> str:
    if path.startswith("s3://") or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


@dataclass
class Conversation:
    """A validated record: ordered turns and media references in placeholder order."""

    system: str | None
    turns: list[tuple[str, str]]
    media: list[tuple[str, str]] = field(default_factory=list)  # (kind, reference)


def detect_dialect(record: Mapping[str, Any], spec: DatasetSpec) -> str:
    """The configured dialect, or for ``auto`` the one whose messages key the record has."""
    if spec.dialect != "auto":
        return spec.dialect
    for dialect in ("sharegpt", "openai"):
        if spec.mapping(dialect).columns["messages"] in record:
            return dialect
    return "sharegpt"


def parse_record(record: Any, spec: DatasetSpec) -> Conversation:
    """Validate one decoded record; raise Rejected with a reason code if it is unusable."""
    if not isinstance(record, dict):
        raise Rejected(Reason.MALFORMED_RECORD, f"expected an object, got {type(record).__name__}")
    mapping = spec.mapping(detect_dialect(record, spec))
    system, turns = _turns(record, mapping)
    _check_order(turns)
    images = _media_list(record, mapping.columns["images"]) + _media_list(record, mapping.columns["image"])
    videos = _media_list(record, mapping.columns["videos"])
    media = _match_placeholders(turns, images, videos, mapping)
    return Conversation(system=system, turns=_canonical_placeholders(turns, mapping), media=media)


def _canonical_placeholders(turns: list[tuple[str, str]], m: KeyMap) -> list[tuple[str, str]]:
    """Rewrite a dataset's own placeholders as ``<image>`` / ``<video>``."""
    if (m.image_placeholder, m.video_placeholder) == (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
        return turns
    return [
        (
            role,
            text.replace(m.image_placeholder, IMAGE_PLACEHOLDER).replace(
                m.video_placeholder, VIDEO_PLACEHOLDER
            ),
        )
        for role, text in turns
    ]


def _turns(record: Mapping[str, Any], m: KeyMap) -> tuple[str | None, list[tuple[str, str]]]:
    messages = record.get(m.columns["messages"])
    if messages is None or (isinstance(messages, list) and not messages):
        raise Rejected(Reason.MISSING_CONVERSATION, f"no '{m.columns['messages']}' turns")
    if not isinstance(messages, list):
        raise Rejected(Reason.MALFORMED_TURN, f"'{m.columns['messages']}' is not a list")
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or m.role_key not in turn or m.content_key not in turn:
            raise Rejected(Reason.MALFORMED_TURN, f"turn {i} lacks '{m.role_key}' or '{m.content_key}'")
        tag, content = turn[m.role_key], turn[m.content_key]
        role = m.roles.get(tag) if isinstance(tag, str) else None
        if role is None:
            raise Rejected(Reason.UNKNOWN_ROLE, f"turn {i} has role {tag!r}")
        if not isinstance(content, str):
            raise Rejected(Reason.NON_STRING_CONTENT, f"turn {i} content is {type(content).__name__}")
        turns.append((role, content))
    system = record.get(m.columns["system"])
    if system is not None and not isinstance(system, str):
        raise Rejected(Reason.NON_STRING_CONTENT, f"system prompt is {type(system).__name__}")
    if turns[0][0] == "system":
        if system:
            raise Rejected(Reason.BROKEN_TURN_ORDER, "system prompt given both as key and turn")
        system, turns = turns[0][1], turns[1:]
    if not turns:
        raise Rejected(Reason.MISSING_CONVERSATION, "only a system prompt, no turns")
    return (system or None), turns


def _check_order(turns: list[tuple[str, str]]) -> None:
    for i, (role, _) in enumerate(turns):
        if role == "system":
            raise Rejected(Reason.BROKEN_TURN_ORDER, f"system turn at position {i}, not first")
        expected = USER_SIDE if i % 2 == 0 else MODEL_SIDE
        if role not in expected:
            side = "a user turn" if i % 2 == 0 else "an assistant turn"
            raise Rejected(Reason.BROKEN_TURN_ORDER, f"turn {i} is {role}, expected {side}")
    if turns[-1][0] not in MODEL_SIDE:
        raise Rejected(Reason.BROKEN_TURN_ORDER, "the last turn is not an assistant turn")
    for i, (role, text) in enumerate(turns):
        if role in MODEL_SIDE and not text.strip():  # would teach the model to answer with nothing
            raise Rejected(Reason.EMPTY_ASSISTANT_TURN, f"turn {i} ({role}) is empty or only whitespace")


def _media_list(record: Mapping[str, Any], key: str) -> list[str]:
    value = record.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Rejected(Reason.MALFORMED_MEDIA_FIELD, f"'{key}' is not a string or list of strings")


def _match_placeholders(
    turns: list[tuple[str, str]], images: list[str], videos: list[str], m: KeyMap
) -> list[tuple[str, str]]:
    """Media in the order their placeholders appear across the turns."""
    found: list[str] = []
    for _, text in turns:
        found += _placeholders_in(text, m.image_placeholder, m.video_placeholder)
    n_img, n_vid = found.count("image"), found.count("video")
    if n_img != len(images) or n_vid != len(videos):
        raise Rejected(
            Reason.PLACEHOLDER_MEDIA_MISMATCH,
            f"{n_img} image / {n_vid} video placeholders for {len(images)} images / {len(videos)} videos",
        )
    queues = {"image": iter(images), "video": iter(videos)}
    return [(kind, next(queues[kind])) for kind in found]


def _placeholders_in(text: str, image_tag: str, video_tag: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while True:
        i, v = text.find(image_tag, pos), text.find(video_tag, pos)
        if i < 0 and v < 0:
            return out
        if v < 0 or (0 <= i < v):
            out.append("image")
            pos = i + len(image_tag)
        else:
            out.append("video")
            pos = v + len(video_tag)


def sample_id(conversation: Conversation, media_uris: list[str]) -> str:
    """Content hash: the same conversation with the same media always gets the same id."""
    canonical = json.dumps(
        {
            "system": conversation.system,
            "turns": conversation.turns,
            "media": [[kind, uri] for (kind, _), uri in zip(conversation.media, media_uris, strict=True)],
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
