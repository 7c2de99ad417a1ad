"""Proof, on the driver, that mmpack renders conversations as the model's own chat template.

mmpack renders conversations itself, a batch at a time, special tokens by id
(``SampleTokenizer.render``). For a model directory (``tokenize.model``), the driver renders
probe conversations (with and without a system prompt, multi-turn, images at every place,
whitespace at the edges, reasoning blocks, tool turns) twice: with the directory's chat
template and tokenizer as transformers does, and with each renderer the family knows
(``Family.chat_modes``). The first renderer whose ids are identical on every probe is the
one the run uses; if none is, the run is refused naming the first difference. Media are
compared at the template's level (``Family.template_layout``: the processor's expansion of an
item is the family's and is tested against the processors).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import MediaPlan
from mmpack_udfs.reasons import Reason, Rejected
from mmpack_udfs.schemas import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, MEDIA_PLACEHOLDER, VIDEO_PLACEHOLDER

PLACEHOLDER = MEDIA_PLACEHOLDER
Turns = list[dict[str, str]]


def _turns(*pairs: tuple[str, str]) -> Turns:
    return [{"role": role, "text": text} for role, text in pairs]


PROBES: list[tuple[str | None, Turns]] = [
    (None, _turns(("user", "Hi"), ("assistant", "Hello."))),
    ("Be brief.", _turns(("user", "<image>What is it?"), ("assistant", "A cat."))),
    (
        None,
        _turns(
            ("user", "Compare <image> and <image>"),
            ("assistant", " Both are red.\n"),
            ("user", "\nAnd this?<video>"),
            ("assistant", "Blue."),
        ),
    ),
    (" You answer in French. ", _turns(("user", "  spaced  "), ("assistant", "\n\nOui. "))),
    (
        None,
        _turns(
            ("user", "Think first."),
            ("assistant", "<think>\nPlan.\n</think>\n\nDone."),
            ("user", "Again"),
            ("assistant", "<think>Short.</think>Yes."),
        ),
    ),
    (
        None,
        _turns(
            ("user", "Weather?"),
            ("function_call", '{"name": "weather", "arguments": {}}'),
            ("tool", '{"temp": 20}'),
            ("assistant", "It is 20 degrees."),
        ),
    ),
]


def messages(
    system: str | None, turns: Sequence[Mapping[str, str]], parts_only: bool = False
) -> list[dict[str, Any]]:
    """mmpack's conversation as chat-template messages: placeholders become content parts;
    ``parts_only``: every content a list of parts (templates that read nothing else)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append(
            {"role": "system", "content": [{"type": "text", "text": system}] if parts_only else system}
        )
    for turn in turns:
        role = "assistant" if turn["role"] == "function_call" else turn["role"]
        parts = [p for p in PLACEHOLDER.split(turn["text"]) if p]
        if not PLACEHOLDER.search(turn["text"]) and not parts_only:
            out.append({"role": role, "content": turn["text"]})
            continue
        content = [_part(p) if PLACEHOLDER.fullmatch(p) else {"type": "text", "text": p} for p in parts]
        out.append({"role": role, "content": content})
    return out


def _part(placeholder: str) -> dict[str, str]:
    """A media item as a content part; a clip also by its key (Qwen2-Audio's published template
    finds clips by ``'audio' in content``)."""
    kind = placeholder[1:-1]
    return {"type": kind, "audio": "clip.wav"} if kind == "audio" else {"type": kind}


def template_ids(
    hf_tokenizer,
    template: str,
    system: str | None,
    turns: Sequence[Mapping[str, str]],
    parts_only: bool = False,
) -> list[int]:
    """The ids transformers gives: the template rendered, then the tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    conversation = messages(system, turns, parts_only)
    rendered, _ = render_jinja_template(  # the special tokens as apply_chat_template passes them
        conversations=[conversation], chat_template=template, **hf_tokenizer.special_tokens_map
    )
    return hf_tokenizer(rendered[0], add_special_tokens=False).input_ids


def default_system(template: str) -> str:
    """The system prompt a template adds to a conversation that has none ('' if none)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]],
        chat_template=template,
    )
    match = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", rendered[0], re.DOTALL)
    return match.group(1) if match else ""


def chosen_renderer(settings, template: str, source: str) -> str:
    """The name of the family renderer that reproduces ``template`` on every probe; a
    ConfigError naming the first difference when none does."""
    from mmpack_udfs.families import make_family
    from mmpack_udfs.families.model_dir import load_tokenizer
    from mmpack_udfs.tokenize.encoder import SampleTokenizer

    hf = load_tokenizer(settings.tokenizer_path)
    family = make_family(settings.profile_name, settings.profile)
    differences = []
    for mode in family.chat_modes:
        candidate = dataclasses.replace(settings, profile={**settings.profile, "chat": mode})
        try:
            sample_tokenizer = SampleTokenizer(candidate)
        except ValueError as err:  # the tokenizer lacks a token this renderer inserts
            differences.append(f"{mode}: {err}")
            continue
        difference = _first_difference(sample_tokenizer, hf, template)
        if difference is None:
            return mode
        differences.append(f"{mode}: {difference}")
    raise ConfigError(
        f"tokenize.model: the chat template of {source} renders conversations in a way mmpack does not "
        f"reproduce ({'; '.join(differences)}); mmpack refuses rather than train on other tokens"
    )


def _first_difference(sample_tokenizer, hf, template: str) -> str | None:
    compared = 0
    probes = [
        (system, turns)
        for system, probe in PROBES
        for turns in _for_modalities(probe, sample_tokenizer.profile.modalities)
    ]
    for system, turns in probes:
        plans = [_template_plan(m) for m in PLACEHOLDER.findall("".join(t["text"] for t in turns))]
        try:
            expected = template_ids(hf, template, system, turns, sample_tokenizer.profile.content_parts)
        except Exception as err:  # the template refuses this shape: not a difference of ours
            if type(err).__name__ == "TemplateError":
                continue
            raise
        closing = sample_tokenizer.profile.chat.closing_token  # the template leaves the last turn open
        if closing is not None:
            expected = [*expected, hf.convert_tokens_to_ids(closing)]
        try:
            pieces = sample_tokenizer.render(system, turns, plans, as_template=True)
            (ours,) = sample_tokenizer.encode([pieces])
        except Rejected as rejected:
            if rejected.reason == Reason.TEMPLATE_REFUSES and compared:  # a shape the renderer quarantines
                continue
            return f"probe {turns!r} was rejected: {rejected}"
        compared += 1
        got = ours.ids.tolist()
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
            at = min(len(got), len(expected)) if at is None else at
            window = slice(max(0, at - 8), at + 8)
            return (
                f"probe {[t['role'] for t in turns]} differs at token {at}: template "
                f"{hf.decode(expected[window])!r}, mmpack {hf.decode(got[window])!r}"
            )
    return None


KIND = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video", AUDIO_PLACEHOLDER: "audio"}


def _for_modalities(turns: Turns, modalities: Sequence[str]) -> list[Turns]:
    """The probe's turns as the family's media kinds need them: as they are for a vision family;
    with every image and video placeholder an audio one for a family that encodes audio only
    (Qwen2-Audio); both for one that encodes all three (the Omni thinkers)."""
    as_audio = [{**t, "text": PLACEHOLDER.sub(AUDIO_PLACEHOLDER, t["text"])} for t in turns]
    if "audio" not in modalities:
        return [turns]
    return [turns, as_audio] if "image" in modalities else [as_audio]


def _template_plan(placeholder: str) -> MediaPlan:
    """A media item as the template writes it: one pad between the wrappers."""
    return MediaPlan(KIND[placeholder], (1, 1, 1), 1, (0, 0))
