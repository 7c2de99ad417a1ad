"""Model families: one module per model line, one registry line per family.

``FAMILIES`` maps a profile's ``kind`` to its class; ``MODEL_TYPES`` maps a model
directory's ``config.json`` ``model_type`` to a kind. Adding a family touches its module,
its tests and these two tables (and its profile section in ``config/model.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmpack_udfs.families.base import ChatFormat, Family, MediaPlan, MediaTokens
from mmpack_udfs.families.gemma3 import Gemma3
from mmpack_udfs.families.gemma4 import Gemma4
from mmpack_udfs.families.glm_v import GlmV
from mmpack_udfs.families.internvl import InternVL, InternVLChat
from mmpack_udfs.families.llava_onevision import LlavaOnevision
from mmpack_udfs.families.qwen2_audio import Qwen2Audio
from mmpack_udfs.families.qwen_omni import Qwen3Omni, Qwen25Omni
from mmpack_udfs.families.qwen_vl import Qwen2VL, Qwen3VL, Qwen25VL, Qwen35

FAMILIES: dict[str, type[Family]] = {
    "qwen2_vl": Qwen2VL,
    "qwen2_5_vl": Qwen25VL,
    "qwen3_vl": Qwen3VL,
    "qwen3_5": Qwen35,
    "internvl": InternVL,
    "internvl_chat": InternVLChat,
    "llava_onevision": LlavaOnevision,
    "gemma3": Gemma3,
    "gemma4": Gemma4,
    "glm4v": GlmV,
    "qwen2_audio": Qwen2Audio,
    "qwen2_5_omni": Qwen25Omni,
    "qwen3_omni": Qwen3Omni,
}

MODEL_TYPES: dict[str, str] = {  # config.json model_type -> family kind
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "internvl": "internvl",
    "llava_onevision": "llava_onevision",
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "glm4v": "glm4v",
    "glm4v_moe": "glm4v",
    "glm46v": "glm4v",
    "glm_ocr": "glm4v",
    "qwen2_audio": "qwen2_audio",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni",
    "qwen3_omni_moe_thinker": "qwen3_omni",
}


def make_family(name: str, settings: Mapping[str, Any]) -> Family:
    """The family object of a profile (``settings["kind"]`` picks the class)."""
    kind = settings.get("kind", name)
    if kind not in FAMILIES:
        raise ValueError(f"profile '{name}': unknown kind '{kind}' (known: {sorted(FAMILIES)})")
    return FAMILIES[kind](name, settings)


__all__ = ["FAMILIES", "MODEL_TYPES", "ChatFormat", "Family", "MediaPlan", "MediaTokens", "make_family"]
