import json

import pyarrow as pa
from PIL import Image

from mmpack_udfs.normalize import media, records
from mmpack_udfs.normalize.sharegpt import DatasetSpec
from mmpack_udfs.schemas import ROW_KIND_QUARANTINE, ROW_KIND_SAMPLE, ROW_KIND_SPLIT


def normalizer(tmp_path, max_raw_chars=1 << 20):
    spec = DatasetSpec(name="d", paths=("x",), media_root=str(tmp_path))
    settings = records.NormalizeSettings(media.ProbeSettings(), max_raw_chars=max_raw_chars)
    return records.RecordNormalizer({"d": spec}, settings)


def raw(text, error=None, position=5, read=None):
    return {
        "dataset": "d",
        "source_file": "/in/x.jsonl",
        "source_position": position,
        "raw": text,
        "error": error,
        "records_read": read,
    }


def test_valid_record_becomes_a_sample_row(tmp_path):
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    row = normalizer(tmp_path)(raw(json.dumps(record)))
    assert row["kind"] == ROW_KIND_SAMPLE and row["media"] == [] and row["system"] is None
    assert row["turns"] == [{"role": "user", "text": "hi"}, {"role": "assistant", "text": "yo"}]
    assert (row["source_file"], row["source_position"]) == ("/in/x.jsonl", 5)


def test_bad_json_is_quarantined_with_the_raw_text_truncated(tmp_path):
    row = normalizer(tmp_path, max_raw_chars=4)(raw("{not json at all"))
    assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == "invalid_json"
    assert row["raw"] == "{not" and row["raw_truncated"] is True


def test_decode_errors_from_the_reader_keep_their_reason(tmp_path):
    row = normalizer(tmp_path)(raw("[{", error="invalid_json: Expecting value"))
    assert (row["reason"], row["detail"]) == ("invalid_json", "Expecting value")


def test_split_summary_rows_pass_through(tmp_path):
    row = normalizer(tmp_path)(raw(None, position=-1, read=12))
    assert row["kind"] == ROW_KIND_SPLIT and row["records_read"] == 12


def image_record(name):
    return {
        "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
        "images": [name],
    }


def test_a_file_is_decoded_once_per_worker_until_it_changes_and_a_missing_one_is_quarantined_every_time(
    tmp_path, monkeypatch
):
    """The probe cache outlives a task (Spark reuses a Python worker for task after task), so it
    is keyed by the file's size and modification time: a file rewritten between runs is probed
    again, never served from the cache."""
    monkeypatch.setattr(records, "_file_probes", records.ProbeCache())
    decoded = []
    real = media.probe_file
    monkeypatch.setattr(media, "probe_file", lambda *a, **k: decoded.append(a[1]) or real(*a, **k))
    Image.new("RGB", (40, 30)).save(tmp_path / "a.png")
    first_task, second_task = normalizer(tmp_path), normalizer(tmp_path)
    rows = [
        task(raw(json.dumps(image_record("a.png")), position=p))
        for p, task in enumerate([first_task, second_task])
    ]
    assert [r["media"][0]["width"] for r in rows] == [40, 40] and len(decoded) == 1

    Image.new("RGB", (80, 30)).save(tmp_path / "a.png")  # another size, another file status
    row = normalizer(tmp_path)(raw(json.dumps(image_record("a.png"))))
    assert row["media"][0]["width"] == 80 and len(decoded) == 2

    n = normalizer(tmp_path)
    rows = [n(raw(json.dumps(image_record("gone.jpg")), position=p)) for p in range(3)]
    assert [r["reason"] for r in rows] == ["media_missing"] * 3
    assert len(decoded) == 2  # nothing to decode: the file's status says it is missing


def test_json_nested_too_deeply_is_quarantined_not_a_crash(tmp_path):
    deep = "[" * 10_000 + "]" * 10_000
    row = normalizer(tmp_path)(raw('{"conversations": ' + deep + "}"))
    assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == "invalid_json"
    assert "nested too deeply" in row["detail"]


def test_a_lone_surrogate_is_quarantined_not_a_crash(tmp_path):
    text = '{"conversations": [{"from": "human", "value": "a\\ud800b"}, {"from": "gpt", "value": "x"}]}'
    row = normalizer(tmp_path)(raw(text))
    assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == "invalid_json"
    assert "surrogate" in row["detail"] and row["raw"] == text
    paired = text.replace("\\ud800", "\\ud83d\\ude00")  # a valid pair (an emoji) is fine
    assert normalizer(tmp_path)(raw(paired))["kind"] == ROW_KIND_SAMPLE


def test_parquet_binary_content_is_never_text_nor_a_bytes_repr(tmp_path):
    """Bytes are not text, UTF-8 or not: the turn is non_string_content, as a timestamp is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmpack_udfs.normalize import inputs

    png = b"\x89PNG\r\n\x1a\n\x00\x00"
    schema = pa.schema(
        [("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.binary())])))]
    )
    rows = [
        {"conversations": [{"from": "human", "value": "hé".encode()}, {"from": "gpt", "value": b"yo"}]},
        {"conversations": [{"from": "human", "value": png}, {"from": "gpt", "value": b"yo"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "x.parquet")
    spec = DatasetSpec(name="d", paths=(str(tmp_path / "x.parquet"),), media_root=str(tmp_path))
    (split,) = inputs.plan_splits(inputs.list_inputs([spec]), 1 << 20)
    raws = [r for r in inputs.read_split(split) if r["records_read"] is None]
    assert all("b'" not in r["raw"] for r in raws)
    for row in (normalizer(tmp_path)(r) for r in raws):
        assert row["kind"] == ROW_KIND_QUARANTINE and row["reason"] == "non_string_content"
        assert "a binary value" in row["detail"] and "string column" in row["detail"]


def test_a_large_spark_batch_is_normalized_a_chunk_at_a_time(tmp_path):
    """A task holds CHUNK_ROWS records as Python objects at a time, whatever the batch size."""
    from mmpack_udfs.normalize.inputs import RAW

    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    texts = [json.dumps({"conversations": turns, "id": i}) for i in range(2 * records.CHUNK_ROWS + 7)]
    rows = [raw(text, position=i) for i, text in enumerate(texts)]
    batch = pa.RecordBatch.from_pylist(rows, schema=RAW)
    spec = DatasetSpec(name="d", paths=("x",), media_root=str(tmp_path))
    settings = records.NormalizeSettings(media.ProbeSettings())
    out = list(records.normalize_batches(iter([batch]), {"d": spec}, settings))
    assert [b.num_rows for b in out] == [records.CHUNK_ROWS, records.CHUNK_ROWS, 7]
    normalized = pa.Table.from_batches(out)
    assert normalized["source_position"].to_pylist() == list(range(len(texts)))
    assert set(normalized["kind"].to_pylist()) == {"sample"}


def test_a_worker_that_normalizes_imports_no_config_models():
    """A Python worker's first normalize task imports what its task needs, not the driver's
    pydantic config (about 0.2 s of each worker's start)."""
    import subprocess
    import sys

    check = "import sys, mmpack_udfs.normalize.records; assert 'pydantic' not in sys.modules, 'pydantic'"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
