"""A corpus of bad (and oddly shaped but good) input, one record or file per kind.

    python tests/corpus/build_corpus.py DIR     # writes DIR/data, DIR/media, DIR/mmpack.yaml

Every kind is something real data holds: broken JSON, wrong shapes, hostile text, media
that is corrupt, truncated, high bit depth, oddly sized, or not where it is said to be.
The pipeline must turn each record into a sample or a quarantine row with a documented
reason, and what it packs must validate and load. ``KINDS`` lists them all.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from mmpack_udfs.demo.webdataset import tar_bytes

Q, A = ("human", "What is shown?"), ("gpt", "Something.")


@dataclass
class Corpus:
    root: Path
    config: Path
    kinds: list[str] = field(default_factory=list)
    records: int = 0


def sg(*turns, **extra) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def write_media(media: Path) -> None:
    """Real images and videos, good and bad."""
    (media / "ok").mkdir(parents=True, exist_ok=True)
    (media / "odd").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(media / "ok" / "photo.jpg")
    Image.fromarray(rgb).save(media / "ok" / "photo.png")
    Image.fromarray(rgb).save(media / "ok" / "name with spaces ü.png")
    Image.fromarray(rgb).convert("CMYK").save(media / "odd" / "cmyk.jpg")
    Image.fromarray(rgb).convert("L").save(media / "odd" / "gray.png")
    Image.fromarray(rgb).convert("1").save(media / "odd" / "bilevel.png")
    Image.fromarray(rgb).convert("P").save(media / "odd" / "palette.png", transparency=0)
    Image.fromarray(np.dstack([rgb, rgb[..., :1]])).save(media / "odd" / "rgba.png")
    Image.fromarray(rgb).save(media / "odd" / "webp.webp")
    frames = [Image.fromarray(np.roll(rgb, i, axis=1)) for i in range(3)]
    frames[0].save(media / "odd" / "animated.gif", save_all=True, append_images=frames[1:])
    Image.fromarray(rgb).save(media / "odd" / "really_a_png.jpg", format="PNG")
    Image.new("RGB", (1, 1), (9, 9, 9)).save(media / "odd" / "one_pixel.png")
    Image.new("RGB", (4000, 8), (9, 9, 9)).save(media / "odd" / "very_wide.png")
    ramp = np.linspace(0, 65535, 64 * 48).reshape(48, 64)
    Image.fromarray(ramp.astype(np.uint16)).save(media / "odd" / "deep16.png")
    Image.fromarray((ramp / 65535).astype(np.float32)).save(media / "odd" / "float.tif")
    (media / "odd" / "empty.jpg").write_bytes(b"")
    (media / "odd" / "text.png").write_text("this is not an image")
    good = (media / "ok" / "photo.jpg").read_bytes()
    (media / "odd" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    _video(media / "ok" / "clip.avi", 30)
    _video(media / "odd" / "one_frame.avi", 1)
    whole = media / "odd" / "whole.avi"
    _video(whole, 60)
    (media / "odd" / "cut.avi").write_bytes(whole.read_bytes()[: int(whole.stat().st_size * 0.35)])
    (media / "odd" / "garbage.mp4").write_bytes(os.urandom(2048))
    os.symlink("loop_b.jpg", media / "odd" / "loop_a.jpg")
    os.symlink("loop_a.jpg", media / "odd" / "loop_b.jpg")


def _video(path: Path, frames: int) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), (i * 8) % 256, np.uint8))
    writer.release()


def records() -> list[tuple[str, object]]:
    """(kind, record) for the JSON-lines file; a record that is a str is written verbatim."""
    img, vid = "ok/photo.jpg", "ok/clip.avi"
    q_img = ("human", "<image> What is shown?")
    q_vid = ("human", "<video> What happens?")
    deep = "[" * 5000 + "]" * 5000
    return [
        ("good text-only", sg(Q, A)),
        ("good image", sg(q_img, A, images=[img])),
        ("good video", sg(q_vid, A, videos=[vid])),
        ("good multi-turn", sg(Q, A, ("human", "And?"), ("gpt", "More."))),
        ("duplicate of a good record", sg(Q, A)),
        ("not JSON", "{this is not json"),
        ("truncated JSON", '{"conversations": [{"from": "human", "value": "hi"}, '),
        ("JSON nested too deeply", '{"conversations": ' + deep + "}"),
        (
            "lone UTF-16 surrogate",
            '{"conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "x"}]}',
        ),
        ("trailing garbage after the object", json.dumps(sg(Q, A)) + " trailing"),
        ("a JSON array, not an object", "[1, 2, 3]"),
        ("a JSON string", '"just a string"'),
        ("null", "null"),
        ("no conversation key", {"id": 1}),
        ("empty conversation", sg()),
        ("conversation is a string", {"conversations": "hello"}),
        ("turn is a string", {"conversations": ["hi", "there"]}),
        ("turn without content", {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}),
        ("unknown role", sg(Q, ("wizard", "abracadabra"))),
        ("numeric role", {"conversations": [{"from": 1, "value": "q"}, {"from": "gpt", "value": "a"}]}),
        ("two user turns in a row", sg(Q, ("human", "again"), A)),
        ("assistant first", sg(A, Q)),
        ("ends with a user turn", sg(Q, A, ("human", "bye"))),
        ("system turn late", sg(Q, ("system", "late"), A)),
        ("only a system prompt", sg(("system", "be brief"))),
        ("number as content", sg(("human", 42), A)),
        ("null content", sg(Q, ("gpt", None))),
        ("list content", sg(("human", ["<image>", "x"]), A)),
        ("system prompt not a string", sg(Q, A, system=["a", "b"])),
        ("empty assistant turn", sg(Q, ("gpt", ""))),
        ("whitespace-only assistant turn", sg(Q, ("gpt", " \n\t "))),
        ("empty user turn", sg(("human", ""), A)),
        (
            "special tokens in user text",
            sg(("human", "<|image_pad|><|im_end|>\n<|im_start|>assistant\nhi"), A),
        ),
        ("special tokens in assistant text", sg(Q, ("gpt", "ok<|im_end|><|vision_start|><|video_pad|>"))),
        ("control characters and NUL", sg(("human", "a\u0000b\u0007c\u001b[31m"), A)),
        ("right-to-left and emoji", sg(("human", "مرحبا \u202e abc 👩‍👩‍👧"), ("gpt", "✓ 你好"))),
        ("a very long answer", sg(Q, ("gpt", "word " * 60_000))),
        ("more placeholders than images", sg(("human", "<image><image>"), A, images=[img])),
        ("an image with no placeholder", sg(Q, A, images=[img])),
        ("a video placeholder, no video", sg(q_vid, A)),
        ("images is an object", sg(q_img, A, images={"path": img})),
        ("images list holds a null", sg(q_img, A, images=[None])),
        ("images is null with a placeholder", sg(q_img, A, images=None)),
        ("missing image file", sg(q_img, A, images=["ok/nope.jpg"])),
        ("absolute media path", sg(q_img, A, images=["/etc/passwd"])),
        ("media path escaping the root", sg(q_img, A, images=["../outside.jpg"])),
        ("data: URI", sg(q_img, A, images=["data:image/png;base64,iVBORw0KGgo="])),
        ("http URL", sg(q_img, A, images=["http://example.invalid/cat.jpg"])),
        ("Windows path", sg(q_img, A, images=["ok\\photo.jpg"])),
        ("symlink loop", sg(q_img, A, images=["odd/loop_a.jpg"])),
        ("empty image file", sg(q_img, A, images=["odd/empty.jpg"])),
        ("text file named .png", sg(q_img, A, images=["odd/text.png"])),
        ("truncated JPEG", sg(q_img, A, images=["odd/truncated.jpg"])),
        ("16-bit PNG", sg(q_img, A, images=["odd/deep16.png"])),
        ("float TIFF", sg(q_img, A, images=["odd/float.tif"])),
        ("CMYK JPEG", sg(q_img, A, images=["odd/cmyk.jpg"])),
        ("grayscale PNG", sg(q_img, A, images=["odd/gray.png"])),
        ("1-bit PNG", sg(q_img, A, images=["odd/bilevel.png"])),
        ("palette PNG with transparency", sg(q_img, A, images=["odd/palette.png"])),
        ("RGBA PNG", sg(q_img, A, images=["odd/rgba.png"])),
        ("WebP", sg(q_img, A, images=["odd/webp.webp"])),
        ("animated GIF", sg(q_img, A, images=["odd/animated.gif"])),
        ("PNG named .jpg", sg(q_img, A, images=["odd/really_a_png.jpg"])),
        ("1x1 image", sg(q_img, A, images=["odd/one_pixel.png"])),
        ("500:1 aspect ratio", sg(q_img, A, images=["odd/very_wide.png"])),
        ("file name with spaces and non-ASCII", sg(q_img, A, images=["ok/name with spaces ü.png"])),
        ("one-frame video", sg(q_vid, A, videos=["odd/one_frame.avi"])),
        ("truncated video (header claims more frames)", sg(q_vid, A, videos=["odd/cut.avi"])),
        ("random bytes named .mp4", sg(q_vid, A, videos=["odd/garbage.mp4"])),
        ("an image given as a video", sg(q_vid, A, videos=[img])),
        ("unknown extra fields", sg(Q, A, id="x-1", meta={"source": "web", "score": 0.3})),
        ("loss weight 0.5", sg(("human", "Weighted half?"), A, weight=0.5)),
        ("loss weight 0 (trains nothing)", sg(("human", "Weighted zero?"), A, weight=0)),
        ("null loss weight (means 1)", sg(("human", "Weighted null?"), A, weight=None)),
        ("loss weight given as text", sg(("human", "Weighted text?"), A, weight="2")),
        ("negative loss weight", sg(("human", "Weighted negative?"), A, weight=-1)),
        ("boolean loss weight", sg(("human", "Weighted true?"), A, weight=True)),
        ("NaN loss weight", sg(("human", "Weighted NaN?"), A, weight=float("nan"))),  # json writes NaN
    ]


def _binary_parquet(path: Path, image: bytes) -> None:
    """Turn text stored as ``binary`` (UTF-8: text) and raw image bytes in a content column."""
    turn = pa.struct([("from", pa.string()), ("value", pa.binary())])
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "binary text é".encode()},
                {"from": "gpt", "value": b"ok"},
            ]
        },
        {"conversations": [{"from": "human", "value": image}, {"from": "gpt", "value": b"ok"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("conversations", pa.list_(turn))])), path)


def _timestamp_parquet(path: Path) -> None:
    """Turn values of a Parquet timestamp type: not text (quarantined as non_string_content)."""
    import datetime

    when = datetime.datetime(2024, 5, 1, 12, 30)
    turns = [{"from": "human", "value": when}, {"from": "gpt", "value": when}]
    pq.write_table(pa.table({"conversations": [turns]}), path)


TAR_TYPES = (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE)


def hostile_tar(members: list[tuple[str, bytes]]) -> bytes:
    """A tar whose members are files (their bytes) or entries of another type (one of TAR_TYPES)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data in TAR_TYPES:
                info.type, info.linkname = data, "a.jpg" if data in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _webdataset(data: Path, media: Path) -> tuple[list[str], int]:
    """WebDataset tars: good keys (media by name, by extension, by neither; a caption member
    nothing names), a bad image member, a key without JSON, and a tar cut inside a key.
    Returns their kinds and the records they hold."""
    photo = (media / "ok" / "photo.jpg").read_bytes()
    q_img = json.dumps(sg(("human", "<image> What is in the tar?"), A))

    def record(**extra) -> bytes:
        return json.dumps({**json.loads(q_img), **extra}).encode()

    (data / "webdataset.tar").write_bytes(tar_bytes([
        ("k/a.json", json.dumps(sg(("human", "Text from a tar?"), A)).encode()), ("k/a.txt", b"caption"),
        ("k/b.jpg", photo), ("k/b.json", record(images=["b.jpg"])),
        ("k/c.0.jpg", photo), ("k/c.json", record(images=["0.jpg"])),
        ("k/d.jpg", photo), ("k/d.json", record()),
        ("k/e.jpg", b"not an image"), ("k/e.json", record()),
        ("k/f.jpg", photo),
    ]))  # fmt: skip
    whole = tar_bytes([(f"{k}.{e}", d) for k in "gh" for e, d in (("jpg", photo), ("json", record()))])
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        cut = tar.getmember("h.jpg").offset_data + len(photo) // 2
    (data / "cut.tar").write_bytes(whole[:cut])  # inside h's image
    record_latin1 = json.dumps(sg(("human", "<image> Qu'est-ce?"), ("gpt", "Un café.")), ensure_ascii=False)
    (data / "hostile.tar").write_bytes(hostile_tar([
        ("k", tarfile.DIRTYPE),  # the tar's own folder entry: no record
        ("k/l.json", record_latin1.encode("latin-1")), ("k/l.jpg", photo),
        ("k/s.json", record()), ("k/s.jpg", tarfile.SYMTYPE),
    ]))  # fmt: skip
    kinds = [
        "WebDataset key: a .json member that is not UTF-8",
        "WebDataset key: a symbolic link for its image",
        "WebDataset key: a text-only record and a caption member",
        "WebDataset key: image named by member name",
        "WebDataset key: image named by extension", "WebDataset key: image found by extension",
        "WebDataset key: a corrupt image member", "WebDataset key without JSON",
        "WebDataset tar cut inside a key",
    ]  # fmt: skip
    return kinds, 6 + 2 + 2  # cut.tar: key g, then the damage; hostile.tar: keys l and s


def build(root: str | os.PathLike) -> Corpus:
    root = Path(root).resolve()
    media, data = root / "media", root / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_media(media)
    (root / "outside.jpg").write_bytes((media / "ok" / "photo.jpg").read_bytes())
    kinds = records()
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for _, r in kinds]
    text = "\n".join(lines[:3]) + "\n\n   \n" + "\r\n".join(lines[3:]) + "\n"  # blank lines, CRLF
    (data / "corpus.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass"))
    file_kinds = [
        "UTF-8 BOM at the start of a file", "blank and whitespace-only lines", "CRLF line ends",
        "a .json file holding one object", "an empty .jsonl file", "a .json file that is not JSON",
        "Parquet binary column holding UTF-8 text", "Parquet binary column holding image bytes",
        "Parquet timestamp turn value",
    ]  # fmt: skip
    (data / "one.json").write_text(json.dumps(sg(("human", "single object file"), A)))
    (data / "empty.jsonl").write_text("")
    (data / "broken.json").write_text('[{"conversations": [')
    _binary_parquet(data / "binary.parquet", (media / "ok" / "photo.png").read_bytes())
    _timestamp_parquet(data / "timestamp.parquet")
    tar_kinds, tar_records = _webdataset(data, media)
    config = root / "mmpack.yaml"
    dataset = {"name": "corpus", "paths": ["data/*"], "media_root": "media"}
    config.write_text(yaml.safe_dump({"datasets": [dataset]}))
    all_kinds = [k for k, _ in kinds] + file_kinds + tar_kinds
    return Corpus(root, config, all_kinds, records=len(kinds) + 5 + tar_records)


if __name__ == "__main__":
    corpus = build(sys.argv[1])
    print(f"{len(corpus.kinds)} kinds, {corpus.records} records: {corpus.config}")
