import hashlib
import json
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack_udfs.config.model import DatasetConfig
from mmpack_udfs.normalize.datasets import specs_of
from mmpack_udfs.normalize.records import parse_record
from mmpack_udfs.normalize.sharegpt import Conversation, DatasetSpec, _plain_text, sample_id
from mmpack_udfs.reasons import Reason, Rejected

SPEC = DatasetSpec(name="d", paths=("x.jsonl",), media_root="/media")


def sg(*turns, **extra):
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def rejected(record, spec=SPEC) -> Reason:
    with pytest.raises(Rejected) as info:
        parse_record(record, spec)
    return info.value.reason


def test_sharegpt_dialect_with_system_key_and_media_in_placeholder_order():
    record = sg(
        ("human", "<video> then <image> and <image>"),
        ("gpt", "ok"),
        ("human", "more"),
        ("gpt", "done"),
        system="be brief",
        images=["a.jpg", "b.png"],
        videos=["v.mp4"],
    )
    conv = parse_record(record, SPEC)
    assert conv.system == "be brief"
    assert [r for r, _ in conv.turns] == ["user", "assistant", "user", "assistant"]
    assert conv.media == [("video", "v.mp4"), ("image", "a.jpg"), ("image", "b.png")]


def test_openai_dialect_detected_with_system_turn_and_tools():
    record = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "weather?"},
            {"role": "function_call", "content": '{"name": "w"}'},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "image": None,
    }
    conv = parse_record(record, SPEC)
    assert conv.system == "sys"
    assert [r for r, _ in conv.turns] == ["user", "function_call", "tool", "assistant"]


def test_custom_columns_and_tags_with_single_image_string():
    spec = DatasetSpec(
        name="c",
        paths=("x",),
        media_root="/m",
        dialect="sharegpt",
        columns=(("image", "picture"), ("messages", "dialog")),
        tags=(
            ("assistant", ("BOT", "AI")),
            ("content_key", "text"),
            ("role_key", "who"),
            ("user", "USER"),
            ("image_placeholder", "[IMG]"),
        ),
    )
    record = {
        "dialog": [{"who": "USER", "text": "[IMG] hi"}, {"who": "AI", "text": "hello"}],
        "picture": "p.jpg",
    }
    conv = parse_record(record, spec)
    assert conv.turns == [("user", "<image> hi"), ("assistant", "hello")]  # canonical placeholder
    assert conv.media == [("image", "p.jpg")]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], Reason.MALFORMED_RECORD),
        ({"id": 1}, Reason.MISSING_CONVERSATION),
        (sg(), Reason.MISSING_CONVERSATION),
        (sg(("system", "only a system prompt")), Reason.MISSING_CONVERSATION),
        ({"conversations": "text"}, Reason.MALFORMED_TURN),
        ({"conversations": [{"from": "human"}]}, Reason.MALFORMED_TURN),
        (sg(("human", "hi"), ("bard", "x")), Reason.UNKNOWN_ROLE),
        (sg(("human", "hi"), ("human", "again"), ("gpt", "x")), Reason.BROKEN_TURN_ORDER),
        (sg(("gpt", "first"), ("human", "x")), Reason.BROKEN_TURN_ORDER),
        (sg(("human", "hi"), ("gpt", "x"), ("human", "end")), Reason.BROKEN_TURN_ORDER),
        (sg(("human", "hi"), ("system", "late"), ("gpt", "x")), Reason.BROKEN_TURN_ORDER),
        (sg(("system", "a"), ("human", "hi"), ("gpt", "x"), system="b"), Reason.BROKEN_TURN_ORDER),
        (sg(("human", 3), ("gpt", "x")), Reason.NON_STRING_CONTENT),
        (sg(("human", "hi"), ("gpt", None)), Reason.NON_STRING_CONTENT),
        (sg(("human", "hi"), ("gpt", "x"), system=7), Reason.NON_STRING_CONTENT),
        (
            sg(("human", "<image>"), ("gpt", "x"), images=[{"size": 3}]),
            Reason.MALFORMED_MEDIA_FIELD,
        ),
        (sg(("human", "<image>"), ("gpt", "x")), Reason.PLACEHOLDER_MEDIA_MISMATCH),
        (sg(("human", "hi"), ("gpt", "x"), images=["a.jpg"]), Reason.PLACEHOLDER_MEDIA_MISMATCH),
        (
            sg(("human", "<video>"), ("gpt", "x"), images=["a.jpg"]),
            Reason.PLACEHOLDER_MEDIA_MISMATCH,
        ),
    ],
)
def test_bad_records_are_rejected_with_their_reason(record, reason):
    assert rejected(record) == reason


@pytest.mark.parametrize("answer", ["", "   ", "\n\t "])
def test_empty_or_whitespace_assistant_turns_are_quarantined(answer):
    assert rejected(sg(("human", "hi"), ("gpt", answer))) == Reason.EMPTY_ASSISTANT_TURN
    assert rejected(sg(("human", "hi"), ("gpt", answer), ("human", "?"), ("gpt", "ok"))) == (
        Reason.EMPTY_ASSISTANT_TURN
    )


def test_empty_user_turns_are_kept():  # a user may send only media, or nothing to answer to
    assert parse_record(sg(("human", ""), ("gpt", "Hello!")), SPEC).turns[0] == ("user", "")


def test_function_call_may_end_a_conversation():
    conv = parse_record(sg(("human", "x"), ("function_call", "{}")), SPEC)
    assert conv.turns[-1] == ("function_call", "{}")


def test_sample_id_is_a_content_hash():
    a = parse_record(sg(("human", "<image> hi"), ("gpt", "x"), images=["a.jpg"]), SPEC)
    b = parse_record(
        {
            "messages": [
                {"role": "user", "content": "<image> hi"},
                {"role": "assistant", "content": "x"},
            ],
            "images": ["a.jpg"],
        },
        SPEC,
    )
    assert sample_id(a, ["/m/a.jpg"]) == sample_id(b, ["/m/a.jpg"])  # dialect does not matter
    assert sample_id(a, ["/m/a.jpg"]) != sample_id(a, ["/other/a.jpg"])
    assert len(sample_id(a, ["/m/a.jpg"])) == 32


def test_dataset_paths_resolve_against_the_config_directory():
    entry = {"name": "n", "paths": "data/*.jsonl", "media_root": "s3://b/media", "_base_dir": "/cfg"}
    [spec] = specs_of([DatasetConfig.model_validate(entry)]).values()
    assert spec.paths == ("/cfg/data/*.jsonl",)
    assert spec.media_root == "s3://b/media"


@pytest.mark.parametrize("given, weight", [({}, 1.0), ({"weight": None}, 1.0), ({"weight": 0}, 0.0),
                                           ({"weight": 2.5}, 2.5), ({"score": 3}, 3.0)])  # fmt: skip
def test_a_records_loss_weight_is_read_and_none_means_1(given, weight):
    columns = (("weight", "score"),) if "score" in given else ()
    spec = DatasetSpec(name="d", paths=("x.jsonl",), media_root="/media", columns=columns)
    assert parse_record(sg(("human", "q"), ("gpt", "a"), **given), spec).weight == weight


@pytest.mark.parametrize("weight", ["2", -1, float("nan"), float("inf"), True, [1]])
def test_a_loss_weight_that_is_not_a_finite_number_at_least_0_is_quarantined(weight):
    assert rejected(sg(("human", "q"), ("gpt", "a"), weight=weight)) == Reason.INVALID_WEIGHT


def test_preference_pairs_take_no_loss_weight():
    pairs = DatasetSpec(name="d", paths=("x.jsonl",), media_root="/media", ranking=True)
    record = {"conversations": [{"from": "human", "value": "q"}], "chosen": "a", "rejected": "b", "weight": 2}
    assert rejected(record, pairs) == Reason.INVALID_WEIGHT
    entry = {"name": "p", "paths": "x.jsonl", "media_root": "/m", "ranking": True, "loss_weight": 2}
    with pytest.raises(Exception, match="preference pairs take no loss_weight"):
        specs_of([DatasetConfig.model_validate(entry)])


def test_sample_ids_hash_the_compact_json_of_the_content_for_every_code_point():
    """The ids stay those of ``json.dumps(content, ensure_ascii=False, separators=(",", ":"))``
    (an append dedups against tables written before orjson made them)."""
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    conversation = Conversation(system=every, turns=[("user", '"\\\n'), ("assistant", every[::-1])])
    conversation.media, conversation.rejected = [("image", "x"), ("audio", "y")], "no"
    content = {
        "system": every,
        "turns": [["user", '"\\\n'], ["assistant", every[::-1]]],
        "media": [["image", "/m/a.png"], ["audio", "sha256:ab"]],
        "rejected": "no",
    }
    canonical = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    assert sample_id(conversation, ["/m/a.png", "sha256:ab"]) == hashlib.sha256(canonical).hexdigest()[:32]


def test_a_plain_text_record_takes_the_short_path():
    record = sg(("system", "Be brief."), ("human", "hi"), ("gpt", "hello"), images=[])
    conversation = _plain_text(record, SPEC.mapping("sharegpt"))
    assert conversation == Conversation(system="Be brief.", turns=[("user", "hi"), ("assistant", "hello")])
    assert _plain_text(sg(("human", "<image> hi"), ("gpt", "x")), SPEC.mapping("sharegpt")) is None


OWN_PLACEHOLDER = DatasetSpec(
    name="p", paths=("x.jsonl",), media_root="/m", tags=(("image_placeholder", "[img]"),)
)
TAGS = st.sampled_from(["human", "gpt", "system", "observation", "function_call", "user", "bot", None, 3])
TEXTS = st.one_of(
    st.sampled_from(["", " \n", "hi", "<image>", "a [img] b", "<video>x", "<audio>", "<imag>"]),
    st.text(max_size=8),
    st.integers(),
    st.lists(st.just({"type": "text", "text": "part"}), max_size=2),
    st.none(),
)
OPTIONAL = {
    "system": st.one_of(st.none(), st.sampled_from(["", "sys", "<image>"]), st.integers()),
    "images": st.one_of(st.none(), st.just([]), st.just(["a.png"]), st.just("a.png"), st.just({})),
    "videos": st.one_of(st.none(), st.just([]), st.just(["v.mp4"])),
    "weight": st.one_of(st.none(), st.sampled_from([0, 2.5, -1, "1", True])),
}


@st.composite
def records(draw) -> dict:
    """A well-formed conversation (a system turn or not, 1-3 rounds), then maybe spoiled: a
    turn's text, tag or shape replaced, the list cut; media, system and weight keys added."""
    plain = st.one_of(st.sampled_from(["hi", "a b"]), st.text(max_size=6))
    turns = [{"from": "system", "value": draw(plain)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        turns += [{"from": "human", "value": draw(plain)}, {"from": "gpt", "value": draw(plain)}]
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(turns) - 1))
        turn, spoil = turns[at], draw(st.sampled_from(["text", "text", "tag", "no text", "not a turn"]))
        if not isinstance(turn, dict):
            continue
        if spoil == "text":
            turn["value"] = draw(TEXTS)
        elif spoil == "tag":
            turn["from"] = draw(TAGS)
        elif spoil == "no text":
            turn.pop("value", None)
        else:
            turns[at] = "turn"
    turns = turns[: draw(st.integers(0, len(turns)))] if draw(st.booleans()) else turns
    extra = draw(st.fixed_dictionaries({}, optional=OPTIONAL))
    return {"conversations": draw(st.sampled_from([turns, turns, None, {}])), **extra}


def _outcome(record, spec):
    try:
        return parse_record(record, spec)
    except Rejected as err:
        return err.reason, err.detail


@settings(max_examples=600, deadline=None)
@given(record=records(), spec=st.sampled_from([SPEC, OWN_PLACEHOLDER]))
def test_the_short_path_reads_every_record_as_the_general_path_does(record, spec):
    """Records near the plain-text shape, read with and without ``_plain_text``: the same
    conversation, or the same reason and detail."""
    short = _outcome(record, spec)
    with mock.patch("mmpack_udfs.normalize.sharegpt._plain_text", return_value=None):
        general = _outcome(record, spec)
    assert short == general
