"""Preference records (LLaMA-Factory ranking, TRL, OpenAI) → pairs, with images; malformed pairs
quarantined with their reasons. Pure parsing, no Spark."""

from __future__ import annotations

import json

import pytest

from mmpack_udfs.config.model import DatasetConfig
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.normalize import media, records
from mmpack_udfs.normalize.datasets import specs_of
from mmpack_udfs.normalize.preference import parse_preference
from mmpack_udfs.normalize.records import parse_record
from mmpack_udfs.normalize.sharegpt import Conversation, DatasetSpec, sample_id
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import NORMALIZED, ROW_KIND_SAMPLE

RANKING = DatasetSpec(name="prefs", paths=("x",), media_root="/m", ranking=True)
EXPECTED = Conversation(
    system="Be brief.",
    turns=[("user", "<image>What colour is the car?"), ("assistant", "Red.")],
    media=[("image", "cars/1.jpg")],
    rejected="Blue.",
)


def test_llamafactory_sharegpt_ranking_record():
    record = {
        "conversations": [{"from": "human", "value": "<image>What colour is the car?"}],
        "chosen": {"from": "gpt", "value": "Red."},
        "rejected": {"from": "gpt", "value": "Blue."},
        "system": "Be brief.",
        "images": ["cars/1.jpg"],
    }
    assert parse_preference(record, RANKING) == EXPECTED


def test_llamafactory_alpaca_ranking_record_with_history():
    record = {"instruction": "And now?", "history": [["Hi", "Hello!"]], "chosen": "Fine.", "rejected": "Bad."}
    spec = DatasetSpec(name="p", paths=("x",), media_root="/m", dialect="alpaca", ranking=True)
    assert parse_preference(record, spec) == Conversation(
        system=None,
        turns=[("user", "Hi"), ("assistant", "Hello!"), ("user", "And now?"), ("assistant", "Fine.")],
        rejected="Bad.",
    )


def test_trl_record_with_content_parts_and_images_alongside():
    record = {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What colour is the car?"}],
            },
        ],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
        "rejected": [{"role": "assistant", "content": "Blue."}],
        "images": ["cars/1.jpg"],
    }
    assert parse_preference(record, RANKING) == EXPECTED


def test_trl_string_prompt_and_the_implicit_prompt_form():
    plain = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}
    assert parse_preference(plain, RANKING) == Conversation(
        system=None, turns=[("user", "Hi?"), ("assistant", "Hello.")], rejected="Go away."
    )
    ask = [{"role": "user", "content": "Hi?"}]
    implicit = {
        "chosen": [*ask, {"role": "assistant", "content": "Hello."}],
        "rejected": [*ask, {"role": "assistant", "content": "Go away."}],
    }
    assert parse_preference(implicit, RANKING) == parse_preference(plain, RANKING)
    differ = {**implicit, "rejected": [{"role": "user", "content": "Other?"}, implicit["rejected"][1]]}
    with pytest.raises(Rejected) as caught:
        parse_preference(differ, RANKING)
    assert caught.value.reason == Reason.MALFORMED_TURN


def test_openai_preference_fine_tuning_record():
    record = {
        "input": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>What colour is the car?"},
            ]
        },
        "preferred_output": [{"role": "assistant", "content": "Red."}],
        "non_preferred_output": [{"role": "assistant", "content": "Blue."}],
        "images": ["cars/1.jpg"],
    }
    assert parse_preference(record, RANKING) == EXPECTED


def test_llamafactory_openai_formatting_with_string_answers_and_parse_record_dispatch():
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image>What colour is the car?"},
        ],
        "chosen": {"role": "assistant", "content": "Red."},
        "rejected": "Blue.",
        "images": ["cars/1.jpg"],
    }
    assert parse_record(record, RANKING) == parse_preference(record, RANKING) == EXPECTED
    with pytest.raises(Rejected) as caught:  # the same record as an SFT conversation
        parse_record(record, DatasetSpec(name="d", paths=("x",), media_root="/m"))
    assert caught.value.reason == Reason.BROKEN_TURN_ORDER


def test_llamafactory_alpaca_ranking_record_with_system_and_images_auto_detected():
    record = {"instruction": "<image>What colour is the car?", "system": "Be brief.", "chosen": "Red.",
              "rejected": "Blue.", "images": ["cars/1.jpg"]}  # fmt: skip
    assert parse_record(record, RANKING) == EXPECTED


def test_trl_implicit_prompt_with_content_parts_and_images():
    ask = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the car?"}]},
    ]
    record = {
        "chosen": [*ask, {"role": "assistant", "content": "Red."}],
        "rejected": [*ask, {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}],
        "images": ["cars/1.jpg"],
    }
    assert parse_record(record, RANKING) == EXPECTED


def test_renamed_columns_tags_and_placeholders_apply_to_pairs():
    spec = DatasetSpec(
        name="p", paths=("x",), media_root="/m", dialect="sharegpt", ranking=True,
        columns=(("chosen", "better"), ("images", "pics"), ("messages", "dialog"), ("rejected", "worse")),
        tags=(("assistant", "bot"), ("content_key", "text"), ("image_placeholder", "[img]"),
              ("role_key", "speaker"), ("user", "me")),
    )  # fmt: skip
    record = {
        "dialog": [{"speaker": "me", "text": "[img]What colour is the car?"}],
        "better": {"speaker": "bot", "text": "Red."},
        "worse": "Blue.",
        "system": "Be brief.",
        "pics": ["cars/1.jpg"],
    }
    assert parse_record(record, spec) == EXPECTED
    with pytest.raises(Rejected) as caught:  # the answer's role is not the assistant tag
        parse_record({**record, "worse": {"speaker": "me", "text": "Blue."}}, spec)
    assert caught.value.reason == Reason.BROKEN_TURN_ORDER


def _openai_answer(ref: str, text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                              {"type": "text", "text": text}]}]  # fmt: skip


def test_inline_media_in_the_answers_must_be_the_same_on_both_sides():
    record = {
        "input": {"messages": [{"role": "user", "content": "Which is the car?"}]},
        "preferred_output": _openai_answer("cars/1.jpg", "This one."),
        "non_preferred_output": _openai_answer("cars/1.jpg", "None of them."),
    }
    pair = parse_record(record, RANKING)
    assert pair.media == [("image", "cars/1.jpg")] and pair.turns[-1] == ("assistant", "<image>This one.")
    assert pair.rejected == "<image>None of them."
    with pytest.raises(Rejected) as caught:
        parse_record({**record, "non_preferred_output": _openai_answer("cars/2.jpg", "No.")}, RANKING)
    assert caught.value.reason == Reason.PREFERENCE_MEDIA_MISMATCH


GOOD = {"prompt": "<image>Q?", "chosen": "A.", "rejected": "B.", "images": ["a.jpg"]}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rejected": None}, Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": "  "}, Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": []}, Reason.PREFERENCE_MISSING_SIDE),
        ({"rejected": "A."}, Reason.PREFERENCE_IDENTICAL_SIDES),
        ({"chosen": "A. <image>", "images": ["a.jpg", "b.jpg"]}, Reason.PREFERENCE_MEDIA_MISMATCH),
        ({"chosen": "<image> A.", "rejected": "<video> B."}, Reason.PREFERENCE_MEDIA_MISMATCH),
        ({"chosen": "<image><video> A.", "rejected": "<video><image> B."}, Reason.PREFERENCE_MEDIA_MISMATCH),
        ({"chosen": {"role": "assistant", "content": ""}}, Reason.PREFERENCE_MISSING_SIDE),
        ({"rejected": {"role": "assistant", "content": None}}, Reason.PREFERENCE_MISSING_SIDE),
        ({"rejected": " \n"}, Reason.PREFERENCE_MISSING_SIDE),
        ({"rejected": [{"role": "assistant", "content": [{"type": "text", "text": " "}]}]},
         Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": [{"role": "assistant", "content": [{"type": "text", "text": ""}]}]},
         Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": [{"role": "assistant", "content": "A."}] * 2}, Reason.MALFORMED_TURN),
        ({"chosen": [{"role": "user", "content": "A."}]}, Reason.BROKEN_TURN_ORDER),
        ({"prompt": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "x"}]},
         Reason.BROKEN_TURN_ORDER),  # the prompt must end with a user turn
        ({"images": []}, Reason.PLACEHOLDER_MEDIA_MISMATCH),
    ],
)  # fmt: skip
def test_malformed_pairs_are_rejected_with_their_reason(change, reason):
    with pytest.raises(Rejected) as caught:
        parse_preference({**GOOD, **change}, RANKING)
    assert caught.value.reason == reason


def test_an_sft_record_in_a_ranking_dataset_lacks_its_sides():
    record = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    with pytest.raises(Rejected) as caught:
        parse_preference(record, RANKING)
    assert caught.value.reason == Reason.PREFERENCE_MISSING_SIDE


def test_media_in_both_answers_alike_is_one_set_of_media():
    record = {**GOOD, "chosen": "See <image>.", "rejected": "Not <image>.", "images": ["a.jpg", "b.jpg"]}
    pair = parse_preference(record, RANKING)
    assert pair.media == [("image", "a.jpg"), ("image", "b.jpg")] and pair.rejected == "Not <image>."


@pytest.mark.parametrize(
    "record",
    [
        {"input": {"messages": [{"role": "user", "content": "Q"}]}, "preferred_output": "A"},
        {"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"}},
        {"instruction": "Q", "rejected": "B"},
        {"prompt": "Q"},
    ],
)
def test_a_pair_without_one_side_in_any_form_is_missing_a_side(record):
    with pytest.raises(Rejected) as caught:
        parse_record(record, RANKING)
    assert caught.value.reason == Reason.PREFERENCE_MISSING_SIDE


def test_a_pair_becomes_one_sample_row_with_its_rejected_answer_and_its_image_once(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "car.jpg")
    specs = {
        "dpo": DatasetSpec(name="dpo", paths=("x",), media_root=str(tmp_path), ranking=True),
        "sft": DatasetSpec(name="sft", paths=("x",), media_root=str(tmp_path)),
    }
    normalizer = records.RecordNormalizer(specs, records.NormalizeSettings(media.ProbeSettings()))

    def row(dataset: str, record: dict) -> dict:
        return normalizer({"dataset": dataset, "source_file": "/in/x.jsonl", "source_position": 0,
                           "raw": json.dumps(record), "error": None, "records_read": None})  # fmt: skip

    ask = "<image>What colour?"
    pair = row("dpo", {"prompt": ask, "chosen": "Red.", "rejected": "Blue.", "images": ["car.jpg"]})
    assert pair["kind"] == ROW_KIND_SAMPLE and set(pair) <= set(NORMALIZED.names), pair
    assert pair["turns"] == [{"role": "user", "text": ask}, {"role": "assistant", "text": "Red."}]
    assert pair["rejected"] == "Blue."
    assert [(m["kind"], m["width"], m["height"]) for m in pair["media"]] == [("image", 64, 48)]
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": "Red."}]
    sft = row("sft", {"messages": messages, "images": ["car.jpg"]})
    assert sft["rejected"] is None and sft["turns"] == pair["turns"] and sft["media"] == pair["media"]
    assert sft["sample_id"] != pair["sample_id"]


def test_ranking_and_sft_entries_in_one_config_are_refused_naming_both():
    entries = [
        DatasetConfig.model_validate(
            {"name": "dpo", "paths": ["dpo.jsonl"], "media_root": "m", "ranking": True}
        ),
        DatasetConfig.model_validate({"name": "sft", "paths": ["sft.jsonl"], "media_root": "m"}),
    ]
    with pytest.raises(ConfigError, match=r"dpo hold preference pairs .* and sft SFT"):
        specs_of(entries)
    assert all(spec.ranking for spec in specs_of(entries[:1]).values())


def test_the_rejected_answer_enters_the_id_and_sft_ids_are_unchanged():
    sft = parse_record({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
                       DatasetSpec(name="d", paths=("x",), media_root="/m"))  # fmt: skip
    assert sample_id(sft, []) == "fc6f06b634504b613006700a18636a51"  # the id before pairs existed
    pair = parse_preference({"prompt": "Q", "chosen": "A", "rejected": "B"}, RANKING)
    other = parse_preference({"prompt": "Q", "chosen": "A", "rejected": "C"}, RANKING)
    assert len({sample_id(sft, []), sample_id(pair, []), sample_id(other, [])}) == 3


def test_ranking_dataset_info_entries_and_the_mixed_run_refusal(tmp_path):
    info = {
        "dpo": {"file_name": "dpo.jsonl", "ranking": True, "formatting": "sharegpt",
                "columns": {"messages": "conversations", "chosen": "better", "rejected": "worse"}},
        "sft": {"file_name": "sft.jsonl", "formatting": "sharegpt"},
    }  # fmt: skip
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    entry = DatasetConfig.model_validate({"name": "lf", "dataset_info": str(tmp_path), "names": ["dpo"]})
    (spec,) = specs_of([entry]).values()
    assert spec.ranking and dict(spec.columns)["chosen"] == "better"
    record = {"conversations": [{"from": "human", "value": "Q"}], "better": {"from": "gpt", "value": "A"},
              "worse": {"from": "gpt", "value": "B"}}  # fmt: skip
    assert parse_preference(record, spec).rejected == "B"
    mixed = DatasetConfig.model_validate(
        {"name": "lf", "dataset_info": str(tmp_path), "names": ["dpo", "sft"]}
    )
    with pytest.raises(ConfigError, match="a pack holds one kind"):
        specs_of([mixed])


def test_the_preference_demo_parses_and_holds_a_bad_pair_per_reason(tmp_path):
    from mmpack_udfs.config import load_config
    from mmpack_udfs.demo import preference

    demo = preference.generate(tmp_path, pairs=30, seed=1)
    specs = specs_of(load_config(demo.config).datasets)
    files = {"llamafactory/ranking": "ranking.jsonl", "trl": "trl.jsonl", "openai": "openai_preference.jsonl"}
    assert set(specs) == set(files) and all(s.ranking for s in specs.values())
    good, reasons = 0, []
    for name, file in files.items():
        for line in (demo.root / "data" / file).read_text().splitlines():
            try:
                pair = parse_preference(json.loads(line), specs[name])
            except Rejected as rejected:
                reasons.append(rejected.reason)
                continue
            good += 1
            assert pair.rejected and pair.rejected != pair.turns[-1][1]
    assert good == 30 and good + len(reasons) == demo.records
    assert sorted(reasons) == sorted(
        [Reason.PREFERENCE_MISSING_SIDE, Reason.PREFERENCE_IDENTICAL_SIDES, Reason.PREFERENCE_MEDIA_MISMATCH]
        * 3
    )
