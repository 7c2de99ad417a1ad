"""The Qwen-Omni thinkers in transformers: Qwen2.5-Omni (``model_type: qwen2_5_omni`` or
``qwen2_5_omni_thinker``, ``Qwen2_5OmniThinkerForConditionalGeneration``, ``Qwen2_5OmniProcessor``).

The thinker is Qwen2.5-VL's vision tower and language model with Qwen2-Audio's audio encoder:

- **Images** are Qwen2-VL's (``smart_resize`` within the image processor's pixel limits).
- **Videos** are Qwen2-VL's frames, resized within the limits the *processor* passes to its video
  processor on every call (``Qwen2_5OmniProcessor.videos_kwargs``: 128 to 768 merged tokens per
  frame), whatever the video processor's own config says. A temporal patch lasts
  ``temporal_patch_size / fps`` seconds, with ``fps`` the rate frames were sampled at (the
  processor's ``video_second_per_grid``).
- **Audio**: every clip is a 16 kHz waveform (``loader.audio.decode``: FFmpeg) and
  ``L = ceil(samples / hop_length)`` Whisper frames; it becomes ``(((L - 1) // 2 + 1) - 2) // 2 + 1``
  ``<|AUDIO|>`` tokens between ``<|audio_bos|>`` and ``<|audio_eos|>``. The processor pads every clip
  to the feature extractor's ``n_samples`` (300 s in the published config) and cuts longer ones,
  so a longer clip is refused rather than trained on sound the model never hears.
- **Positions** (TMRoPE, the thinker's ``get_rope_index``): text and audio spans count up on all
  three rows; an image or video block starting at position p takes
  ``(p + int(i · second_per_grid · position_id_per_seconds), p + row, p + column)`` and the token
  after it the block's largest position + 1 (Qwen2.5-VL's rule is p + max(h, w) instead).
- **Chat**: ChatML with a default system prompt, a message's content parts written in order.

A video's own audio track (``use_audio_in_video``) is not reproduced yet: such a setting is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.base import IdleMedia, MediaPlan, MediaTokens
from mmpack_udfs.families.qwen2_audio import audio_tokens, clip_plan
from mmpack_udfs.families.qwen_vl import Qwen25VL


class Qwen25Omni(Qwen25VL):
    """The Qwen2.5-Omni thinker (3B, 7B): images, videos and audio clips of up to ``n_samples``."""

    kind = "qwen2_5_omni"
    rl_prompts = False  # its generation prompt is not verified for RL exports
    modalities: ClassVar[tuple[str, ...]] = ("image", "video", "audio")
    content_parts = True  # its template reads a message's content parts
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|vision_bos|>",), "<|IMAGE|>", ("<|vision_eos|>",)),
        "video": MediaTokens(("<|vision_bos|>",), "<|VIDEO|>", ("<|vision_eos|>",)),
        "audio": MediaTokens(("<|audio_bos|>",), "<|AUDIO|>", ("<|audio_eos|>",)),
    }
    audio_padded_to_chunk = False  # its encoder reads each clip's own frames only

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        """Qwen2-VL's frames and grid; a temporal patch lasts temporal patch / the sampling rate."""
        plan = super().plan_video(frames, fps, width, height)
        seconds = self.temporal_patch_size / float(self.settings["video"]["fps"])
        return MediaPlan(plan.kind, plan.grid, plan.num_tokens, plan.resized, plan.frame_indices, seconds)

    def plan_audio(self, samples: int) -> MediaPlan:
        """A clip of ``samples`` 16 kHz samples: grid (feature frames, 1, 1)."""
        return clip_plan(
            self.settings["audio"], samples, "Qwen2.5-Omni", 1, "the encoder gives it no feature"
        )

    def positions(self, length: int, media: Sequence[Mapping[str, Any]]) -> np.ndarray:
        blocks = [b for m in media if m["kind"] != "audio" for b in self.vision_blocks(m)]
        return tmrope_positions(length, blocks, self.settings["position_id_per_seconds"])

    def vision_blocks(self, item: Mapping[str, Any]) -> list[tuple[int, int, int, int, float]]:
        """One block per item: (token offset, t, h, w, seconds per temporal patch; images 1)."""
        h, w = item["grid_h"] // self.merge_size, item["grid_w"] // self.merge_size
        seconds = item["second_per_grid_t"] if item["kind"] == "video" else 1.0
        return [(item["token_offset"], item["grid_t"], h, w, seconds)]

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """Qwen-VL's idle image and video, and one silent clip of two feature frames (1 token)."""
        vision = super().idle_media(config)
        mel = int(config.audio_config.num_mel_bins)
        frames = next(n for n in range(1, 100) if audio_tokens(n) == 1)
        clip = IdleMedia(
            "audio", "input_features", (1, mel, frames), int(config.audio_token_id), 1,
            {"feature_attention_mask": [[1] * frames]},
        )  # fmt: skip
        return [*vision, clip]


def tmrope_positions(
    length: int, blocks: Sequence[tuple[int, int, int, int, float]], per_second: float
) -> np.ndarray:
    """[3, length] TMRoPE positions of one sample (Qwen-Omni's ``get_rope_index``): text (and
    audio) advance all three rows by one per token; a block (offset, t, h, w, seconds) starting at
    position p takes (p + int(i · seconds · per_second), p + row, p + column), in float32 as the
    model computes it, and the next token the block's largest position + 1."""
    rows, cursor, position = [], 0, 0
    for offset, t, h, w, seconds in sorted(blocks, key=lambda b: b[0]):
        text = np.arange(offset - cursor) + position
        rows.append(np.broadcast_to(text, (3, len(text))))
        position += offset - cursor
        times = (np.arange(t, dtype=np.float32) * np.float32(seconds) * np.float32(per_second)).astype(
            np.int64
        )
        grid = np.stack(np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        rows.append(grid + position)
        position += int(max(times[-1], h - 1, w - 1)) + 1
        cursor = offset + t * h * w
    rows.append(np.broadcast_to(np.arange(length - cursor) + position, (3, length - cursor)))
    return np.concatenate(rows, axis=1).astype(np.int64)
