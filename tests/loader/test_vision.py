"""Vision tensors at the stored grid, and mRoPE positions, against transformers' Qwen2-VL."""

from __future__ import annotations

import io
import types
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from loader import vision
from mmpack_udfs.config import load_config
from mmpack_udfs.families import make_family

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def planned(image: Image.Image) -> dict:
    profile = make_family("qwen2_vl", load_config().profiles["qwen2_vl"].model_dump())
    plan = profile.plan_image(*image.size)
    return {
        "kind": "image",
        "uri": "x.png",
        "grid_t": plan.grid[0],
        "grid_h": plan.grid[1],
        "grid_w": plan.grid[2],
        "resized_height": plan.resized[0],
        "resized_width": plan.resized[1],
        "num_tokens": plan.num_tokens,
    }


@pytest.mark.parametrize("size", [(97, 203), (640, 480), (30, 30)])
def test_image_patches_equal_transformers(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    item = planned(image)
    ours = vision.qwen2_vl_patches([image], item)
    processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=1003520)
    theirs = processor(images=[image], return_tensors="np")
    assert theirs["image_grid_thw"].tolist() == [[item["grid_t"], item["grid_h"], item["grid_w"]]]
    assert ours.shape == theirs["pixel_values"].shape
    assert ours.shape[0] // 4 == item["num_tokens"]  # vision embeddings = pad tokens
    np.testing.assert_allclose(ours, theirs["pixel_values"], atol=1e-5)


def rope_oracle(ids: list[int], image_grids: list, video_grids: list) -> np.ndarray:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=partial(Qwen2VLModel.get_vision_position_ids, None),
    )
    input_ids = torch.tensor([ids])
    types_ = (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()
    positions, _ = Qwen2VLModel.get_rope_index(
        stub,
        input_ids,
        types_,
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    return positions[:, 0].numpy()


def test_mrope_positions_equal_get_rope_index():
    # text, image (grid 1x4x6: 6 tokens), text, video (grid 3x4x4: 12 tokens), text
    layout = [(7, None), (6, ("image", 1, 4, 6)), (3, None), (12, ("video", 3, 4, 4)), (5, None)]
    ids, media, grids = [], [], {"image": [], "video": []}
    for count, item in layout:
        if item is None:
            ids += [1] * count
            continue
        kind, t, h, w = item
        media.append({"kind": kind, "token_offset": len(ids), "grid_t": t, "grid_h": h, "grid_w": w})
        grids[kind].append([t, h, w])
        ids += [IMAGE_PAD if kind == "image" else VIDEO_PAD] * count
    family = make_family("qwen2_vl", load_config().profiles["qwen2_vl"].model_dump())
    ours = family.positions(len(ids), media)
    np.testing.assert_array_equal(ours, rope_oracle(ids, grids["image"], grids["video"]))
    assert (family.positions(4, []) == np.arange(4)).all()


def test_internvl_tiles_follow_the_stored_grid():
    image = Image.new("RGB", (900, 450), (200, 10, 10))
    item = {"kind": "image", "grid_h": 1, "grid_w": 2}
    tiles = vision.internvl_tiles([image], item, 448, thumbnail=True)
    assert tiles.shape == (3, 3, 448, 448)  # 1 x 2 tiles + thumbnail
    red = (200 / 255 - vision.IMAGENET_MEAN[0]) / vision.IMAGENET_STD[0]
    np.testing.assert_allclose(tiles[:, 0], red, atol=1e-3)


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_jpegs_decode_to_the_pixels_pillow_gives(mode, tmp_path):
    """RGB and gray JPEGs take the libjpeg-turbo path, CMYK the Pillow one: the same pixels."""
    rng = np.random.default_rng(1)
    channels = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    array = rng.integers(0, 256, (45, 61, channels), dtype=np.uint8).squeeze()
    out = io.BytesIO()
    Image.fromarray(array, mode).save(out, format="JPEG", quality=90)
    data = out.getvalue()
    with Image.open(io.BytesIO(data)) as image:
        expected = np.asarray(image.convert("RGB"))
    assert (vision._jpeg_rgb(data) is not None) == (mode != "CMYK")
    assert np.array_equal(np.asarray(vision.decode_image(data)), expected)


def processor_video_patches(frames: np.ndarray, t: int, h: int, w: int) -> np.ndarray:
    """transformers' Qwen2-VL patch layout for [2t, 3, H, W] frames, written out as its
    processor reshapes them (channels, then the two frames of a temporal patch, then 14 × 14)."""
    grid = frames.reshape(t, 2, 3, h // 2, 2, 14, w // 2, 2, 14).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return grid.reshape(t * h * w, 1176)


def test_video_patches_follow_the_processor_layout_and_compact_bytes_round_trip():
    rng = np.random.default_rng(7)
    item = {"kind": "video", "uri": "v.mp4", "frame_indices": [0, 3, 6, 9],
            "grid_t": 2, "grid_h": 4, "grid_w": 6, "resized_height": 56, "resized_width": 84}  # fmt: skip
    frames = [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in range(4)]
    chw = np.stack([np.asarray(f) for f in frames]).transpose(0, 3, 1, 2)
    expected = processor_video_patches(chw, 2, 4, 6)
    assert np.array_equal(vision.qwen2_vl_patches(frames, item, "uint8"), expected)
    compact = vision.qwen2_vl_patches8(frames, item)
    out = np.empty((48, 1176), np.uint8)
    vision.expand_patches8(vision.compact_patches8(compact.tobytes(), item), out)
    assert np.array_equal(out, expected)
    with pytest.raises(vision.MediaDecodeError, match="prepared bytes, the grid needs"):
        vision.compact_patches8(compact.tobytes()[:-1], item)
    with pytest.raises(vision.MediaDecodeError, match="3 frames for grid_t 2"):
        vision.qwen2_vl_patches8(frames[:3], item)


def test_an_image_is_stored_once_and_fills_both_temporal_slots():
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 45, 3), dtype=np.uint8))
    item = planned(image)
    compact = vision.qwen2_vl_patches8([image], item)
    assert compact.shape[2] == 1  # half the bytes of the 1176-wide rows
    rows = vision.qwen2_vl_patches([image], item, "uint8").reshape(len(compact), 3, 2, 196)
    assert np.array_equal(rows[:, :, 0], compact[:, :, 0]) and np.array_equal(rows[:, :, 1], compact[:, :, 0])


def test_video_frames_are_the_frames_at_the_stored_indices(tmp_path):
    """decode_frames returns exactly the frames at ``frame_indices``: each equals that frame
    of a full sequential decode, and each frame's distinct brightness says which it is."""
    import cv2

    path = str(tmp_path / "v.mp4")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10, (64, 48))
    for i in range(12):
        writer.write(np.full((48, 64, 3), 20 * i, np.uint8))
    writer.release()
    capture, every = cv2.VideoCapture(path), []
    while (frame := capture.read())[0]:
        every.append(cv2.cvtColor(frame[1], cv2.COLOR_BGR2RGB))
    capture.release()
    assert len(every) == 12
    indices, data = [0, 3, 4, 11], (tmp_path / "v.mp4").read_bytes()
    frames = vision.decode_frames(data, indices, path)
    for index, frame in zip(indices, frames, strict=True):
        assert np.array_equal(np.asarray(frame), every[index])
        assert abs(float(np.asarray(frame).mean()) - 20 * index) < 6  # and it is that frame, not a neighbour
    with pytest.raises(vision.MediaDecodeError, match=r"frames \[12\] could not be decoded"):
        vision.decode_frames(data, [2, 12], path)


def test_video_frames_come_from_memory_without_a_temporary_file(tmp_path, monkeypatch):
    """OpenCV reads the bytes as a stream (no temp file); the stream outlives the reading
    (OpenCV keeps no reference: a collected stream crashed the process)."""
    import gc

    import cv2

    path = str(tmp_path / "v.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 32))
    for i in range(6):
        writer.write(np.full((32, 32, 3), 40 * i, np.uint8))
    writer.release()
    data = (tmp_path / "v.avi").read_bytes()

    def no_temporary_file(*args, **kwargs):
        raise AssertionError("decoded through a temporary file")

    monkeypatch.setattr(vision.tempfile, "NamedTemporaryFile", no_temporary_file)
    first = [np.asarray(f) for f in vision.decode_frames(data, [1, 5], path)]
    for _ in range(20):
        gc.collect()
        again = [np.asarray(f) for f in vision.decode_frames(data, [1, 5], path)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
