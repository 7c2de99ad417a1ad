import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpack_udfs.normalize import inputs
from mmpack_udfs.normalize.sharegpt import DatasetSpec


def records_of(files, split_bytes):
    """Every (file, position, raw, error) the splits yield, and the per-split counts."""
    out, counted = [], 0
    for split in inputs.plan_splits(files, split_bytes):
        for row in inputs.read_split(split):
            if row["records_read"] is None:
                out.append((row["source_file"], row["source_position"], row["raw"], row["error"]))
            else:
                counted += row["records_read"]
    return out, counted


def one_file(path, dataset="d"):
    spec = DatasetSpec(name=dataset, paths=(str(path),), media_root=str(path.parent))
    return inputs.list_inputs([spec])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.text(alphabet="ab{}é\r \t", max_size=30), max_size=25),
    trailing_newline=st.booleans(),
    split_bytes=st.integers(min_value=1, max_value=80),
    block=st.sampled_from([1, 2, 5, 13, 8 << 20]),
)
def test_jsonl_byte_range_splits_yield_every_line_once(
    tmp_path_factory, monkeypatch, lines, trailing_newline, split_bytes, block
):
    """Every line once, at its byte offset, whatever the splits and the blocks a split is cut
    into lines by (``JSONL_BLOCK``: a block may end inside a line, or hold none whole); the
    task's batches (``read_splits_batches``) hold the same records."""
    monkeypatch.setattr(inputs, "JSONL_BLOCK", block)
    path = tmp_path_factory.mktemp("jsonl") / "x.jsonl"
    data = "\n".join(lines) + ("\n" if trailing_newline and lines else "")
    path.write_bytes(data.encode())
    expected, offset = [], 0
    for line in lines:
        if line.encode().strip():
            expected.append((offset, line.rstrip("\r")))
        offset += len(line.encode()) + 1
    files = one_file(path)
    got, counted = records_of(files, split_bytes)
    assert sorted((pos, raw) for _, pos, raw, _ in got) == expected
    assert counted == len(expected)
    splits = inputs.splits_table(inputs.plan_splits(files, split_bytes))
    batched = pa.Table.from_batches(list(inputs.read_splits_batches(iter(splits.to_batches()))), inputs.RAW)
    rows = [r for r in batched.to_pylist() if r["records_read"] is None]
    assert sorted((r["source_position"], r["raw"]) for r in rows) == expected
    assert sum(r["records_read"] or 0 for r in batched.to_pylist()) == len(expected)


def test_a_line_that_is_not_utf8_is_flagged_and_its_block_keeps_every_other_line(tmp_path):
    """The block of the bad line is decoded line by line: the good lines around it are records
    as usual, with their carriage returns and the BOM removed; the bad one is kept as read
    (its bytes replaced, for the quarantine row)."""
    (tmp_path / "x.jsonl").write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"b": "\xff\xfe"}\r\n\n{"c": 3}')
    got, counted = records_of(one_file(tmp_path / "x.jsonl"), 1 << 20)
    assert counted == 3
    assert [(pos, raw) for _, pos, raw, _ in got] == [
        (0, '{"a": 1}'),
        (13, '{"b": "\ufffd\ufffd"}\r'),
        (27, '{"c": 3}'),
    ]
    assert [error is None for *_, error in got] == [True, False, True]
    assert got[1][3].startswith("invalid_json: not UTF-8: ")


def test_json_array_positions_and_lone_object(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"k": 1}, {"k": 2}]))
    (tmp_path / "b.json").write_text(json.dumps({"k": 3}, indent=2))
    got, counted = records_of(one_file(tmp_path), 1 << 20)
    assert [(p, json.loads(r)["k"]) for _, p, r, _ in got] == [(0, 1), (1, 2), (0, 3)]
    assert counted == 3


def test_invalid_json_file_is_one_invalid_record(tmp_path):
    (tmp_path / "bad.json").write_text('[{"k": 1}, {"k": ')
    got, counted = records_of(one_file(tmp_path), 1 << 20)
    assert counted == 1 and got[0][3].startswith("invalid_json")


def test_json_file_of_json_lines_is_read_as_jsonl(tmp_path):
    (tmp_path / "lines.json").write_text('{"k": 1}\n{"k": 2}\n')
    assert one_file(tmp_path)[0].format == "jsonl"


def test_non_utf8_line_is_flagged(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    got, _ = records_of(one_file(tmp_path), 1 << 20)
    assert got[0][3] is None and got[1][3].startswith("invalid_json")


def test_parquet_row_groups_keep_file_positions(tmp_path):
    table = pa.table({"conversations": [[{"from": "human", "value": str(i)}] for i in range(10)]})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=3)
    files = one_file(tmp_path)
    assert len(inputs.plan_splits(files, 1 << 20)) == 4
    got, counted = records_of(files, 1 << 20)
    assert sorted(p for _, p, _, _ in got) == list(range(10)) and counted == 10
    assert all(json.loads(r)["conversations"][0]["value"] == str(p) for _, p, r, _ in got)


def test_unknown_extension_and_empty_match_are_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(inputs.InputError, match="format"):
        one_file(tmp_path)
    with pytest.raises(inputs.InputError, match="no input files"):
        one_file(tmp_path / "*.jsonl")


def test_globs_and_directories_expand_sorted_and_skip_hidden(tmp_path):
    for name in ("b.jsonl", "a.jsonl", ".hidden.jsonl", "sub/c.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    names = [f.uri.rsplit("/", 1)[1] for f in one_file(tmp_path)]
    assert names == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert len(one_file(tmp_path / "*.jsonl")) == 2


@pytest.mark.parametrize(
    ("name", "split_bytes"), [("x.jsonl", 1 << 20), ("x.jsonl", 7), ("lines.json", 1 << 20)]
)
def test_a_utf8_bom_does_not_cost_the_first_record(tmp_path, name, split_bytes):
    (tmp_path / name).write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    got, counted = records_of(one_file(tmp_path), split_bytes)
    assert counted == 2 and [(raw, error) for _, _, raw, error in got] == [
        ('{"a": 1}', None),
        ('{"a": 2}', None),
    ]


def test_a_json_file_nested_too_deeply_is_one_invalid_record(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 10_000 + "]" * 10_000)
    got, counted = records_of(one_file(tmp_path), 1 << 20)
    assert counted == 1 and got[0][3] == "invalid_json: nested too deeply to parse"


def test_a_media_root_that_does_not_exist_fails_up_front(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    spec = DatasetSpec(name="d", paths=(str(tmp_path / "x.jsonl"),), media_root=str(tmp_path / "nope"))
    with pytest.raises(inputs.InputError, match=r"media_root \S*nope is not a directory"):
        inputs.list_inputs([spec])


def test_a_json_lines_file_named_json_with_a_broken_first_line_keeps_its_good_records(tmp_path):
    (tmp_path / "lines.json").write_text('{"broken": \n{"k": 1}\n{"k": 2}\n')
    assert one_file(tmp_path)[0].format == "jsonl"
    got, counted = records_of(one_file(tmp_path), 1 << 20)
    assert counted == 3 and [raw for _, _, raw, _ in got] == ['{"broken": ', '{"k": 1}', '{"k": 2}']
    (tmp_path / "lines.json").write_text('{\n  "pretty": {\n    "k": 1\n  }\n}\n')  # one pretty object
    assert one_file(tmp_path)[0].format == "json"


def test_parquet_inputs_on_s3_are_split_by_their_row_groups(s3_bucket, tmp_path):
    import boto3

    from mmpack_udfs.io import fs

    endpoint, bucket = s3_bucket
    local = tmp_path / "rows.parquet"
    rows = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(6)
    ]
    pq.write_table(pa.Table.from_pylist(rows), local, row_group_size=2)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").upload_file(
        str(local), bucket, "in/rows.parquet"
    )
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint))
    spec = DatasetSpec(name="d", paths=(f"s3://{bucket}/in/*.parquet",), media_root=f"s3://{bucket}/m")
    splits = inputs.plan_splits(inputs.list_inputs([spec], storage), 1 << 20, storage)
    assert [s.start for s in splits] == [0, 1, 2]
    read = [r for s in splits for r in inputs.read_split(s, storage) if r["records_read"] is None]
    assert [r["source_position"] for r in read] == list(range(6))


def test_parquet_values_json_has_no_type_for_are_never_text(tmp_path):
    """A timestamp, date or decimal turn value is quarantined as non-string content, naming
    its type; the same types in a column the record does not read change nothing."""
    import datetime
    import decimal

    from mmpack_udfs.normalize.records import parse_record
    from mmpack_udfs.normalize.sharegpt import Rejected
    from mmpack_udfs.reasons import Reason

    when = datetime.datetime(2024, 5, 1, 12, 30)
    values = {"timestamp": when, "date": when.date(), "decimal": decimal.Decimal("1.50")}
    turns = pa.table(
        {
            name: pa.array([[{"from": "human", "value": value}, {"from": "gpt", "value": value}]])
            for name, value in values.items()
        }
    )
    text = [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]]
    pq.write_table(turns.append_column("conversations", pa.array(text)).append_column("at", pa.array([when])),
                   tmp_path / "x.parquet")  # fmt: skip
    ((_, _, raw, error),), _ = records_of(one_file(tmp_path), 1 << 20)
    record = json.loads(raw)
    assert error is None and parse_record(record, DatasetSpec(name="d", paths=("x",), media_root=""))
    for name, kind in (("timestamp", "datetime"), ("date", "date"), ("decimal", "Decimal")):
        spec = DatasetSpec(name="d", paths=("x",), media_root="", columns=(("messages", name),))
        with pytest.raises(Rejected) as rejected:
            parse_record(record, spec)
        assert rejected.value.reason == Reason.NON_STRING_CONTENT and f"a {kind} value" in str(rejected.value)


def test_jsonl_is_cut_finer_where_that_gives_every_task_a_split():
    def jsonl(size):
        return inputs.InputFile("d", f"/x/{size}.jsonl", "jsonl", size, 0)

    parquet = inputs.InputFile("d", "/x/p.parquet", "parquet", 1 << 30, 0)
    mib = 1 << 20
    assert inputs.jsonl_split_bytes([jsonl(160 * mib)], 64 * mib, 4) == 40 * mib
    assert inputs.jsonl_split_bytes([jsonl(100 * mib), jsonl(60 * mib)], 64 * mib, 8) == 20 * mib
    assert inputs.jsonl_split_bytes([jsonl(1 << 40)], 64 * mib, 4) == 64 * mib  # never above the setting
    assert inputs.jsonl_split_bytes([jsonl(3 * mib), parquet], 64 * mib, 4) == inputs.MIN_SPLIT_BYTES
    assert inputs.jsonl_split_bytes([jsonl(3 * mib)], 1000, 4) == 1000  # a smaller setting stands
    assert len(inputs.plan_splits([jsonl(160 * mib)], 40 * mib)) == 4
