"""A faster encoder for byte-level BPE tokenizers (the Qwen2 family): tiktoken, with ids
proven equal to the ``tokenizers`` backend it replaces.

Three layers keep it exact:

1. **Eligibility** (``bpe_of``): only a tokenizer.json whose model tiktoken computes the
   same way qualifies: BPE without dropout, byte fallback, unknown token or word affixes;
   pre-tokenization = one regex ``Split`` (Isolated) + ``ByteLevel`` without its own regex
   or prefix space; normalizer none or NFC; merge priority in token-id order (tiktoken
   merges by the rank of the result). Special added tokens are encoded as plain text
   (``encode_special_tokens``, as the ``tokenizers`` path does); plain added tokens (Qwen3's
   ``<think>``, ``<tool_call>``: not normalized, no strip or word rules) are split out of
   the text first, as ``tokenizers`` splits them, and the pieces between them encoded.
2. **Normalization per text**: with an NFC normalizer, a text is normalized in Python
   first. Python's Unicode database is older than the Rust one; Unicode's stability policy
   makes both agree on every text of assigned characters only, so a text holding a code
   point Python does not know (category Cn) goes to ``tokenizers`` instead.
3. **Proof** (``verified``): before workers use it, the driver encodes an adversarial
   corpus (non-NFC, combining marks, Hangul jamo, emoji sequences, CJK, long whitespace
   and digit runs, random code points) both ways; the verdict is cached per tokenizer
   directory content and library versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa

from mmpack_udfs.io.cache import cached_verdict, directory_key


@dataclass(frozen=True)
class Bpe:
    """What tiktoken needs of a byte-level BPE tokenizer.json."""

    pattern: str
    ranks: dict[bytes, int]
    nfc: bool
    added: tuple[tuple[str, int], ...] = ()  # plain (not special) added tokens: (text, id)


def _byte_decoder() -> dict[str, int]:
    """ByteLevel's byte ↔ printable-character table, inverted (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def bpe_of(tokenizer_json: dict[str, Any], check_merges: bool = True) -> tuple[Bpe | None, str]:
    """The tiktoken form of a tokenizer.json, or (None, why it does not qualify). Workers skip
    the merge-order check (``check_merges``): the driver made it before proving the port."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')!r} is not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, f"BPE with {key}"
    if model.get("byte_fallback"):
        return None, "BPE with byte_fallback"
    normalizer = tokenizer_json.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None, f"normalizer {normalizer.get('type')!r}"
    steps = (tokenizer_json.get("pre_tokenizer") or {}).get("pretokenizers") or []
    if (
        len(steps) != 2
        or steps[0].get("type") != "Split"
        or "Regex" not in (steps[0].get("pattern") or {})
        or steps[0].get("behavior") != "Isolated"
        or steps[0].get("invert")
        or steps[1].get("type") != "ByteLevel"
        or steps[1].get("add_prefix_space")
        or steps[1].get("use_regex")
    ):
        return None, "pre-tokenizer is not one regex Split + ByteLevel"
    plain = [t for t in tokenizer_json.get("added_tokens") or [] if not t.get("special")]
    if any(t.get(rule) for t in plain for rule in ("normalized", "lstrip", "rstrip", "single_word")):
        return None, "an added token that is not special, with normalization or strip rules"
    decode = _byte_decoder()
    try:
        ranks = {bytes(decode[c] for c in token): rank for token, rank in model["vocab"].items()}
    except KeyError:
        return None, "a vocabulary entry outside ByteLevel's alphabet"
    vocab = model["vocab"]
    merged = [
        vocab.get(pair[0] + pair[1] if isinstance(pair, list) else pair.replace(" ", "", 1))
        for pair in ((model.get("merges") or []) if check_merges else [])
    ]
    if any(r is None for r in merged) or any(a > b for a, b in itertools.pairwise(merged)):
        return None, "merge priority is not token-id order"
    added = tuple((t["content"], t["id"]) for t in plain)
    return Bpe(steps[0]["pattern"]["Regex"], ranks, normalizer is not None, added), ""


@lru_cache(maxsize=1)
def _unknown_to_python() -> re.Pattern:
    """Code points this Python's Unicode database does not assign (Cn), as one character class."""
    ranges, start = [], None
    for code in range(0x80, sys.maxunicode + 1):
        unknown = unicodedata.category(chr(code)) == "Cn"
        if unknown and start is None:
            start = code
        elif not unknown and start is not None:
            ranges.append((start, code - 1))
            start = None
    if start is not None:
        ranges.append((start, sys.maxunicode))
    return re.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges) + "]")


class FastEncoder:
    """``encode_batch(texts) -> list[list[int]]``, equal to the ``tokenizers`` backend it stands
    in for (encoding special-token strings as text), several times faster. ``load_fallback()``
    gives that backend, called only for texts this encoder cannot normalize itself."""

    def __init__(self, bpe: Bpe, load_fallback: Callable[[], Any]) -> None:
        import tiktoken

        self.encoding = tiktoken.Encoding(
            "mmpack-bpe", pat_str=bpe.pattern, mergeable_ranks=bpe.ranks, special_tokens={}
        )
        self.nfc, self.load_fallback = bpe.nfc, load_fallback
        self.added = dict(bpe.added)
        # leftmost-longest, as tokenizers matches added tokens
        longest_first = sorted(self.added, key=len, reverse=True)
        self.split = re.compile("|".join(map(re.escape, longest_first))) if self.added else None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text; a text holding a plain added token is encoded piece by piece."""
        if self.split is None:
            return self._encode_batch(texts)
        holding = [i for i, text in enumerate(texts) if "<" in text and self.split.search(text)]
        if not holding:
            return self._encode_batch(texts)
        skip = set(holding)
        out = self._encode_batch([("" if i in skip else text) for i, text in enumerate(texts)])
        for i in holding:
            out[i] = self._with_added(texts[i])
        return out

    def _with_added(self, text: str) -> list[int]:
        pieces = self.split.split(text)
        tokens = self.split.findall(text)
        encoded = self._encode_batch([p for p in pieces if p])
        ids, next_piece = [], iter(encoded)
        for k, piece in enumerate(pieces):
            if piece:
                ids += next(next_piece)
            if k < len(tokens):
                ids.append(self.added[tokens[k]])
        return ids

    def _encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encode = self.encoding.encode_ordinary  # a thread pool per batch costs more than it saves here
        if not self.nfc:
            return [encode(text) for text in texts]
        prepared: list[str] = []
        slow: list[int] = []  # texts only tokenizers can normalize exactly
        for i, text in enumerate(texts):
            if text.isascii():  # ASCII is NFC
                prepared.append(text)
            elif _unknown_to_python().search(text) is not None:
                slow.append(i)
                prepared.append("")
            else:
                prepared.append(unicodedata.normalize("NFC", text))
        out = [encode(text) for text in prepared]
        if slow:
            exact = self.load_fallback().encode_batch([texts[i] for i in slow], add_special_tokens=False)
            for i, encoding in zip(slow, exact, strict=True):
                out[i] = encoding.ids
        return out


_LOADED: dict[str, FastEncoder | None] = {}


def load(
    path: str, load_fallback: Callable[[], Any], proven: bool = False, cache: Path | None = None
) -> FastEncoder | None:
    """The fast encoder of the tokenizer directory ``path``, once per process (None when its
    tokenizer.json does not qualify). ``load_fallback()``: the backend it stands in for, once
    per process (``tokenizer.load_backend``). ``proven``: the driver has verified it (workers).
    ``cache``: where its BPE is saved by the directory's content (``saved_bpe``), so that a
    worker reads it in milliseconds instead of parsing tokenizer.json (~0.5 s)."""
    if path not in _LOADED:
        saved = cache / f"bpe-{directory_key(path)[:32]}.arrow" if cache is not None else None
        bpe = saved_bpe(saved) if saved is not None and proven else None
        if bpe is None:
            bpe, _ = bpe_of(json.loads((Path(path) / "tokenizer.json").read_text()), check_merges=not proven)
            if bpe is not None and saved is not None:
                save_bpe(bpe, saved)
        _LOADED[path] = FastEncoder(bpe, load_fallback) if bpe is not None else None
    return _LOADED[path]


def save_bpe(bpe: Bpe, file: Path) -> None:
    """Save ``bpe`` as an Arrow file (atomically; a read-only cache only costs the parse)."""
    tokens = list(bpe.ranks)
    table = pa.table(
        {"token": pa.array(tokens, pa.binary()), "rank": pa.array([bpe.ranks[t] for t in tokens], pa.int64())}
    )
    facts = {"pattern": bpe.pattern, "nfc": bpe.nfc, "added": bpe.added}
    table = table.replace_schema_metadata({"bpe": json.dumps(facts)})
    with contextlib.suppress(OSError):
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        tmp.replace(file)


def saved_bpe(file: Path) -> Bpe | None:
    """The BPE ``save_bpe`` saved at ``file``; None when there is none (or it is unreadable)."""
    try:
        with pa.memory_map(str(file)) as source:
            table = pa.ipc.open_file(source).read_all()
        facts = json.loads(table.schema.metadata[b"bpe"])
    except (OSError, pa.ArrowInvalid, KeyError, TypeError, ValueError):
        return None
    ranks = dict(zip(table.column("token").to_pylist(), table.column("rank").to_pylist(), strict=True))
    return Bpe(facts["pattern"], ranks, facts["nfc"], tuple((text, i) for text, i in facts["added"]))


def adversarial_corpus(seed: int = 0) -> list[str]:
    """Texts where a BPE port goes wrong if it can: normalization, marks, scripts, runs."""
    rng = random.Random(seed)
    fixed = [
        "café", "cafe\u0301", "e\u0301\u0302\u0323x", "A\u030a\u0301",  # composed / decomposed
        "\u1100\u1161\u11a8 한국어 \u1112\u1161\u11ab", "\ud7a3\u11c2\u1100\u1175",  # Hangul jamo
        "\u0915\u094d\u0937", "ﬁ ﬀ ℌ ① ｶ", "a\u0308\u0304 ǖ", "Ω Ω Å Å",  # conjuncts, compatibility
        "👩\u200d👩\u200d👧\u200d👦 👍🏽 🏳️\u200d🌈 🇫🇷", "日本語のテキスト、中文文本。",  # emoji ZWJ, CJK
        "   \t\t  \n\n\n   x", " " * 300, "1234567890" * 20, "\r\n\r\n  \r x",  # runs
        "'s 've 'LL 'D don't", "<|im_start|>user\n<|image_pad|>", "\u0000\u0001 control",
        "\u00a0\u2009\u3000 spaces", "\U0001e900\U0001f9cc\U0001faf8 newer code points",
    ]  # fmt: skip
    pools = [
        range(0x20, 0x7F), range(0xA0, 0x250), range(0x300, 0x370), range(0x1100, 0x1200),
        range(0x3040, 0x30FF), range(0x4E00, 0x4F00), range(0xAC00, 0xAD00), range(0x1F300, 0x1FAFF),
        range(0x0900, 0x097F), range(0x1FA70, 0x1FB00), range(0x31350, 0x323B0),  # some unknown to Python
    ]  # fmt: skip
    random_texts = []
    for _ in range(400):
        length = rng.randrange(1, 60)
        chars = [chr(rng.choice(rng.choice(pools))) for _ in range(length)]
        random_texts.append("".join(c for c in chars if not 0xD800 <= ord(c) <= 0xDFFF))
    return fixed + random_texts


def _around_added_tokens(plain: Sequence[str]) -> list[str]:
    """Texts with the directory's ``plain`` (non-special) added tokens in every position: alone,
    repeated, glued to words, whitespace and each other, inside longer tokens' strings."""
    texts = []
    for token in plain:
        texts += [
            token,
            token * 2,
            f"a{token}b",
            f" {token} ",
            f"\n\n{token}\n\n",
            f"x{token[:-1]}",
            f"é{token}ü",
        ]
    texts += ["".join(plain), " ".join(plain), "\n".join(plain) + "\ncafe\u0301"]
    return texts


def verified(
    path: str,
    fallback: Callable[[], Any],
    plain_added: Sequence[str],
    key: str,
    cache: Path,
    extra: Sequence[str] = (),
) -> bool:
    """Whether the fast encoder gives the ids of ``fallback()`` (the backend it stands in for,
    loaded only when there is no verdict) on the adversarial corpus, the texts around the
    directory's ``plain_added`` tokens and ``extra``; the verdict is cached under ``cache`` by
    ``key`` (directory content and library versions)."""
    versions = "|".join(f"{p}={metadata.version(p)}" for p in ("tiktoken", "tokenizers"))
    texts = [*adversarial_corpus(), *extra, *_around_added_tokens(plain_added)]
    corpus = hashlib.sha256(json.dumps([versions, *texts]).encode()).hexdigest()[:16]

    def identical() -> bool:
        backend = fallback()
        encoder = load(path, fallback, cache=cache)
        expected = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return encoder is not None and encoder.encode_batch(texts) == expected

    verdict = cache / f"fast-{key[:32]}-{corpus}.json"
    return cached_verdict(verdict, "identical", identical, path=path, versions=versions)
