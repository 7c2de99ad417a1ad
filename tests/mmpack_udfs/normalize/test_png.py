"""normalize.png against Pillow alone: on PNGs as encoders write them and as storage and bad
writers break them, probing with the zlib-ng check accepts, sizes and refuses (with the same
words) exactly as Pillow's own decode does, and it takes the fast path where it should."""

import io
import itertools
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from loader.vision import decode_image
from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import media, png
from mmpack_udfs.reasons import Rejected


def encode(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **options)
    return out.getvalue()


def chunks_of(data: bytes) -> list[tuple[bytes, bytes]]:
    """A well-formed PNG's chunks: (type, data)."""
    found, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        found.append((data[at + 4 : at + 8], data[at + 8 : at + 8 + length]))
        at += 12 + length
    return found


def build(chunks: list[tuple[bytes, bytes]]) -> bytes:
    """A PNG of these chunks, each with its correct CRC."""
    out = [b"\x89PNG\r\n\x1a\n"]
    for kind, body in chunks:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        out.append(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc))
    return b"".join(out)


def with_stream(data: bytes, stream: bytes, pieces: int = 1) -> bytes:
    """``data`` with its image data replaced by ``stream``, in ``pieces`` IDAT chunks."""
    chunks = chunks_of(data)
    first = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    rest = [c for c in chunks[first:] if c[0] != b"IDAT"]
    cuts = np.linspace(0, len(stream), pieces + 1).astype(int)
    idats = [(b"IDAT", stream[a:b]) for a, b in itertools.pairwise(cuts)]
    return build(chunks[:first] + idats + rest)


def stream_of(data: bytes) -> bytes:
    return b"".join(body for kind, body in chunks_of(data) if kind == b"IDAT")


def png_variants() -> dict[str, bytes]:
    """PNGs of every mode and layout the fast path takes or leaves to Pillow, and the ways
    they break: cut, bytes flipped, bad filter types, rows short or long, bad checksums,
    chunks where they should not be."""
    rng = random.Random(7)
    drawing = demo_data._drawing(97, 61, random.Random(5))
    noise = Image.fromarray(np.random.default_rng(3).integers(0, 256, (160, 160, 3), np.uint8))
    whole = {
        "rgb": encode(drawing),
        "rgba": encode(drawing.convert("RGBA")),
        "gray": encode(drawing.convert("L")),
        "gray_alpha": encode(drawing.convert("LA")),
        "palette": encode(drawing.convert("P")),
        "bilevel": encode(drawing.convert("1")),
        "gray_16bit": encode(drawing.convert("I;16")),
        "tiny": encode(drawing.resize((1, 1))),
        "multi_idat": encode(noise),
        "stored": encode(drawing, compress_level=0),
        "apng": encode(drawing, save_all=True, append_images=[drawing.rotate(90)]),
    }
    assert sum(kind == b"IDAT" for kind, _ in chunks_of(whole["multi_idat"])) >= 2
    variants = dict(whole)
    rgb = whole["rgb"]
    stream = stream_of(rgb)
    rows = bytearray(zlib.decompress(stream))
    stride = 1 + 97 * 3
    bad_filter = bytearray(rows)
    bad_filter[3 * stride] = 5
    noise_rows = bytearray(zlib.decompress(stream_of(whole["multi_idat"])))
    noise_rows[-(1 + 160 * 3)] = 9  # the last row's filter type, deep in the stream
    variants |= {
        "bad_filter_type_late": with_stream(whole["multi_idat"], zlib.compress(bytes(noise_rows))),
        "inflates_far_past": with_stream(rgb, zlib.compress(bytes(rows) + bytes(8 << 20))),
        "split_idat": with_stream(rgb, stream, pieces=3),
        "empty_idat_between": build(
            [c for c in chunks_of(rgb) if c[0] not in (b"IDAT", b"IEND")]
            + [(b"IDAT", stream[:50]), (b"IDAT", b""), (b"IDAT", stream[50:]), (b"IEND", b"")]
        ),
        "bad_filter_type": with_stream(rgb, zlib.compress(bytes(bad_filter))),
        "a_row_short": with_stream(rgb, zlib.compress(bytes(rows[:-stride]))),
        "a_row_long": with_stream(rgb, zlib.compress(bytes(rows + rows[-stride:]))),
        "half_a_row_short": with_stream(rgb, zlib.compress(bytes(rows[: -stride // 2]))),
        "no_checksum": with_stream(rgb, stream[:-4]),
        "bad_checksum": with_stream(rgb, stream[:-1] + bytes([stream[-1] ^ 1])),
        "junk_after_stream": with_stream(rgb, stream + b"\x00junk" * 5),
        "preset_dictionary": with_stream(rgb, _with_dictionary(bytes(rows))),
        "idat_bad_crc": rgb[:-16] + bytes([rgb[-16] ^ 0xFF]) + rgb[-15:],
        "interlace_flag": _with_ihdr_byte(rgb, 12, 1),
        "text_after_data": after_data(rgb, (b"tEXt", b"k\x00v")),
        "bad_ztxt_after_data": after_data(rgb, (b"zTXt", b"k\x00\x00not zlib")),
        # Pillow refuses text that inflates past 1 MB
        "ztxt_bomb_after_data": after_data(rgb, (b"zTXt", b"k\x00\x00" + zlib.compress(bytes(2 << 20)))),
        "short_phys_after_data": after_data(rgb, (b"pHYs", b"\x00\x01")),
        "text_between_idats": build(
            [c for c in chunks_of(rgb) if c[0] not in (b"IDAT", b"IEND")]
            + [(b"IDAT", stream[:40]), (b"tEXt", b"k\x00v"), (b"IDAT", stream[40:]), (b"IEND", b"")]
        ),
        "no_iend": rgb[:-12],
        "bytes_after_iend": rgb + b"\x00garbage" * 8,
        "header_only": rgb[: rgb.index(b"IDAT") - 4],
    }
    for name in ("rgb", "rgba", "multi_idat", "apng"):
        data = whole[name]
        for cut in (0.3, 0.6, 0.95):
            variants[f"{name}_cut_{cut}"] = data[: int(len(data) * cut)]
        start = data.index(b"IDAT") + 4
        end = data.rindex(b"IEND") - 8
        for flip in range(8):  # in the image data, then anywhere in the file
            broken = bytearray(data)
            at = rng.randrange(start, end) if flip < 5 else rng.randrange(8, len(data))
            broken[at] ^= 1 << rng.randrange(8)
            variants[f"{name}_flipped_{flip}"] = bytes(broken)
    return variants


def after_data(data: bytes, chunk: tuple[bytes, bytes]) -> bytes:
    """``data`` (image data last before IEND) with ``chunk`` between its image data and IEND."""
    return build([*chunks_of(data)[:-1], chunk, (b"IEND", b"")])


def _with_dictionary(rows: bytes) -> bytes:
    packer = zlib.compressobj(zdict=b"a preset dictionary")
    return packer.compress(rows) + packer.flush()


def _with_ihdr_byte(data: bytes, offset: int, value: int) -> bytes:
    chunks = chunks_of(data)
    header = bytearray(chunks[0][1])
    header[offset] = value
    return build([(b"IHDR", bytes(header)), *chunks[1:]])


def outcome(data: bytes, settings: media.ProbeSettings):
    """(MediaInfo, format) as normalize keeps the image, or (reason, detail)."""
    try:
        return media._probe_image("x.png", data, settings)
    except Rejected as rejected:
        return rejected.reason, rejected.detail


def takes_fast_path(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return png.image_data_decodes(image, data)
    except Exception:
        return False


@pytest.fixture(scope="module")
def variants():
    return png_variants()


@pytest.mark.parametrize("max_pixels", [89_478_485, 1_000])
def test_pngs_are_probed_as_pillow_alone_decides(variants, max_pixels, monkeypatch):
    """Every variant probes to the same MediaInfo or the same reason and words with the
    zlib-ng check as with Pillow's decode alone; the loader decodes what normalize keeps."""
    settings = media.ProbeSettings(max_image_pixels=max_pixels)
    checked = {name: outcome(data, settings) for name, data in variants.items()}
    monkeypatch.setattr(png, "zlib_ng", None)  # Pillow decodes every PNG
    for name, data in variants.items():
        assert checked[name] == outcome(data, settings), name
        info = checked[name][0]
        if isinstance(info, media.MediaInfo):
            assert decode_image(data).size == (info.width, info.height), name


def test_the_fast_path_takes_plain_pngs_and_leaves_the_rest_to_pillow(variants):
    taken = {name for name, data in variants.items() if takes_fast_path(data)}
    plain = {"rgb", "rgba", "gray", "gray_alpha", "tiny", "multi_idat", "stored", "split_idat"}
    harmless = {"empty_idat_between", "junk_after_stream", "idat_bad_crc", "bytes_after_iend"}
    assert plain | harmless <= taken
    left = {"palette", "bilevel", "gray_16bit", "apng", "interlace_flag", "text_after_data"}
    left |= {"bad_ztxt_after_data", "ztxt_bomb_after_data", "short_phys_after_data"}
    broken = {
        "bad_filter_type",
        "bad_filter_type_late",
        "inflates_far_past",
        "a_row_short",
        "a_row_long",
        "half_a_row_short",
        "no_checksum",
    }
    broken |= {"bad_checksum", "preset_dictionary", "text_between_idats", "no_iend"}
    assert not taken & (left | broken | {name for name in variants if "cut" in name})
