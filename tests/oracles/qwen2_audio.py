"""transformers as the oracle for a Qwen2-Audio model directory (``model_type: qwen2_audio``).

What a user's training script does: the directory's chat template on the conversation as
content parts (``{"type": "audio", "audio": ...}`` for a clip, as users write them), then
transformers' ``Qwen2AudioProcessor``
(``WhisperFeatureExtractor`` from preprocessor_config.json) on the rendered text and the
sample's waveforms, one sample per call. The waveforms are FFmpeg's 16 kHz mono decode
(PyAV), what transformers' own loader gives with torchcodec (FFmpeg too; not installable beside a
CPU-only torch): ``test_audio.py`` shows it equals transformers' soundfile loader where no
resampling happens. Labels: assistant turns after their header through ``<|im_end|>``, except
each clip's span (``<|audio_bos|>``, ``<|AUDIO|>`` tokens, ``<|audio_eos|>``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from transformers import WhisperFeatureExtractor
from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor

from loader import audio
from tests.oracles import qwen_family
from tests.oracles.qwen_family import chat_template, labels_of

PLACEHOLDER = re.compile(r"(<audio>)")
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)
AUDIO_SPAN = re.compile(r"<\|audio_bos\|>(?:<\|AUDIO\|>)+<\|audio_eos\|>")


def messages(system: str | None, turns: list[dict]) -> list[dict[str, Any]]:
    """A samples-table conversation as chat messages, each clip a part as users write it."""
    return qwen_family.messages(system, turns, PLACEHOLDER, lambda _: {"type": "audio", "audio": "clip.wav"})


def processor(model_dir: Path, tokenizer) -> Qwen2AudioProcessor:
    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    extractor = WhisperFeatureExtractor(
        **{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    )
    return Qwen2AudioProcessor(extractor, tokenizer, chat_template=chat_template(model_dir))


def reference(model_dir: Path, tokenizer, sample: dict, videos: Any = None) -> dict[str, Any]:
    """What transformers gives for one samples-table row: ids, labels, the tokens of every clip,
    its features and feature mask (``videos``: unused, Qwen2-Audio takes none)."""
    wrapper = processor(model_dir, tokenizer)
    text = tokenizer.apply_chat_template(
        messages(sample["system"], sample["turns"]), chat_template=chat_template(model_dir), tokenize=False
    )
    waveforms = [audio.decode(m["uri"]) for m in sample["media"]]
    out = wrapper(text=[text], audio=waveforms or None, sampling_rate=16000, return_tensors="np")
    ids = [int(i) for i in out["input_ids"][0]]
    expanded = tokenizer.decode(ids, skip_special_tokens=False)
    pad = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    runs = [len(m.group(0)) for m in re.finditer(f"(?:{pad},)+", ",".join(map(str, ids)) + ",")]
    return {
        "input_ids": ids,
        "labels": labels_of(tokenizer, expanded, ids, AUDIO_SPAN, ASSISTANT_TURN),
        "tokens": [r // (len(str(pad)) + 1) for r in runs],
        "input_features": np.asarray(out["input_features"]) if waveforms else None,
        "feature_attention_mask": np.asarray(out["feature_attention_mask"]) if waveforms else None,
        "text": expanded,
    }
