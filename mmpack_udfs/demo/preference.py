"""A deterministic preference (DPO) demo dataset with real images and videos.

``generate(out_dir, pairs, seed)`` writes, beside media drawn like the SFT demo's:

    out_dir/data/ranking.jsonl             LLaMA-Factory ranking (sharegpt), named by
    out_dir/data/dataset_info.json         its dataset_info entry "ranking"
    out_dir/data/trl.jsonl                 TRL's format: prompt / chosen / rejected messages,
                                           content parts, images alongside
    out_dir/data/openai_preference.jsonl   OpenAI's preference fine-tuning format
    out_dir/mmpack-dpo.yaml                a config naming the three (ranking: true)

Each file also holds one malformed pair per preference quarantine reason.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmpack_udfs.demo.data import _drawing, _write_video, sentence

SYSTEM = "You are a careful visual assistant."
IMAGE_SIZES = [(64, 48), (160, 120), (224, 224), (320, 240), (448, 448), (640, 480), (300, 600)]  # small:
# preference sets hold one photo or screenshot per pair, and the DPO tests train on CPU


@dataclass(frozen=True)
class PreferenceDemo:
    root: Path
    config: Path
    records: int
    bad_records: int


@dataclass(frozen=True)
class _Pair:
    system: str | None
    rounds: list[tuple[str, str]]  # earlier (question, answer) turns
    question: str  # the last user turn, placeholders first
    chosen: str
    rejected: str
    images: list[str]
    videos: list[str]


def generate(out_dir: str | os.PathLike, pairs: int = 48, seed: int = 0) -> PreferenceDemo:
    """Write the preference demo under ``out_dir``; return where things are."""
    root = Path(out_dir).resolve()
    rng = random.Random(seed)
    images = [_write_image(root, i, rng) for i in range(max(pairs // 3, 6))]
    videos = [_write_video(root, i, rng) for i in range(2)]
    made = [_pair(rng, images, videos) for _ in range(pairs)]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    files = {
        "ranking.jsonl": [_llamafactory(p) for p in made[0::3]] + _bad(images, _llamafactory),
        "trl.jsonl": [_trl(p) for p in made[1::3]] + _bad(images, _trl),
        "openai_preference.jsonl": [_openai(p) for p in made[2::3]] + _bad(images, _openai),
    }
    for name, records in files.items():
        rng.shuffle(records)
        (data / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    info = {
        "ranking": {
            "file_name": "ranking.jsonl",
            "formatting": "sharegpt",
            "ranking": True,
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                        "images": "images", "videos": "videos", "system": "system"},
        }
    }  # fmt: skip
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    config = {
        "datasets": [
            {"name": "llamafactory", "dataset_info": "data", "names": ["ranking"], "media_root": "media"},
            {"name": "trl", "paths": ["data/trl.jsonl"], "media_root": "media", "ranking": True},
            {
                "name": "openai",
                "paths": ["data/openai_preference.jsonl"],
                "media_root": "media",
                "ranking": True,
            },
        ]
    }
    path = root / "mmpack-dpo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    bad = 3 * len(_bad(images, _trl))
    return PreferenceDemo(root, path, records=pairs + bad, bad_records=bad)


def _write_image(root: Path, index: int, rng: random.Random) -> str:
    width, height = rng.choice(IMAGE_SIZES)
    rel = f"images/pref_{index:05d}.jpg"
    path = root / "media" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    _drawing(width, height, rng).save(path, quality=85)
    return rel


def _pair(rng: random.Random, images: list[str], videos: list[str]) -> _Pair:
    n_images = rng.choices([0, 1, 2], weights=[25, 55, 20])[0]
    n_videos = 1 if rng.random() < 0.08 else 0
    chosen = _answer(rng)
    rejected = _answer(rng)
    while rejected == chosen:
        rejected = _answer(rng)
    return _Pair(
        system=SYSTEM if rng.random() < 0.3 else None,
        rounds=[
            (sentence(rng), _answer(rng)) for _ in range(rng.choices([0, 1, 2], weights=[60, 30, 10])[0])
        ],
        question=" ".join(["<image>"] * n_images + ["<video>"] * n_videos + [sentence(rng)]),
        chosen=chosen,
        rejected=rejected,
        images=[rng.choice(images) for _ in range(n_images)],
        videos=[rng.choice(videos) for _ in range(n_videos)],
    )


def _answer(rng: random.Random) -> str:
    """A short answer of 5 to 40 words."""
    words = []
    while len(words) < rng.randint(5, 40):
        words += sentence(rng).split()
    return " ".join(words[:40])


def _media(p: _Pair) -> dict:
    return {k: v for k, v in (("images", p.images), ("videos", p.videos)) if v}


def _llamafactory(p: _Pair) -> dict:
    turns = []
    for question, answer in p.rounds:
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    turns.append({"from": "human", "value": p.question})
    record = {"conversations": turns, "chosen": {"from": "gpt", "value": p.chosen},
              "rejected": {"from": "gpt", "value": p.rejected}, **_media(p)}  # fmt: skip
    return {**record, "system": p.system} if p.system else record


def _trl(p: _Pair) -> dict:
    """TRL: the last question as content parts (a part per image / video, then the text)."""
    prompt = [{"role": "system", "content": p.system}] if p.system else []
    for question, answer in p.rounds:
        prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    words = p.question.split(" ")
    parts = [{"type": w[1:-1]} for w in words if w in ("<image>", "<video>")]
    parts.append({"type": "text", "text": " ".join(w for w in words if w not in ("<image>", "<video>"))})
    prompt.append({"role": "user", "content": parts})
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": p.chosen}],
            "rejected": [{"role": "assistant", "content": p.rejected}], **_media(p)}  # fmt: skip


def _openai(p: _Pair) -> dict:
    """OpenAI: images as image_url parts naming their files (relative to the media root)."""
    messages = [{"role": "system", "content": p.system}] if p.system else []
    for question, answer in p.rounds:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    images = iter(p.images)
    content: list[dict] = []
    for word in p.question.split(" "):
        if word == "<image>":
            content.append({"type": "image_url", "image_url": {"url": next(images)}})
        elif word == "<video>":
            content.append({"type": "video"})
        elif content and content[-1]["type"] == "text":
            content[-1]["text"] += " " + word
        else:
            content.append({"type": "text", "text": word})
    messages.append({"role": "user", "content": content})
    record = {
        "input": {"messages": messages},
        "preferred_output": [{"role": "assistant", "content": p.chosen}],
        "non_preferred_output": [{"role": "assistant", "content": p.rejected}],
    }
    return {**record, "videos": p.videos} if p.videos else record


def _bad(images: list[str], form) -> list[dict]:
    """One malformed pair per preference quarantine reason, in ``form``."""
    base = _Pair(None, [], "<image> What is drawn here?", "A red circle.", "A blue square.", images[:1], [])
    missing = form(base)
    for key in ("rejected", "non_preferred_output"):
        missing.pop(key, None)
    same = form(_Pair(**{**base.__dict__, "rejected": base.chosen}))
    mismatch = form(_Pair(**{**base.__dict__, "chosen": "Look: <image> a red circle.", "images": images[:2]}))
    return [missing, same, mismatch]
