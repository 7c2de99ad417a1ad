"""How a family's chat template renders a conversation, turn by turn.

mmpack renders conversations itself (a batch at a time, special tokens by id) and proves on
the driver that the rendering is the model's own: ``tokenize.template_check`` renders probe
conversations with the directory's chat template and with every renderer its family knows
(``Family.chat_modes``), and keeps the one whose ids are identical (none: the run is
refused). The renderers:

- ``chatml``: Qwen2-VL / Qwen2.5-VL. ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` for every
  turn, roles as they are (``tool`` included).
- ``qwen3``: Qwen3-VL Instruct. As ChatML, but a tool turn is a user turn holding
  ``\\n<tool_response>\\n{content}\\n</tool_response>``.
- ``qwen3_thinking``: Qwen3-VL Thinking. As ``qwen3``; an assistant turn's ``<think>…</think>``
  prefix is its reasoning: dropped in turns before the last user query, and after it, when the
  turn is the last one or has reasoning, rendered as ``<think>\\n{reasoning}\\n</think>\\n\\n``
  + the answer (the template's empty think block on a final turn without reasoning).
- ``internvl``: transformers-native InternVL. ChatML, and every media placeholder followed by a
  newline (its template writes ``<IMG_CONTEXT>\\n`` / ``<video>\\n`` for a media part).
- ``llava_onevision``: LLaVA-OneVision. ChatML, a turn's images first (``<image>`` + newline
  each), then its videos (``<video>`` + newline), then its texts without the placeholders (a
  video written before an image moves after it, and so does its place among the sample's media).
- ``gemma3``: Gemma 3. ``<start_of_turn>{user|model}\n{content}<end_of_turn>\n``, every text
  part trimmed, a system prompt + two newlines at the head of the first user turn; turns must
  alternate user / model, user first (else the template raises: ``template_refuses``).
- ``gemma4``: Gemma 4 (its template published 2026-07-09). ``<|turn>{user|model}\n{content}<turn|>\n``,
  every text part trimmed, media as their bare tokens, a system prompt as a trimmed system turn;
  tool turns (which its template skips without a tool call) and consecutive model turns (which
  it merges) are refused (``template_refuses``).
- ``glm4v``: GLM-4.5V, GLM-4.6V, GLM-OCR. ``[gMASK]<sop>``, then ``<|system|>`` / ``<|user|>`` /
  ``<|assistant|>`` / ``<|observation|>`` + newline + content, no end token; an assistant turn is
  ``<think>{reasoning}</think>`` (reasoning only after the last user turn) + newline + its trimmed
  answer; a tool turn ``<tool_response>\\n{content}\\n</tool_response>\\n``.
- ``glm45v``: GLM-4.5V. As ``glm4v``, without the newline after a tool response.
- ``glm41v``: GLM-4.1V-9B-Thinking. Role-token turns, contents as they are (no think block of its
  own); its template drops tool turns, so samples with one are refused (``template_refuses``).
- ``qwen2_audio``: Qwen2-Audio. ChatML; the k-th clip of a conversation is written
  ``Audio k: `` + the clip + a newline (its template's audio part).
- ``qwen3_omni``: Qwen3-Omni (its Thinking template, published 2025-09-22). As
  ``qwen3_thinking``, but the last user query is the last user turn without media (the
  template reads only a string content); with none, no turn keeps its reasoning.
- ``qwen3_5``: Qwen3.5. Every content trimmed; every assistant turn after the last user query
  carries ``<think>\\n{reasoning}\\n</think>\\n\\n`` (empty reasoning included).

Supervised tokens (``tokenize.loss``): everything a supervised turn renders after its role
header (think block, answer, ``<|im_end|>``); never the header, the template's newline after
``<|im_end|>``, the system prompt or a tool turn's wrapper. GLM ends a turn with the next turn's
role token, which is supervised as the end of a supervised turn; a conversation's last turn is
closed by ``<|user|>`` (``ChatFormat.closing_token``), the token GLM generates to stop.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, MEDIA_PLACEHOLDER

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_response>", "</tool_response>"
TEMPLATE_ROLE = {"function_call": "assistant"}

# One element of a token layout (a turn's or a media item's): ("token", "<|vision_start|>"),
# ("pad", n) for n copies of the item's pad token, ("text", "<0.5 seconds>") for text encoded
# in place.
LayoutElement = tuple[str, Any]


@dataclass(frozen=True)
class TurnLayout:
    """One turn after its ``<|im_start|>``: ``role`` + newline, then ``before`` (tokens and
    texts), the ``body`` (text with media placeholders), then ``after``."""

    role: str
    body: str
    before: list[LayoutElement] = field(default_factory=list)
    after: list[LayoutElement] = field(default_factory=list)
    # the body's media placeholders by their place among the turn's own (empty: as the turn wrote
    # them): a template that moves a turn's media (LLaVA-OneVision: images first)
    media_order: tuple[int, ...] = ()


class ChatML:
    """Qwen2-VL's template: roles and contents as they are."""

    name = "chatml"
    tokens: tuple[str, ...] = ()  # tokens the renderer inserts by id, besides the chat format's
    system_in_first_turn = False  # a system prompt heads the first turn (no system turn of its own)

    def system(self, text: str) -> str:
        return text

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        return [TurnLayout(TEMPLATE_ROLE.get(t["role"], t["role"]), t["text"]) for t in turns]


class InternVL(ChatML):
    """transformers-native InternVL: ChatML, a newline after every media item."""

    name = "internvl"

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        return [
            TurnLayout(layout.role, MEDIA_PLACEHOLDER.sub(r"\1\n", layout.body))
            for layout in super().turns(turns)
        ]


class Qwen2Audio(ChatML):
    """Qwen2-Audio: ChatML, each clip labelled with its number in the conversation and followed
    by a newline."""

    name = "qwen2_audio"

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        out, count = [], 0
        for layout in super().turns(turns):
            pieces = layout.body.split(AUDIO_PLACEHOLDER)
            body = pieces[0]
            for piece in pieces[1:]:
                count += 1
                body += f"Audio {count}: {AUDIO_PLACEHOLDER}\n{piece}"
            out.append(TurnLayout(layout.role, body))
        return out


class LlavaOnevision(ChatML):
    """LLaVA-OneVision: a message's images, then its videos, each with a newline, then its texts.
    A turn that writes a video before an image is rendered as the template does, its media in
    the template's order (``TurnLayout.media_order``; the tokenized row's media follow it)."""

    name = "llava_onevision"

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        out = []
        for layout in super().turns(turns):
            items = MEDIA_PLACEHOLDER.findall(layout.body)
            order = sorted(range(len(items)), key=lambda i: items[i] != IMAGE_PLACEHOLDER)
            media = "".join(items[i] + "\n" for i in order)
            moved = tuple(order) if order != sorted(order) else ()
            out.append(
                TurnLayout(layout.role, media + MEDIA_PLACEHOLDER.sub("", layout.body), media_order=moved)
            )
        return out


class Gemma3(ChatML):
    """Gemma 3: user / model turns of trimmed text parts; the system prompt heads the first turn."""

    name = "gemma3"
    system_in_first_turn = True

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        out = []
        for index, turn in enumerate(turns):
            role = TEMPLATE_ROLE.get(turn["role"], turn["role"])
            if (role == "user") != (index % 2 == 0):
                raise Rejected(
                    Reason.TEMPLATE_REFUSES,
                    "Gemma 3's template needs turns that alternate user / assistant, user first",
                )
            parts = MEDIA_PLACEHOLDER.split(turn["text"])
            body = "".join(part if k % 2 else part.strip() for k, part in enumerate(parts))
            out.append(TurnLayout("model" if role == "assistant" else role, body))
        return out

    def with_system(self, system: str, layouts: list[TurnLayout]) -> list[TurnLayout]:
        """The system prompt and two newlines at the head of the first turn (not trimmed)."""
        return [dataclasses.replace(layouts[0], body=system + "\n\n" + layouts[0].body), *layouts[1:]]


class Gemma4(ChatML):
    """Gemma 4 (its template of 2026-07-09): ``<|turn>{user|model}\n`` + trimmed text parts and
    bare media tokens + ``<turn|>\n``; a system prompt is a trimmed system turn. Its template
    skips a tool message that follows no tool call and merges consecutive model messages into
    one turn: such samples are refused (``template_refuses``)."""

    name = "gemma4"

    def system(self, text: str) -> str:
        return text.strip()

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        out = []
        for turn in turns:
            role = TEMPLATE_ROLE.get(turn["role"], turn["role"])
            if role not in ("user", "assistant"):
                raise Rejected(
                    Reason.TEMPLATE_REFUSES, f"Gemma 4's template drops {role} turns without tool calls"
                )
            if role == "assistant" and out and out[-1].role == "model":
                raise Rejected(Reason.TEMPLATE_REFUSES, "Gemma 4's template merges consecutive model turns")
            parts = MEDIA_PLACEHOLDER.split(turn["text"])
            body = "".join(part if k % 2 else part.strip() for k, part in enumerate(parts))
            out.append(TurnLayout("model" if role == "assistant" else role, body))
        return out


class Qwen3(ChatML):
    """Qwen3-VL Instruct: tool turns as user turns holding a tool response."""

    name = "qwen3"
    tokens = (TOOL_OPEN, TOOL_CLOSE)
    trim = False

    def content(self, text: str) -> str:
        return text.strip() if self.trim else text

    def system(self, text: str) -> str:
        return self.content(text)

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        last_query = self.last_query(turns)
        out = []
        for index, turn in enumerate(turns):
            text = self.content(turn["text"])
            if turn["role"] == "tool":
                body = "\n" + text + "\n"
                out.append(TurnLayout("user", body, [("token", TOOL_OPEN)], [("token", TOOL_CLOSE)]))
            elif turn["role"] == "user":
                out.append(TurnLayout("user", text))
            else:
                final = index == len(turns) - 1
                out.append(self.assistant(text, index > last_query, final))
        return out

    def last_query(self, turns: Sequence[Mapping[str, str]]) -> int:
        """Index of the last user turn that is a query (``is_query``: the template's
        ``last_query_index``); without one, ``no_query``'s."""
        for index in range(len(turns) - 1, -1, -1):
            if turns[index]["role"] == "user" and self.is_query(self.content(turns[index]["text"])):
                return index
        return self.no_query(turns)

    def is_query(self, text: str) -> bool:
        """Whether a user turn's text is a query: not a wrapped tool response."""
        return not (text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE))

    def no_query(self, turns: Sequence[Mapping[str, str]]) -> int:
        raise Rejected(Reason.TEMPLATE_REFUSES, "no user query (only tool responses)")

    def assistant(self, text: str, after_query: bool, final: bool) -> TurnLayout:
        return TurnLayout("assistant", text)


class Qwen3Thinking(Qwen3):
    """Qwen3-VL Thinking: reasoning split off the answer; a think block after the last query."""

    name = "qwen3_thinking"
    tokens = (TOOL_OPEN, TOOL_CLOSE, THINK_OPEN, THINK_CLOSE)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) as the template splits an assistant turn at ``</think>``."""
        if THINK_CLOSE not in text:
            return "", text
        reasoning = text.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
        return reasoning, text.split(THINK_CLOSE)[-1].lstrip("\n")

    def assistant(self, text: str, after_query: bool, final: bool) -> TurnLayout:
        reasoning, answer = self.split(text)
        if after_query and (final or reasoning):
            return self.think_block(reasoning.strip("\n"), answer.lstrip("\n"))
        return TurnLayout("assistant", answer)

    def think_block(self, reasoning: str, answer: str) -> TurnLayout:
        thought: list[LayoutElement] = [("token", THINK_OPEN), ("text", "\n" + reasoning + "\n")]
        return TurnLayout("assistant", "\n\n" + answer, [*thought, ("token", THINK_CLOSE)])


class Qwen3OmniChat(Qwen3Thinking):
    """Qwen3-Omni: as ``qwen3_thinking``, but its template finds the last query among user turns
    written as a string only (``message.content is string``), so a turn with media never is one;
    without such a turn, no assistant turn gets a think block."""

    name = "qwen3_omni"

    def is_query(self, text: str) -> bool:
        return not MEDIA_PLACEHOLDER.search(text) and super().is_query(text)

    def no_query(self, turns: Sequence[Mapping[str, str]]) -> int:
        return len(turns) - 1  # the template's default: no turn comes after it


class Qwen35(Qwen3Thinking):
    """Qwen3.5: contents trimmed; every assistant turn after the last query thinks."""

    name = "qwen3_5"
    trim = True

    def assistant(self, text: str, after_query: bool, final: bool) -> TurnLayout:
        reasoning, answer = self.split(text)
        if after_query:
            return self.think_block(reasoning.strip(), answer)
        return TurnLayout("assistant", answer)


class Glm(Qwen3Thinking):
    """GLM-4.5V, GLM-4.6V, GLM-OCR: turns opened by role tokens (``ChatFormat.role_tokens``), no
    end token; every assistant turn has a think block, its reasoning kept after the last user
    turn, its answer trimmed; a tool turn is an ``observation`` turn holding a tool response."""

    name = "glm4v"
    after_tool = "\n"  # GLM-4.6V's template: a newline after a tool response

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
        out = []
        for index, turn in enumerate(turns):
            role = TEMPLATE_ROLE.get(turn["role"], turn["role"])
            if role == "tool":
                if index and turns[index - 1]["role"] == "tool":
                    raise Rejected(
                        Reason.TEMPLATE_REFUSES,
                        "consecutive tool turns: GLM's template writes them under one <|observation|>",
                    )
                before = [("token", TOOL_OPEN)]
                after = [("token", TOOL_CLOSE), *([("text", self.after_tool)] if self.after_tool else [])]
                out.append(TurnLayout("observation", "\n" + turn["text"] + "\n", before, after))
            elif role == "assistant":
                reasoning, answer = self.split(turn["text"])
                shown = reasoning.strip() if index > last_user and reasoning else ""
                thought = [
                    ("token", THINK_OPEN),
                    *([("text", shown)] if shown else []),
                    ("token", THINK_CLOSE),
                ]
                body = "\n" + answer.strip() if answer.strip() else ""
                out.append(TurnLayout("assistant", body, thought))
            else:
                out.append(TurnLayout(role, turn["text"]))
        return out


class Glm45(Glm):
    """GLM-4.5V: as GLM-4.6V, nothing after a tool response."""

    name = "glm45v"
    after_tool = ""


class Glm41(ChatML):
    """GLM-4.1V-9B-Thinking: turns opened by role tokens, contents as they are (the think tags
    in an answer by id); its template writes nothing for a tool turn, so a sample with one is
    refused rather than trained without it."""

    name = "glm41v"
    tokens = (THINK_OPEN, THINK_CLOSE)

    def turns(self, turns: Sequence[Mapping[str, str]]) -> list[TurnLayout]:
        out = []
        for turn in turns:
            role = TEMPLATE_ROLE.get(turn["role"], turn["role"])
            if role == "tool":
                raise Rejected(Reason.TEMPLATE_REFUSES, "GLM-4.1V's template drops tool turns")
            parts = [p for p in THINK_TAG.split(turn["text"]) if p] if role == "assistant" else []
            if len(parts) < 2:  # no think tags: the text as it is
                out.append(TurnLayout(role, turn["text"]))
                continue
            body = "" if parts[-1] in (THINK_OPEN, THINK_CLOSE) else parts.pop()
            before = [("token", p) if p in (THINK_OPEN, THINK_CLOSE) else ("text", p) for p in parts]
            out.append(TurnLayout(role, body, before))
        return out


THINK_TAG = re.compile(f"({re.escape(THINK_OPEN)}|{re.escape(THINK_CLOSE)})")

CHAT_RENDERERS: dict[str, ChatML] = {
    r.name: r
    for r in (
        ChatML(), Gemma3(), Gemma4(), Glm(), Glm45(), Glm41(), InternVL(), LlavaOnevision(), Qwen2Audio(),
        Qwen3(), Qwen3Thinking(), Qwen3OmniChat(), Qwen35(),
    )
}  # fmt: skip
