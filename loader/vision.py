"""Media bytes → the vision tensors a model expects, at exactly the grid stored in the shard;
and Qwen2-VL's 3-D rotary positions. numpy only; the dataset turns results into tensors.

Qwen2-VL: resize to (resized_height, resized_width) with PIL bicubic, scale to [0, 1],
normalize with the CLIP mean/std, cut into 14-px patches grouped 2 × 2 (spatial merge)
and 2 frames deep (images repeat their one frame): one row of 3·2·14·14 = 1176 values per
patch, grid_t · grid_h · grid_w rows per item, so merged tokens = rows / 4 = pad tokens.
InternVL: 448-px tiles (ImageNet mean/std) in the stored tile grid, plus the thumbnail.
"""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np
from PIL import Image

try:
    import simplejpeg
except ImportError:  # optional: Pillow decodes every JPEG then
    simplejpeg = None

from mmpack_udfs.constants import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE
from mmpack_udfs.schemas import RGB_CONVERTIBLE_MODES

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
PATCH, MERGE, TEMPORAL = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE


class MediaDecodeError(RuntimeError):
    """A stored media item could not be decoded into the frames its grid needs."""


def decode_image(data: bytes) -> Image.Image:
    """An image file's bytes as 8-bit RGB. Baseline/progressive JPEGs in YCbCr or gray go
    through libjpeg-turbo directly (simplejpeg, accurate DCT and upsampling: bit-identical to
    Pillow, ~3× faster); everything else (CMYK JPEGs, PNG, ...) through Pillow."""
    fast = _jpeg_rgb(data)
    if fast is not None:
        return Image.fromarray(fast)
    with Image.open(io.BytesIO(data)) as image:
        if image.mode not in RGB_CONVERTIBLE_MODES:  # normalize quarantines these: a shard never should
            raise MediaDecodeError(f"pixel mode {image.mode} would clip when converted to 8-bit RGB")
        return image.convert("RGB")


def _jpeg_rgb(data: bytes) -> np.ndarray | None:
    """The RGB pixels of a YCbCr or gray JPEG, or None (not one, simplejpeg absent, or a file
    Pillow should report on)."""
    if data[:2] != b"\xff\xd8" or simplejpeg is None:
        return None
    try:
        if simplejpeg.decode_jpeg_header(data)[2] not in ("YCbCr", "Gray"):
            return None
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False)
    except (ValueError, RuntimeError):
        return None  # corrupt or unusual: Pillow decides and words the error


def decode_frames(data: bytes, indices: list[int], uri: str) -> list[Image.Image]:
    """The frames at ``indices`` of a video file's bytes, as RGB images: decoded from memory
    (OpenCV ≥ 4.11 reads a stream), through a temporary file where OpenCV cannot; the same
    FFmpeg decoder either way, so the same pixels."""
    import cv2

    stream = io.BytesIO(data)  # referenced here while OpenCV reads it (it keeps no reference)
    try:
        capture = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])
    except (cv2.error, TypeError):  # an OpenCV without stream input
        capture = None
    if capture is not None and capture.isOpened():
        return _frames_at(capture, indices, uri)
    suffix = os.path.splitext(uri)[1] or ".mp4"
    with tempfile.NamedTemporaryFile(suffix=suffix) as f:
        f.write(data)
        f.flush()
        return _frames_at(cv2.VideoCapture(f.name), indices, uri)


def _frames_at(capture, indices: list[int], uri: str) -> list[Image.Image]:
    """Decode in order up to the last wanted frame; convert only the wanted ones (``grab``
    decodes, ``retrieve`` converts: together they are ``read``)."""
    import cv2

    frames, wanted, index = {}, set(indices), 0
    try:
        while len(frames) < len(wanted) and capture.grab():
            if index in wanted:
                ok, frame = capture.retrieve()
                if not ok:
                    break
                frames[index] = Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            index += 1
    finally:
        capture.release()
    missing = sorted(wanted - frames.keys())
    if missing:
        raise MediaDecodeError(f"{uri}: frames {missing[:5]} could not be decoded ({index} frames read)")
    return [frames[i] for i in indices]


def resized_rgb8(frames: list[Image.Image], height: int, width: int) -> np.ndarray:
    """[frames, height, width, 3] uint8: each frame resized (PIL bicubic on 8-bit RGB, as
    transformers' processors resize before they rescale)."""
    return np.stack([np.asarray(f.resize((width, height), Image.Resampling.BICUBIC)) for f in frames])


def normalize(pixels: np.ndarray, mean: np.ndarray, std: np.ndarray, axis: int) -> np.ndarray:
    """uint8 pixels → float32 ``(x / 255 - mean) / std``, channels along ``axis``."""
    shape = [1] * pixels.ndim
    shape[axis] = 3
    return _scaled(pixels, mean.reshape(shape), std.reshape(shape))


def _scaled(pixels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(x * float32(1/255) - mean) / std`` in float32, each step in place (one output array,
    no temporaries: the same operations, so the same bits, at a third of the memory traffic)."""
    out = pixels.astype(np.float32)
    out *= np.float32(1 / 255)
    out -= mean
    out /= std
    return out


def qwen2_vl_patches(frames: list[Image.Image], item: dict, dtype: str = "float32") -> np.ndarray:
    """[grid_t · grid_h · grid_w, 1176] patches of one image (one frame) or video: float32
    normalized, or (``dtype="uint8"``) the raw 8-bit values (``normalize_qwen2_vl``)."""
    rows = qwen2_vl_rows(item)
    out = np.empty((rows, ROW_VALUES), np.uint8)
    expand_patches8(qwen2_vl_patches8(frames, item), out)
    return out if dtype == "uint8" else normalize_qwen2_vl(out)


ROW_VALUES = 3 * TEMPORAL * PATCH * PATCH  # 1176 values per Qwen2-VL patch row


def qwen2_vl_rows(item: dict) -> int:
    """Patch rows of one item: grid_t · grid_h · grid_w."""
    return item["grid_t"] * item["grid_h"] * item["grid_w"]


def qwen2_vl_patches8(frames: list[Image.Image], item: dict) -> np.ndarray:
    """One item's 8-bit patches in transformers' order, compact: [rows, 3, F, 14 · 14] with
    F = 1 for an image (the processor's two temporal copies are the same frame, kept once)
    and F = 2 for a video (each row's two frames). ``expand_patches8`` makes the 1176-wide
    rows; prepared media (``media_encoding: patches8``) store exactly these bytes."""
    t, h, w = item["grid_t"], item["grid_h"], item["grid_w"]
    height, width = item["resized_height"], item["resized_width"]
    if (height // PATCH, width // PATCH) != (h, w):
        raise MediaDecodeError(f"{item['uri']}: grid {h}x{w} does not match resized size {height}x{width}")
    depth = _depth(item)
    if len(frames) != (1 if depth == 1 else TEMPORAL * t) or (depth == 1 and t != 1):
        raise MediaDecodeError(f"{item['uri']}: {len(frames)} frames for grid_t {t}")
    rgb = resized_rgb8(frames, height, width)  # [frames, H, W, 3]
    grid = rgb.reshape(t, depth, h // MERGE, MERGE, PATCH, w // MERGE, MERGE, PATCH, 3)
    compact = grid.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # t, h/2, w/2, 2, 2, c, depth, 14, 14
    return np.ascontiguousarray(compact).reshape(t * h * w, 3, depth, PATCH * PATCH)


def _depth(item: dict) -> int:
    """Frames per patch row as stored: 1 for an image (or a one-frame video), else 2."""
    single = item["kind"] == "image" or len(item["frame_indices"]) == 1
    return 1 if single else TEMPORAL


def expand_patches8(compact: np.ndarray, out: np.ndarray) -> None:
    """Write compact patches ([rows, 3, F, 196], F = 1 or 2) into ``out`` [rows, 1176] uint8:
    one pass, an image's frame broadcast to both temporal slots."""
    out.reshape(len(out), 3, TEMPORAL, PATCH * PATCH)[...] = compact


def compact_patches8(data: np.ndarray | bytes, item: dict) -> np.ndarray:
    """Prepared media bytes (``qwen2_vl_patches8``) as [rows, 3, F, 196], checked against the grid."""
    shape = (qwen2_vl_rows(item), 3, _depth(item), PATCH * PATCH)
    values = np.frombuffer(data, np.uint8)
    if values.size != int(np.prod(shape)):
        raise MediaDecodeError(f"{item['uri']}: {values.size} prepared bytes, the grid needs {shape}")
    return values.reshape(shape)


QWEN2_VL_PATCH_CHANNEL = np.arange(ROW_VALUES) // (TEMPORAL * PATCH * PATCH)
QWEN2_VL_PATCH_MEAN, QWEN2_VL_PATCH_STD = CLIP_MEAN[QWEN2_VL_PATCH_CHANNEL], CLIP_STD[QWEN2_VL_PATCH_CHANNEL]


def normalize_qwen2_vl(patches: np.ndarray) -> np.ndarray:
    """uint8 Qwen2-VL patches [rows, 1176] → the float32 pixel values transformers gives
    (each row is channel-major: 3 × 2 × 14 × 14). The loader's ``pixel_dtype="uint8"`` hands
    the uint8 patches over; this (or ``loader.normalize_pixel_values`` on the device) finishes."""
    return _scaled(patches, QWEN2_VL_PATCH_MEAN, QWEN2_VL_PATCH_STD)


def internvl_tiles(
    frames: list[Image.Image], item: dict, tile_size: int, thumbnail: bool, dtype: str = "float32"
) -> np.ndarray:
    """[tiles, 3, tile_size, tile_size]: images in their stored rows × columns grid (plus a
    thumbnail when split), video frames one tile each; float32 normalized with the ImageNet
    mean/std, or (``dtype="uint8"``) the raw 8-bit values (``normalize_internvl``)."""

    def chw(image: Image.Image, height: int, width: int) -> np.ndarray:
        return resized_rgb8([image], height, width)[0].transpose(2, 0, 1)

    if item["kind"] == "video":
        tiles = np.stack([chw(f, tile_size, tile_size) for f in frames])
    else:
        rows, cols = item["grid_h"], item["grid_w"]
        whole = chw(frames[0], rows * tile_size, cols * tile_size)
        tiles = whole.reshape(3, rows, tile_size, cols, tile_size).transpose(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, tile_size, tile_size)
        if thumbnail and rows * cols > 1:
            tiles = np.concatenate([tiles, chw(frames[0], tile_size, tile_size)[None]])
    tiles = np.ascontiguousarray(tiles)
    return tiles if dtype == "uint8" else normalize_internvl(tiles)


def normalize_internvl(tiles: np.ndarray) -> np.ndarray:
    """uint8 InternVL tiles [tiles, 3, H, W] → float32 normalized with the ImageNet mean/std."""
    return normalize(tiles, IMAGENET_MEAN, IMAGENET_STD, axis=1)


def mrope_positions(length: int, media: list[dict]) -> np.ndarray:
    """[3, length] Qwen2-VL rotary positions of one sample (transformers' get_rope_index):
    text advances all three rows by one per token; a vision item of merged grid t × h × w
    takes (start + t index, start + row, start + column) and advances by max(h, w)."""
    rows, cursor, position = [], 0, 0
    for item in sorted(media, key=lambda m: m["token_offset"]):
        offset = item["token_offset"]
        text = np.arange(offset - cursor) + position
        rows.append(np.broadcast_to(text, (3, len(text))))
        position += offset - cursor
        t, h, w = item["grid_t"], item["grid_h"] // MERGE, item["grid_w"] // MERGE
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        rows.append(grid + position)
        position += max(h, w)
        cursor = offset + t * h * w
    rows.append(np.broadcast_to(np.arange(length - cursor) + position, (3, length - cursor)))
    return np.concatenate(rows, axis=1).astype(np.int64)
