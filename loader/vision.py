"""Media bytes → the vision tensors a model expects, at exactly the grid stored in the shard.
numpy only; the dataset turns results into tensors (positions: ``mmpack_udfs.families``).

The Qwen-VL line: resize to (resized_height, resized_width) with PIL bicubic, scale to
[0, 1], normalize with the profile's mean/std, cut into p-px patches (14: Qwen2-VL,
Qwen2.5-VL; 16: Qwen3-VL, Qwen3.5) grouped 2 × 2 (spatial merge) and 2 frames deep (images
repeat their one frame): one row of 3·2·p·p values per patch, grid_t · grid_h · grid_w rows
per item, so merged tokens = rows / 4 = pad tokens.
InternVL: 448-px tiles (ImageNet mean/std) in the stored tile grid, plus the thumbnail; video
frames one tile each.
"""

from __future__ import annotations

import io
import math
import os
import tempfile

import numpy as np
from PIL import Image

try:
    import simplejpeg
except ImportError:  # optional: Pillow decodes every JPEG then
    simplejpeg = None

from mmpack_udfs.constants import MERGE_SIZE, TEMPORAL_PATCH_SIZE
from mmpack_udfs.schemas import RGB_CONVERTIBLE_MODES

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
MERGE, TEMPORAL = MERGE_SIZE, TEMPORAL_PATCH_SIZE


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


def fast_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG that ``decode_image`` decodes through libjpeg-turbo directly
    (YCbCr or gray, simplejpeg installed), from its header; None for any other file."""
    if data[:2] != b"\xff\xd8" or simplejpeg is None:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError):
        return None
    return (width, height) if colorspace in ("YCbCr", "Gray") else None


def fast_jpeg_decodes(data: bytes) -> bool:
    """Whether libjpeg-turbo decodes a ``fast_jpeg_size`` JPEG without an error or a warning
    (simplejpeg's strict mode, as ``decode_image`` calls it), at 1/8 scale and in gray: every
    marker and every entropy-coded block is read as in a full decode, only the pixels are not
    computed. False: ``decode_image`` hands the file to Pillow."""
    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=1, min_width=1, min_factor=8)
    except (ValueError, RuntimeError):
        return False
    return True


def _jpeg_rgb(data: bytes) -> np.ndarray | None:
    """The RGB pixels of a YCbCr or gray JPEG, or None (not one, simplejpeg absent, or a file
    Pillow should report on)."""
    if fast_jpeg_size(data) is None:
        return None
    try:
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


def resized_rgb8(
    frames: list[Image.Image], height: int, width: int, resample: Image.Resampling = Image.Resampling.BICUBIC
) -> np.ndarray:
    """[frames, height, width, 3] uint8: each frame resized (PIL, bicubic unless ``resample`` says
    otherwise, on 8-bit RGB, as transformers' image processors resize with their PIL backend)."""
    return np.stack([np.asarray(f.resize((width, height), resample)) for f in frames])


def resized_video_rgb8(frames: list[Image.Image], height: int, width: int) -> np.ndarray:
    """[frames, height, width, 3] uint8 as transformers' video processors resize: torchvision's
    bicubic antialiased resize of uint8 frames, which on the CPU is torch's native uint8
    ``interpolate`` (bit for bit; a test compares with the processor). Needs torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as err:  # the pipeline's spark extra has no torch
        raise MediaDecodeError("video frames are resized as transformers does it: with torch") from err
    x = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).contiguous()
    if (x.shape[-2], x.shape[-1]) != (height, width):  # the processor leaves an unchanged size alone
        x = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


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


def qwen2_vl_patches(
    frames: list[Image.Image], item: dict, dtype: str = "float32", mean=CLIP_MEAN, std=CLIP_STD
) -> np.ndarray:
    """[grid_t · grid_h · grid_w, 3 · 2 · p²] patches of one image (one frame) or video of the
    Qwen-VL line (p = the item's patch size, 14 or 16): float32 normalized with ``mean``/``std``,
    or (``dtype="uint8"``) the raw 8-bit values (``normalize_qwen_patches``)."""
    compact = qwen2_vl_patches8(frames, item)
    out = np.empty((len(compact), 3 * TEMPORAL * compact.shape[-1]), np.uint8)
    expand_patches8(compact, out)
    return out if dtype == "uint8" else normalize_qwen_patches(out, mean, std)


def qwen2_vl_rows(item: dict) -> int:
    """Patch rows of one item: grid_t · grid_h · grid_w."""
    return item["grid_t"] * item["grid_h"] * item["grid_w"]


def patch_size_of(item: dict) -> int:
    """The vision patch side of a Qwen-VL item: its resized size over its grid."""
    patch = item["resized_height"] // item["grid_h"]
    if patch * item["grid_h"] != item["resized_height"] or patch * item["grid_w"] != item["resized_width"]:
        raise MediaDecodeError(
            f"{item['uri']}: grid {item['grid_h']}x{item['grid_w']} does not divide resized size "
            f"{item['resized_height']}x{item['resized_width']}"
        )
    return patch


def row_values(item: dict) -> int:
    """Values per patch row: 3 channels × 2 frames × p × p (1176 at patch 14, 1536 at 16)."""
    return 3 * TEMPORAL * patch_size_of(item) ** 2


def qwen2_vl_patches8(frames: list[Image.Image], item: dict) -> np.ndarray:
    """One item's 8-bit patches in transformers' order, compact: [rows, 3, F, p²] with F = 1
    for an image (the processor's two temporal copies are the same frame, kept once) and F = 2
    for a video (each row's two frames; an odd frame count repeats its last frame, as the
    processor pads). ``expand_patches8`` makes the full rows; prepared media (``media_encoding:
    patches8``) store exactly these bytes."""
    t, h, w = item["grid_t"], item["grid_h"], item["grid_w"]
    height, width = item["resized_height"], item["resized_width"]
    patch = patch_size_of(item)
    depth = _depth(item)
    if depth == TEMPORAL and len(frames) == len(item["frame_indices"]) == TEMPORAL * t - 1:
        frames = [*frames, frames[-1]]  # an odd sample: the processor repeats the last frame
    if len(frames) != (1 if depth == 1 else TEMPORAL * t) or (depth == 1 and t != 1):
        raise MediaDecodeError(f"{item['uri']}: {len(frames)} frames for grid_t {t}")
    resize = resized_video_rgb8 if item["kind"] == "video" else resized_rgb8
    rgb = resize(frames, height, width)  # [frames, H, W, 3]
    grid = rgb.reshape(t, depth, h // MERGE, MERGE, patch, w // MERGE, MERGE, patch, 3)
    compact = grid.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # t, h/2, w/2, 2, 2, c, depth, p, p
    return np.ascontiguousarray(compact).reshape(t * h * w, 3, depth, patch * patch)


def _depth(item: dict) -> int:
    """Frames per patch row as stored: 1 for an image (or a one-frame video), else 2."""
    single = item["kind"] == "image" or len(item["frame_indices"]) == 1
    return 1 if single else TEMPORAL


def expand_patches8(compact: np.ndarray, out: np.ndarray) -> None:
    """Write compact patches ([rows, 3, F, p²], F = 1 or 2) into ``out`` [rows, 3 · 2 · p²]
    uint8: one pass, an image's frame broadcast to both temporal slots."""
    out.reshape(len(out), 3, TEMPORAL, compact.shape[-1])[...] = compact


def compact_patches8(data: np.ndarray | bytes, item: dict) -> np.ndarray:
    """Prepared media bytes (``qwen2_vl_patches8``) as [rows, 3, F, p²], checked against the grid."""
    shape = (qwen2_vl_rows(item), 3, _depth(item), patch_size_of(item) ** 2)
    values = np.frombuffer(data, np.uint8)
    if values.size != int(np.prod(shape)):
        raise MediaDecodeError(f"{item['uri']}: {values.size} prepared bytes, the grid needs {shape}")
    return values.reshape(shape)


def patch_channel(width: int) -> np.ndarray:
    """The channel of each value of a patch row (rows are channel-major: 3 × 2 × p × p)."""
    return np.arange(width) // (width // 3)


def normalize_qwen_patches(patches: np.ndarray, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    """uint8 Qwen-VL patches [rows, 3 · 2 · p²] → the float32 pixel values transformers gives
    with that ``mean``/``std`` (Qwen2-VL and Qwen2.5-VL: CLIP's; Qwen3-VL: 0.5). The loader's
    ``pixel_dtype="uint8"`` hands the uint8 patches over; this (or
    ``loader.normalize_pixel_values`` on the device) finishes."""
    channel = patch_channel(patches.shape[-1])
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return _scaled(patches, mean[channel], std[channel])


def soft_patches8(
    frames: list[Image.Image], item: dict, patch: int, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """Gemma 4's patches of one image or video: ([frames, budget, p · p · 3] uint8, [frames,
    budget, 2] int64): each frame resized to the item's size (an image with PIL, video frames as
    its video processor does), cut into p × p patches row by row, each patch's values (row,
    column, channel) in a row, zero rows after the last patch; its (x, y) positions, -1 there."""
    height, width = item["resized_height"], item["resized_width"]
    resize = resized_video_rgb8 if item["kind"] == "video" else resized_rgb8
    rgb = resize(frames, height, width)  # [F, H, W, 3]
    count, rows, cols = len(rgb), height // patch, width // patch
    grid = rgb.reshape(count, rows, patch, cols, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    patches = np.zeros((count, budget, patch * patch * 3), np.uint8)
    patches[:, : rows * cols] = grid.reshape(count, rows * cols, -1)
    positions = np.full((count, budget, 2), -1, np.int64)
    y, x = np.divmod(np.arange(rows * cols), cols)
    positions[:, : rows * cols] = np.stack([x, y], axis=-1)
    return patches, positions


def internvl_tiles(
    frames: list[Image.Image],
    item: dict,
    tile_size: int,
    thumbnail: bool,
    dtype: str = "float32",
    video_processor: bool = False,
) -> np.ndarray:
    """[tiles, 3, tile_size, tile_size]: images in their stored rows × columns grid (plus a
    thumbnail when split), video frames one tile each; float32 normalized with the ImageNet
    mean/std, or (``dtype="uint8"``) the raw 8-bit values (``normalize_internvl``). Frames are
    resized with PIL as InternVL's own code does, or (``video_processor``: transformers-native
    InternVL) to the stored size as transformers' video processors resize (torch)."""

    def chw(image: Image.Image, height: int, width: int) -> np.ndarray:
        return resized_rgb8([image], height, width)[0].transpose(2, 0, 1)

    if item["kind"] == "video" and video_processor:
        size = (item["resized_height"], item["resized_width"])
        tiles = resized_video_rgb8(frames, *size).transpose(0, 3, 1, 2)
    elif item["kind"] == "video":
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


def llava_onevision_crops(image: Image.Image, item: dict, crop: int, mean) -> np.ndarray:
    """[crops, 3, crop, crop] uint8, as transformers' LLaVA-OneVision image processor (PIL backend)
    cuts an image. The only image of a sample (grid rows × columns > 0): the whole image resized
    to one crop, then the tiles of the image resized into its grid's canvas (aspect kept, the
    larger scale's side ceil-ed) and centred on zeros. An image among several (grid 0 × 0): padded
    to a centred square with the ``mean`` colour (int(mean · 255)), resized to one crop."""
    rows, cols = item["grid_h"], item["grid_w"]
    pixels = np.asarray(image)
    height, width = pixels.shape[:2]
    if rows == 0:
        side = max(height, width)
        square = np.empty((side, side, 3), np.uint8)
        square[:] = [int(m * 255) for m in mean]
        top, left = (
            (side - height) // 2 if width > height else 0,
            (side - width) // 2 if width <= height else 0,
        )
        square[top : top + height, left : left + width] = pixels
        return resized_rgb8([Image.fromarray(square)], crop, crop).transpose(0, 3, 1, 2)
    canvas_h, canvas_w = rows * crop, cols * crop
    if canvas_w / width < canvas_h / height:
        new_w, new_h = canvas_w, min(math.ceil(height * canvas_w / width), canvas_h)
    else:
        new_h, new_w = canvas_h, min(math.ceil(width * canvas_h / height), canvas_w)
    canvas = np.zeros((canvas_h, canvas_w, 3), np.uint8)
    top, left = (canvas_h - new_h) // 2, (canvas_w - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resized_rgb8([image], new_h, new_w)[0]
    tiles = canvas.reshape(rows, crop, cols, crop, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, crop, crop)
    return np.concatenate([resized_rgb8([image], crop, crop).transpose(0, 3, 1, 2), tiles])


def normalize_internvl(tiles: np.ndarray, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
    """uint8 InternVL tiles [tiles, 3, H, W] → float32 normalized with ``mean``/``std`` (ImageNet's)."""
    return normalize(tiles, np.asarray(mean, np.float32), np.asarray(std, np.float32), axis=1)
