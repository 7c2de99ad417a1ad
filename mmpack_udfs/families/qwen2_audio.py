"""Qwen2-Audio in transformers (``model_type: qwen2_audio``, ``Qwen2AudioForConditionalGeneration``;
``Qwen2AudioProcessor`` with ``WhisperFeatureExtractor``).

Every clip is a 16 kHz mono waveform (``loader.audio.decode``: FFmpeg) cut or padded to
``n_samples`` (30 s) and turned into 128 log-mel bins every ``hop_length`` (160) samples. The
processor's ``feature_attention_mask`` keeps ``L = ceil(samples / hop_length)`` frames (at most
3000), and the clip becomes ``(((L - 1) // 2 + 1) - 2) // 2 + 1`` ``<|AUDIO|>`` tokens between
``<|audio_bos|>`` and ``<|audio_eos|>`` (``processing_qwen2_audio._process_audio``). The chat
template (renderer ``qwen2_audio``) writes ``Audio k: `` before a conversation's k-th clip and a
newline after it. No images, no videos. 1-D positions, so packing is plain varlen.

Refused (``media_unsupported``), never approximated:
- a clip longer than 30 s: the feature extractor keeps its first 30 s, and the answer would be
  trained on sound the model never hears;
- a clip shorter than 7 feature frames (70 ms): it gives fewer than 2 tokens, and the model
  takes a prompt without two adjacent ``<|AUDIO|>`` tokens for an unexpanded one (its
  ``legacy_processing`` path), which a packed batch does not reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from mmpack_udfs.constants import AUDIO_SAMPLE_RATE
from mmpack_udfs.families.base import Family, IdleMedia, MediaPlan, MediaTokens
from mmpack_udfs.reasons import Reason, Rejected

MIN_AUDIO_TOKENS = 2


def audio_tokens(frames: int) -> int:
    """``<|AUDIO|>`` tokens of ``frames`` feature frames: the encoder's two stride-2 steps
    (``Qwen2AudioEncoder._get_feat_extract_output_lengths``)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


class Qwen2Audio(Family):
    """transformers-native Qwen2-Audio (7B, 7B-Instruct): audio clips of up to 30 s."""

    kind = "qwen2_audio"
    chat_modes: ClassVar[tuple[str, ...]] = ("qwen2_audio",)
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "audio": MediaTokens(("<|audio_bos|>",), "<|AUDIO|>", ("<|audio_eos|>",))
    }
    modalities: ClassVar[tuple[str, ...]] = ("audio",)
    content_parts = True  # its template reads a message's content parts (audio, texts)
    pixel_layout = "audio"
    padded_encoder_config = "audio_config"  # its encoder masks each clip's padding to 30 s

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """One silent clip of the fewest frames mmpack packs (7: 2 tokens), its features padded
        to the encoder's 30 s as the processor pads every clip; its mask keeps those 7 frames."""
        audio = config.audio_config
        frames = 2 * int(audio.max_source_positions)  # the encoder's input length (the conv halves it)
        kept = next(n for n in range(1, frames) if audio_tokens(n) == MIN_AUDIO_TOKENS)
        mask = [[1] * kept + [0] * (frames - kept)]
        shape = (1, int(audio.num_mel_bins), frames)
        token = int(config.audio_token_index)
        return [
            IdleMedia(
                "audio", "input_features", shape, token, MIN_AUDIO_TOKENS, {"feature_attention_mask": mask}
            )
        ]

    def plan_audio(self, samples: int) -> MediaPlan:
        """A clip of ``samples`` 16 kHz samples: grid (feature frames, 1, 1)."""
        why = "Qwen2-Audio takes a clip of fewer than 2 for an unexpanded prompt"
        return clip_plan(self.settings["audio"], samples, "Qwen2-Audio", MIN_AUDIO_TOKENS, why)


def clip_plan(features: Mapping[str, Any], samples: int, model: str, least: int, why: str) -> MediaPlan:
    """The plan of a clip of ``samples`` 16 kHz samples under a profile's Whisper ``features``:
    grid (feature frames, 1, 1) and its ``<|AUDIO|>`` tokens; refused past the feature extractor's
    chunk (the processor cuts it) and under ``least`` tokens (``why``)."""
    hop, limit = int(features["hop_length"]), int(features["n_samples"])
    if samples > limit:
        raise Rejected(
            Reason.MEDIA_UNSUPPORTED,
            f"audio of {samples / AUDIO_SAMPLE_RATE:.2f} s: {model}'s feature extractor keeps the "
            f"first {limit / AUDIO_SAMPLE_RATE:g} s and the answer would be trained on the rest",
        )
    frames = math.ceil(samples / hop)
    tokens = audio_tokens(frames)
    if tokens < least:
        raise Rejected(
            Reason.MEDIA_UNSUPPORTED, f"audio of {samples} samples gives {tokens} <|AUDIO|> token(s): {why}"
        )
    return MediaPlan("audio", (frames, 1, 1), tokens, (0, 0))
