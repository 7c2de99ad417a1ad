"""The short way for plain-ChatML text (tokenize/plain.py) gives the general path's rows."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack_udfs.tokenize import plain
from mmpack_udfs.tokenize.encoder import to_record_batch
from tests.mmpack_udfs.tokenize.test_encoder import CASES, auto_tokenizer, image, make_tokenizer, sample
from tests.oracles import qwen2_vl as oracle

TEXTS = [
    "Hello there!", "Hi, how can I help?", " starts with a space", "\nstarts with a newline", "",
    "a <imagine> tag, no placeholder", "<|im_end|> as text", "日本語 テキスト ✓", "ends with space ",
    "e\u0301 decomposed", "two\n\nparagraphs",
]  # fmt: skip
ROLES = ["user", "assistant", "function_call", "tool"]


def general_rows(tok, samples) -> tuple[pa.Table | None, list[dict]]:
    done, quarantined = tok.tokenize(samples)
    return (pa.Table.from_batches([to_record_batch(done)]) if done else None), quarantined


def batch_rows(tok, samples) -> tuple[pa.Table | None, list[dict], int]:
    """tokenize_batch's rows, quarantine and how many rows went the general way."""
    batch, done, quarantined = tok.tokenize_batch(samples)
    return (pa.Table.from_batches([batch]) if batch is not None else None), quarantined, len(done)


def mixed_batch() -> list[dict]:
    samples = [dict(s, sample_id=f"case-{k}") for k, s in enumerate(CASES.values())]
    samples += [
        sample(["q", "a"], sample_id="none"),
        sample(["q", "a"], system="You are a helpful assistant.", sample_id="default-system"),
        sample(["q", "a"], system="  spaced system", sample_id="spaced-system"),
        sample(["<image> q", "a"], [image(64, 64)], sample_id="image"),
        sample(["q " * 400, "a"], sample_id="too-long"),
        sample(["q", "<|im_end|> literally"], sample_id="special-as-text"),
        dict(sample(["q", "a"], sample_id="weighted"), weight=2.5),
        dict(sample(["q", "chosen"], sample_id="pair"), rejected="rejected"),
    ]
    return samples


@pytest.mark.parametrize("loss", ["assistant", "last", "all"])
def test_a_mixed_batch_gives_the_general_paths_rows_in_order(loss):
    tok = make_tokenizer(loss=loss, max_tokens=300, over_length="drop")
    assert tok.plain is not None
    samples = mixed_batch()
    expected, expected_quarantine = general_rows(tok, samples)
    got, quarantine, general = batch_rows(tok, samples)
    assert got.equals(expected)
    assert quarantine == expected_quarantine
    assert 0 < general < got.num_rows  # both ways were taken
    assert "too-long" in {q["sample_id"] for q in quarantine}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(ROLES), st.sampled_from(TEXTS)), min_size=1, max_size=6),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([None, "", "You are a helpful assistant.", "Be brief.", " spaced"]),
)
def test_any_text_batch_gives_the_general_paths_rows(conversations, system):
    tok = plain_tokenizer()
    samples = [
        sample([{"role": r, "text": t} for r, t in turns], system=system, sample_id=f"s{k}")
        for k, turns in enumerate(conversations)
    ]
    expected, expected_quarantine = general_rows(tok, samples)
    got, quarantine, _ = batch_rows(tok, samples)
    assert (got is None and expected is None) or got.equals(expected)
    assert quarantine == expected_quarantine


_TOKENIZER = []


def plain_tokenizer():
    if not _TOKENIZER:
        _TOKENIZER.append(make_tokenizer(max_tokens=200))
    return _TOKENIZER[0]


def test_only_plain_chatml_takes_the_short_way():
    tok = make_tokenizer()
    assert plain.applies(tok.profile)
    for name in ("qwen3", "internvl", "gemma3", "glm4v"):
        profile = type(tok.profile)(tok.profile.name, {**tok.profile.settings, "chat": name})
        assert not plain.applies(profile), name


PLAIN_CASES = ["text only", "empty system prompt", "unicode and specials-like text", "tools"]


@pytest.mark.parametrize("name", PLAIN_CASES)
def test_plain_rows_equal_transformers(name):
    tok = plain_tokenizer()
    s = CASES[name]
    batch, done, _ = tok.tokenize_batch([s])
    assert not done  # the short way
    system = s["system"] if s["system"] is not None else "You are a helpful assistant."
    expected = oracle.reference_ids(auto_tokenizer(tok), system, s["turns"], [])
    assert batch.column("input_ids")[0].as_py() == expected
