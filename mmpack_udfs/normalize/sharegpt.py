"""Conversation records → validated conversations. Pure Python, no Spark, no I/O.

Three dialects are built in, and a dataset may rename any key or role tag:

- ``sharegpt``: ``conversations: [{from: human|gpt|system|function_call|observation, value}]``
- ``openai``:   ``messages: [{role: user|assistant|system|function_call|tool, content}]``
- ``alpaca``:   ``instruction`` (+ ``input``), ``output``, ``system``, ``history: [[q, a], ...]``

A turn's content is a string with ``<image>``/``<video>``/``<audio>`` placeholders, or a list
of content parts (text, image, video, audio; media in part order). Media come as
``images``/``videos``/``audios`` lists (or one item), or a single ``image``: paths, URIs,
``data:`` URIs or inline bytes (Hugging Face ``Image``/``Audio`` structs, binary columns); an
OpenAI ``input_audio`` part carries base64 data and its format. Roles are normalized to
``system``, ``user``, ``assistant``, ``function_call`` (model side) and ``tool`` (observation,
user side). Records of ``ranking: true`` datasets are preference pairs, read by ``preference.py``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson

from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

USER_SIDE = frozenset({"user", "tool"})
MODEL_SIDE = frozenset({"assistant", "function_call"})

COLUMN_DEFAULTS = {
    "system": "system",
    "images": "images",
    "videos": "videos",
    "image": "image",
    "audios": "audios",
    "chosen": "chosen",  # preference pairs (ranking: true): the two answers
    "rejected": "rejected",
    "weight": "weight",  # the sample's loss weight
}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": "history"}
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
DIALECTS["alpaca"] = {
    "columns": {**DIALECTS["sharegpt"]["columns"], **ALPACA_COLUMNS},
    "tags": DIALECTS["sharegpt"]["tags"],
}
PLACEHOLDER_DEFAULTS = {
    "image_placeholder": IMAGE_PLACEHOLDER,
    "video_placeholder": VIDEO_PLACEHOLDER,
    "audio_placeholder": AUDIO_PLACEHOLDER,
}
BLOB_KEY = "$mmpack_blob"  # inputs.py puts inline bytes aside and leaves {BLOB_KEY: index}
# inputs.py writes a Parquet value JSON has no type for (timestamp, date, decimal, ...) as
# {NON_TEXT_KEY: its type, "value": its text}: never text, so a turn holding one is quarantined
NON_TEXT_KEY = "$mmpack_non_text"


def kind_of(value: Any) -> str:
    """What a value is, for a message: its Python type, or the Parquet value's type it stands for."""
    if isinstance(value, dict) and isinstance(value.get(NON_TEXT_KEY), str):
        return f"a {value[NON_TEXT_KEY]} value"
    if isinstance(value, dict) and isinstance(value.get(BLOB_KEY), int):
        return "a binary value (bytes, not text: store text as a string column)"
    return type(value).__name__


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
    audio_placeholder: str
    media_columns: tuple[str, ...]  # the keys of the media columns (column_media)
    marks: re.Pattern  # the placeholders, own and canonical: a text without them is plain


@dataclass(frozen=True)
class Blob:
    """Inline media bytes of a record: ``blobs[index]`` of its raw row; ``name`` a file name
    the data came with (a Hugging Face ``Image``'s ``path``), for its extension."""

    index: int
    name: str = ""


MediaRef = str | Blob  # a path or URI (also data: and http URLs, refused later), or inline bytes


@dataclass(frozen=True)
class DatasetSpec:
    """One input dataset: where it is, how to read it, how to map it (``datasets.specs_of``
    builds them from the config)."""

    name: str
    paths: tuple[str, ...]
    media_root: str | None  # None: the dataset's media are all inline (a path is quarantined)
    format: str = "auto"
    dialect: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, Any], ...] = ()
    ranking: bool = False  # preference pairs (normalize.preference), not SFT conversations

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
    own = [tags[f"{kind}_placeholder"] for kind in PLACEHOLDERS]
    return KeyMap(
        columns=columns,
        role_key=tags["role_key"],
        content_key=tags["content_key"],
        roles=roles,
        image_placeholder=tags["image_placeholder"],
        video_placeholder=tags["video_placeholder"],
        audio_placeholder=tags["audio_placeholder"],
        media_columns=tuple(columns[key] for key in ("images", "image", "videos", "audios")),
        marks=re.compile("|".join(re.escape(p) for p in dict.fromkeys([*own, *PLACEHOLDERS.values()]))),
    )


@dataclass
class Conversation:
    """A validated record: ordered turns and media references in placeholder order."""

    system: str | None
    turns: list[tuple[str, str]]
    media: list[tuple[str, MediaRef]] = field(default_factory=list)  # (kind, reference)
    rejected: str | None = None  # a preference pair's rejected answer (the last turn is the chosen one)
    weight: float = 1.0  # the record's loss weight


def detect_dialect(record: Mapping[str, Any], spec: DatasetSpec) -> str:
    """The configured dialect, or for ``auto`` the one whose messages (or, alpaca, instruction)
    key the record has."""
    if spec.dialect != "auto":
        return spec.dialect
    for dialect in ("sharegpt", "openai"):
        if spec.mapping(dialect).columns["messages"] in record:
            return dialect
    if spec.mapping("alpaca").columns["prompt"] in record:
        return "alpaca"
    return "sharegpt"


def parse_conversation(record: Any, spec: DatasetSpec) -> Conversation:
    """Validate one decoded conversation record; raise Rejected with a reason code if it is
    unusable (a ranking dataset's records are pairs: ``records.parse_record``)."""
    if not isinstance(record, dict):
        raise Rejected(Reason.MALFORMED_RECORD, f"expected an object, got {type(record).__name__}")
    dialect = detect_dialect(record, spec)
    mapping = spec.mapping(dialect)
    if dialect != "alpaca" and (plain := _plain_text(record, mapping)) is not None:
        return plain
    messages = _alpaca_messages(record, mapping) if dialect == "alpaca" else _messages(record, mapping)
    system, turns, slots = _turns(record, messages, mapping)
    _check_order(turns)
    media = _fill_slots(slots, column_media(record, mapping))
    return Conversation(system=system, turns=turns, media=media, weight=record_weight(record, mapping))


def _plain_text(record: dict[str, Any], m: KeyMap) -> Conversation | None:
    """The conversation of a sharegpt / openai record of plain text (string turns holding no
    placeholder, no media), as the general path below reads it, in fewer steps; None for any
    other record, which the general path reads (and rejects, where it is unusable)."""
    messages = record.get(m.columns["messages"])
    if type(messages) is not list or not messages:
        return None
    for key in m.media_columns:
        if record.get(key) not in (None, []):
            return None
    roles, role_key, content_key, has_mark = m.roles, m.role_key, m.content_key, m.marks.search
    turns = []
    for turn in messages:
        if type(turn) is not dict:
            return None
        tag, text = turn.get(role_key), turn.get(content_key)
        role = roles.get(tag) if type(tag) is str else None
        if role is None or type(text) is not str or has_mark(text):
            return None
        turns.append((role, text))
    system = record.get(m.columns["system"])
    if system is not None and type(system) is not str:
        return None
    if turns[0][0] == "system":
        if system or len(turns) == 1:
            return None
        system, turns = turns[0][1], turns[1:]
    _check_order(turns)  # the general path's next check, which these turns reach
    return Conversation(system=system or None, turns=turns, weight=record_weight(record, m))


def record_weight(record: Mapping[str, Any], m: KeyMap) -> float:
    """The record's loss weight (its ``weight`` key): a finite number >= 0; 1 when absent or null."""
    value = record.get(m.columns["weight"])
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise Rejected(
            Reason.INVALID_WEIGHT, f"{m.columns['weight']} must be a finite number >= 0, got {value!r}"
        )
    return float(value)


def column_media(record: Mapping[str, Any], m: KeyMap) -> dict[str, list[MediaRef]]:
    """The media of a record's media columns, by kind, in column order."""
    return {
        "image": _media_list(record, m.columns["images"]) + _media_list(record, m.columns["image"]),
        "video": _media_list(record, m.columns["videos"]),
        "audio": _media_list(record, m.columns["audios"]),
    }


def _messages(record: Mapping[str, Any], m: KeyMap) -> list[tuple[Any, Any]]:
    """(role tag, content) of each turn of a sharegpt / openai record."""
    messages = record.get(m.columns["messages"])
    if messages is None or (isinstance(messages, list) and not messages):
        raise Rejected(Reason.MISSING_CONVERSATION, f"no '{m.columns['messages']}' turns")
    if not isinstance(messages, list):
        raise Rejected(Reason.MALFORMED_TURN, f"'{m.columns['messages']}' is not a list")
    out = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or m.role_key not in turn or m.content_key not in turn:
            raise Rejected(Reason.MALFORMED_TURN, f"turn {i} lacks '{m.role_key}' or '{m.content_key}'")
        out.append((turn[m.role_key], turn[m.content_key]))
    return out


def _alpaca_messages(record: Mapping[str, Any], m: KeyMap) -> list[tuple[Any, Any]]:
    """An alpaca record as turns, the way LLaMA-Factory reads it: each ``history`` pair, then
    the instruction and the input joined by a newline, then the output."""
    if not any(record.get(m.columns[k]) for k in ("prompt", "query")) and record.get(
        m.columns["response"]
    ) in (None, ""):
        raise Rejected(
            Reason.MISSING_CONVERSATION, f"no '{m.columns['prompt']}' or '{m.columns['response']}'"
        )
    return [*alpaca_prompt(record, m), (_first_tag(m, "assistant"), record.get(m.columns["response"]))]


def alpaca_prompt(record: Mapping[str, Any], m: KeyMap) -> list[tuple[Any, Any]]:
    """An alpaca record's turns before its answer: each ``history`` pair, then the instruction
    and the input joined by a newline."""
    user, assistant = _first_tag(m, "user"), _first_tag(m, "assistant")
    turns: list[tuple[Any, Any]] = []
    history = record.get(m.columns["history"])
    if history is not None:
        if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
            raise Rejected(
                Reason.MALFORMED_TURN, f"'{m.columns['history']}' is not a list of [prompt, response]"
            )
        for old_prompt, old_response in history:
            turns += [(user, old_prompt), (assistant, old_response)]
    prompt = [record.get(m.columns[key]) for key in ("prompt", "query")]
    for value in prompt:
        if value is not None and not isinstance(value, str):
            raise Rejected(Reason.NON_STRING_CONTENT, f"alpaca prompt is {kind_of(value)}")
    turns.append((user, "\n".join(p for p in prompt if p)))
    return turns


def _first_tag(m: KeyMap, role: str) -> str:
    return next(tag for tag, canonical in m.roles.items() if canonical == role)


Slot = tuple[str, MediaRef | None]  # a media position in the text: its kind, its inline reference


def _turns(
    record: Mapping[str, Any], messages: list[tuple[Any, Any]], m: KeyMap
) -> tuple[str | None, list[tuple[str, str]], list[Slot]]:
    """The system prompt, the turns (texts with canonical placeholders) and the media slots in
    order (inline references from content parts; None where a placeholder takes the next item
    of the media columns)."""
    turns: list[tuple[str, str]] = []
    slots: list[Slot] = []
    in_first = 0  # slots of the first turn (a system turn's are not media)
    for i, (tag, content) in enumerate(messages):
        role = m.roles.get(tag) if isinstance(tag, str) else None
        if role is None:
            raise Rejected(Reason.UNKNOWN_ROLE, f"turn {i} has role {tag!r}")
        text, turn_slots = _content(content, m, f"turn {i}")
        turns.append((role, text))
        slots += turn_slots
        in_first = in_first if i else len(turn_slots)
    system = record.get(m.columns["system"])
    if system is not None and not isinstance(system, str):
        raise Rejected(Reason.NON_STRING_CONTENT, f"system prompt is {kind_of(system)}")
    if turns[0][0] == "system":
        if system:
            raise Rejected(Reason.BROKEN_TURN_ORDER, "system prompt given both as key and turn")
        if any(ref is not None for _, ref in slots[:in_first]):
            raise Rejected(Reason.PLACEHOLDER_MEDIA_MISMATCH, "a media part in the system prompt")
        system, turns, slots = turns[0][1], turns[1:], slots[in_first:]
    if not turns:
        raise Rejected(Reason.MISSING_CONVERSATION, "only a system prompt, no turns")
    return (system or None), turns, slots


def _content(content: Any, m: KeyMap, where: str) -> tuple[str, list[Slot]]:
    """A turn's text with canonical placeholders, and its media slots in order."""
    if isinstance(content, str):
        text = _canonical(content, m)
        return text, [(kind, None) for kind in _placeholders_in(text)]
    if not isinstance(content, list):
        raise Rejected(Reason.NON_STRING_CONTENT, f"{where} content is {kind_of(content)}")
    texts: list[str] = []
    slots: list[Slot] = []
    for k, part in enumerate(content):
        kind, value = _part(part, f"{where} part {k}")
        if kind == "text":
            text = _canonical(value, m)
            texts.append(text)
            slots += [(found, None) for found in _placeholders_in(text)]
        else:
            texts.append(PLACEHOLDERS[kind])
            slots.append((kind, value))
    return "".join(texts), slots  # text parts join as chat templates render them: back to back


TEXT_KEYS = ("text", "value", "content")
MEDIA_PART_KEYS = {  # part type → (media kind, the keys that may hold the reference)
    "image": ("image", ("image", "url", "path", "value")),
    "image_url": ("image", ("image_url", "url", "value")),
    "video": ("video", ("video", "url", "path", "value")),
    "video_url": ("video", ("video_url", "url", "value")),
    "audio": ("audio", ("audio", "url", "path", "value")),
    "audio_url": ("audio", ("audio_url", "url", "value")),
}
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER}
INPUT_AUDIO = (
    "input_audio"  # OpenAI: {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}
)


def _part(part: Any, where: str) -> tuple[str, Any]:
    """("text", text) or (media kind, reference or None) for one content part."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        what = type(part).__name__
        raise Rejected(Reason.NON_STRING_CONTENT, f"{where} is a {what}, not a content part with a 'type'")
    kind = part["type"]
    if kind == "text":
        text = next((part[k] for k in TEXT_KEYS if k in part), None)
        if not isinstance(text, str):
            raise Rejected(Reason.NON_STRING_CONTENT, f"{where}: a text part without a text string")
        return "text", text
    if kind in MEDIA_PART_KEYS:
        media_kind, keys = MEDIA_PART_KEYS[kind]
        value = next((part[k] for k in keys if part.get(k) is not None), None)
        if isinstance(value, dict) and "url" in value and not _is_image_struct(value):
            value = value["url"]  # {"type": "image_url", "image_url": {"url": ...}}
        return media_kind, None if value is None else _reference(value, where)
    if kind == INPUT_AUDIO:
        return "audio", _input_audio(part.get(INPUT_AUDIO), where)
    raise Rejected(Reason.UNSUPPORTED_MODALITY, f"{where}: a content part of type {kind!r}")


def _input_audio(value: Any, where: str) -> str:
    """An OpenAI ``input_audio`` part's audio as a ``data:`` URI (decoded where its media are)."""
    data = value.get("data") if isinstance(value, dict) else None
    audio_format = value.get("format") if isinstance(value, dict) else None
    if not isinstance(data, str) or not data or not isinstance(audio_format, str):
        raise Rejected(
            Reason.MALFORMED_MEDIA_FIELD, f"{where}: input_audio needs a base64 'data' string and a 'format'"
        )
    return f"data:audio/{audio_format};base64,{data}"


def _is_image_struct(value: Mapping[str, Any]) -> bool:
    return "bytes" in value or "path" in value


def _reference(value: Any, where: str) -> MediaRef:
    """One media item as a reference: a path/URI string, or inline bytes (a blob marker, or a
    Hugging Face ``Image`` / ``Video`` struct of ``bytes`` and ``path``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get(BLOB_KEY), int):
        return Blob(value[BLOB_KEY])
    if isinstance(value, dict) and _is_image_struct(value):
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, dict) and isinstance(data.get(BLOB_KEY), int):
            return Blob(data[BLOB_KEY], path if isinstance(path, str) else "")
        if data is None and isinstance(path, str) and path:
            return path
    raise Rejected(Reason.MALFORMED_MEDIA_FIELD, f"{where}: a media item that is not a path, URI or image")


def _canonical(text: str, m: KeyMap) -> str:
    """``text`` with the dataset's own placeholders as ``<image>`` / ``<video>`` / ``<audio>``."""
    for own, canonical in (
        (m.image_placeholder, IMAGE_PLACEHOLDER),
        (m.video_placeholder, VIDEO_PLACEHOLDER),
        (m.audio_placeholder, AUDIO_PLACEHOLDER),
    ):
        if own != canonical:
            text = text.replace(own, canonical)
    return text


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


def _media_list(record: Mapping[str, Any], key: str) -> list[MediaRef]:
    value = record.get(key)
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    try:
        return [_reference(item, f"'{key}'") for item in items]
    except Rejected:
        raise Rejected(
            Reason.MALFORMED_MEDIA_FIELD, f"'{key}' is not a path, an image, or a list of them"
        ) from None


def _fill_slots(slots: list[Slot], columns: Mapping[str, list[MediaRef]]) -> list[tuple[str, MediaRef]]:
    """Media in slot order: inline references as given, the rest from the media columns
    (``column_media``)."""
    open_slots = {kind: sum(1 for k, ref in slots if k == kind and ref is None) for kind in PLACEHOLDERS}
    if any(open_slots[kind] != len(columns[kind]) for kind in PLACEHOLDERS):
        raise Rejected(
            Reason.PLACEHOLDER_MEDIA_MISMATCH,
            " / ".join(f"{open_slots[k]} {k}" for k in PLACEHOLDERS)
            + " placeholders for "
            + " / ".join(f"{len(columns[k])} {k}s" for k in PLACEHOLDERS),
        )
    queues = {kind: iter(items) for kind, items in columns.items()}
    return [(kind, ref if ref is not None else next(queues[kind])) for kind, ref in slots]


PLACEHOLDER_KINDS = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS.values()))
KIND_OF_PLACEHOLDER = {p: kind for kind, p in PLACEHOLDERS.items()}


def _placeholders_in(text: str) -> list[str]:
    """The kinds of the canonical placeholders in ``text``, in order."""
    return [KIND_OF_PLACEHOLDER[p] for p in PLACEHOLDER_KINDS.findall(text)]


def sample_id(conversation: Conversation, media_uris: list[str]) -> str:
    """Content hash: the same conversation with the same media always gets the same id.
    ``media_uris``: each item's identity, its resolved URI, or ``sha256:<hex>`` of inline bytes.
    A preference pair hashes its rejected answer too (an SFT conversation's id is unchanged)."""
    content = {
        "system": conversation.system,
        "turns": conversation.turns,
        "media": [[kind, uri] for (kind, _), uri in zip(conversation.media, media_uris, strict=True)],
    }
    if conversation.rejected is not None:
        content["rejected"] = conversation.rejected
    # orjson writes what json.dumps(content, ensure_ascii=False, separators=(",", ":")) writes,
    # UTF-8 encoded, for every code point (tests/mmpack_udfs/normalize/test_sharegpt.py)
    return hashlib.sha256(orjson.dumps(content)).hexdigest()[:32]
