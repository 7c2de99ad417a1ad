"""A PNG's image data checked the way Pillow's decoder reads it, at a fraction of its cost.

Normalize decodes every image so that it can quarantine the ones the loader (Pillow) would
fail on. For a PNG, nearly all of Pillow's ``load()`` is inflating the image data through the
system's zlib (1.2.13 on Debian 12) and unfiltering its rows into pixels that normalize then
throws away. ``image_data_decodes`` inflates the same stream with zlib-ng, the maintained fork
of zlib whose inflate keeps zlib's checks and so accepts and rejects the same streams, and
then checks the one thing Pillow's decoder checks per row: the filter type.

It answers True only where Pillow's ``load()`` cannot fail:

- an 8-bit, non-interlaced L, LA, RGB or RGBA image that Pillow has already opened (chunks
  before the image data parsed, their CRCs checked);
- IDAT chunks in one run, followed directly by IEND, with no animation chunks;
- a zlib stream that is whole (its checksum holds) and inflates to exactly one filter byte
  plus one row of pixels for each row, and every filter byte 0–4.

For everything else it answers False, and Pillow decodes the file, decides, and words the
reason. This covers palettes, 1–4 and 16-bit depths, interlacing, APNG, chunks after the
image data, and every stream that is cut, corrupt, short or long. The test suite checks a
corpus of PNGs, good and broken, against Pillow alone.
"""

from __future__ import annotations

from PIL import Image

try:
    from zlib_ng import zlib_ng
except ImportError:  # Pillow decodes every PNG
    zlib_ng = None

# The 8-bit modes whose rows Pillow reads as they are stored (raw mode == mode).
CHANNELS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}
ANIMATION_CHUNKS = {b"acTL", b"fcTL", b"fdAT"}
SIGNATURE_BYTES = 8
LAST_FILTER_TYPE = 4  # Paeth
# Input fed to zlib-ng at a time: one call's output is at most ~1,032 times this (deflate's
# largest ratio), so a stream that inflates far past its image stops early, never held whole.
INPUT_PIECE = 1 << 14


def image_data_decodes(image: Image.Image, data: bytes) -> bool:
    """True when Pillow's ``image.load()`` of the PNG ``data`` (opened as ``image``) is certain
    to succeed; False when Pillow has to decide."""
    channels = _plain_channels(image)
    if channels is None or zlib_ng is None:
        return False
    stream = _image_stream(memoryview(data), image.tile[0][2])
    if stream is None:
        return False
    width, height = image.size
    return _rows_are_whole(stream, 1 + width * channels, height)


def _rows_are_whole(stream: memoryview | bytes, stride: int, height: int) -> bool:
    """The zlib ``stream`` ends (checksum included) after exactly ``height`` rows of ``stride``
    bytes, and each row starts with a filter type Pillow knows."""
    inflater, expected, done = zlib_ng.decompressobj(), stride * height, 0
    try:
        for start in range(0, len(stream), INPUT_PIECE):
            rows = inflater.decompress(stream[start : start + INPUT_PIECE])
            if max(rows[-done % stride :: stride], default=0) > LAST_FILTER_TYPE:
                return False
            done += len(rows)
            if inflater.eof or done > expected:
                break
    except zlib_ng.error:
        return False
    return inflater.eof and done == expected


def _plain_channels(image: Image.Image) -> int | None:
    """The channels of an opened PNG whose rows Pillow reads as stored: one tile, not
    interlaced, 8 bits per channel, no palette; None for any other image."""
    if image.format != "PNG" or image.info.get("interlace") or len(image.tile) != 1:
        return None
    codec, _, _, raw_mode = image.tile[0]
    width, height = image.size
    if codec != "zip" or raw_mode != image.mode or width <= 0 or height <= 0:
        return None
    return CHANNELS.get(image.mode)


def _image_stream(data: memoryview, first_data_at: int) -> memoryview | bytes | None:
    """The image data of a PNG laid out as chunks, the IDAT chunks in one run starting where
    Pillow found the first, then IEND: their data joined. None for any other layout."""
    parts: list[memoryview] = []
    at = SIGNATURE_BYTES
    while at + 12 <= len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind = bytes(data[at + 4 : at + 8])
        body = at + 8
        if body + length + 4 > len(data) or kind in ANIMATION_CHUNKS:
            return None
        if kind == b"IDAT":
            if not parts and body != first_data_at:
                return None
            parts.append(data[body : body + length])
        elif parts:
            if kind != b"IEND":
                return None
            return parts[0] if len(parts) == 1 else b"".join(parts)
        at = body + length + 4
    return None
