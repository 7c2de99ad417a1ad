"""The Qwen-VL line's size rules against transformers' own functions at the installed version."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mmpack_udfs.config import load_config
from mmpack_udfs.families import make_family
from mmpack_udfs.families.base import smart_resize, torch_arange_int
from mmpack_udfs.families.qwen_vl import video_smart_resize
from mmpack_udfs.reasons import Rejected

SIZES = [1, 2, 13, 27, 28, 29, 31, 32, 33, 55, 57, 100, 224, 333, 480, 640, 1080, 1920, 4000, 9000]


def family(kind: str, **video):
    settings = load_config().profiles[kind].model_dump()
    settings["video"].update(video)
    return make_family(kind, settings)


def test_smart_resize_is_transformers_rule():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    for (h, w), factor in itertools.product(itertools.product(SIZES, SIZES), (28, 32)):
        for low, high in ((3136, 1003520), (65536, 16777216), (100, 200)):
            try:
                expected = theirs(h, w, factor=factor, min_pixels=low, max_pixels=high)
            except ValueError:
                with pytest.raises(ValueError):
                    smart_resize(h, w, factor, low, high)
                continue
            assert smart_resize(h, w, factor, low, high) == expected, (h, w, factor, low, high)


def test_video_smart_resize_is_transformers_rule():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as theirs

    for (h, w), frames in itertools.product(itertools.product(SIZES, SIZES), (1, 2, 3, 4, 7, 64, 768)):
        args = dict(temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824)
        try:
            expected = theirs(num_frames=frames, height=h, width=w, **args)
        except ValueError:
            with pytest.raises(ValueError):
                video_smart_resize(frames, h, w, 2, 32, 4096, 25165824)
            continue
        assert video_smart_resize(frames, h, w, 2, 32, 4096, 25165824) == expected, (h, w, frames)


def test_frame_positions_equal_torch_arange_without_torch():
    """The pipeline has no torch; its frame positions equal transformers' torch.arange rule."""
    for total in range(1, 700, 3):
        for count in range(2, total + 1, 2):
            expected = torch.arange(0, total, total / count).int().tolist()
            assert torch_arange_int(total, total / count) == expected, (total, count)


@pytest.mark.parametrize(
    "total,fps", [(1, 30.0), (3, 10.0), (10, 24.0), (61, 30.0), (240, 29.97), (5000, 25.0)]
)
def test_qwen3_vl_frames_are_its_video_processors(total, fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ours = family("qwen3_vl")
    processor = Qwen3VLVideoProcessor.__new__(
        Qwen3VLVideoProcessor
    )  # sample_frames reads class defaults only
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    expected = processor.sample_frames(metadata, fps=2).tolist()
    assert list(ours.sample_frames(total, fps)) == expected


def test_qwen3_vl_video_plan_timestamps_and_tokens():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    ours = family("qwen3_vl")
    plan = ours.plan_video(61, 30.0, 320, 240)  # 4 frames by fps 2, clamped to min_frames
    assert plan.frame_indices == (0, 20, 40, 60)
    assert plan.grid[0] == 2 and plan.num_tokens == 2 * plan.grid[1] * plan.grid[2] // 4
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(plan.frame_indices), 30.0, 2)
    assert plan.timestamps == tuple(stamps)
    odd = ours.plan_video(5, 1.0, 320, 240)  # 5 frames: the last repeats to fill the group
    assert odd.grid[0] == 3 and len(odd.frame_indices) == 5 and len(odd.timestamps) == 3


def test_qwen2_5_vl_second_per_grid_t_is_the_sampled_rate():
    plan = family("qwen2_5_vl").plan_video(90, 30.0, 320, 240)  # 3 s at 2 fps: 6 frames
    assert len(plan.frame_indices) == 6 and plan.second_per_grid_t == pytest.approx(2 / (6 / 90 * 30))


def test_a_video_too_short_for_a_temporal_patch_is_rejected():
    with pytest.raises(Rejected, match="temporal_factor"):
        family("qwen3_vl", min_frames=1).plan_video(1, 30.0, 320, 240)


def test_qwen3_vl_media_layout_wraps_each_group_with_its_time():
    ours = family("qwen3_vl")
    plan = ours.plan_video(61, 30.0, 64, 64)
    layout = ours.media_layout(plan)
    texts = [v for k, v in layout if k == "text"]
    assert texts == [f"<{t:.1f} seconds>" for t in plan.timestamps]
    assert [v for k, v in layout if k == "pad"] == [plan.num_tokens // 2] * 2
    assert layout[0] == ("token", "<|vision_start|>") and layout[-1] == ("token", "<|vision_end|>")


def test_positions_scale_time_for_qwen2_5_vl_videos():
    ours = family("qwen2_5_vl")
    item = {
        "kind": "video",
        "token_offset": 2,
        "grid_t": 3,
        "grid_h": 4,
        "grid_w": 4,
        "second_per_grid_t": 1.25,
    }
    rows = ours.positions(2 + 12 + 3, [item])
    assert rows[0, 2:14].reshape(3, 4).tolist() == [[2] * 4, [4] * 4, [7] * 4]  # int(i * 2 * 1.25) + 2
    assert rows[:, 14].tolist() == [4, 4, 4]  # the next text token: 2 + max(h, w) / 2
    np.testing.assert_array_equal(rows[:, :2], [[0, 1]] * 3)
