"""A Hugging Face model directory → the profile mmpack tokenizes with.

Trainers are pointed at a model directory; so is mmpack (``tokenize.model``). Its
``config.json`` ``model_type`` picks the family (``families.MODEL_TYPES``); every vision
setting comes from the processor configs, resolved as transformers resolves them: the
processor class's defaults, then the file's keys (``size`` for the pixel limits, the
older ``min_pixels``/``max_pixels`` keys over it). A directory without a video processor
config gets the profile's own ``video`` defaults (qwen-vl-utils' values for Qwen2.5-VL),
and the resolution says so in its ``notes``. An ``s3://`` directory is listed once where a
run starts and copied once to each machine's cache (``fetch``).

This module reads files; a run resolves its model once (``mmpack_udfs.resolve``) and every
stage takes the result from the run context.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from mmpack_udfs.config.model import LLAVA_PINPOINTS, PROFILE_MODELS
from mmpack_udfs.errors import ConfigError
from mmpack_udfs.families import MODEL_TYPES
from mmpack_udfs.io import cache, fs

TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer_config.json",
    "processor_config.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# transformers' processor class defaults (5.23: Qwen2VLImageProcessor, Qwen2VLVideoProcessor,
# Qwen3VLVideoProcessor), before a directory's files override them.
QWEN2_IMAGE_DEFAULTS = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
VIDEO_DEFAULTS = {
    "qwen2": {
        **QWEN2_IMAGE_DEFAULTS,
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "min_frames": 4,
        "max_frames": 768,
        "fps": 2,
        "do_sample_frames": False,
    },
    "qwen3": {
        **QWEN2_IMAGE_DEFAULTS,
        "patch_size": 16,
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "min_frames": 4,
        "max_frames": 768,
        "fps": 2,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,
        "max_video_tokens": 768,
    },
}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # never fetched: mmpack needs no weights
RemoteFiles = tuple[tuple[str, int], ...]  # (name, size) of an s3:// directory's top-level files


@dataclass(frozen=True)
class ModelDirectory:
    """What a model directory says: its family, the settings of its profile, and how to find
    its files again (an ``s3://`` one's listing, the digest of its content)."""

    path: str  # local directory (the cache copy of an s3:// one)
    source: str  # as configured
    model_type: str
    kind: str  # the family
    profile: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    files: RemoteFiles = ()  # an s3:// source's files: executors fetch them without listing again
    digest: str = ""  # cache.directory_key: its files' content and the tokenizer libraries' versions

    def record(self) -> dict[str, Any]:
        """What the manifest and the run summary record of the model (with the run's chat
        renderer, ``RunContext.model_record``)."""
        return {
            "source": self.source,
            "model_type": self.model_type,
            "family": self.kind,
            "notes": self.notes,
        }


def read(source: str, storage: fs.Storage = fs.LOCAL) -> ModelDirectory:
    """Resolve a model directory (raises ConfigError naming what is missing or unsupported).
    The chat template's settings (``default_system``, ``chat``) are the resolver's to add."""
    files = listing(source, storage) if fs.is_s3(source) else ()
    path = fetch(source, storage, files) if fs.is_s3(source) else source  # an empty listing: "nothing at"
    if not Path(path).is_dir():
        raise ConfigError(f"tokenize.model: there is no model directory at {source}")
    config = _json(path, "config.json", required=True)
    model_type = config.get("model_type")
    kind = MODEL_TYPES.get(model_type)
    if kind is None:
        raise ConfigError(
            f"tokenize.model: {source}/config.json has model_type {model_type!r}, which mmpack cannot "
            f"tokenize exactly (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"tokenize.model: {source} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if chat_template(path) is None:
        raise ConfigError(
            f"tokenize.model: {source} has no chat template ({', '.join(TEMPLATE_FILES)}); mmpack renders "
            "conversations as the model's own template does and checks it against that template"
        )
    notes: list[str] = []
    profile = DIRECTORY_READERS.get(kind, _qwen_profile)(path, source, kind, config, notes)
    return ModelDirectory(path, source, model_type, kind, profile, notes, files, cache.directory_key(path))


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """The Hugging Face tokenizer at ``path`` (AutoTokenizer), loaded once per process."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@lru_cache(maxsize=16)
def added_tokens(path: str) -> dict[str, Any]:
    """AutoTokenizer's added tokens at ``path``: ``ids``, each one's id (``get_added_vocab``), and
    ``plain``, the non-special ones in id order. Cached on disk by the directory's content and
    the libraries' versions: once a directory has been seen, a stage checks its tokens without
    loading its tokenizer (1-4 s)."""

    def read() -> dict[str, Any]:
        tokenizer = load_tokenizer(path)
        added = sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder().items())
        return {"ids": tokenizer.get_added_vocab(), "plain": [t.content for _, t in added if not t.special]}

    record = cache.checks_dir() / f"added-tokens-{cache.directory_key(path)}.json"
    return cache.cached_json(record, read)


def _qwen_profile(path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]) -> dict:
    defaults = PROFILE_MODELS[kind]().model_dump()
    image_file = _processor_file(path, "preprocessor_config.json", "image_processor")
    if image_file is None:
        raise ConfigError(
            f"tokenize.model: {source} has no preprocessor_config.json (the image processor's settings), "
            f"which a {kind} model needs"
        )
    image = _resolved(QWEN2_IMAGE_DEFAULTS, image_file)
    video_file = _processor_file(path, "video_preprocessor_config.json", "video_processor")
    profile = dict(defaults)
    profile["vision"] = {k: image[k] for k in ("patch_size", "merge_size", "temporal_patch_size")}
    profile["image"] = {
        "min_pixels": image["size"]["shortest_edge"],
        "max_pixels": image["size"]["longest_edge"],
        "mean": list(image["image_mean"]),
        "std": list(image["image_std"]),
    }
    if video_file is None:
        notes.append(
            f"{source} has no video_preprocessor_config.json: videos use mmpack's {kind} video settings "
            f"(profiles.model.video: {_brief(defaults['video'])})"
        )
    else:
        profile["video"] = _video_settings(kind, video_file, defaults["video"], profile["vision"], source)
    vision_config = config.get("vision_config") or {}
    _check_vision_config(vision_config, profile["vision"], source)
    if "tokens_per_second" in defaults:
        profile["tokens_per_second"] = vision_config.get("tokens_per_second", defaults["tokens_per_second"])
    profile["default_system"] = ""  # set from the chat template (families.chat_check)
    return profile


# transformers' class defaults (5.24) that GotOcr2ImageProcessor, InternVLVideoProcessor and
# LLaVA-OneVision's image and video processors share: 384 px squares, bicubic, CLIP's mean/std
SQUARE_PROCESSOR_DEFAULTS = {
    "size": {"height": 384, "width": 384},
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}
VIDEO_PROCESSOR_DEFAULTS = {
    **SQUARE_PROCESSOR_DEFAULTS,
    "do_sample_frames": False,
    "num_frames": None,
    "fps": None,
}
GOT_OCR2_DEFAULTS = {**SQUARE_PROCESSOR_DEFAULTS, "min_patches": 1, "max_patches": 12}
INTERNVL_VIDEO_DEFAULTS = {**VIDEO_PROCESSOR_DEFAULTS, "initial_shift": True}


def _internvl_profile(path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]) -> dict:
    """transformers-native InternVL: GotOcr2 tiles from preprocessor_config.json, 256 (the
    processor's ``image_seq_length``) tokens a tile, the video processor's settings from
    video_preprocessor_config.json or, as transformers falls back, preprocessor_config.json."""
    image_file, image, tile = _square_image_processor(path, source, kind, GOT_OCR2_DEFAULTS)
    processor = _json(path, "processor_config.json") or {}
    per_tile = processor.get("image_seq_length", 256)
    vision, ratio = config.get("vision_config") or {}, config.get("downsample_ratio", 0.5)
    patch = vision.get("patch_size", 14)
    patch = patch[0] if isinstance(patch, list) else patch
    if (tile // patch) ** 2 * ratio**2 != per_tile:
        raise ConfigError(
            f"tokenize.model: {source}: image_seq_length {per_tile} (processor_config.json) differs from the "
            f"{int((tile // patch) ** 2 * ratio**2)} tokens the vision tower makes of a {tile} px tile "
            f"(patch {patch}, downsample_ratio {ratio})"
        )
    _check_token_id(path, source, config, "image_token_id", "<IMG_CONTEXT>")
    video = _video_processor(path, source, INTERNVL_VIDEO_DEFAULTS, image_file, notes)
    if not isinstance(video["initial_shift"], bool):
        raise ConfigError(
            f"tokenize.model: {source}: initial_shift {video['initial_shift']!r} is not reproduced"
        )
    profile = PROFILE_MODELS[kind]().model_dump()
    profile["image"].update(
        tile_size=tile,
        tokens_per_tile=per_tile,
        min_tiles=image["min_patches"],
        max_tiles=image["max_patches"],
        mean=list(image["image_mean"]),
        std=list(image["image_std"]),
    )
    profile["video"].update(_video_profile(video), initial_shift=video["initial_shift"])
    return profile


def _square_image_processor(
    path: str, source: str, kind: str, defaults: Mapping[str, Any]
) -> tuple[dict, dict, int]:
    """(the file's settings, them over the class ``defaults``, the square side) of a directory's
    image processor with square tiles or crops; refused where mmpack's pixels would differ."""
    image_file = _processor_file(path, "preprocessor_config.json", "image_processor")
    if image_file is None:
        raise ConfigError(
            f"tokenize.model: {source} has no preprocessor_config.json, which the {kind} family needs"
        )
    image = {**defaults, **{k: v for k, v in image_file.items() if v is not None}}
    _refuse_other_processing(image, "preprocessor_config.json", source, defaults["resample"])
    return image_file, image, _square(image["size"], "preprocessor_config.json", source)


def _check_token_id(path: str, source: str, config: Mapping[str, Any], key: str, token: str) -> int:
    """The tokenizer's id of ``token``, which config.json's ``key`` (e.g. ``image_token_id``) must
    be (the model puts the media features where it finds that id)."""
    expected = config.get(key)
    found = added_tokens(path)["ids"].get(token)
    if found is None:  # not an added token: its id in the vocabulary
        found = load_tokenizer(path).convert_tokens_to_ids(token)
    if expected is not None and found != expected:
        raise ConfigError(
            f"tokenize.model: {source}: config.json {key} {expected} is not the tokenizer's {token} ({found})"
        )
    return found


# transformers' LlavaOnevisionImageProcessor and LlavaOnevisionVideoProcessor class defaults (5.24)
LLAVA_ONEVISION_IMAGE_DEFAULTS = {**SQUARE_PROCESSOR_DEFAULTS, "image_grid_pinpoints": LLAVA_PINPOINTS}


def _llava_onevision_profile(
    path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]
) -> dict:
    """LLaVA-OneVision: crops and pinpoints from preprocessor_config.json, tokens per crop and the
    anyres limit from processor_config.json, checked against config.json's vision tower; the video
    processor's settings as for InternVL."""
    image_file, image, crop = _square_image_processor(path, source, kind, LLAVA_ONEVISION_IMAGE_DEFAULTS)
    processor = _json(path, "processor_config.json") or {}
    per_crop = processor.get("num_image_tokens")
    vision = config.get("vision_config") or {}
    side, patch = vision.get("image_size", 384), vision.get("patch_size", 14)
    if side != crop or per_crop != (side // patch) ** 2:
        raise ConfigError(
            f"tokenize.model: {source}: processor_config.json num_image_tokens {per_crop!r} and the {crop} "
            f"px crops of preprocessor_config.json are not the vision tower's ({(side // patch) ** 2} "
            f"tokens of a {side} px image, config.json vision_config)"
        )
    for key, default in (("vision_feature_select_strategy", "full"), ("vision_aspect_ratio", "anyres_max_9")):
        ours, theirs = processor.get(key, default), config.get(key, default)
        if ours != theirs:
            raise ConfigError(
                f"tokenize.model: {source}: processor_config.json {key} {ours!r} differs from config.json's "
                f"{theirs!r}"
            )
    if processor.get("vision_feature_select_strategy") != "full":
        raise ConfigError(
            f"tokenize.model: {source}: vision_feature_select_strategy "
            f"{processor.get('vision_feature_select_strategy')!r}; mmpack reproduces LLaVA-OneVision only "
            "with 'full' (the SigLIP tower has no class token to drop)"
        )
    aspect = re.fullmatch(r"anyres_max_(\d+)", processor.get("vision_aspect_ratio", "anyres_max_9"))
    if aspect is None:
        raise ConfigError(
            f"tokenize.model: {source}: vision_aspect_ratio {processor['vision_aspect_ratio']!r} is not "
            "anyres_max_N, which mmpack reproduces"
        )
    pinpoints = [list(p) for p in image["image_grid_pinpoints"]]
    if config.get("image_grid_pinpoints", pinpoints) != pinpoints:
        raise ConfigError(
            f"tokenize.model: {source}: config.json image_grid_pinpoints differ from those of "
            "preprocessor_config.json"
        )
    _check_token_id(path, source, config, "image_token_index", "<image>")
    _check_token_id(path, source, config, "video_token_index", "<video>")
    video = _video_processor(path, source, VIDEO_PROCESSOR_DEFAULTS, image_file, notes)
    if video["do_sample_frames"] and video["num_frames"] and video["fps"]:
        raise ConfigError(
            f"tokenize.model: {source}: the video processor sets both num_frames and fps, which transformers "
            "refuses"
        )
    if not (video["do_sample_frames"] and video["num_frames"]):
        notes.append(
            f"{source}: the video processor samples no fixed number of frames (do_sample_frames, "
            "num_frames); "
            "LLaVA-OneVision stacks a batch's videos, so samples with videos are quarantined"
        )
    profile = PROFILE_MODELS[kind]().model_dump()
    profile["image"].update(
        crop_size=crop,
        tokens_per_crop=per_crop,
        pinpoints=pinpoints,
        max_crops=int(aspect.group(1)),
        mean=list(image["image_mean"]),
        std=list(image["image_std"]),
    )
    profile["video"].update(_video_profile(video))
    return profile


# transformers' Gemma3ImageProcessor class defaults (5.24), and Gemma3Processor's: pan-and-scan off
GEMMA3_IMAGE_DEFAULTS = {
    **SQUARE_PROCESSOR_DEFAULTS,
    "size": {"height": 224, "width": 224},
    "resample": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": False,
}
GEMMA3_TOKENS = (  # config.json key -> the tokenizer's token
    (("image_token_index", "image_token_id"), "<image_soft_token>"),
    (("boi_token_index", "boi_token_id"), "<start_of_image>"),
    (("eoi_token_index", "eoi_token_id"), "<end_of_image>"),
)


def _gemma3_profile(path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]) -> dict:
    """Gemma 3: the square size and mean/std from preprocessor_config.json, tokens per image from
    processor_config.json (``image_seq_length``), checked against config.json
    (``mm_tokens_per_image``, the vision tower's size, the image token ids); pan-and-scan crops
    are refused; the sliding window from ``text_config``."""
    _, image, size = _square_image_processor(path, source, kind, GEMMA3_IMAGE_DEFAULTS)
    if image["do_pan_and_scan"]:
        raise ConfigError(
            f"tokenize.model: {source}: preprocessor_config.json sets do_pan_and_scan; mmpack reproduces "
            "Gemma 3 only without pan-and-scan crops (the processor's default)"
        )
    processor = _json(path, "processor_config.json") or {}
    per_image = processor.get("image_seq_length", image.get("image_seq_length", 256))
    vision = config.get("vision_config") or {}
    if per_image != config.get("mm_tokens_per_image", 256) or vision.get("image_size", size) != size:
        raise ConfigError(
            f"tokenize.model: {source}: {per_image} tokens per {size} px image (processor_config.json "
            "image_seq_length, preprocessor_config.json size) are not the model's (config.json "
            f"mm_tokens_per_image {config.get('mm_tokens_per_image', 256)}, vision_config.image_size "
            f"{vision.get('image_size')})"
        )
    ids = {
        token: _check_token_id(path, source, config, next((k for k in keys if k in config), keys[0]), token)
        for keys, token in GEMMA3_TOKENS
    }
    profile = PROFILE_MODELS[kind]().model_dump()
    profile["image"].update(
        size=size,
        tokens_per_image=per_image,
        patch_size=vision.get("patch_size", 14),
        mean=list(image["image_mean"]),
        std=list(image["image_std"]),
    )
    profile["sliding_window"] = (config.get("text_config") or {}).get("sliding_window", 4096)
    profile["image_token_id"] = ids["<image_soft_token>"]
    return profile


# transformers' Gemma4ImageProcessor and Gemma4VideoProcessor class defaults (5.24): no mean/std
# (pixels in [0, 1]; the video processor "normalizes" with mean 0 and std 1)
GEMMA4_IMAGE_DEFAULTS = {
    **SQUARE_PROCESSOR_DEFAULTS,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "do_normalize": False,
    "patch_size": 16,
    "max_soft_tokens": 280,
    "pooling_kernel_size": 3,
}
GEMMA4_VIDEO_DEFAULTS = {
    **GEMMA4_IMAGE_DEFAULTS,
    "do_normalize": True,
    "max_soft_tokens": 70,
    "num_frames": 32,
    "fps": None,
    "do_sample_frames": True,
}
GEMMA4_TOKENS = (  # config.json key -> the tokenizer's token
    ("image_token_id", "<|image|>"),
    ("video_token_id", "<|video|>"),
    ("boi_token_id", "<|image>"),
    ("eoi_token_id", "<image|>"),
)
GEMMA4_CLASSES = {  # the processor classes mmpack reproduces, by where a directory names them
    "processor_class": ("Gemma4Processor",),
    "image_processor_type": ("Gemma4ImageProcessor", "Gemma4ImageProcessorPil"),
    "video_processor_type": ("Gemma4VideoProcessor",),
}


def _gemma4_profile(path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]) -> dict:
    """Gemma 4: the soft-token budgets, patch and pooling of the image and video processors
    (preprocessor_config.json / video_preprocessor_config.json, or their sections of
    processor_config.json) checked against the vision tower; frames sampled by ``num_frames``;
    the token ids, the sliding window and ``use_bidirectional_attention`` from config.json. A
    directory with an audio tower is read for its images and videos (audio is refused per
    sample); ``use_bidirectional_attention: all`` is refused."""
    files = {
        "processor_class": _json(path, "processor_config.json") or {},
        "image_processor_type": _processor_file(path, "preprocessor_config.json", "image_processor") or {},
        "video_processor_type": _processor_file(path, "video_preprocessor_config.json", "video_processor")
        or {},
    }
    for key, allowed in GEMMA4_CLASSES.items():
        named = files[key].get(key)
        if named is not None and named not in allowed:
            raise ConfigError(
                f"tokenize.model: {source}: {key} {named!r}; mmpack reproduces {' or '.join(allowed)}"
            )
    text = config.get("text_config") or {}
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        raise ConfigError(
            f"tokenize.model: {source}: text_config.use_bidirectional_attention "
            f"{text['use_bidirectional_attention']!r}; mmpack packs Gemma 4 with causal text (null or "
            "'vision')"
        )
    vision = config.get("vision_config") or {}
    profile = PROFILE_MODELS[kind]().model_dump()
    for kind_, defaults, file_key in (
        ("image", GEMMA4_IMAGE_DEFAULTS, "image_processor_type"),
        ("video", GEMMA4_VIDEO_DEFAULTS, "video_processor_type"),
    ):
        settings = {**defaults, **{k: v for k, v in files[file_key].items() if v is not None}}
        where = f"the {kind_} processor"
        if settings["do_normalize"] and (settings["image_mean"], settings["image_std"]) != (
            [0.0] * 3,
            [1.0] * 3,
        ):
            raise ConfigError(f"tokenize.model: {source}: {where} normalizes with a mean/std other than 0/1")
        _refuse_other_processing({**settings, "do_normalize": True}, where, source)
        for key in ("patch_size", "pooling_kernel_size"):
            if key in vision and settings[key] != vision[key]:
                raise ConfigError(
                    f"tokenize.model: {source}: {where}'s {key} {settings[key]} is not the vision tower's "
                    f"{vision[key]} (config.json vision_config)"
                )
        if kind_ == "video" and (settings["fps"] is not None or not settings["do_sample_frames"]):
            raise ConfigError(
                f"tokenize.model: {source}: {where} samples frames by fps or not at all; mmpack reproduces "
                "Gemma 4's num_frames sampling (do_sample_frames true, no fps)"
            )
        picked = {k: settings[k] for k in ("max_soft_tokens", "patch_size", "pooling_kernel_size")}
        profile[kind_].update(picked, **({"num_frames": settings["num_frames"]} if kind_ == "video" else {}))
    ids = {token: _check_token_id(path, source, config, key, token) for key, token in GEMMA4_TOKENS}
    profile.update(
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        sliding_window=text.get("sliding_window", 512),
        bidirectional_media=text.get("use_bidirectional_attention") == "vision",
    )
    return profile


# transformers' Glm4vImageProcessor and Glm4vVideoProcessor class defaults (5.24; Glm46V's are the
# same); GLM reads the pixel limits from ``size`` alone (no min_pixels/max_pixels keys)
GLM_IMAGE_DEFAULTS = {
    **SQUARE_PROCESSOR_DEFAULTS,
    "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000},
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
}
GLM_VIDEO_DEFAULTS = {
    **GLM_IMAGE_DEFAULTS,
    "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
    "fps": 2,
    "max_duration": 300,
    "do_sample_frames": True,
}
# the processor class a directory names → how its frames are labelled (GlmVProfile.frame_label)
GLM_PROCESSORS = {"Glm4vProcessor": "integer", "Glm46VProcessor": "seconds"}
GLM_VIDEO_PROCESSORS = {"Glm4vVideoProcessor": "glm4v", "Glm46VVideoProcessor": "glm46v"}
GLM_TOKENS = (  # config.json key -> the tokenizer's token
    ("image_token_id", "<|image|>"),
    ("video_token_id", "<|video|>"),
    ("image_start_token_id", "<|begin_of_image|>"),
    ("image_end_token_id", "<|end_of_image|>"),
    ("video_start_token_id", "<|begin_of_video|>"),
    ("video_end_token_id", "<|end_of_video|>"),
)


def _glm_profile(path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]) -> dict:
    """The GLM-V line: the image and video processors' settings (their ``size`` pixel limits,
    patching, mean/std), the processor classes the directory names (GLM-4.6V's frame labels and
    frame sampling) or, where it names none, those transformers maps its ``model_type`` to."""
    image_file = _processor_file(path, "preprocessor_config.json", "image_processor")
    if image_file is None:
        raise ConfigError(f"tokenize.model: {source} has no preprocessor_config.json, which GLM-V needs")
    image = {**GLM_IMAGE_DEFAULTS, **{k: v for k, v in image_file.items() if v is not None}}
    _refuse_other_processing(image, "preprocessor_config.json", source)
    video_file = _processor_file(path, "video_preprocessor_config.json", "video_processor")
    if video_file is None:
        notes.append(
            f"{source} has no video_preprocessor_config.json: videos use its video processor's class defaults"
        )
    video = {**GLM_VIDEO_DEFAULTS, **{k: v for k, v in (video_file or {}).items() if v is not None}}
    _refuse_other_processing(video, "the video processor's config", source)
    if not video["do_sample_frames"]:
        raise ConfigError(
            f"tokenize.model: {source}: the video processor sets do_sample_frames false (every frame); "
            "mmpack reproduces GLM-V's frame sampling only"
        )
    vision = {k: image[k] for k in ("patch_size", "merge_size", "temporal_patch_size")}
    for key in (*vision, "image_mean", "image_std"):
        if video[key] != image[key]:
            raise ConfigError(
                f"tokenize.model: {source}: the video processor's {key} {video[key]} differs from the image "
                f"processor's {image[key]}; mmpack hands GLM-V's video frames to the vision tower as images"
            )
    _check_vision_config(config.get("vision_config") or {}, vision, source)
    for key, token in GLM_TOKENS:
        _check_token_id(path, source, config, key, token)
    glm46v = config.get("model_type") == "glm46v"
    processor = (_json(path, "processor_config.json") or {}).get("processor_class") or image_file.get(
        "processor_class", "Glm46VProcessor" if glm46v else "Glm4vProcessor"
    )
    paired = processor.replace("Processor", "VideoProcessor")  # the processor class's own video processor
    video_class = video.get("video_processor_type") or paired
    checks = (
        (processor, GLM_PROCESSORS, "processor"),
        (video_class, GLM_VIDEO_PROCESSORS, "video processor"),
    )
    for name, known, what in checks:
        if name not in known:
            raise ConfigError(
                f"tokenize.model: {source} names the {what} {name!r}; mmpack reproduces GLM-V with "
                f"{' or '.join(known)}"
            )
    profile = PROFILE_MODELS[kind]().model_dump()
    profile["vision"] = vision
    profile["image"].update(
        min_pixels=image["size"]["shortest_edge"],
        max_pixels=image["size"]["longest_edge"],
        mean=list(image["image_mean"]),
        std=list(image["image_std"]),
    )
    profile["video"].update(
        sampling=GLM_VIDEO_PROCESSORS[video_class],
        fps=video["fps"],
        max_duration=video["max_duration"],
        min_pixels=video["size"]["shortest_edge"],
        max_pixels=video["size"]["longest_edge"],
    )
    profile["frame_label"] = GLM_PROCESSORS[processor]
    return profile


def _video_profile(video: Mapping[str, Any]) -> dict[str, Any]:
    """The profile's ``video`` keys (ProcessorVideo) from a video processor's settings."""
    return {
        "height": video["size"]["height"],
        "width": video["size"]["width"],
        "mean": list(video["image_mean"]),
        "std": list(video["image_std"]),
        **{k: video[k] for k in ("do_sample_frames", "num_frames", "fps")},
    }


def _video_processor(
    path: str, source: str, defaults: Mapping[str, Any], image_file: Mapping[str, Any], notes: list[str]
) -> dict[str, Any]:
    """A video processor's settings: class defaults, then video_preprocessor_config.json or, as
    transformers falls back, the image processor's file; refused where mmpack differs."""
    video_file = _processor_file(path, "video_preprocessor_config.json", "video_processor")
    if video_file is None:
        video_file = image_file
        notes.append(f"{source} has no video_preprocessor_config.json: videos use preprocessor_config.json")
    video = {**defaults, **{k: v for k, v in video_file.items() if v is not None}}
    _refuse_other_processing(video, "the video processor's config", source)
    if video["do_sample_frames"] and not (video["num_frames"] or video["fps"]):
        raise ConfigError(
            f"tokenize.model: {source}: the video processor samples frames (do_sample_frames) but sets "
            "neither num_frames nor fps"
        )
    if not (isinstance(video["size"], dict) and video["size"].get("height") and video["size"].get("width")):
        raise ConfigError(
            f"tokenize.model: {source}: the video processor's size {video['size']!r} is no height and width"
        )
    return video


def _refuse_other_processing(settings: Mapping[str, Any], where: str, source: str, resample: int = 3) -> None:
    """ConfigError naming a processor option mmpack's pixels do not reproduce (``resample``: the
    PIL filter the family resizes with, bicubic unless it says otherwise)."""
    required = {
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": resample,
    }
    for key, value in required.items():
        if settings.get(key) != value:
            raise ConfigError(
                f"tokenize.model: {source}: {where} sets {key} {settings.get(key)!r}; mmpack reproduces "
                f"this processing only with {key} {value!r}"
            )
    if settings.get("do_center_crop") or abs(settings["rescale_factor"] - 1 / 255) > 1e-12:
        raise ConfigError(
            f"tokenize.model: {source}: {where} sets do_center_crop or a rescale_factor other than 1/255, "
            "which mmpack does not reproduce"
        )


def _square(size: Any, where: str, source: str) -> int:
    if not isinstance(size, dict) or size.get("height") != size.get("width") or not size.get("height"):
        raise ConfigError(
            f"tokenize.model: {source}: {where} size {size!r} is not a square tile (height = width)"
        )
    return int(size["height"])


def _video_settings(
    kind: str, file: Mapping[str, Any], defaults: Mapping[str, Any], vision: Mapping[str, int], source: str
) -> dict:
    base = VIDEO_DEFAULTS["qwen3" if kind in ("qwen3_vl", "qwen3_5") else "qwen2"]
    video = _resolved(base, file)
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if video[key] != vision[key]:
            raise ConfigError(
                f"tokenize.model: {source}: the video processor's {key} {video[key]} differs from the image "
                f"processor's {vision[key]} (one vision tower)"
            )
    settings = {
        "fps": video["fps"],
        "min_frames": video["min_frames"],
        "max_frames": video["max_frames"],
        "min_pixels": video["size"]["shortest_edge"],
        "max_pixels": video["size"]["longest_edge"],
        "mean": list(video["image_mean"]),
        "std": list(video["image_std"]),
    }
    if "do_sample_frames" in defaults:
        settings.update(
            do_sample_frames=bool(video["do_sample_frames"]),
            cap_pixels_per_frame=bool(video.get("cap_pixels_per_frame")),
            max_video_tokens=video["max_video_tokens"],
        )
    else:  # Qwen2-VL's video processor: mmpack samples at fps, without the qwen-vl-utils cap
        if not video["do_sample_frames"]:
            raise ConfigError(
                f"tokenize.model: {source}/video_preprocessor_config.json sets do_sample_frames false (every "
                "frame of a clip); mmpack samples frames at fps: set do_sample_frames true there"
            )
        if video.get("cap_pixels_per_frame"):
            raise ConfigError(
                f"tokenize.model: {source}/video_preprocessor_config.json sets cap_pixels_per_frame, which "
                f"mmpack does not reproduce for {kind}"
            )
    return {**defaults, **settings}


def _check_vision_config(vision_config: Mapping[str, Any], vision: Mapping[str, int], source: str) -> None:
    """The processor's patching must be the vision tower's (config.json ``vision_config``)."""
    pairs = {
        "patch_size": "patch_size",
        "merge_size": "spatial_merge_size",
        "temporal_patch_size": "temporal_patch_size",
    }
    for ours, theirs in pairs.items():
        if theirs in vision_config and vision_config[theirs] != vision[ours]:
            raise ConfigError(
                f"tokenize.model: {source}: the processor's {ours} {vision[ours]} differs from config.json "
                f"vision_config.{theirs} {vision_config[theirs]}"
            )


def _resolved(defaults: Mapping[str, Any], file: Mapping[str, Any]) -> dict[str, Any]:
    """A processor's settings: class defaults, the file's keys, ``min_pixels``/``max_pixels``
    over ``size`` (transformers' backward compatibility)."""
    merged = {**defaults, **{k: v for k, v in file.items() if v is not None}}
    size = dict(merged.get("size") or defaults["size"])
    if file.get("min_pixels") is not None:
        size["shortest_edge"] = file["min_pixels"]
    if file.get("max_pixels") is not None:
        size["longest_edge"] = file["max_pixels"]
    merged["size"] = size
    return merged


def _brief(video: Mapping[str, Any]) -> str:
    return (
        f"{video['fps']} fps, {video['min_frames']}–{video['max_frames']} frames, "
        f"{video['min_pixels']}–{video['max_pixels']} pixels"
    )


def _processor_file(path: str, name: str, nested: str) -> dict | None:
    """A processor's settings file, or its section of processor_config.json."""
    found = _json(path, name)
    if found is not None:
        return found
    combined = _json(path, "processor_config.json") or {}
    section = combined.get(nested)
    return section if isinstance(section, dict) else None


def chat_template(path: str) -> str | None:
    """The directory's chat template, looked up as transformers does: chat_template.jinja,
    chat_template.json, then the ``chat_template`` key of tokenizer_config.json or
    processor_config.json."""
    jinja = Path(path) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in TEMPLATE_FILES[1:]:
        data = _json(path, name) or {}
        template = data.get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
    return None


def _json(path: str, name: str, required: bool = False) -> dict | None:
    file = Path(path) / name
    if not file.is_file():
        if required:
            raise ConfigError(f"tokenize.model: {path} has no {name}")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ConfigError(f"tokenize.model: {file} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"tokenize.model: {file} must hold a JSON object")
    return data


def listing(uri: str, storage: fs.Storage) -> RemoteFiles:
    """(name, size) of an s3:// model directory's top-level files but its weights (one listing)."""
    filesystem, path = storage.filesystem(uri)
    infos = filesystem.get_file_info(pafs.FileSelector(path.rstrip("/"), allow_not_found=True))
    return tuple(
        sorted(
            (info.base_name, info.size)
            for info in infos
            if info.type == pafs.FileType.File and not info.base_name.endswith(WEIGHT_SUFFIXES)
        )
    )


def fetch(uri: str, storage: fs.Storage, files: RemoteFiles) -> str:
    """A local copy of the ``files`` (``listing``) of an s3:// model directory, made once per
    machine under the mmpack cache, keyed by the URI and the files' names and sizes."""
    if not files:
        raise ConfigError(f"tokenize.model: nothing at {uri}")
    stamp = hashlib.sha256(json.dumps([uri, *sorted(f"{n}:{size}" for n, size in files)]).encode())
    target = cache.cache_dir() / "models" / stamp.hexdigest()[:16]
    if target.is_dir():
        return str(target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, _ in files:
        (tmp / name).write_bytes(storage.read_bytes(fs.join(uri, name)))
    try:
        tmp.replace(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# transformers' WhisperFeatureExtractor class defaults (5.24), which Qwen2-Audio's directories use
WHISPER_DEFAULTS = {
    "feature_size": 80,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 30,
    "n_fft": 400,
    "padding_value": 0.0,
    "dither": 0.0,
}
QWEN2_AUDIO_TOKENS = (  # config.json key -> the tokenizer's token
    ("audio_token_index", "<|AUDIO|>"),
    ("audio_bos_token_id", "<|audio_bos|>"),
    ("audio_eos_token_id", "<|audio_eos|>"),
)


def _qwen2_audio_profile(
    path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]
) -> dict:
    """Qwen2-Audio: the Whisper features' settings from preprocessor_config.json, checked against
    config.json (mel bins, the encoder's 30 s of frames, the audio token ids)."""
    profile = PROFILE_MODELS[kind]().model_dump()
    profile["audio"] = _whisper_features(path, source, kind, config.get("audio_config") or {}, fixed=True)
    ids = {token: _check_token_id(path, source, config, key, token) for key, token in QWEN2_AUDIO_TOKENS}
    profile["audio_token_id"] = ids["<|AUDIO|>"]
    profile["default_system"] = ""  # set from the chat template (families.chat_check)
    return profile


def _whisper_features(
    path: str, source: str, kind: str, audio_config: Mapping[str, Any], fixed: bool
) -> dict[str, Any]:
    """The profile's ``audio`` section: the Whisper feature extractor's settings from
    preprocessor_config.json (``n_samples``: the clip length it pads and cuts to), refused where
    mmpack's features would differ (another rate, dithering, normalizing) or do not fit the audio
    encoder (``audio_config``: its mel bins; ``fixed``: an encoder that takes exactly one padded
    chunk of frames, Qwen2-Audio's)."""
    file = _processor_file(path, "preprocessor_config.json", "feature_extractor")
    if file is None:
        raise ConfigError(
            f"tokenize.model: {source} has no preprocessor_config.json, which a {kind} model needs"
        )
    features = {**WHISPER_DEFAULTS, **{k: v for k, v in file.items() if v is not None}}
    n_samples = features["chunk_length"] * features["sampling_rate"]
    problems = [
        f"{key} {features.get(key)!r} (mmpack reproduces {value!r})"
        for key, value in (("sampling_rate", 16000), ("dither", 0.0), ("do_normalize", None))
        if features.get(key) != value
    ]
    frames = 2 * audio_config.get("max_source_positions", 1500)  # the encoder's first conv strides 2
    if fixed and n_samples // features["hop_length"] != frames:
        problems.append(f"{n_samples // features['hop_length']} frames per clip, the encoder takes {frames}")
    if features["feature_size"] != audio_config.get("num_mel_bins", 128):
        problems.append(f"feature_size {features['feature_size']}, the encoder's num_mel_bins differ")
    if problems:
        raise ConfigError(f"tokenize.model: {source}: preprocessor_config.json: {'; '.join(problems)}")
    return {
        "feature_size": features["feature_size"],
        "hop_length": features["hop_length"],
        "n_fft": features["n_fft"],
        "n_samples": n_samples,
        "padding_value": features["padding_value"],
    }


QWEN_OMNI_TOKENS = (  # the thinker config's key -> the tokenizer's token
    ("audio_token_index", "<|AUDIO|>"),
    ("image_token_index", "<|IMAGE|>"),
    ("video_token_index", "<|VIDEO|>"),
    ("audio_start_token_id", "<|audio_bos|>"),
    ("audio_end_token_id", "<|audio_eos|>"),
    ("vision_start_token_id", "<|vision_bos|>"),
    ("vision_end_token_id", "<|vision_eos|>"),
)
# the frame pixel limits Qwen2_5OmniProcessor passes its video processor on every call
# (``Qwen2_5OmniProcessor.videos_kwargs``, transformers 5.24), over the video processor's own
QWEN_OMNI_VIDEO_PIXELS = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28}


def _qwen_omni_profile(
    path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]
) -> dict:
    """Qwen2.5-Omni (a whole checkpoint, its ``thinker_config``, or a thinker's own config): the
    image and video settings as Qwen2.5-VL's (the video frames' pixel limits those the processor
    passes), the Whisper features from preprocessor_config.json, the token ids and
    ``position_id_per_seconds`` from the thinker's config."""
    profile, thinker = _omni_thinker_profile(
        path, source, kind, config, notes, QWEN_OMNI_TOKENS, QWEN_OMNI_VIDEO_PIXELS
    )
    profile["seconds_per_chunk"] = thinker.get("seconds_per_chunk", 2)
    return profile


def _omni_thinker_profile(
    path: str,
    source: str,
    kind: str,
    config: Mapping[str, Any],
    notes: list[str],
    tokens: tuple[tuple[str, str], ...],
    video_pixels: Mapping[str, int],
) -> tuple[dict, Mapping[str, Any]]:
    """What the Omni thinkers' directories share: the thinker's config (a whole checkpoint's
    ``thinker_config``), images and videos as the Qwen-VL line's with the frame limits the
    processor passes (``video_pixels``), the Whisper features, the ``tokens`` checked against the
    tokenizer (the first is the audio token), ``position_id_per_seconds`` (the thinker configs'
    class default 25 where config.json has none). The profile and the thinker's config."""
    thinker = config.get("thinker_config") or config
    profile = _qwen_profile(path, source, kind, thinker, notes)
    profile["video"].update(video_pixels)
    profile["audio"] = _whisper_features(path, source, kind, thinker.get("audio_config") or {}, fixed=False)
    ids = [_check_token_id(path, source, thinker, key, token) for key, token in tokens]
    profile["audio_token_id"] = ids[0]
    profile["position_id_per_seconds"] = thinker.get("position_id_per_seconds", 25)
    return profile, thinker


QWEN3_OMNI_TOKENS = (  # the thinker config's key -> the tokenizer's token
    ("audio_token_id", "<|audio_pad|>"),
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("audio_start_token_id", "<|audio_start|>"),
    ("audio_end_token_id", "<|audio_end|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)
# Qwen3OmniMoeProcessor (transformers 5.24): the frame pixel limits it passes its video processor on
# every call, and the audio encoder window it counts a clip's tokens with (its n_window)
QWEN3_OMNI_VIDEO_PIXELS = {"min_pixels": 128 * 32 * 32, "max_pixels": 768 * 32 * 32}
QWEN3_OMNI_PROCESSOR_WINDOW = 50


def _qwen3_omni_profile(
    path: str, source: str, kind: str, config: Mapping[str, Any], notes: list[str]
) -> dict:
    """Qwen3-Omni (a whole checkpoint, its ``thinker_config``, or a thinker's own config): images
    and videos as Qwen2-VL's processors take them (a directory without
    video_preprocessor_config.json gives its video processor preprocessor_config.json, as
    transformers does: the image's mean and std), the frame limits the processor passes, the
    Whisper features, the token ids, ``position_id_per_seconds`` (the thinker config's class
    default 25 where config.json has none) and the audio encoder's window, which must be the one
    the processor counts tokens with."""
    profile, thinker = _omni_thinker_profile(
        path, source, kind, config, notes, QWEN3_OMNI_TOKENS, QWEN3_OMNI_VIDEO_PIXELS
    )
    if _processor_file(path, "video_preprocessor_config.json", "video_processor") is None:
        profile["video"].update(mean=profile["image"]["mean"], std=profile["image"]["std"])
    window = (thinker.get("audio_config") or {}).get("n_window", QWEN3_OMNI_PROCESSOR_WINDOW)
    if window != QWEN3_OMNI_PROCESSOR_WINDOW:
        raise ConfigError(
            f"tokenize.model: {source}: audio_config.n_window {window}, but Qwen3OmniMoeProcessor counts "
            f"a clip's tokens with {QWEN3_OMNI_PROCESSOR_WINDOW}; mmpack refuses a model and processor "
            "that disagree"
        )
    profile["audio_window"] = window
    return profile


# the profile reader of each family whose directory is not read as Qwen-VL's (_qwen_profile)
DIRECTORY_READERS = {
    "qwen2_audio": _qwen2_audio_profile,
    "qwen2_5_omni": _qwen_omni_profile,
    "qwen3_omni": _qwen3_omni_profile,
    "internvl": _internvl_profile,
    "llava_onevision": _llava_onevision_profile,
    "gemma3": _gemma3_profile,
    "gemma4": _gemma4_profile,
    "glm4v": _glm_profile,
}
