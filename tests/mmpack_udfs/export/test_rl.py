"""``mmpack export rl`` on the demo tokenized for Qwen2.5-VL: every exported prompt's token count
is what transformers gives for it (the directory's chat template with the generation prompt,
the image processor on the exported image bytes), overlong prompts are left out and counted,
every sample is accounted for, the same tables export the same bytes, and verl's own
``RLHFDataset`` (in its own environment, .venv-verl) reads the export and counts as mmpack does."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmpack_udfs import cli
from mmpack_udfs.export import rl
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.io import fs, tables
from tests.oracles import qwen_family as oracle

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[3]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
LIMIT = 700  # tokens: the demo's prompts fall on both sides


@pytest.fixture(scope="module")
def export(spark, family_run, tmp_path_factory):
    run = family_run("qwen2_5_vl")
    dest = tmp_path_factory.mktemp("rl") / "prompts"
    manifest = rl.run(spark, run.ctx, str(dest), LIMIT)
    rows = pq.read_table([dest / f["path"] for f in manifest["files"]]).to_pylist()
    return run, dest, manifest, rows


def processor_count(model_dir: Path, tokenizer, row: dict) -> int:
    """The prompt's tokens as transformers gives them: the chat template with the generation
    prompt, every image pad expanded to its grid by the directory's image processor."""
    system = next((m["content"] for m in row["prompt"] if m["role"] == "system"), None)
    turns = [{"role": m["role"], "text": m["content"]} for m in row["prompt"] if m["role"] != "system"]
    text = tokenizer.apply_chat_template(
        oracle.messages(system, turns), chat_template=oracle.chat_template(model_dir), tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    if row["images"]:
        pictures = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in row["images"]]
        grids = iter(oracle.image_processor(model_dir)(images=pictures)["image_grid_thw"])
        text = re.sub(r"<\|image_pad\|>", lambda _: "<|image_pad|>" * (int(np.prod(next(grids))) // 4), text)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_every_prompt_has_the_processors_token_count_and_every_sample_is_accounted_for(export):
    run, dest, manifest, rows = export
    tokenizer = load_tokenizer(str(run.model_dir))
    counts = [r["extra_info"]["prompt_tokens"] for r in rows]
    assert counts == [processor_count(run.model_dir, tokenizer, r) for r in rows]
    assert max(counts) <= LIMIT and sum(bool(r["images"]) for r in rows) >= 5
    assert all(r["reward_model"]["ground_truth"] == r["extra_info"]["answer"] != "" for r in rows)
    assert [r["extra_info"]["sample_id"] for r in rows] == sorted(r["extra_info"]["sample_id"] for r in rows)
    excluded = pq.read_table(dest / rl.EXCLUDED).to_pylist()
    too_long = [e for e in excluded if (e["status"], e["reason"]) == ("dropped", "too_long")]
    assert too_long and all(e["prompt_tokens"] > LIMIT for e in too_long)
    assert manifest["dropped"]["too_long"] == len(too_long) and manifest["dropped"]["video_in_prompt"] > 0
    thin = [e["sample_id"] for e in excluded if e["reason"] == "thin_image"]  # the demo's 12 x 900 px image
    assert thin and manifest["dropped"]["thin_image"] == len(thin)
    samples = tables.read_arrow(str(run.output / "tables" / "samples"), fs.LOCAL, columns=["sample_id"])
    t = manifest["totals"]
    assert t["samples"] == samples.num_rows == t["exported"] + t["dropped"] + t["quarantined"]
    assert t["exported"] == len(rows) and len(excluded) == t["dropped"] + t["quarantined"]
    assert set(samples["sample_id"].to_pylist()) == {r["extra_info"]["sample_id"] for r in rows} | {
        e["sample_id"] for e in excluded
    }
    quarantined = tables.read_arrow(str(run.output / "tables" / "tokenize_quarantine"), fs.LOCAL)
    assert t["quarantined"] == len(set(quarantined["sample_id"].to_pylist())) > 0  # tokenize's, reasons kept


def test_the_same_tables_export_the_same_bytes(spark, export, tmp_path):
    run, dest, manifest, _ = export
    again = rl.run(spark, run.ctx, str(tmp_path / "again"), LIMIT)
    assert again["files"] == manifest["files"] and len(again["files"]) >= 1
    for name in [rl.EXCLUDED, rl.MANIFEST, *(f["path"] for f in again["files"])]:
        assert (tmp_path / "again" / name).read_bytes() == (dest / name).read_bytes()


def test_refusals_exit_2_before_writing(export, family_run, tmp_path, capsys):
    run, dest, _, _ = export

    def refused(out: Path, *extra: str, to: Path | None = None, model: Path | None = None) -> str:
        to = to or tmp_path / "dest"
        settings = ["--set", f"tokenize.model={model or run.model_dir}"]
        command = ["export", "rl", "--out", str(out), "--to", str(to), "--max-prompt-length", "512"]
        assert cli.main([*command, *settings, *extra]) == cli.EXIT_BAD_CONFIG
        return capsys.readouterr().err

    assert "no tokenized table" in refused(tmp_path / "nothing")
    assert "is not empty" in refused(run.output, to=dest)
    assert "must be a positive number" in refused(run.output, "--max-prompt-length", "0")
    gemma = family_run("gemma3")
    assert "cannot count RL prompts exactly" in refused(gemma.output, model=gemma.model_dir)
    assert not (tmp_path / "dest").exists()


VERL_CHECK = """
import json, sys
from omegaconf import OmegaConf
from transformers import AutoProcessor, AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
files, model_dir, limit = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
config_file = f"{model_dir}/preprocessor_config.json"  # the published name, which transformers 5 does not
settings = json.load(open(config_file))  # resolve (Qwen2_5_VLImageProcessor), as the class it is
json.dump({**settings, "image_processor_type": "Qwen2VLImageProcessor"}, open(config_file, "w"))
tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoProcessor.from_pretrained(model_dir)
config = OmegaConf.create({"max_prompt_length": limit, "filter_overlong_prompts": True,
                           "filter_overlong_prompts_workers": 1})
dataset = RLHFDataset(data_files=files, tokenizer=tokenizer, config=config, processor=processor)
counts = []
for i in range(len(dataset)):
    row = dataset[i]
    images, _, _ = RLHFDataset._process_multi_modal_info(row["raw_prompt"], dataset.image_patch_size, config)
    text = processor.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    counts.append([row["extra_info"]["sample_id"], int(inputs["input_ids"].shape[1])])
print(json.dumps(counts))
"""


def test_verls_dataset_reads_every_prompt_and_counts_as_mmpack(export, tmp_path):
    """verl's RLHFDataset with its overlong filter at the same limit keeps every row, and the
    processor on what verl builds for the rollout (its messages, its image resize) counts what
    mmpack counted."""
    run, dest, manifest, rows = export
    if not VERL_PYTHON.exists():
        raise RuntimeError(f"verl's environment is missing ({VERL_PYTHON}): run `make test`")
    files = [str(dest / f["path"]) for f in manifest["files"]]
    model_dir = tmp_path / "model"
    shutil.copytree(run.model_dir, model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests/oracles/torchvision_boot")}
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", VERL_CHECK, json.dumps(files), str(model_dir), str(LIMIT)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    counted = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    assert counted == {r["extra_info"]["sample_id"]: r["extra_info"]["prompt_tokens"] for r in rows}


def test_easyr1_gets_its_columns_and_single_turn_prompts_only(spark, export, tmp_path):
    """Against EasyR1's documented layout (its RLHFDataset is not on PyPI: hiyouga/EasyR1
    verl/utils/dataset.py): ``problem`` is the one user turn, a string with one ``<image>`` per
    entry of ``images`` (dicts with the bytes), ``answer`` the reward's ground truth."""
    run, _, verl_manifest, verl_rows = export
    manifest = rl.run(spark, run.ctx, str(tmp_path / "easyr1"), LIMIT, "easyr1")
    table = pq.read_table([tmp_path / "easyr1" / f["path"] for f in manifest["files"]])
    assert table.column_names == ["problem", "answer", "images", "data_source", "extra_info"]
    rows = table.to_pylist()
    single = {r["extra_info"]["sample_id"]: r for r in verl_rows if len(r["prompt"]) == 1}
    assert {r["extra_info"]["sample_id"] for r in rows} == set(single) and len(rows) >= 5
    for row in rows:
        same = single[row["extra_info"]["sample_id"]]
        assert row["problem"] == same["prompt"][0]["content"] and row["extra_info"] == same["extra_info"]
        assert row["problem"].count("<image>") == len(row["images"]) == len(same["images"])
    excluded = pq.read_table(tmp_path / "easyr1" / rl.EXCLUDED).to_pylist()
    multi = {e["sample_id"] for e in excluded if e["reason"] == "not_single_turn"}
    assert multi and not multi & set(single) and len(multi) == manifest["dropped"]["not_single_turn"]
    assert manifest["totals"]["samples"] == verl_manifest["totals"]["samples"]
    assert manifest["trainer_settings"]["data.prompt_key"] == "problem"


def test_prompt_files_are_written_in_row_groups_that_do_not_depend_on_sparks_batches():
    """A task writes its prompts a row group at a time (never the whole file in memory), and the
    row groups are the same however Spark cut its Arrow batches."""
    schema = pa.schema([("n", pa.int64())])
    cuts = [(0, 3), (3, 3), (3, 1204), (1204, 1210)]
    batches = [pa.record_batch([pa.array(range(a, b), pa.int64())], schema=schema) for a, b in cuts]
    groups = list(rl._row_groups(iter(batches), 500, schema))
    assert [g.num_rows for g in groups] == [500, 500, 210]
    assert pa.concat_tables(groups)["n"].to_pylist() == list(range(1210))
    assert list(rl._row_groups(iter([]), 500, schema)) == []
