"""Real files in the shapes users have, through the jobs: Hugging Face-style Parquet with
images inside (Image structs, lists of them, binary columns), content-part messages, and a
LLaMA-Factory folder read through its dataset_info.json."""

from __future__ import annotations

import io
import json
import zlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from mmpack_udfs.io import tables
from mmpack_udfs.resolve import load_run
from mmpack_udfs.schemas import shared_media_data, table_uri

pytestmark = pytest.mark.spark


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def bomb() -> bytes:
    """A PNG whose header claims 40000 × 40000 pixels."""
    data = bytearray(png(4, 4, (0, 0, 0)))
    data[16:24] = (40000).to_bytes(4, "big") * 2
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


GOOD = [png(64, 48, (200, 0, 0)), png(48, 64, (0, 200, 0)), png(40, 40, (0, 0, 200))]
CORRUPT, BOMB = b"\x00\xffthese are not image bytes", bomb()
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def ask(question: str, answer: str = "A colour.") -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def write_hf_parquet(folder: Path) -> dict[str, int]:
    """Three Parquet files as Hugging Face datasets store images; the quarantine reasons due."""
    folder.mkdir(parents=True)
    single = [GOOD[0], CORRUPT, BOMB]
    pq.write_table(
        pa.Table.from_pylist(
            [{"messages": ask("<image> What colour?"), "image": {"bytes": b, "path": f"{i}.png"}}
             for i, b in enumerate(single)],
            schema=pa.schema([("messages", MESSAGES), ("image", IMAGE)]),
        ),
        folder / "single.parquet",
    )  # fmt: skip
    lists = [[GOOD[1], GOOD[2]], [GOOD[0], BOMB]]
    pq.write_table(
        pa.Table.from_pylist(
            [{"messages": ask("<image><image> Which colours?"),
              "images": [{"bytes": b, "path": None} for b in row]} for row in lists],
            schema=pa.schema([("messages", MESSAGES), ("images", pa.list_(IMAGE))]),
        ),
        folder / "lists.parquet",
    )  # fmt: skip
    raw = [[GOOD[2]], [CORRUPT], [BOMB]]
    content = pa.list_(pa.struct([("type", pa.string()), ("text", pa.string())]))
    parts = pa.list_(pa.struct([("role", pa.string()), ("content", content)]))
    pq.write_table(
        pa.Table.from_pylist(
            [{"messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                         {"type": "text", "text": "What colour?"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}],
              "images": row} for row in raw],
            schema=pa.schema([("messages", parts), ("images", pa.list_(pa.binary()))]),
        ),
        folder / "binary.parquet",
    )  # fmt: skip
    return {"image_too_large": 3, "media_unreadable": 2}


def config_file(folder: Path, datasets: list[dict], name: str = "mmpack.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump({"datasets": datasets}))
    return path


def run(spark, config: Path, out: Path, *stages: str, overrides: tuple[str, ...] = ()) -> list[dict]:
    from mmpack_udfs.pipeline import stage

    ctx = load_run(config, [f"output={out}", *overrides])
    return [stage(name).run(spark, ctx) for name in stages]


def test_images_inside_parquet_are_probed_like_files_and_embedded_in_the_shards(spark, tmp_path):
    due = write_hf_parquet(tmp_path / "hf")
    config = config_file(tmp_path, [{"name": "hf", "paths": ["hf/*.parquet"], "media_root": "hf"}])
    out = tmp_path / "out"
    normalized, tokenized, _ = run(spark, config, out, "normalize", "tokenize", "pack",
                                   overrides=("pack.oversize=skip",))  # fmt: skip
    totals = normalized["totals"]
    assert totals["read"] == 8 == totals["samples"] + totals["quarantined"] + totals["duplicates"]
    assert normalized["reasons"] == due and totals["samples"] == 3
    samples = tables.read_arrow(table_uri(str(out), "samples")).to_pylist()
    uris = [m["uri"] for s in samples for m in s["media"]]
    assert all(u.startswith(str(out / "media")) for u in uris)  # content-addressed copies
    assert {Path(u).read_bytes() for u in uris} == set(GOOD)
    assert tokenized["counts"]["tokenized_samples"] == 3
    embedded = set()
    for shard in (out / "packed" / "shards").rglob("s*.parquet"):
        for row in pq.read_table(shard, columns=["media"]).column("media").to_pylist():
            embedded |= {m["data"] for m in shared_media_data(row)}
    assert embedded == set(GOOD)  # shards carry the bytes that were inside the Parquet files


def write_llama_factory_folder(root: Path) -> None:
    """A data folder as LLaMA-Factory users have it: dataset_info.json, a sharegpt file with
    role/content tags, an alpaca file, media beside them."""
    (root / "mllm_demo_data").mkdir(parents=True)
    for i, data in enumerate(GOOD):
        (root / "mllm_demo_data" / f"{i}.png").write_bytes(data)
    info = {
        "mllm_demo": {
            "file_name": "mllm_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                     "assistant_tag": "assistant"},
        },
        "alpaca_mm": {
            "file_name": "alpaca_mm.json",
            "columns": {"prompt": "instruction", "query": "input", "response": "output", "images": "images"},
        },
        "ranked": {"file_name": "ranked.json", "ranking": True},
        "from_the_hub": {"hf_hub_url": "someone/some_dataset"},
    }  # fmt: skip
    (root / "dataset_info.json").write_text(json.dumps(info))
    sharegpt = [
        {"messages": ask(f"<image>Which colour is picture {i}?"), "images": [f"mllm_demo_data/{i}.png"]}
        for i in range(3)
    ] + [{"messages": ask("Nothing to see."), "images": ["mllm_demo_data/missing.png"]}]
    (root / "mllm_demo.json").write_text(json.dumps(sharegpt))
    alpaca = [
        {
            "instruction": "<image>Describe.",
            "input": "Briefly.",
            "output": "Red.",
            "images": ["mllm_demo_data/0.png"],
        },
        {"instruction": "Say hi.", "input": "", "output": "Hi."},
        {"instruction": "No answer.", "output": ""},
    ]
    (root / "alpaca_mm.json").write_text(json.dumps(alpaca))


def test_a_llama_factory_folder_reads_through_its_dataset_info(spark, tmp_path):
    write_llama_factory_folder(tmp_path / "data")
    entry = {"name": "lf", "dataset_info": "data", "names": ["mllm_demo", "alpaca_mm"]}
    [summary] = run(spark, config_file(tmp_path, [entry]), tmp_path / "out", "normalize")
    datasets = summary["datasets"]
    assert datasets["lf/mllm_demo"] == {"read": 4, "samples": 3, "quarantined": 1, "duplicates": 0,
                                        "reasons": {"placeholder_media_mismatch": 1}}  # fmt: skip
    assert datasets["lf/alpaca_mm"] == {"read": 3, "samples": 2, "quarantined": 1, "duplicates": 0,
                                        "reasons": {"empty_assistant_turn": 1}}  # fmt: skip
    rows = tables.read_arrow(table_uri(str(tmp_path / "out"), "samples")).to_pylist()
    alpaca = [r for r in rows if r["dataset"] == "lf/alpaca_mm" and r["media"]]
    assert [t["text"] for t in alpaca[0]["turns"]] == ["<image>Describe.\nBriefly.", "Red."]
    assert Counter(m["uri"] for r in rows for m in r["media"]) == Counter(
        str(tmp_path / "data" / "mllm_demo_data" / f"{i}.png") for i in (0, 1, 2, 0)
    )
