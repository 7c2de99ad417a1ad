"""The tiktoken port of byte-level BPE tokenizers: identical ids, or not used at all."""

from __future__ import annotations

import copy
import dataclasses
import json
import unicodedata
from pathlib import Path

import pytest

from mmpack_udfs.config import load_config
from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.tokenize import fast
from mmpack_udfs.tokenize import tokenizer as tokenizers
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings


@pytest.fixture(scope="module")
def builtin() -> str:
    return tokenizers.resolve_path(None)


@pytest.fixture(scope="module")
def backend(builtin):
    return tokenizers.load_backend(builtin, tokenizers.json_matches_auto(builtin))


@pytest.fixture(scope="module")
def tokenizer_json(builtin) -> dict:
    return json.loads((Path(builtin) / "tokenizer.json").read_text())


def ids(backend, texts):
    return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]


def test_the_builtin_tokenizer_normalizes_to_nfc_as_qwen2s_does(tokenizer_json, backend):
    assert tokenizer_json["normalizer"] == {"type": "NFC"}
    assert ids(backend, ["cafe\u0301"]) == ids(backend, ["café"])


def test_the_port_equals_tokenizers_on_the_adversarial_corpus(builtin, backend):
    encoder = fast.load(builtin, lambda: backend)
    texts = fast.adversarial_corpus(seed=1)
    assert any(not unicodedata.is_normalized("NFC", t) for t in texts)
    assert any(fast._unknown_to_python().search(t) for t in texts)  # code points newer than Python's
    assert encoder.encode_batch(texts) == ids(backend, texts)


def test_the_port_equals_tokenizers_on_demo_conversations(builtin, backend, tmp_path):
    demo = demo_data.generate(tmp_path, samples=300, seed=3)
    texts = []
    for line in (demo.root / "data" / "sharegpt.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
            texts += [t["value"] for t in record["conversations"] if isinstance(t["value"], str)]
        except (ValueError, KeyError, TypeError):
            continue
    assert len(texts) > 300
    assert fast.load(builtin, lambda: backend).encode_batch(texts) == ids(backend, texts)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda j: j.update(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
        (lambda j: j["model"].update(byte_fallback=True), "byte_fallback"),
        (lambda j: j["model"].update(dropout=0.1), "dropout"),
        (lambda j: j["added_tokens"][0].update(special=False, normalized=True), "not special, with"),
        (lambda j: j["added_tokens"][0].update(special=False, lstrip=True), "not special, with"),
        (lambda j: j["pre_tokenizer"]["pretokenizers"].pop(0), "one regex Split"),
        (lambda j: j["model"]["merges"].reverse(), "merge priority"),
        (lambda j: j.update(model={"type": "WordLevel"}), "not BPE"),
    ],
)
def test_tokenizers_the_port_cannot_compute_are_refused_with_the_reason(tokenizer_json, change, why):
    changed = copy.deepcopy(tokenizer_json)
    change(changed)
    bpe, reason = fast.bpe_of(changed)
    assert bpe is None and why in reason


def test_workers_use_the_port_only_when_the_driver_proved_it(builtin, tmp_path, monkeypatch):
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))
    settings = TokenizeSettings.from_config(load_config())
    assert settings.fast_encoder is True and SampleTokenizer(settings).fast is not None
    checks = list((tmp_path / "cache" / "tokenizer-checks").glob("fast-*.json"))
    assert len(checks) == 1 and json.loads(checks[0].read_text())["identical"] is True

    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "wordlevel"
    folder.mkdir()
    plain.save(str(folder / "tokenizer.json"))
    assert tokenizers.fast_encoder_verified(str(folder), True) is False


def test_a_port_that_disagrees_is_not_used(builtin, backend, tmp_path, monkeypatch):
    class Wrong:
        def encode_batch(self, texts):
            return [[0] for _ in texts]

    monkeypatch.setitem(fast._LOADED, builtin, Wrong())
    assert fast.verified(builtin, lambda: backend, [], "key", tmp_path) is False


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_plain_added_tokens_are_split_out_as_tokenizers_splits_them(name, tmp_path):
    """Qwen3's <think>, <tool_call>, ... are added tokens that are not special: the port splits
    them out of the text and encodes the pieces between them, as tokenizers does."""
    from tests.models.build import build_model_dir

    path = str(build_model_dir(name, tmp_path / name))
    backend = tokenizers.load_backend(path, from_json=False)
    encoder = fast.load(path, lambda: backend)
    assert encoder is not None and "<think>" in encoder.added
    texts = ["<think>\nwhy\n</think>\n\nbecause", "a<tool_call>{}</tool_call>b", "</think></think>"]
    texts += ["x</think", " <think> ", "café<think>e\u0301", "<|im_start|> text <think>", "none"]
    assert encoder.encode_batch(texts) == ids(backend, texts)
    assert tokenizers.fast_encoder_verified(path, tokenizers.json_matches_auto(path))


def test_a_worker_tokenizing_text_only_chat_loads_no_backend(builtin, backend, tmp_path, monkeypatch):
    """With the port proven, the special tokens' ids come from the driver and the recurring
    template strings from the port: the tokenizers backend (~1 s a worker) loads only for a
    text the port hands back (a character unknown to Python), and then gives the same ids."""
    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "cache"))
    settings = TokenizeSettings.from_config(load_config())
    assert dict(settings.special_ids) == {t: backend.token_to_id(t) for t, _ in settings.special_ids}
    fast._LOADED.clear()
    loads = []
    load_backend = tokenizers.load_backend
    monkeypatch.setattr(tokenizers, "load_backend", lambda *a: loads.append(a) or load_backend(*a))
    tokenizer = SampleTokenizer(settings)
    sample = {"sample_id": "s", "dataset": "d", "system": None, "media": [], "rejected": None, "weight": 1.0}
    hello = [{"role": "user", "text": "Hi there"}, {"role": "assistant", "text": "Hello, café!"}]
    newer = [{"role": "user", "text": "\U0001faf8 new"}, hello[1]]  # newer than this Python's Unicode
    assert fast._unknown_to_python().search(newer[0]["text"])
    (plain,), _ = tokenizer.tokenize([{**sample, "turns": hello}])
    assert loads == []
    (slow,), _ = tokenizer.tokenize([{**sample, "turns": newer}])
    assert len(loads) == 1
    reference = SampleTokenizer(dataclasses.replace(settings, fast_encoder=False, special_ids=()))
    for got, turns in ((plain, hello), (slow, newer)):
        (want,), _ = reference.tokenize([{**sample, "turns": turns}])
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.labels.tolist() == want.labels.tolist()


def test_a_saved_bpe_is_the_parsed_one_and_a_broken_file_is_parsed_again(builtin, backend, tmp_path):
    """Workers read the port's BPE from the cache (saved by the directory's content) instead of
    parsing tokenizer.json; what they read is what the parse gives, and an unreadable file
    costs only the parse."""
    parsed, _ = fast.bpe_of(json.loads((Path(builtin) / "tokenizer.json").read_text()))
    fast._LOADED.clear()
    first = fast.load(builtin, lambda: backend, proven=True, cache=tmp_path)
    (saved,) = tmp_path.glob("bpe-*.arrow")
    assert fast.saved_bpe(saved) == parsed
    fast._LOADED.clear()
    again = fast.load(builtin, lambda: backend, proven=True, cache=tmp_path)
    texts = fast.adversarial_corpus(seed=2)
    assert again.encode_batch(texts) == first.encode_batch(texts) == ids(backend, texts)
    saved.write_bytes(saved.read_bytes()[:1000])
    assert fast.saved_bpe(saved) is None
    fast._LOADED.clear()
    assert fast.load(builtin, lambda: backend, proven=True, cache=tmp_path).encode_batch(texts) == ids(
        backend, texts
    )
    assert fast.saved_bpe(saved) == parsed  # saved again
    fast._LOADED.clear()
