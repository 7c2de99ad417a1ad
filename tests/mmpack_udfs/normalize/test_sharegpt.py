import pytest

from mmpack_udfs.config.model import DatasetConfig
from mmpack_udfs.normalize.datasets import specs_of
from mmpack_udfs.normalize.records import parse_record
from mmpack_udfs.normalize.sharegpt import DatasetSpec, sample_id
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
