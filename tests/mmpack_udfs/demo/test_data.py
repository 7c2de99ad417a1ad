import hashlib
import json
import re
from collections import Counter

from mmpack_udfs.demo import data as demo_data


def digest(root):
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_same_seed_same_dataset_other_seed_other_records(tmp_path):
    a = demo_data.generate(tmp_path / "a", samples=40, seed=3)
    b = demo_data.generate(tmp_path / "b", samples=40, seed=3)
    c = demo_data.generate(tmp_path / "c", samples=40, seed=4)
    da, db, dc = digest(a.root), digest(b.root), digest(c.root)
    data = [k for k in da if k.startswith("data/")]
    assert len(data) == 3
    assert {k: da[k] for k in data} == {k: db[k] for k in data}
    assert da["data/sharegpt.jsonl"] != dc["data/sharegpt.jsonl"]
    images = [k for k in da if k.startswith("media/images/")]
    assert {k: da[k] for k in images} == {k: db[k] for k in images}
    assert a.records == b.records and a.bad_records > 25


def test_media_is_varied_and_real(tmp_path):
    from PIL import Image

    demo = demo_data.generate(tmp_path, samples=200, seed=0)
    images = sorted((demo.root / "media" / "images").iterdir())
    sizes = {Image.open(p).size for p in images}
    assert {p.suffix for p in images} == {".jpg", ".png"} and len(sizes) >= 8
    assert {p.suffix for p in (demo.root / "media" / "videos").iterdir()} == {".mp4", ".avi"}


def test_the_preference_demo_is_deterministic_with_real_images(tmp_path):
    from PIL import Image

    from mmpack_udfs.demo import preference

    a = preference.generate(tmp_path / "a", pairs=12, seed=3)
    b = preference.generate(tmp_path / "b", pairs=12, seed=3)
    c = preference.generate(tmp_path / "c", pairs=12, seed=4)
    da, dc = digest(a.root), digest(c.root)
    assert da == digest(b.root) and da["data/trl.jsonl"] != dc["data/trl.jsonl"]
    files = ("data/ranking.jsonl", "data/trl.jsonl", "data/openai_preference.jsonl", "mmpack-dpo.yaml")
    assert set(files) <= set(da)
    assert (a.records, a.bad_records) == (12 + 9, 9)  # one bad pair per reason in each of the 3 files
    for image in (a.root / "media" / "images").iterdir():
        with Image.open(image) as opened:
            opened.verify()


def image_references(root) -> Counter:
    """How often each image file is referenced by the demo's records (all three files)."""
    import pyarrow.parquet as pq

    text = (root / "data" / "sharegpt.jsonl").read_text() + (root / "data" / "openai.json").read_text()
    text += json.dumps(pq.read_table(root / "data" / "custom.parquet").to_pylist())
    return Counter(re.findall(r"img_\d{5}\.(?:jpg|png)", text))


def test_media_reuse_makes_most_images_appear_once(tmp_path):
    pooled = image_references(demo_data.generate(tmp_path / "pool", samples=300, seed=2).root)
    assert sum(pooled.values()) / len(pooled) > 5  # the default: a small pool, reused a lot

    realistic = demo_data.generate(tmp_path / "real", samples=300, seed=2, media_reuse=0.1)
    refs = image_references(realistic.root)
    once = sum(n == 1 for n in refs.values())
    assert once / len(refs) > 0.75 and max(refs.values()) <= 6
    files = {p.name for p in (realistic.root / "media" / "images").iterdir()}
    assert set(refs) <= files and len(files) > 300
    again = demo_data.generate(tmp_path / "again", samples=300, seed=2, media_reuse=0.1)
    assert digest(again.root) == digest(realistic.root)


def test_a_large_json_dataset_is_split_into_files_the_config_names(tmp_path, monkeypatch):
    """One task parses a JSON array whole, so a large demo writes it in bounded files."""
    whole = demo_data.generate(tmp_path / "whole", samples=120, seed=5)
    monkeypatch.setattr(demo_data, "JSON_FILE_RECORDS", 15)
    split = demo_data.generate(tmp_path / "split", samples=120, seed=5)
    files = sorted((split.root / "data").glob("openai-*.json"))
    assert len(files) >= 3 and not (split.root / "data" / "openai.json").exists()
    parts = [json.loads(f.read_text()) for f in files]
    assert all(len(p) <= 15 for p in parts)
    assert [r for p in parts for r in p] == json.loads((whole.root / "data" / "openai.json").read_text())
    config = split.config.read_text()
    assert all(f"data/{f.name}" in config for f in files) and split.records == whole.records
