"""Subprocess half of the video oracle: transformers' own video processor on a video file
(the Qwen-VL line's, InternVL's, LLaVA-OneVision's).

Runs where torchvision is importable (``make test`` installs it, tests only, under
``.venv/torchvision-cpu``; ``torchvision_boot/sitecustomize.py`` lets the CUDA wheel import on
the CPU torch). Reads requests ``{"model_dir", "family", "videos": [{"uri", "out"}], "settings"}``,
one JSON line each on stdin until it closes (one process, its imports paid once, for every family
of a test session: ``VideoOracle`` in tests/integration/test_family_tokens.py); decodes every
frame with OpenCV (the decoder mmpack uses), hands the frames and their metadata to the
processor with frame sampling on, and answers each request with one line:
per video, the sampled frame indices, the grid, the text its processor puts in place of
``<|video_pad|>`` and ``second_per_grid_t`` (``{"error": ...}`` where it failed); the pixel
values go to ``out`` (.npy).
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import cv2
import numpy as np


def frames_of(uri: str) -> tuple[np.ndarray, float]:
    capture = cv2.VideoCapture(uri)
    fps = capture.get(cv2.CAP_PROP_FPS)
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    return np.stack(frames), fps


# GLM-V: the processor classes a directory resolves to (its profile's frame labels and sampling)
GLM_CLASSES = {
    "glm4v": ("transformers.models.glm4v.video_processing_glm4v", "Glm4vVideoProcessor"),
    "glm46v": ("transformers.models.glm46v.video_processing_glm46v", "Glm46VVideoProcessor"),
    "integer": ("transformers.models.glm4v.processing_glm4v", "Glm4vProcessor"),
    "seconds": ("transformers.models.glm46v.processing_glm46v", "Glm46VProcessor"),
}


def glm_class(key: str):
    import importlib

    module, name = GLM_CLASSES[key]
    return getattr(importlib.import_module(module), name)


def processor(family: str, settings: dict, request: dict | None = None):
    if family == "gemma4":
        from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

        return Gemma4VideoProcessor(**settings)
    if family == "glm4v":
        return glm_class(request["sampling"])(**settings)
    if family == "internvl":
        from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

        return InternVLVideoProcessor(**settings)
    if family == "llava_onevision":
        from transformers.models.llava_onevision.video_processing_llava_onevision import (
            LlavaOnevisionVideoProcessor,
        )

        return LlavaOnevisionVideoProcessor(**settings)
    if family in ("qwen3_vl", "qwen3_5"):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor(**settings)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(**settings)


def text_processor(family: str, video_processor, tokenizer, model_dir: str, request: dict):
    """The family's processor class around the video processor (for its pad replacement)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family == "gemma4":
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
        from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

        return Gemma4Processor(
            Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(), tokenizer, video_processor
        )
    if family == "glm4v":
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        cls = glm_class(request["frame_label"])
        return cls(
            image_processor=Glm4vImageProcessorPil(), tokenizer=tokenizer, video_processor=video_processor
        )
    if family == "internvl":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
        from transformers.models.internvl.processing_internvl import InternVLProcessor

        return InternVLProcessor(GotOcr2ImageProcessorPil(), tokenizer, video_processor)
    if family == "llava_onevision":  # num_image_tokens from the directory's processor_config.json
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )
        from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

        from tests.oracles.llava_onevision import processor_settings

        images, settings = LlavaOnevisionImageProcessorPil(), processor_settings(Path(model_dir))
        return LlavaOnevisionProcessor(images, tokenizer, video_processor, **settings)
    if family in ("qwen3_vl", "qwen3_5"):
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor as cls
    else:
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor as cls
    image_processor = Qwen2VLImageProcessorPil()
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


def answer(request: dict) -> list[dict]:
    """Per video of ``request``: its frame indices, grid, replacement text (pixels to its ``out``)."""
    from transformers import AutoTokenizer
    from transformers.video_utils import VideoMetadata

    family = request["family"]
    video_processor = processor(family, request["settings"], request)
    model_dir = request["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    wrapper = text_processor(family, video_processor, tokenizer, model_dir, request)
    results = []
    for video in request["videos"]:
        frames, fps = frames_of(video["uri"])
        every = list(range(len(frames)))
        metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=every)
        if family == "glm4v":  # its sampling reads the duration, as transformers' video loaders give it
            metadata.duration = len(frames) / fps
        if family == "gemma4":  # frames as its video config samples them; grid: (frames, rows, columns)
            out, (replacement,) = wrapper._process_videos(
                videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt",
                input_data_format="channels_last",
            )  # fmt: skip
            pixels, where = out["pixel_values_videos"], out["video_position_ids"][0]
            real = where[(where >= 0).all(-1)]
            grid = [len(pixels), int(real[:, 1].max()) + 1, int(real[:, 0].max()) + 1]
        elif family in ("internvl", "llava_onevision"):  # frame sampling as the directory's video config says
            out, (replacement,) = wrapper._process_videos(
                videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt",
                input_data_format="channels_last",
            )  # fmt: skip
            pixels = out["pixel_values_videos"][0]
            grid = [len(pixels), 1, 1]
            if family == "llava_onevision":  # frames of pooled ⌈√num_image_tokens / 2⌉² features
                pooled = math.ceil(math.isqrt(wrapper.num_image_tokens) / 2)
                grid = [len(pixels), pooled, pooled]
        else:
            extra = {} if family == "glm4v" else {"cap_pixels_per_frame": False}
            out, (replacement,) = wrapper._process_videos(  # the processor's own video half
                videos=[frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True,
                return_tensors="pt", input_data_format="channels_last", **extra,
            )  # fmt: skip
            pixels, grid = out["pixel_values_videos"], [int(x) for x in out["video_grid_thw"][0]]
        np.save(video["out"], pixels.numpy())
        result = {
            "frame_indices": [int(i) for i in out["video_metadata"][0].frames_indices],
            "grid": grid,
            "replacement": replacement,
        }
        if "second_per_grid_ts" in out:
            result["second_per_grid_t"] = float(out["second_per_grid_ts"][0])
        results.append(result)
    return results


OMNI_PROCESSORS = {  # request["processor"] -> transformers' processor class
    "qwen2_5_omni": ("transformers.models.qwen2_5_omni.processing_qwen2_5_omni", "Qwen2_5OmniProcessor"),
    "qwen3_omni": ("transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe", "Qwen3OmniMoeProcessor"),
}
# what a directory without video_preprocessor_config.json gives its video processor from
# preprocessor_config.json (transformers reads that file instead)
VIDEO_FROM_IMAGE_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")


def omni_samples(request: dict) -> list[dict]:
    """The Omni processor (``request["processor"]``), whole, on each sample of ``request["samples"]``
    alone: its rendered text, images (files), audio (.npy waveforms) and videos (files, every frame
    decoded, sampled by the directory's video processor: video_preprocessor_config.json, or without
    one, as transformers does, preprocessor_config.json's patching and normalization sampling at
    ``video_settings``). Per sample: the ids, grids, the seconds per
    temporal patch and the clips' feature frames; the pixel values and features go to ``out`` +
    ``.pixel_values.npy`` etc."""
    import importlib

    from PIL import Image
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    model_dir = Path(request["model_dir"])
    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    settings = {k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}
    video_file = model_dir / "video_preprocessor_config.json"
    if video_file.exists():  # the directory's video processor, as transformers reads it
        video_settings = json.loads(video_file.read_text())
        video_settings = {k: v for k, v in video_settings.items() if not k.endswith(("_type", "_class"))}
    else:
        video_settings = {k: settings[k] for k in VIDEO_FROM_IMAGE_KEYS if k in settings}
        video_settings.update(request["video_settings"])
    module, name = OMNI_PROCESSORS[request.get("processor", "qwen2_5_omni")]
    processor = getattr(importlib.import_module(module), name)(
        Qwen2VLImageProcessorPil(**settings),
        Qwen2VLVideoProcessor(**video_settings),
        WhisperFeatureExtractor(**settings),
        AutoTokenizer.from_pretrained(model_dir),
    )
    results = []
    for sample in request["samples"]:
        images = []
        for uri in sample["images"]:
            with Image.open(uri) as image:
                images.append(image.convert("RGB"))
        videos, metadata = [], []
        for uri in sample["videos"]:
            frames, fps = frames_of(uri)
            videos.append(frames)
            metadata.append(
                VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames))))
            )
        audio = [np.load(path) for path in sample["audio"]]
        # audio in video: one audio per slot in text order, a video's track decoded by the caller
        # (transformers decodes it with torchcodec otherwise), ``audio_from_video_indices`` naming it
        slots = sample.get("audio_from_video_indices")
        extra = {"audio_from_video_indices": slots, "load_audio_from_video": True} if slots else {}
        out = processor(
            text=[sample["text"]], images=images or None, audio=audio or None, videos=videos or None,
            videos_kwargs={"video_metadata": metadata, "do_sample_frames": True, "fps": video_settings["fps"],
                           "input_data_format": "channels_last"} if videos else {},
            return_tensors="np", **extra,
        )  # fmt: skip
        result = {"input_ids": [int(i) for i in out["input_ids"][0]]}
        for key in ("image_grid_thw", "video_grid_thw"):
            result[key] = [[int(x) for x in grid] for grid in out.get(key, [])]
        result["video_second_per_grid"] = [float(x) for x in out.get("video_second_per_grid", [])]
        result["feature_frames"] = [int(m.sum()) for m in out.get("feature_attention_mask", [])]
        for key in ("pixel_values", "pixel_values_videos", "input_features"):
            if key in out:
                np.save(f"{sample['out']}.{key}.npy", np.asarray(out[key]))
        results.append(result)
    return results


def main() -> None:
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = {"results": omni_samples(request) if "samples" in request else answer(request)}
        except Exception:
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
