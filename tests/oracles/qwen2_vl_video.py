"""Subprocess half of the video oracle: reads cases as JSON on stdin, prints results.

transformers' Qwen2-VL video processor module imports torchvision at import time, and
there is no CPU torchvision here; its frame sampling and resize rule need none of it, so
this process installs an inert torchvision stand-in before importing transformers.
"""

import importlib.machinery
import json
import sys
import types

NAMES = [
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.transforms.functional",
    "torchvision.io",
]


class AnyAttribute(type):
    """A class whose every attribute exists (enum members like InterpolationMode.BICUBIC)."""

    def __getattr__(cls, name):
        return name


class Inert(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return AnyAttribute(name, (), {})


def install_stand_in() -> None:
    for name in NAMES:
        module = Inert(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        sys.modules[name] = module
    sys.modules["torchvision"].__version__ = "0.26.0"
    for name in NAMES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])


def main() -> None:
    install_stand_in()
    from transformers.models.qwen2_vl import video_processing_qwen2_vl as module
    from transformers.video_utils import VideoMetadata

    request = json.load(sys.stdin)
    cfg = request["cfg"]
    processor = module.Qwen2VLVideoProcessor(
        min_pixels=cfg["min_pixels"],
        max_pixels=cfg["max_pixels"],
        min_frames=cfg["min_frames"],
        max_frames=cfg["max_frames"],
    )
    out = []
    for frames, fps, width, height in request["cases"]:
        indices = processor.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=cfg["fps"])
        h, w = module.smart_resize(
            height,
            width,
            factor=28,
            min_pixels=processor.size["shortest_edge"],
            max_pixels=processor.size["longest_edge"],
        )
        out.append([len(indices) // 2 * (h // 14) * (w // 14) // 4, [int(i) for i in indices]])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
