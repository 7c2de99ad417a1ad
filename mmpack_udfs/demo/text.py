"""Text-only ShareGPT data at any size, for the text-heavy benchmark (bench/bench_text.py).

``generate_text(out_dir, samples, seed)`` writes:

    out_dir/data/text/sharegpt-NNNNN.jsonl  ``conversations``/``from``/``value`` records, no
                                       media, ``FILE_RECORDS`` records a file
    out_dir/mmpack.yaml                a config naming them as one dataset
    out_dir/data/dataset_info.json     the same files as a LLaMA-Factory dataset (``sharegpt``;
                                       its ``file_name`` is their directory)

The conversations are drawn as the demo's (``data.py``) are, without media: 1–5 rounds, a
system prompt in 30 %, long answers in 30 %. ``distinct`` conversations are drawn; beyond
that they repeat with a distinct prefix on their first question (``[copy 3] ...``), so every
record is its own sample (none is a duplicate) and 1 M records take seconds to write.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmpack_udfs.demo.data import sentence

FILE_RECORDS = 100_000  # records per JSONL file (each file is split into byte ranges anyway)
DATASET = "text_sharegpt"


@dataclass(frozen=True)
class TextData:
    root: Path
    config: Path
    files: list[Path]
    records: int


def text_conversation(rng: random.Random) -> dict:
    """One text-only ShareGPT record."""
    rounds = rng.choices([1, 2, 3, 5], weights=[50, 25, 15, 10])[0]
    turns = []
    for _ in range(rounds):
        turns.append({"from": "human", "value": sentence(rng)})
        turns.append({"from": "gpt", "value": sentence(rng, long=rng.random() < 0.3)})
    record: dict = {"conversations": turns}
    if rng.random() < 0.3:
        record["system"] = "You are a helpful assistant. " + sentence(rng)
    return record


def generate_text(out_dir: str | Path, samples: int, seed: int = 0, distinct: int = 10_000) -> TextData:
    """Write ``samples`` text-only records under ``out_dir`` (see the module docstring)."""
    root = Path(out_dir).resolve()
    data = root / "data"
    (data / "text").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = [json.dumps(text_conversation(rng), ensure_ascii=False) for _ in range(min(samples, distinct))]
    files = []
    for part, first in enumerate(range(0, samples, FILE_RECORDS)):
        path = data / "text" / f"sharegpt-{part:05d}.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for index in range(first, min(first + FILE_RECORDS, samples)):
                out.write(_copy(lines[index % len(lines)], index // len(lines)) + "\n")
        files.append(path)
    names = [f"data/text/{f.name}" for f in files]
    config = root / "mmpack.yaml"
    config.write_text(
        yaml.safe_dump(
            {"datasets": [{"name": DATASET, "paths": names, "media_root": "data"}]}, sort_keys=False
        )
    )
    info = {DATASET: {"file_name": "text", "formatting": "sharegpt",
                      "columns": {"messages": "conversations", "system": "system"}}}  # fmt: skip
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return TextData(root, config, files, samples)


def _copy(line: str, copy: int) -> str:
    """The record ``line`` as copy number ``copy``: the first question gets a prefix."""
    if copy == 0:
        return line
    head = '"from": "human", "value": "'
    return line.replace(head, f"{head}[copy {copy}] ", 1)
