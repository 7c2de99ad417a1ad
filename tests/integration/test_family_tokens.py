"""Every family from its model directory (``tokenize.model``), against transformers on the same
files: each tokenized sample's ids, labels, grids, pad counts and video frames; each packed
sample's pixel values (original and prepared media) and rotary positions.

The model directories hold the published processor configs and chat templates
(tests/models/build.py). The oracle (tests/oracles/qwen_family.py) is the directory's chat
template, the PIL image processor built from its ``preprocessor_config.json`` and the
family's processor class with its video processor (in a subprocess with the test-only
torchvision scaffold: tests/oracles/qwen_video.py), and the tiny model's ``get_rope_index``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loader import PackedDataset, collate_packed
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.io import tables
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.schemas import table_uri
from mmpack_udfs.validate import stage as validate
from tests.conftest import FAMILY_MODELS, PACKED_DEMO_SETTINGS, demo_run
from tests.loader.test_model_parity import sample_media
from tests.models.build import tiny_models
from tests.oracles import qwen_family as oracle

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
TORCHVISION = ROOT / ".venv" / "torchvision-cpu"
# Qwen2.5-VL checkpoints ship no video processor config: mmpack's documented video defaults
# (qwen-vl-utils' values), given to transformers' Qwen2-VL video processor explicitly.
QWEN2_5_VIDEO = {"fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True,
                 "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}}  # fmt: skip
MODEL_TYPES = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_5": "qwen3_5"}


class VideoOracle:
    """``tests.oracles.qwen_video``: one process answers every family's request of the session
    (torchvision and transformers imported once), started on first use, closed at exit."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    def ask(self, request: dict) -> list[dict]:
        if self.process is None or self.process.poll() is not None:
            self._start()
        assert self.process and self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the video oracle exited:\n{self.log.read_text()[-3000:] if self.log else ''}"
        reply = json.loads(line)
        assert "error" not in reply, reply.get("error")
        return reply["results"]

    def _start(self) -> None:
        if not (TORCHVISION / ".installed").exists():
            raise RuntimeError(f"the video oracle needs torchvision at {TORCHVISION}: run `make test`")
        self.close()  # a process that died: its log goes with it
        paths = [str(ROOT / "tests/oracles/torchvision_boot"), str(TORCHVISION), str(ROOT)]
        log, name = tempfile.mkstemp(prefix="video-oracle-", suffix=".log")
        self.log = Path(name)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.oracles.qwen_video"], cwd=ROOT, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
        os.close(log)  # the process holds its own

    def close(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        if self.log:
            self.log.unlink(missing_ok=True)
            self.log = None


VIDEO_ORACLE = VideoOracle()
atexit.register(VIDEO_ORACLE.close)


def video_references(run, uris: list[str], tmp: Path) -> dict[str, dict]:
    """transformers' video processor on every video (``VIDEO_ORACLE``)."""
    profile = run.ctx.config.profile
    file = run.model_dir / "video_preprocessor_config.json"
    fallback = {} if profile.kind == "glm4v" else QWEN2_5_VIDEO  # GLM: the class defaults
    settings = json.loads(file.read_text()) if file.exists() else fallback
    request = {
        "model_dir": str(run.model_dir),
        "family": profile.kind,
        "settings": {k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))},
        "videos": [{"uri": uri, "out": str(tmp / f"video{i}.npy")} for i, uri in enumerate(uris)],
    }
    if profile.kind == "glm4v":  # the processor classes the directory resolved to
        request.update(sampling=profile.video.sampling, frame_label=profile.frame_label)
    results = VIDEO_ORACLE.ask(request)
    for result, video in zip(results, request["videos"], strict=True):
        result["pixels"] = np.load(video["out"])
    return dict(zip(uris, results, strict=True))


def oracle_references(run, oracle, tmp: Path) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
    """A family run's tokenized rows, ``oracle.reference`` of each (by sample id) and transformers'
    video processor on every video (by uri): the InternVL and LLaVA-OneVision checks."""
    samples = {
        s["sample_id"]: s for s in tables.read_arrow(table_uri(str(run.output), "samples")).to_pylist()
    }
    rows = tables.read_arrow(table_uri(str(run.output), "tokenized")).to_pylist()
    uris = sorted({m["uri"] for r in rows for m in samples[r["sample_id"]]["media"] if m["kind"] == "video"})
    videos = video_references(run, uris, tmp)
    hf = load_tokenizer(str(run.model_dir))
    refs = {
        r["sample_id"]: oracle.reference(
            run.model_dir, hf, samples[r["sample_id"]], lambda m: videos[m["uri"]]
        )
        for r in rows
    }
    return rows, refs, videos


def runs_with_references(family_run, oracle, tmp_path_factory):
    """``get(name)``: (run, tokenized rows, ``oracle.reference`` by sample id, videos by uri) of a
    family's run, built on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            run = family_run(name)
            cache[name] = (run, *oracle_references(run, oracle, tmp_path_factory.mktemp(f"videos-{name}")))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def references(family_run, tmp_path_factory):
    """Per family: the run, its rows and transformers' reference for every tokenized sample."""
    return runs_with_references(family_run, oracle, tmp_path_factory)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_every_sample_has_the_ids_labels_and_grids_transformers_gives(references, name):
    _, rows, refs, videos = references(name)
    assert len(rows) >= 40 and any(m["kind"] == "video" for r in rows for m in r["media"])
    for row in rows:
        ref = refs[row["sample_id"]]
        assert row["input_ids"] == ref["input_ids"], row["sample_id"]
        assert row["labels"] == ref["labels"], row["sample_id"]
        images = [m for m in row["media"] if m["kind"] == "image"]
        assert [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in images] == ref["image_grid_thw"]
        clips = [m for m in row["media"] if m["kind"] == "video"]
        assert [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in clips] == ref["video_grid_thw"]
        for m in clips:
            assert m["frame_indices"] == videos[m["uri"]]["frame_indices"]
            if name == "qwen2_5_vl":
                assert m["second_per_grid_t"] == pytest.approx(
                    videos[m["uri"]]["second_per_grid_t"], rel=1e-6
                )
        pads = [m["num_tokens"] for m in row["media"]]
        assert pads == [int(np.prod(g)) // 4 for g in _grids_in_order(row, ref)]


def _grids_in_order(row, ref):
    images, clips = iter(ref["image_grid_thw"]), iter(ref["video_grid_thw"])
    return [next(images) if m["kind"] == "image" else next(clips) for m in row["media"]]


@pytest.fixture(scope="module")
def prepared_run(spark, family_demo, family_run):
    """The same tokenized rows packed again with prepared media (8-bit patches in the shard)."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            run = family_run(name)
            out = run.output.parent / "prepared"
            shutil.copytree(run.output / "tables", out / "tables")
            settings = (f"tokenize.model={run.model_dir}", "pack.media=prepared", *PACKED_DEMO_SETTINGS)
            pack.run(spark, demo_run(family_demo, out, *settings))
            cache[name] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_packed_samples_have_transformers_pixels_and_positions(references, prepared_run, name):
    run, _, refs, _ = references(name)
    model = tiny_models().tiny_model(MODEL_TYPES[name])
    pads = (model.config.image_token_id, model.config.video_token_id)
    checked = {"image": 0, "video": 0, "positions": 0}
    original = list(PackedDataset(str(run.output / "packed"), shuffle=False))
    prepared = list(PackedDataset(str(prepared_run(name) / "packed"), shuffle=False))
    for bin_, same_bin in zip(original, prepared, strict=True):
        batch, prepared_batch = collate_packed([bin_]), collate_packed([same_bin])
        cu = batch["cu_seq_lens_q"].tolist()
        for key in ("pixel_values", "pixel_values_videos"):
            if key in batch:
                torch.testing.assert_close(prepared_batch[key], batch[key], rtol=0, atol=0)
        for s, (sample_id, media) in enumerate(
            zip(bin_["sample_ids"], sample_media(batch, cu, pads), strict=True)
        ):
            ref = refs[sample_id]
            ids = batch["input_ids"][0, cu[s] : cu[s + 1]].tolist()
            assert ids == ref["input_ids"]
            positions = batch["position_ids"][1:, 0, cu[s] : cu[s + 1]].numpy()
            np.testing.assert_array_equal(positions, oracle.rope_index(model, ids, ref))
            checked["positions"] += 1
            if ref["pixel_values"]:
                expected = np.concatenate(ref["pixel_values"])
                np.testing.assert_allclose(media["pixel_values"].numpy(), expected, rtol=0, atol=1e-6)
                checked["image"] += 1
            if ref["pixel_values_videos"]:
                expected = np.concatenate(ref["pixel_values_videos"])
                np.testing.assert_allclose(media["pixel_values_videos"].numpy(), expected, rtol=0, atol=1e-6)
                checked["video"] += 1
    assert checked["image"] >= 20 and checked["video"] >= 3 and checked["positions"] >= 40, checked


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_validate_accepts_every_familys_shards_and_catches_a_moved_pad(spark, family_run, name, tmp_path):
    """The validate stage reads each family's shards (Qwen3-VL videos: pad runs split by
    timestamp text, ``group_starts``), and still sees a pad token moved out of its run."""
    run = family_run(name)
    summary = validate.run(spark, run.ctx)
    assert summary["ok"], summary["problems"]
    assert summary["source"]["rows"] == summary["samples"] + summary["skipped"]

    broken = tmp_path / "out"
    shutil.copytree(run.output, broken)
    manifest = json.loads((broken / "packed" / "manifest.json").read_text())
    shard = broken / "packed" / manifest["shards"][0]["path"]
    table = pq.read_table(shard)
    rows = table.to_pylist()
    video_pad = 151656 if name != "qwen3_5" else 248057
    row = next(r for r in rows if any(m["kind"] == "video" for m in r["media"]))
    item = next(m for m in row["media"] if m["kind"] == "video")
    first = item["token_offset"]
    assert row["input_ids"][first] == video_pad
    row["input_ids"][first - 1], row["input_ids"][first] = video_pad, row["input_ids"][first - 1]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    entry = manifest["shards"][0]  # the shard's new bytes, so only the moved pad is wrong
    entry.update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest(), bytes=shard.stat().st_size)
    (broken / "packed" / "manifest.json").write_text(json.dumps(manifest))
    config = run.ctx.config.model_copy(update={"output": str(broken)})
    with pytest.raises(validate.ValidationError, match="a span holds ids other than its pad id"):
        validate.run(spark, run.ctx.with_config(config))
