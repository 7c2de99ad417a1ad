"""Model profiles: how many tokens an image or a video becomes, and which tokens wrap them.

- ``qwen2_vl``: dynamic resolution. An image is resized by transformers' own Qwen2-VL
  ``smart_resize`` (multiples of 28 within min/max pixels) and becomes
  ``<|vision_start|>`` + (h'/14)(w'/14)/4 × ``<|image_pad|>`` + ``<|vision_end|>``. A video
  is sampled at ``fps`` (min/max frames, rounded down to the temporal patch of 2), each
  frame resized the same way with the video pixel limits, and becomes
  (frames/2)(h'/14)(w'/14)/4 × ``<|video_pad|>``.
- ``internvl``: fixed 448 px tiles with dynamic tiling (InternVL's closest-aspect-ratio
  rule, up to ``max_tiles``, plus a thumbnail tile), 256 ``<IMG_CONTEXT>`` tokens per
  tile wrapped in ``<img>`` … ``</img>``; a video is ``frames`` uniformly sampled frames
  of one tile each, in one ``<img>`` … ``</img>`` span.

Each profile owns its chat format (``Profile.chat``): both render turns as ChatML
(``<|im_start|>role\\n…<|im_end|>\\n``). The tokenize stage checks on the driver, before
Spark starts, that the tokenizer has every token the profile renders.
"""

from __future__ import annotations

import ast
import builtins
import dis
import importlib
import importlib.util
import math
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.constants import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE
from mmpack_udfs.reasons import Reason, Rejected


@dataclass(frozen=True)
class MediaPlan:
    """What one media item becomes: its grid, token count and (videos) the frames to decode."""

    kind: str
    grid: tuple[int, int, int]  # qwen2_vl: (t, h, w) in 14 px patches; internvl: (t, rows, cols) tiles
    num_tokens: int
    resized: tuple[int, int]  # (height, width) the vision encoder sees (per tile for internvl)
    frame_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChatFormat:
    """How a turn is rendered: ``turn_start + role + separator + text + turn_end + separator``."""

    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    separator: str = "\n"  # after the role header and after every turn


@dataclass(frozen=True)
class MediaTokens:
    """The literal tokens around a media span and the pad token repeated inside it."""

    before: tuple[str, ...]
    pad: str
    after: tuple[str, ...]


class Profile:
    """A model's rendering rules. Subclasses decide the media token counts."""

    kind = ""
    chat: ClassVar[ChatFormat] = ChatFormat()  # ChatML
    media_tokens: ClassVar[dict[str, MediaTokens]] = {}

    def __init__(self, name: str, settings: Mapping[str, Any]) -> None:
        self.name = name
        self.settings = settings
        self.default_system: str | None = settings.get("default_system") or None
        self._plans: dict[tuple, MediaPlan] = {}

    def special_tokens(self) -> set[str]:
        """Every token the profile inserts by id: its chat format's and its media wrappers'."""
        tokens = {self.chat.turn_start, self.chat.turn_end}
        for m in self.media_tokens.values():
            tokens |= {*m.before, m.pad, *m.after}
        return tokens

    def plan(self, media: Mapping[str, Any]) -> MediaPlan:
        """The plan for one probed media item (a row of the samples table's ``media``); plans
        depend only on the geometry, so they are cached."""
        key = (media["kind"], media["width"], media["height"], media["frames"], media["fps"])
        plan = self._plans.get(key)
        if plan is None:
            if media["kind"] == "image":
                plan = self.plan_image(media["width"], media["height"])
            else:
                plan = self.plan_video(media["frames"], media["fps"], media["width"], media["height"])
            if len(self._plans) < 100_000:
                self._plans[key] = plan
        return plan

    def plan_image(self, width: int, height: int) -> MediaPlan:
        raise NotImplementedError

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        raise NotImplementedError


SMART_RESIZE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


@lru_cache(maxsize=1)
def _smart_resize():
    """transformers' own Qwen2-VL resize rule. Importing its module imports transformers and
    torch (~3 s in every Python worker), so the function is compiled from that module's source
    file instead; if the file no longer holds it as a plain function whose globals are
    imported modules and builtins, it is imported the normal way. (A test checks that the
    compiled code is the imported code.)"""
    try:
        return smart_resize_from_source()
    except (LookupError, OSError, SyntaxError):
        module = importlib.import_module(SMART_RESIZE_MODULE)
        return module.smart_resize


def smart_resize_from_source():
    """``smart_resize`` compiled from transformers' installed source, without importing it."""
    spec = importlib.util.find_spec("transformers")  # finds the package, does not import it
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("transformers is not installed")
    relative = SMART_RESIZE_MODULE.split(".", 1)[1].replace(".", "/") + ".py"
    path = Path(spec.submodule_search_locations[0]) / relative
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    if len(found) != 1 or found[0].decorator_list:
        raise LookupError(f"{path} has no plain smart_resize function")
    # With the module's own `import` lines for the names it uses, so it compiles to the same
    # bytecode as in the module.
    names = {n.id for n in ast.walk(found[0]) if isinstance(n, ast.Name)}
    imports = [
        node
        for node in tree.body
        if isinstance(node, ast.Import) and any((a.asname or a.name) in names for a in node.names)
    ]
    namespace: dict[str, Any] = {"__name__": SMART_RESIZE_MODULE}
    code = compile(ast.Module(body=imports + found, type_ignores=[]), str(path), "exec", dont_inherit=True)
    exec(code, namespace)
    function = namespace["smart_resize"]
    unknown = set(_global_names(function.__code__)) - set(namespace) - set(dir(builtins))
    if unknown:
        raise LookupError(f"{path}: smart_resize needs {sorted(unknown)}")
    return function


def _global_names(code: types.CodeType) -> Iterator[str]:
    """Names a function's code looks up as globals (its own and nested code's)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


class Qwen2VL(Profile):
    kind = "qwen2_vl"
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<|vision_start|>",), "<|image_pad|>", ("<|vision_end|>",)),
        "video": MediaTokens(("<|vision_start|>",), "<|video_pad|>", ("<|vision_end|>",)),
    }
    patch_size, merge_size, temporal_patch_size = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE

    def _resize(self, height: int, width: int, limits: Mapping[str, int]) -> tuple[int, int]:
        try:
            return _smart_resize()(
                height,
                width,
                factor=self.patch_size * self.merge_size,
                min_pixels=limits["min_pixels"],
                max_pixels=limits["max_pixels"],
            )
        except ValueError as err:  # e.g. aspect ratio over 200
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"{width}x{height}: {err}") from err

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // (self.merge_size**2)

    def plan_image(self, width: int, height: int) -> MediaPlan:
        h, w = self._resize(height, width, self.settings["image"])
        grid = (1, h // self.patch_size, w // self.patch_size)
        return MediaPlan("image", grid, self._tokens(grid), (h, w))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        indices = self.sample_frames(frames, fps)
        h, w = self._resize(height, width, self.settings["video"])
        grid = (
            len(indices) // self.temporal_patch_size,
            h // self.patch_size,
            w // self.patch_size,
        )
        return MediaPlan("video", grid, self._tokens(grid), (h, w), indices)

    def sample_frames(self, total: int, video_fps: float) -> tuple[int, ...]:
        """Frame indices as transformers' Qwen2VLVideoProcessor.sample_frames picks them with
        ``fps`` (its module needs torchvision, absent here, so the rule is restated; the
        tests compare against the original). Its ``torch.arange(0, total, step).int()`` is
        computed without torch (not a dependency of the pipeline): positions in float64,
        rounded to float32, truncated, as torch does (a test compares the two)."""
        cfg, t = self.settings["video"], self.temporal_patch_size
        max_frames = math.floor(min(cfg["max_frames"], total) / t) * t
        wanted = total / video_fps * cfg["fps"]
        wanted = min(max(wanted, cfg["min_frames"]), max_frames, total)
        count = math.floor(wanted / t) * t
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, f"video of {total} frames is too short to sample")
        return tuple(torch_arange_int(total, total / count))


def torch_arange_int(end: int, step: float) -> list[int]:
    """``torch.arange(0, end, step).int().tolist()`` for a float ``step``, in numpy."""
    return np.arange(0, end, step).astype(np.float32).astype(np.int64).tolist()


class InternVL(Profile):
    kind = "internvl"
    media_tokens: ClassVar[dict[str, MediaTokens]] = {
        "image": MediaTokens(("<img>",), "<IMG_CONTEXT>", ("</img>",)),
        "video": MediaTokens(("<img>",), "<IMG_CONTEXT>", ("</img>",)),
    }

    def plan_image(self, width: int, height: int) -> MediaPlan:
        cfg = self.settings["image"]
        cols, rows = closest_tile_grid(width, height, cfg["tile_size"], cfg["min_tiles"], cfg["max_tiles"])
        tiles = cols * rows + (1 if cfg["thumbnail"] and cols * rows > 1 else 0)
        size = cfg["tile_size"]
        return MediaPlan("image", (1, rows, cols), tiles * cfg["tokens_per_tile"], (size, size))

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        count = min(self.settings["video"]["frames"], frames)
        if count <= 0:
            raise Rejected(Reason.MEDIA_UNSUPPORTED, "video has no frames")
        segment = (frames - 1) / count  # InternVL's get_index: the middle of each segment
        indices = tuple(int(segment / 2 + round(segment * i)) for i in range(count))
        size = self.settings["image"]["tile_size"]
        tokens = count * self.settings["image"]["tokens_per_tile"]
        return MediaPlan("video", (count, 1, 1), tokens, (size, size), indices)


def closest_tile_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of tiles: InternVL's dynamic_preprocess closest-aspect-ratio rule."""
    ratios = sorted(
        {
            (i, j)
            for n in range(min_tiles, max_tiles + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_tiles <= i * j <= max_tiles
        },
        key=lambda r: r[0] * r[1],
    )
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


PROFILE_KINDS: dict[str, type[Profile]] = {"qwen2_vl": Qwen2VL, "internvl": InternVL}


def make_profile(name: str, settings: Mapping[str, Any]) -> Profile:
    kind = settings.get("kind", name)
    if kind not in PROFILE_KINDS:
        raise ValueError(f"profile '{name}': unknown kind '{kind}' (known: {sorted(PROFILE_KINDS)})")
    return PROFILE_KINDS[kind](name, settings)
