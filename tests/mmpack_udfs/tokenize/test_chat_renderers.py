"""Each family's renderer against the published chat template it was chosen for, beyond the
driver's probes: conversations with reasoning blocks in every position, tool turns, media
in every turn, whitespace at every edge, and seeded random ones."""

from __future__ import annotations

import random

import pytest

from mmpack_udfs.families import model_dir
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.resolve import load_run
from mmpack_udfs.tokenize.encoder import IGNORE, SampleTokenizer, TokenizeSettings
from mmpack_udfs.tokenize.template_check import _template_plan, template_ids
from tests.models.build import build_model_dir

DIRECTORIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_thinking", "qwen3_5")


@pytest.fixture(scope="module")
def renderers(tmp_path_factory):
    """Per model directory: (our SampleTokenizer, its HF tokenizer, its chat template)."""
    root = tmp_path_factory.mktemp("renderers")
    out = {}
    for name in DIRECTORIES:
        path = build_model_dir(name, root / name)
        config = load_run(None, [f"tokenize.model={path}", "tokenize.max_tokens=1000000"]).config
        tokenizer = SampleTokenizer(TokenizeSettings.from_config(config))
        out[name] = (tokenizer, load_tokenizer(str(path)), model_dir.chat_template(str(path)))
    return out


def turns(*pairs):
    return [{"role": role, "text": text} for role, text in pairs]


CASES = [
    (
        None,
        turns(
            ("user", "a"),
            ("assistant", "<think>r1</think>b"),
            ("user", "c"),
            ("assistant", "<think>\n\nr2\n\n</think>\n\nd"),
        ),
    ),
    (None, turns(("user", "q"), ("assistant", "\n\n\nanswer with leading newlines"))),
    ("sys ", turns(("user", " <image> look "), ("assistant", "</think>only a closing tag"))),
    (None, turns(("user", "<video>\n<image>"), ("assistant", "a <think>inside</think> the text"))),
    (
        None,
        turns(
            ("user", "x"),
            ("function_call", '{"name": "f"}'),
            ("tool", "<image> result"),
            ("assistant", "done"),
        ),
    ),
    (
        None,
        turns(("user", "x"), ("function_call", "call"), ("tool", "r1"), ("assistant", "<think>t</think>ok")),
    ),
    (
        "",
        turns(
            ("user", "<tool_response>\nnot a query\n</tool_response>"),
            ("assistant", "hmm"),
            ("user", "real"),
            ("assistant", "yes"),
        ),
    ),
    (
        None,
        turns(
            ("user", "tabs\tand  spaces  "), ("assistant", "  spaced  "), ("user", "\n"), ("assistant", "\t")
        ),
    ),
]


def random_case(rng: random.Random):
    words = [
        "hello",
        " world",
        "\n",
        "\n\n",
        "  ",
        "<image>",
        "<think>",
        "</think>",
        "ok.",
        "数据",
        "é",
        "\t",
    ]
    out = []
    for _ in range(rng.randrange(1, 4)):
        out.append(("user", "".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))))
        text = "".join(rng.choice([w for w in words if w != "<image>"]) for _ in range(rng.randrange(1, 6)))
        out.append(("assistant", text if text.strip() else "x"))
    system = rng.choice([None, "", " s ", "be brief"])
    return system, turns(*out)


@pytest.mark.parametrize("name", DIRECTORIES)
def test_renderer_gives_the_templates_ids(renderers, name):
    tokenizer, hf, template = renderers[name]
    rng = random.Random(7)
    cases = CASES + [random_case(rng) for _ in range(60)]
    compared = 0
    for system, conversation in cases:
        text = "".join(t["text"] for t in conversation)
        plans = [_template_plan(m) for m in _placeholders(text)]
        try:
            expected = template_ids(hf, template, system, conversation)
        except Exception as err:  # the template itself refuses this shape (Qwen3.5: no user query)
            assert type(err).__name__ == "TemplateError", err
            continue
        (ours,) = tokenizer.encode([tokenizer.render(system, conversation, plans)])
        assert ours.ids.tolist() == expected, (system, conversation)
        compared += 1
    assert compared >= 60


def _placeholders(text: str) -> list[str]:
    import re

    return re.findall(r"<image>|<video>", text)


def test_thinking_templates_supervise_the_think_block_with_its_answer(renderers):
    tokenizer, hf, _ = renderers["qwen3_vl_thinking"]
    conversation = turns(("user", "q"), ("assistant", "<think>why</think>because"))
    (encoded,) = tokenizer.encode([tokenizer.render(None, conversation, [])])
    supervised = hf.decode(
        [i for i, label in zip(encoded.ids, encoded.labels, strict=True) if label != IGNORE]
    )
    assert supervised == "<think>\nwhy\n</think>\n\nbecause<|im_end|>"
