"""WebDataset tar input: the same samples as the same records in JSONL, bad tars and members
quarantined with reasons and counted, and tars on S3 read as local ones."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import boto3
import pytest

from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.demo.webdataset import REFERENCE_FORMS, tar_bytes, write_tars
from mmpack_udfs.io import fs
from mmpack_udfs.normalize import inputs, media, records
from mmpack_udfs.normalize.sharegpt import DatasetSpec
from mmpack_udfs.schemas import ROW_KIND_SAMPLE
from tests.corpus.build_corpus import hostile_tar


def inside(root: Path, path: str) -> bool:
    """A media file under ``root`` (a tar embeds bytes: an escape by link or .. has no meaning there)."""
    file = root / path
    return file.is_file() and not file.is_symlink() and file.resolve().is_relative_to(root.resolve())


@pytest.fixture(scope="module")
def demo_records(tmp_path_factory) -> tuple[list[dict], Path]:
    """The small demo's ShareGPT records (bad ones too) whose media all lie under their media
    root, and that root."""
    demo = demo_data.generate(tmp_path_factory.mktemp("demo"), samples=90, seed=5)
    root = demo.root / "media"
    found = []
    for line in (demo.root / "data" / "sharegpt.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        lists = (
            [record.get(kind) or [] for kind in ("images", "videos")] if isinstance(record, dict) else [None]
        )
        if all(isinstance(m, list) and all(isinstance(p, str) and inside(root, p) for p in m) for m in lists):
            found.append(record)
    return found, root


def read(paths: list[str], root: Path, storage: fs.Storage = fs.LOCAL) -> tuple[list[dict], int]:
    """Every raw record of ``paths`` (one dataset "d"), and the records the splits counted."""
    specs = {"d": DatasetSpec(name="d", paths=tuple(paths), media_root=str(root))}
    splits = inputs.plan_splits(inputs.list_inputs(list(specs.values()), storage), 1 << 20, storage)
    rows = [r for s in splits for r in inputs.read_split(s, storage, specs)]
    return [r for r in rows if r["records_read"] is None], sum(r["records_read"] or 0 for r in rows)


def normalized(raws: list[dict], root: Path, out: Path) -> list[dict]:
    specs = {"d": DatasetSpec(name="d", paths=("x",), media_root=str(root))}
    settings = records.NormalizeSettings(media.ProbeSettings(), media_dir=str(out))
    normalizer = records.RecordNormalizer(specs, settings)
    return [normalizer(raw) for raw in raws]


def content(row: dict) -> tuple:
    """What a sample holds whatever file it came from (its media by what they are, not where)."""
    if row["kind"] != ROW_KIND_SAMPLE:
        return row["kind"], row["reason"]
    fields = ("kind", "file_bytes", "width", "height", "frames", "fps", "duration")
    found = [tuple(m[f] for f in fields) for m in row["media"]]
    return row["system"], [tuple(t.values()) for t in row["turns"]], found, row["weight"]


def test_tars_give_the_samples_their_records_give_in_jsonl(demo_records, tmp_path):
    found, root = demo_records
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in found))
    tars = write_tars(found, root, tmp_path / "tars", keys_per_tar=4)
    from_jsonl, _ = read([str(jsonl)], root)
    from_tars, counted = read([str(tmp_path / "tars" / "*.tar")], root)
    assert counted == len(from_tars) == len(found) and len(tars) == -(-len(found) // 4)
    with_media = [r for r in found if r.get("images") or r.get("videos")]
    assert len(with_media) >= 9 and any(r.get("videos") for r in with_media)  # each reference form
    jsonl_rows = normalized(from_jsonl, root, tmp_path / "m1")
    tar_rows = normalized(from_tars, root, tmp_path / "m2")
    assert [content(r) for r in tar_rows] == [content(r) for r in jsonl_rows]
    forms = {
        i % len(REFERENCE_FORMS)
        for i, r in enumerate(tar_rows)
        if r["kind"] == ROW_KIND_SAMPLE and r["media"]
    }
    assert forms == {0, 1, 2}  # samples with media found by name, by extension and by neither
    first = from_tars[:4]  # positions: where each key's first member starts in its tar
    assert [r["source_position"] for r in first] == sorted({r["source_position"] for r in first})
    with tarfile.open(tars[0]) as tar:
        assert first[1]["source_position"] == next(m.offset for m in tar if m.name.startswith("000001."))


def test_bad_tars_and_members_are_quarantined_with_reasons_and_counted(demo_records, tmp_path):
    found, root = demo_records
    image = next((root / r["images"][0]).read_bytes() for r in found if r.get("images"))
    turns = {"conversations": [{"from": "human", "value": "<image> What?"}, {"from": "gpt", "value": "A."}]}
    text = {"conversations": [{"from": "human", "value": "What?"}, {"from": "gpt", "value": "B."}]}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.tar").write_bytes(
        tar_bytes([
            ("k/1.json", json.dumps(text).encode()),
            ("k/2.jpg", b"not an image at all"), ("k/2.json", json.dumps(turns).encode()),
            ("k/3.jpg", image),  # no JSON: not a record
            ("k/4.png", image), ("k/4.json", json.dumps(turns).encode()),
        ])
    )  # fmt: skip
    whole = tar_bytes(
        [(f"{k}.{e}", d) for k in "abc" for e, d in (("jpg", image), ("json", json.dumps(turns).encode()))]
    )
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        key_c = tar.getmember("c.jpg")
    (tmp_path / "in" / "b.tar").write_bytes(whole[: key_c.offset_data + len(image) // 2])  # ends in c's image
    (tmp_path / "in" / "c.tar").write_bytes(whole[: key_c.offset])  # ends between members, no end blocks
    raws, counted = read([str(tmp_path / "in" / "*.tar")], root)
    rows = normalized(raws, root, tmp_path / "m")
    assert counted == len(raws) == len(rows) == 9
    reasons = [r.get("reason") if r["kind"] != ROW_KIND_SAMPLE else "sample" for r in rows]
    # a.tar: keys 1 to 4; b.tar: keys a and b, then c cut; c.tar: key a, then b (it may have had more)
    assert reasons == ["sample", "media_unreadable", "missing_conversation", "sample",
                       "sample", "sample", "tar_unreadable", "sample", "tar_unreadable"]  # fmt: skip
    assert "k/3.jpg" in rows[2]["raw"] and "no .json member" in rows[2]["detail"]
    assert rows[6]["source_position"] == key_c.offset  # where the key being read starts
    assert "end-of-archive" in rows[8]["detail"]


def test_tars_on_s3_read_as_local_ones(demo_records, s3_bucket, tmp_path):
    found, root = demo_records
    tars = write_tars(found[:6], root, tmp_path / "tars", keys_per_tar=3)
    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for path in tars:
        client.upload_file(str(path), bucket, f"wds/{path.name}")
    storage = fs.Storage(fs.S3Options(endpoint_override=endpoint))
    remote, counted = read([f"s3://{bucket}/wds/*.tar"], root, storage)
    local, _ = read([str(tmp_path / "tars" / "*.tar")], root)
    keep = ("source_position", "raw", "error", "blobs")
    assert counted == 6 and [{k: r[k] for k in keep} for r in remote] == [
        {k: r[k] for k in keep} for r in local
    ]


def test_hostile_members_and_json_that_is_not_utf8_get_reasons_of_their_own(demo_records, tmp_path):
    """Found by hostile tars: a key's ``.json`` in Latin-1 is invalid_json (as a .jsonl line),
    not a record that lost its image; a link, folder or FIFO standing for a key's image is
    media_unreadable naming it; the tar's own folder entry is no record. The tar's media are
    all inline, so the dataset needs no media_root."""
    found, root = demo_records
    image = next((root / r["images"][0]).read_bytes() for r in found if r.get("images"))
    record = json.dumps(
        {
            "conversations": [
                {"from": "human", "value": "<image> Qu'est-ce?"},
                {"from": "gpt", "value": "Un café."},
            ]
        },
        ensure_ascii=False,
    )
    latin1 = record.encode("latin-1")
    assert latin1 != record.encode()  # "café" in Latin-1: not UTF-8
    irregular = {"b": tarfile.SYMTYPE, "c": tarfile.LNKTYPE, "d": tarfile.DIRTYPE, "e": tarfile.FIFOTYPE}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.tar").write_bytes(
        hostile_tar([
            ("shards", tarfile.DIRTYPE),
            ("shards/a.json", latin1), ("shards/a.jpg", image),
            *[m for k, kind in irregular.items() for m in ((f"shards/{k}.json", record.encode()),
                                                          (f"shards/{k}.jpg", kind))],
            ("shards/f.json", record.encode()), ("shards/f.jpg", image),
        ])
    )  # fmt: skip
    spec = DatasetSpec(name="d", paths=(str(tmp_path / "in" / "x.tar"),), media_root=None)
    splits = inputs.plan_splits(inputs.list_inputs([spec]), 1 << 20)
    raws = [r for s in splits for r in inputs.read_split(s, fs.LOCAL, {"d": spec})]
    counted = sum(r["records_read"] or 0 for r in raws)
    raws = [r for r in raws if r["records_read"] is None]
    settings = records.NormalizeSettings(media.ProbeSettings(), media_dir=str(tmp_path / "m"))
    rows = [records.RecordNormalizer({"d": spec}, settings)(raw) for raw in raws]
    assert counted == len(rows) == 6
    reasons = [r.get("reason") if r["kind"] != ROW_KIND_SAMPLE else "sample" for r in rows]
    assert reasons == ["invalid_json", *["media_unreadable"] * 4, "sample"]
    assert "shards/a.json is not UTF-8" in rows[0]["detail"]
    kinds = ["a symbolic link", "a hard link", "a directory", "a FIFO"]
    for row, (key, kind) in zip(rows[1:5], zip(irregular, kinds, strict=True), strict=True):
        assert f"shards/{key}.jpg ({kind}) is not a regular file" in row["detail"]


def test_a_dataset_without_media_root_takes_inline_media_and_quarantines_paths(demo_records, tmp_path):
    found, root = demo_records
    path = next(r["images"][0] for r in found if r.get("images"))
    inline = "data:image/jpeg;base64," + base64.b64encode((root / path).read_bytes()).decode()
    turns = [{"from": "human", "value": "<image> What?"}, {"from": "gpt", "value": "A."}]
    (tmp_path / "x.jsonl").write_text(
        "".join(json.dumps({"conversations": turns, "images": [m]}) + "\n" for m in (inline, path))
    )
    spec = DatasetSpec(name="d", paths=(str(tmp_path / "x.jsonl"),), media_root=None)
    (split,) = inputs.plan_splits(inputs.list_inputs([spec]), 1 << 20)  # no media_root to check
    raws = [r for r in inputs.read_split(split) if r["records_read"] is None]
    settings = records.NormalizeSettings(media.ProbeSettings(), media_dir=str(tmp_path / "m"))
    by_data_uri, by_path = (records.RecordNormalizer({"d": spec}, settings)(raw) for raw in raws)
    assert by_data_uri["kind"] == ROW_KIND_SAMPLE
    assert by_path["reason"] == "media_missing" and "has no media_root" in by_path["detail"]
