"""Preference records (LLaMA-Factory ranking, TRL, OpenAI) → pairs, with images; malformed pairs
quarantined with their reasons. Pure parsing, no Spark."""

from __future__ import annotations

import json

import pytest

from mmpack_udfs.config.model import DatasetConfig
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.normalize.datasets import specs_of
from mmpack_udfs.normalize.preference import parse_preference
from mmpack_udfs.normalize.sharegpt import Conversation, DatasetSpec, parse_record, sample_id
from mmpack_udfs.reasons import Reason, Rejected

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


GOOD = {"prompt": "<image>Q?", "chosen": "A.", "rejected": "B.", "images": ["a.jpg"]}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rejected": None}, Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": "  "}, Reason.PREFERENCE_MISSING_SIDE),
        ({"chosen": []}, Reason.PREFERENCE_MISSING_SIDE),
        ({"rejected": "A."}, Reason.PREFERENCE_IDENTICAL_SIDES),
        ({"chosen": "A. <image>", "images": ["a.jpg", "b.jpg"]}, Reason.PREFERENCE_MEDIA_MISMATCH),
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
