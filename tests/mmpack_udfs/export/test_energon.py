"""mmpack export energon on real Spark: every bin of the pack goes out once, its tar sample
holding the shard row; the counts reconcile with the manifest; Energon's own preparation wrote
.nv-meta; the same pack gives the same bytes (locally and on S3, against moto); what cannot be
exported is refused with exit 2 before anything is written."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from mmpack_udfs import cli
from mmpack_udfs.export import energon
from mmpack_udfs.resolve import load_run

pytestmark = pytest.mark.spark


def tar_samples(path: Path) -> dict[str, dict[str, bytes]]:
    """key → part → bytes, in tar order (a sample's parts are adjacent)."""
    samples: dict[str, dict[str, bytes]] = defaultdict(dict)
    with tarfile.open(path) as tar:
        for member in tar:
            key, part = member.name.split(".", 1)
            assert (member.mtime, member.uid, member.gid, member.uname, member.mode) == (0, 0, 0, "", 0o644)
            samples[key][part] = tar.extractfile(member).read()
    return samples


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_bin_goes_out_once_as_its_shard_row(energon_export, packed_demo):
    export = energon_export("qwen2_vl")
    manifest = json.loads((export / "mmpack_export.json").read_text())
    pack = json.loads((packed_demo / "packed" / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert {k: train[k] for k in ("bins", "samples", "tokens")} == {
        k: pack["totals"][k] for k in ("bins", "samples", "tokens")
    }
    source = manifest["source"]["packs"]["train"]
    assert source["run_id"] == pack["run_id"]
    assert (
        source["manifest_sha256"]
        == hashlib.sha256((packed_demo / "packed" / "manifest.json").read_bytes()).hexdigest()
    )
    assert [s["sha256"] for s in source["shards"]] == [s["sha256"] for s in pack["shards"]]
    assert len(train["tars"]) == len(pack["shards"])
    media_items = 0
    for number, (tar, shard) in enumerate(zip(train["tars"], pack["shards"], strict=True)):
        assert hashlib.sha256((export / tar["path"]).read_bytes()).hexdigest() == tar["sha256"]
        samples = tar_samples(export / tar["path"])
        rows = pq.read_table(packed_demo / "packed" / shard["path"]).to_pylist()
        assert list(samples) == [f"train-{number:05d}-{row:06d}" for row in range(len(rows))]
        for parts, row in zip(samples.values(), rows, strict=True):
            record = json.loads(parts["json"])
            for name in ("input_ids", "labels", "cu_seqlens"):
                array = np.load(io.BytesIO(parts[f"{name}.npy"]))
                assert array.dtype == np.int32 and array.tolist() == row[name]
            assert record["sample_ids"] == row["sample_ids"] and record["num_tokens"] == row["num_tokens"]
            assert record["media"] == [{k: v for k, v in m.items() if k != "data"} for m in row["media"]]
            embedded = [parts[f"{i}.media"] for i in range(len(row["media"]))]
            originals = [
                m["data"] if m["data"] is not None else Path(m["uri"]).read_bytes() for m in row["media"]
            ]
            assert embedded == originals
            assert set(parts) == {"json", "input_ids.npy", "labels.npy", "cu_seqlens.npy"} | {
                f"{i}.media" for i in range(len(row["media"]))
            }
            media_items += len(row["media"])
    assert media_items > 0
    meta = export / ".nv-meta"
    assert yaml.safe_load((meta / "dataset.yaml").read_text()) == {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
    }
    assert set(yaml.safe_load((meta / "split.yaml").read_text())["split_parts"]) == {"train"}
    assert (meta / "index.sqlite").exists() and all(
        (export / f"{t['path']}.idx").exists() for t in train["tars"]
    )


def test_the_same_pack_exports_the_same_bytes_locally_and_on_s3(
    spark, energon_export, packed_demo, tmp_path, s3_bucket
):
    import boto3

    first = files(energon_export("qwen2_vl"))
    ctx = load_run(None, [f"output={packed_demo}"])
    energon.run(spark, ctx, str(tmp_path / "again"))
    assert files(tmp_path / "again") == first

    endpoint, bucket = s3_bucket
    s3 = [f"s3.endpoint_override={endpoint}", "s3.scheme=http", "s3.region=us-east-1"]
    energon.run(spark, load_run(None, [f"output={packed_demo}", *s3]), f"s3://{bucket}/export")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    remote = {k.removeprefix("export/"): client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
    assert remote == first


def test_the_evaluation_pack_goes_out_as_the_val_split(energon_export, mixed_demo):
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset, reraise_exception

    from loader.energon import MmpackTaskEncoder

    export = energon_export("mixed")
    manifest = json.loads((export / "mmpack_export.json").read_text())
    pack_eval = json.loads((mixed_demo[0] / "packed-eval" / "manifest.json").read_text())
    assert manifest["splits"]["val"]["bins"] == pack_eval["totals"]["bins"] > 0
    assert manifest["source"]["packs"]["val"]["run_id"] == pack_eval["run_id"]
    config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    encoder = MmpackTaskEncoder(str(export), with_media=False)
    batches = list(
        get_loader(
            get_val_dataset(
                str(export), split_part="val", worker_config=config, task_encoder=encoder, batch_size=None
            )
        )
    )
    exported = sorted(i for b in batches for i in b["meta"]["sample_ids"])
    tables = [pq.read_table(mixed_demo[0] / "packed-eval" / s["path"]) for s in pack_eval["shards"]]
    assert exported == sorted(i for t in tables for ids in t["sample_ids"].to_pylist() for i in ids)
    assert {b["meta"]["source"]["split"] for b in batches} == {"val"}


def refused(out: Path, dest: Path, capsys, *extra: str) -> str:
    """What ``mmpack export energon`` of ``out`` to ``dest`` says as it exits 2, writing nothing."""
    assert (
        cli.main(["export", "energon", "--out", str(out), "--to", str(dest), *extra]) == cli.EXIT_BAD_CONFIG
    )
    assert not (dest / "mmpack_export.json").exists()
    return capsys.readouterr().err


def test_refusals_exit_2_naming_what_before_writing(
    packed_demo, preference_run, weighted_demo, tmp_path, capsys
):
    def refused_here(out: Path, *extra: str, dest: Path | None = None) -> str:
        return refused(out, dest or tmp_path / "dest", capsys, *extra)

    assert "no manifest at" in refused_here(tmp_path / "nothing")
    unpublished = tmp_path / "unpublished"
    shutil.copytree(
        packed_demo / "packed", unpublished / "packed", ignore=shutil.ignore_patterns("manifest.json")
    )
    assert "export needs a published pack" in refused_here(unpublished)
    busy = tmp_path / "busy"
    (busy / "old").mkdir(parents=True)
    assert "is not empty" in refused_here(packed_demo, dest=busy)
    assert "unknown split 'test'" in refused_here(packed_demo, "--splits", "train,test")
    assert "has no eval split to export as 'val'" in refused_here(packed_demo, "--splits", "val")
    assert "preference pairs (DPO)" in refused_here(preference_run.output)
    assert "carry a loss weight other than 1" in refused_here(weighted_demo[0])
    assert not (tmp_path / "dest").exists()


def test_gemma_bins_are_refused(family_run, tmp_path, capsys):
    assert "Gemma 3 and Gemma 4 bins" in refused(family_run("gemma3").output, tmp_path / "dest", capsys)
    assert not (tmp_path / "dest").exists()


def test_a_shard_changed_after_publishing_fails_the_export(packed_demo, tmp_path, capsys):
    changed = tmp_path / "changed"
    shutil.copytree(packed_demo / "packed", changed / "packed")
    shard = (
        changed
        / "packed"
        / json.loads((changed / "packed" / "manifest.json").read_text())["shards"][0]["path"]
    )
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert (
        cli.main(["export", "energon", "--out", str(changed), "--to", str(tmp_path / "dest")])
        == cli.EXIT_FAILED
    )
    assert "changed after pack published it" in capsys.readouterr().err
    assert not (tmp_path / "dest" / "mmpack_export.json").exists()
