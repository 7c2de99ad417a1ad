"""The validate stage on real packed demo output: ok as published, and each kind of damage named."""

from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mmpack_udfs import cli
from mmpack_udfs.validate import stage as validate
from tests.conftest import demo_run

pytestmark = pytest.mark.spark


@pytest.fixture
def copy(packed_demo, tmp_path):
    """A copy of the packed demo output (its source table stays where the manifest says)."""
    out = tmp_path / "copy"
    shutil.copytree(packed_demo, out)
    return out


def rewrite_shard(out, change) -> None:
    """Rewrite the first shard with ``change(table)`` and update the manifest to match, so only
    the source reconciliation can notice."""
    manifest_path = out / "packed" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["shards"][0]
    path = out / "packed" / entry["path"]
    table = change(pq.read_table(path))
    pq.write_table(table, path, row_group_size=manifest["bins_per_row_group"], compression="zstd")
    data = path.read_bytes()
    figures = {
        "rows": table.num_rows,
        "samples": pc.sum(table["num_samples"]).as_py(),
        "tokens": pc.sum(table["num_tokens"]).as_py(),
        "bytes": len(data),
        "row_groups": pq.ParquetFile(path).num_row_groups,
    }
    for key in ("rows", "samples", "tokens", "bytes"):
        manifest["totals"]["bins" if key == "rows" else key] += figures[key] - entry[key]
    entry.update(figures, sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))


def test_a_published_packing_validates(spark, demo, packed_demo, capsys):
    summary = validate.run(spark, demo_run(demo, packed_demo))
    assert summary["ok"] and summary["problems"] == []
    assert (
        summary["source"]["checked"] and summary["source"]["rows"] == summary["samples"] + summary["skipped"]
    )
    assert json.loads((packed_demo / "report" / "validate.json").read_text())["ok"] is True
    assert "ok: every shard matches the manifest" in capsys.readouterr().out


def test_a_corrupt_shard_fails_with_exit_1_naming_it(demo, copy, capsys):
    manifest = json.loads((copy / "packed" / "manifest.json").read_text())
    shard = copy / "packed" / manifest["shards"][-1]["path"]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert cli.main(["validate", "--config", str(demo.config), "--out", str(copy)]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert manifest["shards"][-1]["path"] in err and "the manifest says" in err
    assert json.loads((copy / "report" / "validate.json").read_text())["ok"] is False


def test_a_lost_bin_is_caught_by_the_source_reconciliation(spark, demo, copy):
    rewrite_shard(copy, lambda table: table.slice(1))
    with pytest.raises(validate.ValidationError, match=r"source table in fewer training bins"):
        validate.run(spark, demo_run(demo, copy))


def test_a_duplicated_bin_is_caught(spark, demo, copy):
    import pyarrow as pa

    rewrite_shard(copy, lambda table: pa.concat_tables([table, table.slice(0, 1)]))
    with pytest.raises(validate.ValidationError, match=r"in more training bins than its copies"):
        validate.run(spark, demo_run(demo, copy))


def test_no_manifest_is_a_clear_failure(demo, tmp_path, capsys):
    assert cli.main(["validate", "--config", str(demo.config), "--out", str(tmp_path)]) == cli.EXIT_FAILED
    assert "no manifest at" in capsys.readouterr().err


def test_a_cost_index_that_disagrees_with_the_shards_is_named(spark, demo, copy):
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmpack_udfs import schemas
    from mmpack_udfs.pack import costs

    manifest_path = copy / "packed" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["cost_index"]
    index_path = copy / "packed" / entry["path"]
    index = pq.read_table(index_path)
    tokens = index["tokens"].to_numpy().copy()
    tokens[1] += 7  # a stale or hand-edited index, with a consistent hash
    edited = pa.Table.from_pydict({**index.to_pydict(), "tokens": tokens}, schema=schemas.COST_INDEX)
    data = costs.index_bytes(edited)
    index_path.write_bytes(data)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        validate.ValidationError, match=r"figures differ from the shards in 1 bin\(s\) \(rows 1\)"
    ):
        validate.run(spark, demo_run(demo, copy))
    index_path.write_bytes(data[:-3])
    with pytest.raises(validate.ValidationError, match="not the size and sha256"):
        validate.run(spark, demo_run(demo, copy))
