"""What every model family has in common: media plans, the chat format, the media token
layout, and the rules a family's subclass fills in.

A family (``Family`` subclass, one module per model line) says how a model turns media
into tokens (``plan_image``, ``plan_video``, ``media_layout``), how its chat template
renders a turn (``chat``), which positions its language model needs (``positions``) and
which pixel layout its vision tower takes. The tokenize stage, the pack stage and the
Spark-free loader all use the same family object, built from a profile's settings (a
plain mapping: the ``profiles.<name>`` config section, or one resolved from a model
directory by ``families.model_dir``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from mmpack_udfs.families.chat import CHAT_RENDERERS, LayoutElement
from mmpack_udfs.reasons import Reason, Rejected


@dataclass(frozen=True)
class MediaPlan:
    """What one media item becomes: its grid, token count and (videos) the frames to decode."""

    kind: str
    grid: tuple[int, int, int]  # qwen: (t, h, w) in vision patches; internvl: (t, rows, cols) tiles;
    # llava_onevision: (1, rows, cols) anyres tiles, (1, 0, 0) one square crop, (frames, 0, 0) a video;
    # gemma3: (1, 1, 1), one square
    num_tokens: int  # pad tokens of the item, all groups together
    resized: tuple[int, int]  # (height, width) the vision encoder sees (per tile for internvl)
    frame_indices: tuple[int, ...] = ()
    second_per_grid_t: float | None = None  # videos: seconds per temporal patch (Qwen2.5-VL's mRoPE)
    timestamps: tuple[float, ...] = ()  # videos rendered per temporal group (Qwen3-VL): each group's time
    audio: MediaPlan | None = None  # a video's own audio track, interleaved with it (Qwen2.5-Omni)


@dataclass(frozen=True)
class ChatFormat:
    """How a turn is rendered: ``turn_start + role + separator + text + turn_end + separator``;
    with ``role_tokens`` (GLM): ``role token + separator + text``, a turn ended by the next turn's
    role token (supervised as the end of a supervised turn) and the last one by ``closing_token``."""

    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    separator: str = "\n"  # after the role header and after every turn
    # (role, token) pairs where every turn starts with its role's token
    role_tokens: tuple[tuple[str, str], ...] = ()
    closing_token: str | None = None  # ends a conversation whose turns have no end token of their own

    def start_token(self, role: str) -> str:
        """The token a turn of ``role`` starts with."""
        if not self.role_tokens:
            return self.turn_start
        tokens = dict(self.role_tokens)
        if role not in tokens:
            raise Rejected(Reason.TEMPLATE_REFUSES, f"the chat format has no {role!r} turns")
        return tokens[role]

    def header(self, role: str) -> str:
        """The text after a turn's start token: its role (unless the token names it) and the separator."""
        return self.separator if self.role_tokens else role + self.separator

    def tokens(self) -> set[str]:
        """Every token the format inserts by id."""
        found = {self.turn_start, self.turn_end, self.closing_token, *dict(self.role_tokens).values()}
        return {t for t in found if t}


@dataclass(frozen=True)
class MediaTokens:
    """The literal tokens around a media span and the pad token repeated inside it."""

    before: tuple[str, ...]
    pad: str
    after: tuple[str, ...]


@dataclass(frozen=True)
class IdleMedia:
    """The smallest media item of one kind a model's vision tower takes, fed as a masked sample
    of its own when a micro-batch has none of that kind (``loader.training.with_idle_media``:
    under FSDP every rank must call the vision tower alike). Built from a transformers model
    config (``Family.idle_media``)."""

    kind: str  # "image", "video" or "audio"
    pixel_key: str  # the model input it fills: zeros of ``pixel_shape`` (black pixels, silent features)
    pixel_shape: tuple[int, ...]
    token_id: int  # its sample is ``tokens`` copies of this token
    tokens: int
    extra: Mapping[str, list] = field(default_factory=dict)  # int64 inputs (grids, sizes)


class Family:
    """A model family's rendering rules. Subclasses decide the media token counts."""

    kind = ""
    chat: ClassVar[ChatFormat] = ChatFormat()  # ChatML
    chat_modes: ClassVar[tuple[str, ...]] = ("chatml",)  # the renderers its templates may need
    media_tokens: ClassVar[dict[str, MediaTokens]] = {}
    # the kinds of media its models encode: a sample holding another (audio for a vision-language
    # model) is quarantined at tokenize as media_unsupported
    modalities: ClassVar[tuple[str, ...]] = ("image", "video")
    template_tokens: ClassVar[dict[str, str]] = {}  # a media item as its template writes it, if not its span
    content_parts = False  # whether its chat template reads every message's content as a list of parts
    mrope = False  # whether the language model takes 3-row multimodal rotary positions
    # how the loader hands over pixels (loader/dataset.py): "patches" (Qwen-VL's flattened
    # patches and grids), "tiles" (InternVL), "anyres" (LLaVA-OneVision's crops and image sizes),
    # "squares" (Gemma 3: one resized square per image)
    pixel_layout = "patches"
    # whether its vision tower takes a video's temporal patches as images (GLM-V, whose model finds
    # image and video features by one token id): the loader hands every item over as pixel_values
    videos_as_images = False
    video_processor_resize = False  # video frames resized as transformers' video processors do (torch)
    linear_attention = False  # whether its language model has recurrent (linear-attention) layers
    # whether a forward may take the batch's boundaries as keyword arguments (cu_seq_lens_q/k,
    # max_length_q/k, for flash-attn): not where the model hands its keyword arguments to the
    # vision tower's attention too, which would apply the text's boundaries to the image patches
    boundary_kwargs = True
    bos_tokens: tuple[str, ...] = ()  # tokens its chat template starts every conversation with
    # whether its image tokens attend to each other within an image (Gemma 3; Gemma 4 where its
    # config says so: ``blocks_media``): the loader then builds the attention masks of packed
    # batches itself (loader.collate)
    bidirectional_media = False
    media_blocks_on_global_layers = True  # Gemma 3: on every layer; Gemma 4: sliding layers only
    # the sub-config of a vision tower that transformers runs one image per attention call unless
    # the attention's name reads as flash-attn's (Qwen-VL's VisionAttention): under mmpack_varlen it
    # gets loader.attention.VISION_VARLEN, one varlen call per layer for all of a batch's images
    vision_varlen_config: str | None = None
    # the sub-config of an encoder that attends over padding with a mask (Gemma 4's vision tower,
    # Qwen2-Audio's audio encoder over its 30 s of frames): it keeps SDPA under mmpack_varlen
    # (loader.attention.use_attention)
    padded_encoder_config: str | None = None
    # the log-mel features the loader hands over per clip (``loader.audio.whisper_features``):
    # "chunk", padded to the feature extractor's whole chunk (Qwen2-Audio: 30 s); "frames", the
    # clip's own frames of that padded chunk (Qwen2.5-Omni's encoder reads no more); "clip", the
    # clip zero-padded to its sample's longest (Qwen3-Omni's processor pads only to a call's longest)
    audio_features = "chunk"
    position_dtype: ClassVar[type] = np.int64  # of the mRoPE rows (Qwen3-Omni's are float32)
    # whether ``mmpack export rl`` counts its RL prompts exactly: the generation prompt its chat
    # template adds is the header of an assistant turn, checked against its processor
    # (tests/mmpack_udfs/export/test_rl.py); other families' exports are refused
    rl_prompts = False

    def __init__(self, name: str, settings: Mapping[str, Any]) -> None:
        self.name = name
        self.settings = settings
        self.default_system: str | None = settings.get("default_system") or None
        self.renderer = CHAT_RENDERERS[settings.get("chat", "chatml")]
        self._plans: dict[tuple, MediaPlan] = {}

    @property
    def blocks_media(self) -> bool:
        """Whether this profile's packed batches carry media block masks: a family whose image
        tokens attend within their image, unless the profile turns that off (Gemma 4 checkpoints
        without ``use_bidirectional_attention``)."""
        return self.bidirectional_media and bool(self.settings.get("bidirectional_media", True))

    def special_tokens(self) -> set[str]:
        """Every token the family inserts by id: its chat format's, its renderer's and its
        media wrappers'."""
        tokens = {*self.chat.tokens(), *self.renderer.tokens, *self.bos_tokens}
        for m in self.media_tokens.values():
            tokens |= {*m.before, m.pad, *m.after}
        return tokens | set(self.template_tokens.values())

    def plans(self, media: Sequence[Mapping[str, Any]]) -> list[MediaPlan]:
        """The plans of one sample's media items, in order (a family whose items depend on their
        sample, LLaVA-OneVision's images, overrides this)."""
        return [self.plan(m) for m in media]

    def plan(self, media: Mapping[str, Any]) -> MediaPlan:
        """The plan for one probed media item (a row of the samples table's ``media``); plans
        depend only on the geometry, so they are cached."""
        if media["kind"] not in self.modalities:
            encoded = " and ".join(self.modalities)
            raise Rejected(
                Reason.MEDIA_UNSUPPORTED, f"{media['kind']}: a {self.kind} model encodes {encoded} only"
            )
        key = (media["kind"], media["width"], media["height"], media["frames"], media["fps"])
        plan = self._plans.get(key)
        if plan is None:
            if media["kind"] == "image":
                plan = self.plan_image(media["width"], media["height"])
            elif media["kind"] == "audio":
                plan = self.plan_audio(media["frames"])
            else:
                plan = self.plan_video(media["frames"], media["fps"], media["width"], media["height"])
            if len(self._plans) < 100_000:
                self._plans[key] = plan
        return plan

    def plan_image(self, width: int, height: int) -> MediaPlan:
        raise NotImplementedError

    def plan_video(self, frames: int, fps: float, width: int, height: int) -> MediaPlan:
        raise NotImplementedError

    def plan_audio(self, samples: int) -> MediaPlan:
        """A clip of ``samples`` samples of its 16 kHz mono waveform (``loader.audio.decode``)."""
        raise NotImplementedError

    def media_layout(self, plan: MediaPlan) -> list[LayoutElement]:
        """The tokens of one media item: its wrappers around one run of its pad token."""
        tokens = self.media_tokens[plan.kind]
        return [
            *(("token", t) for t in tokens.before),
            ("pad", plan.num_tokens),
            *(("token", t) for t in tokens.after),
        ]

    def template_layout(self, kind: str) -> list[LayoutElement]:
        """A media item as the chat template writes it, before the processor expands it (what
        ``tokenize.template_check`` compares): by default its span with one pad."""
        return self.media_layout(MediaPlan(kind, (1, 1, 1), 1, (0, 0), (0,)))

    @classmethod
    def attention_blocks(
        cls, items: Mapping[str, np.ndarray], settings: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, patches per block) of the vision encoder's attention for media items given as
        columns (``grid_t``, ``grid_h``, ``grid_w``, ``num_tokens`` arrays) under a profile's
        ``settings``: the cost model's Σ patches². Qwen-VL: one block of h × w patches per
        temporal patch."""
        return items["grid_t"], items["grid_h"] * items["grid_w"]

    @classmethod
    def idle_media(cls, config: Any) -> list[IdleMedia]:
        """The idle items (one per kind its vision tower encodes in a call of its own) of a model
        of this family, from its transformers ``config``. Qwen-VL: one merged token, an image and
        a video (encoded in two calls)."""
        vision = config.vision_config
        merge = int(vision.spatial_merge_size)
        rows = int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3)))
        rows *= int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        return [
            IdleMedia(kind, pixels, (merge**2, rows), int(getattr(config, f"{kind}_token_id")), 1,
                      {grid: [[1, merge, merge]]})
            for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                                       ("video", "pixel_values_videos", "video_grid_thw"))
        ]  # fmt: skip

    def positions(self, length: int, media: Sequence[Mapping[str, Any]]) -> np.ndarray | None:
        """Extra position rows of one sample alone (mRoPE: [3, length]); None: 1-D positions."""
        return None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL ``smart_resize`` (image processors of Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL): both sides multiples of ``factor``, the area within [min, max] pixels, the
    aspect ratio kept (a test checks it against transformers' function)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rejected_resize(err: ValueError, width: int, height: int) -> Rejected:
    """A resize rule's ValueError (e.g. aspect ratio over 200) as a quarantine reason."""
    return Rejected(Reason.MEDIA_UNSUPPORTED, f"{width}x{height}: {err}")


def torch_arange_int(end: int, step: float, start: float = 0.0) -> list[int]:
    """``torch.arange(start, end, step).int().tolist()`` for a float ``step``, in numpy."""
    return np.arange(start, end, step).astype(np.float32).astype(np.int64).tolist()
