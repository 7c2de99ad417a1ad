"""Text-only conversations in plain ChatML, tokenized a batch at a time without pieces.

``SampleTokenizer.render`` lays a conversation out as pieces (~30 for a text-only sample) and
``encode`` walks them one by one: most of a text-only batch's time after the encoder itself.
Where the renderer writes turns as they are (``chat.ChatML``: Qwen2-VL, Qwen2.5-VL) and a
sample has no media, its pieces always come in the same runs:

    [BOS tokens]  [<|im_start|> system\\n{system} <|im_end|> \\n]
    per turn:     <|im_start|> {role}\\n │ {text} <|im_end|> │ \\n
                  never supervised      │ the turn's        │ never

``PlainChat`` builds those runs for a batch with one encoder call and numpy, and leaves to the
general path every sample that path treats otherwise: media, preference pairs, a text that
starts with whitespace (encoded with its header) or is empty, a placeholder in a text, a
sample over ``max_tokens``, one without a supervised token. The rows are the general path's
(tests/mmpack_udfs/tokenize/test_plain.py compares the two).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mmpack_udfs.constants import IGNORE_INDEX as IGNORE
from mmpack_udfs.families.chat import TEMPLATE_ROLE, ChatML
from mmpack_udfs.schemas import MEDIA_PLACEHOLDER, TOKENIZED

if TYPE_CHECKING:
    from mmpack_udfs.families import Family

ROLES = ("user", "assistant", "function_call", "tool")  # a sample's turns (its system prompt aside)


def applies(profile: Family) -> bool:
    """Whether ``profile`` renders text as plain ChatML (turns as they are, ended by a token)."""
    chat = profile.chat
    return (
        type(profile.renderer) is ChatML
        and bool(chat.turn_end)
        and not chat.role_tokens
        and not chat.closing_token
    )


class PlainChat:
    """The plain-ChatML rows of a batch (``tokenize``); built once per ``SampleTokenizer``, with
    its profile, special-token ids, ``constant`` (a template string's ids, encoded once),
    ``encode`` (texts' ids, one call), ``supervised_turns`` (the turns ``tokenize.loss``
    supervises) and ``max_tokens``."""

    def __init__(
        self,
        profile: Family,
        special: Mapping[str, int],
        constant: Callable[[str], Sequence[int]],
        encode: Callable[[list[str]], list[list[int]]],
        supervised_turns: Callable[[Sequence[Mapping[str, str]]], set[int]],
        max_tokens: int,
    ) -> None:
        chat = profile.chat
        self.encode, self.supervised_turns, self.max_tokens = encode, supervised_turns, max_tokens
        self.default_system = profile.default_system
        self.bos = [special[token] for token in profile.bos_tokens]
        self.start = special[chat.turn_start]
        self.head = {  # role → its turn's start token and header, as ids
            role: [self.start, *constant(chat.header(TEMPLATE_ROLE.get(role, role)))] for role in ROLES
        }
        self.end = [special[chat.turn_end]]
        self.separator = list(constant(chat.separator))
        self.system_head = chat.header("system")
        self.default_system_ids = (
            None if self.default_system is None else constant(self.system_head + self.default_system)
        )

    def eligible(self, sample: Mapping[str, Any]) -> bool:
        """Whether the runs above are ``render``'s pieces for ``sample``."""
        if sample["media"] or sample.get("rejected") is not None:
            return False
        for turn in sample["turns"]:
            text = turn["text"]
            if not text or text[0].isspace() or ("<" in text and MEDIA_PLACEHOLDER.search(text)):
                return False
            if turn["role"] not in self.head:
                return False
        return bool(sample["turns"])

    def tokenize(self, samples: Sequence[Mapping[str, Any]]) -> tuple[pa.RecordBatch, list[int]]:
        """The TOKENIZED rows of the ``eligible`` ``samples`` that fit, in order, and the indices
        of those left to the general path (over ``max_tokens``, or nothing supervised)."""
        systems = [self._system(sample) for sample in samples]
        texts = [s for s in systems if isinstance(s, str)]
        texts += [turn["text"] for sample in samples for turn in sample["turns"]]
        encoded = self.encode(texts)
        system_ids = iter(encoded)
        turn_ids = iter(encoded[sum(isinstance(s, str) for s in systems) :])
        compact: list[int] = []  # the batch's ids
        lengths: list[int] = []  # tokens per run
        supervised: list[bool] = []  # per run
        sample_runs: list[int] = []  # runs per sample
        head, end, separator = self.head, self.end, self.separator
        for sample, system in zip(samples, systems, strict=True):
            runs = len(lengths)
            prefix = list(self.bos)
            if system is not None:
                body = next(system_ids) if isinstance(system, str) else system
                prefix += [self.start, *body, *end, *separator]
            if prefix:
                compact += prefix
                lengths.append(len(prefix))
                supervised.append(False)
            chosen = self.supervised_turns(sample["turns"])
            for t, turn in enumerate(sample["turns"]):
                ids = next(turn_ids)
                role_head = head[turn["role"]]
                compact += role_head
                compact += ids
                compact += end
                compact += separator
                lengths += (len(role_head), len(ids) + 1, len(separator))
                supervised += (False, t in chosen, False)
            sample_runs.append(len(lengths) - runs)
        return self._rows(samples, compact, lengths, supervised, sample_runs)

    def _system(self, sample: Mapping[str, Any]) -> str | tuple[int, ...] | None:
        """The system turn's body: None (no system turn), its ids (the default prompt, a constant)
        or the text to encode (the header with the prompt: one text between special tokens)."""
        system = sample["system"]
        if system is None:
            system = self.default_system
        if system is None:
            return None
        if system == self.default_system:
            return self.default_system_ids
        return self.system_head + system

    def _rows(self, samples, compact, lengths, supervised, sample_runs) -> tuple[pa.RecordBatch, list[int]]:
        ids = np.array(compact, np.int32)
        run_lengths = np.array(lengths, np.int64)
        mask = np.repeat(np.array(supervised, bool), run_lengths)
        run_starts = np.concatenate(([0], np.cumsum(sample_runs)))[:-1]
        tokens = np.add.reduceat(run_lengths, run_starts) if len(samples) else np.zeros(0, np.int64)
        starts = np.concatenate(([0], np.cumsum(tokens)))
        supervised_tokens = np.add.reduceat(mask, starts[:-1]) if len(samples) else np.zeros(0, np.int64)
        fits = (tokens <= self.max_tokens) & (supervised_tokens > 0)
        if not fits.all():
            keep = np.repeat(fits, tokens)
            ids, mask = ids[keep], mask[keep]
        kept = [s for s, ok in zip(samples, fits.tolist(), strict=True) if ok]
        tokens, supervised_tokens = tokens[fits].astype(np.int32), supervised_tokens[fits].astype(np.int32)
        offsets = pa.array(np.concatenate(([0], np.cumsum(tokens, dtype=np.int64))).astype(np.int32))
        labels = np.where(mask, ids, np.int32(IGNORE))
        zeros = np.zeros(len(kept), np.int32)
        ids_of = [s["sample_id"] for s in kept]
        columns = {
            "sample_id": pa.array(ids_of, pa.string()),
            "parent_id": pa.array(ids_of, pa.string()),
            "dataset": pa.array([s["dataset"] for s in kept], pa.string()),
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids, pa.int32())),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(labels, pa.int32())),
            "num_tokens": pa.array(tokens),
            "text_tokens": pa.array(tokens),
            "image_tokens": pa.array(zeros),
            "video_tokens": pa.array(zeros),
            "supervised_tokens": pa.array(supervised_tokens),
            "media": pa.array([[] for _ in kept], TOKENIZED.field("media").type),
            "pair_side": pa.nulls(len(kept), pa.string()),
            "weight": pa.array([s.get("weight", 1.0) for s in kept], pa.float64()),
        }
        left = np.flatnonzero(~fits).tolist()
        return pa.RecordBatch.from_pydict(columns, schema=TOKENIZED), left
