"""Preference records → a conversation whose last turn is the chosen answer, plus the rejected
answer (``Conversation.rejected``). Pure Python, no Spark, no I/O; the SFT parser
(``sharegpt``) reads the prompt, its media and its roles.

Forms, recognised per record of a ``ranking: true`` dataset by their keys:

- **LLaMA-Factory ranking** (sharegpt / openai formatting): the prompt in the messages key
  (ending with a user turn), ``chosen`` and ``rejected`` one message each (or a string);
  alpaca formatting: ``instruction`` (+ ``input``, ``history``), ``chosen`` / ``rejected``
  strings.
- **TRL**: ``prompt`` (a string or messages), ``chosen`` / ``rejected`` (a string or one
  assistant message), ``images`` alongside. Without ``prompt``, ``chosen`` and ``rejected``
  are whole conversations that agree on every message but the last (the implicit prompt).
- **OpenAI preference fine-tuning**: ``input.messages``, ``preferred_output`` and
  ``non_preferred_output`` (one assistant message each).

A pair whose answers differ in media (placeholder kinds or inline references) is refused:
both sequences of a pair get the same media.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from mmpack_udfs.normalize.sharegpt import (
    MODEL_SIDE,
    Conversation,
    DatasetSpec,
    KeyMap,
    _check_order,
    _content,
    _fill_slots,
    _messages,
    _turns,
    alpaca_prompt,
    column_media,
    detect_dialect,
)
from mmpack_udfs.reasons import Reason, Rejected

OPENAI_INPUT, OPENAI_CHOSEN, OPENAI_REJECTED = "input", "preferred_output", "non_preferred_output"
TRL_PROMPT = "prompt"

Message = tuple[Any, Any]  # (role tag, content)


def parse_preference(record: Any, spec: DatasetSpec) -> Conversation:
    """Validate one preference record; raise Rejected with a reason code if it is unusable."""
    if not isinstance(record, dict):
        raise Rejected(Reason.MALFORMED_RECORD, f"expected an object, got {type(record).__name__}")
    prompt, chosen, rejected, m = _sides(record, spec)
    if record.get(m.columns["weight"]) is not None:
        raise Rejected(Reason.INVALID_WEIGHT, "a preference pair takes no per-sample loss weight")
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if side is None or side[1] in ([], None):
            raise Rejected(Reason.PREFERENCE_MISSING_SIDE, f"no {name} answer")
    chosen_text, chosen_slots = _content(chosen[1], m, "the chosen answer")
    rejected_text, rejected_slots = _content(rejected[1], m, "the rejected answer")
    for name, text in (("chosen", chosen_text), ("rejected", rejected_text)):
        if not text.strip():  # also content parts holding only whitespace
            raise Rejected(Reason.PREFERENCE_MISSING_SIDE, f"the {name} answer is empty or only whitespace")
    system, turns, slots = _turns(record, [*prompt, chosen], m)
    _check_order(turns)
    if rejected_text == chosen_text:
        raise Rejected(Reason.PREFERENCE_IDENTICAL_SIDES, "the chosen and rejected answers are the same")
    if chosen_slots != rejected_slots:
        raise Rejected(
            Reason.PREFERENCE_MEDIA_MISMATCH,
            f"the chosen answer holds {_kinds(chosen_slots)}, the rejected one {_kinds(rejected_slots)}",
        )
    _check_answer_role(rejected[0], m, "rejected")
    media = _fill_slots(slots, column_media(record, m))
    return Conversation(system=system, turns=turns, media=media, rejected=rejected_text)


def _sides(record: Mapping[str, Any], spec: DatasetSpec) -> tuple[list[Message], Any, Any, KeyMap]:
    """(prompt messages, chosen message, rejected message, key map) of a record in any form;
    a side is None when absent."""
    if OPENAI_INPUT in record and (OPENAI_CHOSEN in record or OPENAI_REJECTED in record):
        m = spec.mapping("openai")
        source = record[OPENAI_INPUT]
        if not isinstance(source, dict):
            raise Rejected(Reason.MALFORMED_TURN, f"'{OPENAI_INPUT}' is not an object with 'messages'")
        prompt = _messages(source, m)
        return (
            prompt,
            _one(record.get(OPENAI_CHOSEN), m, OPENAI_CHOSEN),
            _one(record.get(OPENAI_REJECTED), m, OPENAI_REJECTED),
            m,
        )
    dialect = detect_dialect(record, spec)
    m = spec.mapping(dialect)
    chosen_key, rejected_key = m.columns["chosen"], m.columns["rejected"]
    if m.columns["messages"] in record or (dialect == "alpaca" and m.columns["prompt"] in record):
        prompt = alpaca_prompt(record, m) if dialect == "alpaca" else _messages(record, m)
        return (
            prompt,
            _one(record.get(chosen_key), m, chosen_key),
            _one(record.get(rejected_key), m, rejected_key),
            m,
        )
    m = spec.mapping("openai")  # TRL: role / content messages
    if TRL_PROMPT in record:
        prompt = record[TRL_PROMPT]
        messages = (
            [(_first_user(m), prompt)] if isinstance(prompt, str) else _messages(record, _as(m, TRL_PROMPT))
        )
        return (
            messages,
            _one(record.get(chosen_key), m, chosen_key),
            _one(record.get(rejected_key), m, rejected_key),
            m,
        )
    return _implicit_prompt(record, chosen_key, rejected_key, m)


def _implicit_prompt(
    record: Mapping[str, Any], chosen_key: str, rejected_key: str, m: KeyMap
) -> tuple[list[Message], Any, Any, KeyMap]:
    """TRL's implicit prompt: two whole conversations that differ only in the last message."""
    for key in (chosen_key, rejected_key):
        if not isinstance(record.get(key), list) or not record[key]:
            raise Rejected(
                Reason.PREFERENCE_MISSING_SIDE,
                f"no prompt and no '{key}' conversation (a preference record needs a prompt and two answers)",
            )
    chosen_messages = _messages(record, _as(m, chosen_key))
    rejected_messages = _messages(record, _as(m, rejected_key))
    if chosen_messages[:-1] != rejected_messages[:-1]:
        raise Rejected(
            Reason.MALFORMED_TURN, "the chosen and rejected conversations differ before their last message"
        )
    return chosen_messages[:-1], chosen_messages[-1], rejected_messages[-1], m


def _one(side: Any, m: KeyMap, key: str) -> Message | None:
    """One answer: a string, a message, or a list holding one message; None when absent."""
    if side is None or side == "" or side == []:
        return None
    if isinstance(side, str):
        return (_first_assistant(m), side)
    if isinstance(side, list):
        if len(side) != 1:
            raise Rejected(Reason.MALFORMED_TURN, f"'{key}' holds {len(side)} messages; an answer is one")
        side = side[0]
    if not isinstance(side, dict) or m.role_key not in side or m.content_key not in side:
        raise Rejected(
            Reason.MALFORMED_TURN, f"'{key}' is not a message with '{m.role_key}' and '{m.content_key}'"
        )
    _check_answer_role(side[m.role_key], m, key)
    return (side[m.role_key], side[m.content_key])


def _check_answer_role(tag: Any, m: KeyMap, key: str) -> None:
    if (m.roles.get(tag) if isinstance(tag, str) else None) not in MODEL_SIDE:
        raise Rejected(Reason.BROKEN_TURN_ORDER, f"'{key}' has role {tag!r}, not an assistant's")


def _as(m: KeyMap, key: str) -> KeyMap:
    """``m`` reading its messages from the record's ``key``."""
    return replace(m, columns={**m.columns, "messages": key})


def _first_user(m: KeyMap) -> str:
    return next(tag for tag, role in m.roles.items() if role == "user")


def _first_assistant(m: KeyMap) -> str:
    return next(tag for tag, role in m.roles.items() if role == "assistant")


def _kinds(slots: list) -> str:
    return "[" + ", ".join(kind for kind, _ in slots) + "]" if slots else "no media"
