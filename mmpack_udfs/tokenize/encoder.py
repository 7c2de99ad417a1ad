"""Samples → token ids, labels and media spans. Runs on executors, a batch at a time.

A conversation is rendered into *pieces*: literal special tokens, runs of media pad
tokens, and texts. The texts are exactly the strings a Hugging Face tokenizer would see
between special tokens in the chat-template output, so encoding them separately (all
texts of a batch in one Rust ``encode_batch_fast`` call) gives the same ids as
tokenizing the rendered conversation whole. Ids and labels are then assembled with
numpy, one concatenation per batch.

Supervised tokens (labels != -100): the content of the supervised turns and their
``<|im_end|>``; never role headers, media tokens, the system prompt or template newlines.

A preference pair (a sample with ``rejected``) becomes two rows, ``<id>-chosen`` (its turns)
and ``<id>-rejected`` (the last turn's answer replaced), with the same media; each is
supervised on its final answer only, and the two together must fit ``max_tokens``: they
are packed into one bin, never truncated or split.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from mmpack_udfs.constants import IGNORE_INDEX as IGNORE
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import Family, MediaPlan, make_family, model_dir
from mmpack_udfs.io.cache import checks_dir
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import MEDIA_PLACEHOLDER, PAIR_SIDES, TOKENIZED
from mmpack_udfs.tokenize import fast, plain
from mmpack_udfs.tokenize import tokenizer as tokenizers

if TYPE_CHECKING:
    from mmpack_udfs.config import Config

MODEL_SIDE = {"assistant", "function_call"}
PLACEHOLDER = MEDIA_PLACEHOLDER


@dataclass(frozen=True)
class TokenizeSettings:
    tokenizer_path: str
    profile_name: str
    profile: Mapping[str, Any]
    max_tokens: int
    over_length: str = "drop"
    loss: str = "assistant"
    tokenizer_json: bool = False  # workers may load tokenizer.json alone (checked on the driver)
    fast_encoder: bool = False  # workers may encode with the tiktoken port (proven on the driver)
    model_source: str | None = None  # an s3:// tokenize.model: each machine fetches its own copy
    model_files: model_dir.RemoteFiles = ()  # its files as the run start listed them
    # the profile's special tokens' ids (checked on the driver): workers need no backend for them
    special_ids: tuple[tuple[str, int], ...] = ()

    def on_this_machine(self, storage) -> TokenizeSettings:
        """These settings with the tokenizer directory present on this machine: an s3:// model
        directory's listed files are fetched to this machine's cache (once) when the driver's
        copy is not here."""
        if self.model_source is None or os.path.isdir(self.tokenizer_path):
            return self
        path = model_dir.fetch(self.model_source, storage, self.model_files)
        return dataclasses.replace(self, tokenizer_path=path)

    @classmethod
    def from_config(cls, config: Config, model: model_dir.ModelDirectory | None = None) -> TokenizeSettings:
        """What the executors need of the checked config (and the run's ``model`` directory),
        with the tokenizer resolved and checked against the profile (on the driver: a mismatch
        is a ConfigError, not an executor traceback)."""
        section = config.tokenize
        path = tokenizers.resolve_path(section.tokenizer)
        remote = model is not None and bool(model.files) and path == model.path
        settings = cls(
            tokenizer_path=path,
            profile_name=section.profile,
            profile=config.profile.model_dump(),
            max_tokens=section.max_tokens,
            over_length=section.over_length,
            loss=section.loss,
            tokenizer_json=tokenizers.json_matches_auto(path),
            model_source=model.source if remote else None,
            model_files=model.files if remote else (),
        )
        return dataclasses.replace(
            settings,
            special_ids=tuple(sorted(settings.special_token_ids().items())),
            fast_encoder=tokenizers.fast_encoder_verified(path, settings.tokenizer_json),
        )

    def special_token_ids(self) -> dict[str, int]:
        """The ids of the tokens of the profile's chat format and media spans; ConfigError
        naming those the tokenizer lacks."""
        profile = make_family(self.profile_name, self.profile)
        added = model_dir.added_tokens(self.tokenizer_path)["ids"]
        ids = {t: added[t] for t in profile.special_tokens() if t in added}
        missing = sorted(profile.special_tokens() - ids.keys())
        if missing:  # not added tokens: perhaps in the vocabulary
            backend = tokenizers.load_backend(self.tokenizer_path, self.tokenizer_json)
            ids |= {t: backend.token_to_id(t) for t in missing if backend.token_to_id(t) is not None}
            missing = [t for t in missing if t not in ids]
        if missing:
            raise ConfigError(
                f"tokenize.tokenizer: {self.tokenizer_path} has no token {', '.join(missing)}, which "
                f"profile '{self.profile_name}' (tokenize.profile) renders turns or media with; use "
                "a tokenizer of that model family or a profile that matches the tokenizer"
            )
        return ids


class Piece(NamedTuple):
    text: str | None  # a text to encode, or None for literal ids
    ids: tuple[int, ...] = ()  # literal ids, repeated `repeat` times
    repeat: int = 1
    supervised: bool = False
    media: int = -1  # index of the media item, on its pad run
    track: bool = False  # the pad run is of the item's own audio track (a video's, MediaPlan.audio)
    span: int = -1  # index of the media item, on every piece of its span (wrappers and pads)
    turn: int = -1  # index of the turn the piece belongs to (-1: system prompt)
    quiet: tuple[tuple[int, int], ...] = ()  # character ranges of `text` never supervised (a role header)


@dataclass
class Tokenized:
    """One tokenized sample (or one piece of a split sample)."""

    sample_id: str
    parent_id: str
    dataset: str
    input_ids: np.ndarray
    labels: np.ndarray
    media: list[dict] = field(default_factory=list)
    image_tokens: int = 0
    video_tokens: int = 0
    over_length: bool = False  # cut down to max_tokens (truncate) or a piece of a split sample
    pair_side: str | None = None  # "chosen" | "rejected" for a preference pair's sequences
    weight: float = 1.0  # the sample's loss weight (every piece of a split sample keeps it)
    reordered: bool = False  # its media in another order than its placeholders (the template moved them)


class SampleTokenizer:
    """Built once per Python worker: holds the tokenizer, the profile and its token ids. With
    the fast encoder, the ``tokenizers`` backend is loaded only when a batch needs it (texts
    with role headers inside, characters unknown to Python): text-only chat loads none."""

    def __init__(self, settings: TokenizeSettings) -> None:
        self.settings = settings
        self.fast = (
            fast.load(settings.tokenizer_path, self._load_backend, proven=True, cache=checks_dir())
            if settings.fast_encoder
            else None
        )
        self.profile: Family = make_family(settings.profile_name, settings.profile)
        self.special = dict(settings.special_ids) or {
            tok: self._token_id(tok) for tok in self.profile.special_tokens()
        }
        self._constants: dict[str, tuple[int, ...]] = {}
        self.plain = (
            plain.PlainChat(
                self.profile, self.special, self._constant, self._encode_plain, self._supervised_turns,
                settings.max_tokens,
            )
            if plain.applies(self.profile)
            else None
        )  # fmt: skip

    @cached_property
    def backend(self):
        """The ``tokenizers`` backend (``tokenizer.load_backend``), on first use."""
        return self._load_backend()

    def _load_backend(self):
        return tokenizers.load_backend(self.settings.tokenizer_path, self.settings.tokenizer_json)

    def _constant(self, text: str) -> tuple[int, ...]:
        """Ids of a template string that recurs in every sample (role headers, newlines, the
        default system prompt), encoded once: it is its own segment between special tokens."""
        ids = self._constants.get(text)
        if ids is None:
            ids = tuple(self._encode_plain([text])[0])
            self._constants[text] = ids
        return ids

    def _token_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer {self.settings.tokenizer_path} has no token {token!r}, "
                f"which profile '{self.profile.name}' needs"
            )
        return token_id

    # --- rendering ---------------------------------------------------------------------

    def render(
        self,
        system: str | None,
        turns: Sequence[Mapping[str, str]],
        plans: Sequence[MediaPlan],
        last_turn_only: bool = False,
        as_template: bool = False,
    ) -> list[Piece]:
        """The pieces of one conversation, as the family's chat renderer lays out its turns;
        media plans are consumed in placeholder order. ``last_turn_only``: supervise the final
        answer alone (a preference pair's sequences), whatever ``tokenize.loss`` says.
        ``as_template``: each media item as the chat template writes it, unexpanded."""
        chat, renderer = self.profile.chat, self.profile.renderer
        pieces = [Piece(None, (self.special[token],)) for token in self.profile.bos_tokens]
        if system is None:
            system = self.profile.default_system
        layouts = renderer.turns(turns)
        if system is not None and renderer.system_in_first_turn:
            layouts = renderer.with_system(system, layouts)
        elif system is not None:
            system = renderer.system(system)
            head = chat.header("system") + system
            body = Piece(None, self._constant(head)) if system == self.profile.default_system else Piece(head)
            pieces += [Piece(None, self._start("system")), body, *self._end(False, -1)]
        supervised = {len(turns) - 1} if last_turn_only else self._supervised_turns(turns)
        next_media = 0
        for t, layout in enumerate(layouts):
            sup = t in supervised
            header = chat.header(layout.role)
            # without end tokens (GLM), a turn's start token ends the turn before it
            closes = not chat.turn_end and t - 1 in supervised
            pieces.append(Piece(None, self._start(layout.role), supervised=closes, turn=t))
            if layout.before:  # the header stands alone: a token follows it
                pieces.append(Piece(None, self._constant(header), turn=t))
                pieces += self._layout_pieces(layout.before, sup, t)
            text = layout.body
            parts = PLACEHOLDER.split(text) if "<" in text else (text,)
            # the sample's media index of each placeholder as rendered (the template may move them)
            indices = [next_media + j for j in layout.media_order or range(len(parts) // 2)]
            for k, part in enumerate(parts):
                if k % 2 == 1:  # a placeholder
                    index = indices[k // 2]
                    plan = plans[index]
                    shape = (
                        self.profile.template_layout(plan.kind)
                        if as_template
                        else self.profile.media_layout(plan)
                    )
                    _append_joined(pieces, self._media_pieces(shape, plan, index, t))
                    next_media += 1
                elif k > 0 or layout.before:
                    if part:
                        pieces.append(Piece(part, supervised=sup, turn=t))
                elif part[:1].isspace():  # may merge with the header's newline: encode together
                    pieces.append(Piece(header + part, supervised=sup, turn=t, quiet=((0, len(header)),)))
                elif not part and len(parts) > 1 and self._starts_with_text(plans[indices[0]], as_template):
                    # the media item's leading text (Gemma 3's newlines) joins the header
                    pieces.append(Piece(header, turn=t, quiet=((0, len(header)),)))
                else:
                    pieces.append(Piece(None, self._constant(header), turn=t))
                    if part:
                        pieces.append(Piece(part, supervised=sup, turn=t))
            pieces += self._layout_pieces(layout.after, sup, t)
            pieces += self._end(sup, t)
        if chat.closing_token and layouts:
            last = len(layouts) - 1
            pieces.append(
                Piece(None, (self.special[chat.closing_token],), supervised=last in supervised, turn=last)
            )
        if next_media != len(plans):
            raise Rejected(
                Reason.PLACEHOLDER_MEDIA_MISMATCH, f"{next_media} placeholders, {len(plans)} media"
            )
        return pieces

    def _start(self, role: str) -> tuple[int, ...]:
        return (self.special[self.profile.chat.start_token(role)],)

    def _end(self, supervised: bool, turn: int) -> list[Piece]:
        """A turn's end token (supervised with the turn) and the separator after it; none where
        the chat format ends turns with the next one's start token."""
        chat = self.profile.chat
        if not chat.turn_end:
            return []
        end = Piece(None, (self.special[chat.turn_end],), supervised=supervised, turn=turn)
        return [end, Piece(None, self._constant(chat.separator), turn=turn)]

    def prompt_tokens(
        self, system: str | None, turns: Sequence[Mapping[str, str]], plans: Sequence[MediaPlan]
    ) -> int:
        """Tokens of a prompt (``turns`` ending with a user turn, ``plans`` their media) as the
        chat template renders it with ``add_generation_prompt``: every turn, then the header of
        the model's turn (for families whose generation prompt is that header: ``rl_prompts``)."""
        pieces = self.render(system, [*turns, {"role": "assistant", "text": ""}], plans)
        header = next(i for i, p in enumerate(pieces) if p.turn == len(turns)) + 1  # after its start token
        (encoded,) = self.encode([pieces])
        return sum(encoded.lengths[: header + 1])

    def _starts_with_text(self, plan: MediaPlan, as_template: bool) -> bool:
        shape = self.profile.template_layout(plan.kind) if as_template else self.profile.media_layout(plan)
        return bool(shape) and shape[0][0] == "text"

    def _layout_pieces(self, layout: Sequence[tuple[str, str]], supervised: bool, turn: int) -> list[Piece]:
        """Tokens (by id) and texts a chat renderer puts around a turn's body."""
        return [
            Piece(None, (self.special[value],), supervised=supervised, turn=turn)
            if what == "token"
            else Piece(value, supervised=supervised, turn=turn)
            for what, value in layout
        ]

    def _supervised_turns(self, turns: Sequence[Mapping[str, str]]) -> set[int]:
        model = [i for i, t in enumerate(turns) if t["role"] in MODEL_SIDE]
        if self.settings.loss == "all":
            return set(range(len(turns)))
        if self.settings.loss == "last":
            return set(model[-1:])
        return set(model)

    def _media_pieces(self, layout, plan: MediaPlan, index: int, turn: int) -> list[Piece]:
        """The pieces of one media item's ``layout``: wrapper tokens, pad runs (each marked with
        the item's index) and texts (Qwen3-VL's timestamps, InternVL's frame labels)."""
        pieces = []
        for what, value in layout:
            if what == "token":
                pieces.append(Piece(None, (self.special[value],), turn=turn, span=index))
            elif what in ("pad", "track"):  # the item's pads, or its audio track's
                kind = plan.kind if what == "pad" else "audio"
                pad = (self.special[self.profile.media_tokens[kind].pad],)
                track = what == "track"
                pieces.append(Piece(None, pad, repeat=value, media=index, turn=turn, span=index, track=track))
            else:
                pieces.append(Piece(value, turn=turn, span=index))
        return pieces

    # --- encoding ----------------------------------------------------------------------

    def encode(self, conversations: Sequence[list[Piece]]) -> list[Encoded]:
        """Ids, labels and piece lengths of every conversation. One Rust call encodes all plain
        texts; supervised texts with unsupervised characters (a role header, an InternVL frame
        label joined to the text before it: rare) go through a second call with offsets.
        The batch is assembled flat: ids in one list where a pad run is a single id (expanded
        by ``np.repeat``), labels from a per-piece supervision mask."""
        plain = [p.text for conv in conversations for p in conv if p.text is not None and not p.quiet]
        headed = [p.text for conv in conversations for p in conv if p.quiet]
        plain_ids = iter(self._encode_plain(plain))
        headed_enc = iter(self.backend.encode_batch(headed, add_special_tokens=False) if headed else ())
        compact: list[int] = []  # the batch's ids, each pad run as one id
        runs: list[tuple[int, int]] = []  # (position in compact, length) of each pad run
        lengths: list[int] = []  # tokens per piece
        supervised: list[bool] = []  # per piece
        quiet_tokens: list[tuple[int, np.ndarray]] = []  # (piece, its tokens) to unsupervise
        for conv in conversations:
            for p in conv:
                if p.text is None:
                    if p.repeat > 1 and len(p.ids) == 1:
                        runs.append((len(compact), p.repeat))
                        compact += p.ids
                    else:
                        compact += p.ids * p.repeat
                    lengths.append(len(p.ids) * p.repeat)
                elif p.quiet:
                    enc = next(headed_enc)
                    compact += enc.ids
                    lengths.append(len(enc.ids))
                    if p.supervised:
                        quiet_tokens.append((len(lengths) - 1, _tokens_in(enc.offsets, p.quiet)))
                else:
                    ids = next(plain_ids)
                    compact += ids
                    lengths.append(len(ids))
                supervised.append(p.supervised)
        repeats = np.ones(len(compact), np.int64)
        for position, length in runs:
            repeats[position] = length
        token_ids = np.repeat(np.array(compact, np.int32), repeats)
        starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        mask = np.repeat(np.array(supervised, bool), lengths)
        for piece, tokens in quiet_tokens:
            mask[starts[piece] + tokens] = False
        labels = np.where(mask, token_ids, np.int32(IGNORE))
        out, first_piece = [], 0
        for conv in conversations:
            end_piece = first_piece + len(conv)
            a, b = starts[first_piece], starts[end_piece]
            out.append(Encoded(token_ids[a:b], labels[a:b], lengths[first_piece:end_piece]))
            first_piece = end_piece
        return out

    def _encode_plain(self, texts: list[str]) -> list[list[int]]:
        """Ids of texts without role headers: the tiktoken port where proven, else tokenizers."""
        if self.fast is not None:
            return self.fast.encode_batch(texts)
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    # --- samples -----------------------------------------------------------------------

    def tokenize(self, samples: Sequence[Mapping[str, Any]]) -> tuple[list[Tokenized], list[dict]]:
        """Tokenize a batch of samples-table rows; return (tokenized, quarantined) rows."""
        with paused_gc():
            return self._tokenize(samples)

    def tokenize_batch(
        self, samples: Sequence[Mapping[str, Any]]
    ) -> tuple[pa.RecordBatch | None, list[Tokenized], list[dict]]:
        """``tokenize`` as one TOKENIZED batch (None: no row), in the samples' order; plain-ChatML
        text goes the short way (``plain.PlainChat``). Also returns the rows that went the
        general way and the quarantined ones."""
        fast = [i for i, sample in enumerate(samples) if self.plain.eligible(sample)] if self.plain else []
        with paused_gc():
            quick, left = self.plain.tokenize([samples[i] for i in fast]) if fast else (None, [])
            fast_set = set(fast) - {fast[i] for i in left}
            general = [i for i in range(len(samples)) if i not in fast_set]
            done, quarantined = self._tokenize([samples[i] for i in general])
        parts, order = [], []
        if quick is not None and quick.num_rows:
            parts.append(quick)
            order += sorted(fast_set)
        if done:
            parts.append(to_record_batch(done))
            index = {samples[i]["sample_id"]: i for i in general}
            order += [index[row.parent_id] for row in done]
        if not parts:
            return None, done, quarantined
        rows = pa.Table.from_batches(parts, schema=TOKENIZED)
        if len(parts) > 1:
            rows = rows.take(pa.array(np.argsort(order, kind="stable")))
        return rows.combine_chunks().to_batches()[0], done, quarantined

    def _tokenize(self, samples: Sequence[Mapping[str, Any]]) -> tuple[list[Tokenized], list[dict]]:
        done: list[Tokenized] = []
        quarantined: list[dict] = []
        rendered, kept, all_plans = [], [], []
        for sample in samples:
            try:
                plans = self.profile.plans(sample["media"])
                pair = sample.get("rejected") is not None
                conversations = _pair_turns(sample) if pair else (sample["turns"],)
                rendered.append([self.render(sample["system"], t, plans, pair) for t in conversations])
                kept.append(sample)
                all_plans.append(plans)
            except Rejected as rejected:
                quarantined.append(_quarantine(sample, rejected, None))
        encoded = iter(self.encode([pieces for sequences in rendered for pieces in sequences]))
        for sample, plans, sequences in zip(kept, all_plans, rendered, strict=True):
            encs = [next(encoded) for _ in sequences]
            try:
                if len(sequences) == 1:
                    done += self._fit(sample, plans, sequences[0], encs[0])
                else:
                    done += self._fit_pair(sample, plans, sequences, encs)
            except Rejected as rejected:
                quarantined.append(_quarantine(sample, rejected, sum(len(e.ids) for e in encs)))
        return done, quarantined

    def _fit_pair(self, sample, plans, sequences: list[list[Piece]], encs: list[Encoded]) -> list[Tokenized]:
        """A preference pair's two rows, when both fit ``max_tokens`` together (they share a bin)."""
        total, limit = sum(len(e.ids) for e in encs), self.settings.max_tokens
        if total > limit:
            raise Rejected(
                Reason.TOO_LONG, f"the pair has {total} tokens > max_tokens {limit}; pairs are never cut"
            )
        rows = []
        for side, pieces, enc in zip(PAIR_SIDES, sequences, encs, strict=True):
            turns = sample["turns"] if side == "chosen" else _pair_turns(sample)[1]
            row = _assemble(f"{sample['sample_id']}-{side}", {**sample, "turns": turns}, plans, pieces, enc)
            if not (row.labels != IGNORE).any():
                raise Rejected(Reason.NO_SUPERVISED_TOKENS, f"the {side} answer has none")
            row.pair_side = side
            rows.append(row)
        return rows

    def _fit(self, sample, plans, pieces, enc: Encoded) -> list[Tokenized]:
        """Apply the over-length policy and the supervised-token check."""
        limit = self.settings.max_tokens
        if len(enc.ids) <= limit:
            results = [_assemble(sample["sample_id"], sample, plans, pieces, enc)]
        elif self.settings.over_length == "truncate":
            results = [_truncate(sample, plans, pieces, enc, limit)]
            kept = len(results[0].media)
            if self.profile.plans(sample["media"][:kept]) != plans[:kept]:
                raise Rejected(
                    Reason.TOO_LONG,
                    f"{len(enc.ids)} tokens > max_tokens {limit}, and truncating would drop media items, "
                    f"which changes the tokens {self.profile.kind} gives the items kept",
                )
        elif self.settings.over_length == "split":
            results = self._split(sample, plans, pieces, enc, limit)
        else:
            raise Rejected(Reason.TOO_LONG, f"{len(enc.ids)} tokens > max_tokens {limit}")
        if len(enc.ids) > limit:
            for result in results:
                result.over_length = True
        for result in results:
            if not (result.labels != IGNORE).any():
                raise Rejected(Reason.NO_SUPERVISED_TOKENS, f"piece {result.sample_id} has none")
        return results

    def _split(self, sample, plans, pieces, enc: Encoded, limit) -> list[Tokenized]:
        """Split at round boundaries (a user turn starts a round) into pieces that fit."""
        turn_tokens: dict[int, int] = {}
        for piece, length in zip(pieces, enc.lengths, strict=True):
            turn_tokens[piece.turn] = turn_tokens.get(piece.turn, 0) + length
        system_tokens = turn_tokens.pop(-1, 0)
        turns = sample["turns"]
        rounds, current = [], []
        for t, turn in enumerate(turns):
            if current and turn["role"] not in MODEL_SIDE and turns[t - 1]["role"] in MODEL_SIDE:
                rounds.append(current)
                current = []
            current.append(t)
        rounds.append(current)
        chunks, chunk, size = [], [], system_tokens
        for r in rounds:
            cost = sum(turn_tokens[t] for t in r)
            if system_tokens + cost > limit:
                raise Rejected(Reason.TOO_LONG, f"one round has {system_tokens + cost} tokens > {limit}")
            if chunk and size + cost > limit:
                chunks.append(chunk)
                chunk, size = [], system_tokens
            chunk += r
            size += cost
        chunks.append(chunk)
        media_before = _media_counts_per_turn(turns)
        results = []
        for k, chunk in enumerate(chunks):
            first, end = media_before[chunk[0]], media_before[chunk[-1] + 1]
            sub = {**sample, "turns": [turns[t] for t in chunk], "media": sample["media"][first:end]}
            sub_plans = self.profile.plans(sub["media"])
            sub_pieces = self.render(sample["system"], sub["turns"], sub_plans)
            (sub_enc,) = self.encode([sub_pieces])
            results.append(_assemble(f"{sample['sample_id']}-{k}", sub, sub_plans, sub_pieces, sub_enc))
        return results


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: a batch allocates millions of acyclic objects (id
    lists, row dicts) and collections triggered by them cost ~30 % of the stage's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Encoded(NamedTuple):
    ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE where not supervised
    lengths: list[int]  # tokens per piece


def _pair_turns(sample: Mapping[str, Any]) -> tuple[list[Mapping[str, str]], list[Mapping[str, str]]]:
    """A preference pair's two conversations: its turns (the chosen answer last), and the same
    with the rejected answer in place of the last turn."""
    turns = list(sample["turns"])
    return turns, [*turns[:-1], {"role": turns[-1]["role"], "text": sample["rejected"]}]


def _tokens_in(offsets: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The indices of the tokens that start inside one of the character ``ranges``."""
    starts = np.array([start for start, _ in offsets], np.int64)
    inside = np.zeros(len(starts), bool)
    for first, end in ranges:
        inside |= (starts >= first) & (starts < end)
    return np.flatnonzero(inside)


def _append_joined(pieces: list[Piece], media: list[Piece]) -> None:
    """Append a media item's pieces; a text it starts with (InternVL's ``Frame1: ``) joins the
    text before it, as the processor's expanded string is tokenized: one text between two
    special tokens. The joined piece belongs to the item's span; its part from the item is
    never supervised."""
    before = pieces[-1] if pieces else None
    if not media:  # an item its template does not write (Gemma 3's videos)
        return
    first = media[0]
    if first.text is None or before is None or before.text is None or before.turn != first.turn:
        pieces += media
        return
    text = before.text + first.text
    quiet = (*before.quiet, (len(before.text), len(text))) if before.supervised else ()
    pieces[-1] = Piece(text, supervised=before.supervised, span=first.span, turn=first.turn, quiet=quiet)
    pieces += media[1:]


def _assemble(sample_id: str, sample, plans, pieces, enc: Encoded) -> Tokenized:
    result = Tokenized(sample_id, sample["sample_id"], sample["dataset"], enc.ids, enc.labels)
    result.weight = sample.get("weight", 1.0)  # a samples table written before weights has none
    runs: dict[tuple[int, bool], list[int]] = {}  # (media index, its track?) -> offsets of its pad runs
    offset = 0
    for piece, length in zip(pieces, enc.lengths, strict=True):
        if piece.media >= 0:
            runs.setdefault((piece.media, piece.track), []).append(offset)
        offset += length
    result.reordered = list(runs) != sorted(runs)  # media rows follow the tokens
    for (index, track), starts in runs.items():
        plan, source = plans[index], sample["media"][index]
        if track:  # a video's audio track: a clip of the video's file
            plan, source = plan.audio, {**source, "width": None, "height": None}
        result.media.append(_media_row(source, plan, starts))
        if plan.kind == "image":
            result.image_tokens += plan.num_tokens
        elif plan.kind == "video":
            result.video_tokens += plan.num_tokens  # audio tokens: counted with the text's (text_tokens)
    return result


def _truncate(sample, plans, pieces, enc: Encoded, limit: int) -> Tokenized:
    """Keep a prefix of at most ``limit`` tokens: text may be cut, a media span never is."""
    kept, total = 0, 0
    for i, length in enumerate(enc.lengths):
        if total + length <= limit:
            kept, total = i + 1, total + length
            continue
        if pieces[i].span >= 0:  # leave out the part of this span already kept
            while kept and pieces[kept - 1].span == pieces[i].span:
                kept -= 1
                total -= enc.lengths[kept]
        elif pieces[i].text is not None:
            kept, total = i + 1, limit
        break
    lengths = enc.lengths[:kept]
    if kept and sum(lengths) > total:
        lengths[-1] -= sum(lengths) - total
    cut = Encoded(enc.ids[:total], enc.labels[:total], lengths)
    return _assemble(sample["sample_id"], sample, plans, pieces[:kept], cut)


def _media_counts_per_turn(turns: Sequence[Mapping[str, str]]) -> list[int]:
    """counts[t] = media placeholders in turns before t (len(turns) + 1 entries)."""
    counts = [0]
    for turn in turns:
        counts.append(counts[-1] + len(PLACEHOLDER.findall(turn["text"])))
    return counts


def _media_row(source: Mapping[str, Any], plan: MediaPlan, run_starts: Sequence[int]) -> dict:
    offset = run_starts[0]
    return {
        "kind": plan.kind,
        "uri": source["uri"],
        "width": source["width"],
        "height": source["height"],
        "grid_t": plan.grid[0],
        "grid_h": plan.grid[1],
        "grid_w": plan.grid[2],
        "resized_height": plan.resized[0],
        "resized_width": plan.resized[1],
        "token_offset": offset,
        "num_tokens": plan.num_tokens,
        "frame_indices": list(plan.frame_indices) if plan.kind == "video" else None,
        "second_per_grid_t": plan.second_per_grid_t,
        "group_starts": [s - offset for s in run_starts] if len(run_starts) > 1 else None,
    }


def _quarantine(sample: Mapping[str, Any], rejected: Rejected, num_tokens: int | None) -> dict:
    return {
        "sample_id": sample["sample_id"],
        "dataset": sample["dataset"],
        "source_file": sample["source_file"],
        "source_position": sample["source_position"],
        "reason": str(rejected.reason),
        "detail": rejected.detail,
        "num_tokens": num_tokens,
    }


# --- Arrow output ----------------------------------------------------------------------


def to_record_batch(rows: Sequence[Tokenized]) -> pa.RecordBatch:
    """Tokenized rows as one TOKENIZED batch; ids and labels go in as flat int32 buffers."""
    lengths = np.fromiter((len(r.input_ids) for r in rows), np.int32, len(rows))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))

    def flat(arrays: list[np.ndarray]) -> pa.Array:
        values = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return pa.ListArray.from_arrays(offsets, pa.array(values, pa.int32()))

    image = np.fromiter((r.image_tokens for r in rows), np.int32, len(rows))
    video = np.fromiter((r.video_tokens for r in rows), np.int32, len(rows))
    supervised = np.fromiter(((r.labels != IGNORE).sum() for r in rows), np.int32, len(rows))
    columns = {
        "sample_id": pa.array([r.sample_id for r in rows], pa.string()),
        "parent_id": pa.array([r.parent_id for r in rows], pa.string()),
        "dataset": pa.array([r.dataset for r in rows], pa.string()),
        "input_ids": flat([r.input_ids for r in rows]),
        "labels": flat([r.labels for r in rows]),
        "num_tokens": pa.array(lengths),
        "text_tokens": pa.array(lengths - image - video),
        "image_tokens": pa.array(image),
        "video_tokens": pa.array(video),
        "supervised_tokens": pa.array(supervised),
        "media": pa.array([r.media for r in rows], TOKENIZED.field("media").type),
        "pair_side": pa.array([r.pair_side for r in rows], pa.string()),
        "weight": pa.array([r.weight for r in rows], pa.float64()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=TOKENIZED)


_WORKER_TOKENIZERS: dict[str, SampleTokenizer] = {}


def worker_tokenizer(settings: TokenizeSettings) -> SampleTokenizer:
    """The SampleTokenizer of this Python worker for ``settings`` (built on first use)."""
    key = json.dumps(dataclasses.asdict(settings), sort_keys=True)
    if key not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[key] = SampleTokenizer(settings)
        # The imports and the tokenizer leave millions of long-lived objects: move them out of
        # the collector's reach, or every full collection walks them again (~0.3 s a time).
        gc.collect()
        gc.freeze()
    return _WORKER_TOKENIZERS[key]
