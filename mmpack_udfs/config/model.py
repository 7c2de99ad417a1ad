"""The configuration model: the one place where a config key, its type, default, rules and
help text are written.

Everything else derives from it: the defaults (``Config()``), conf/defaults.yaml and the
README's configuration reference (both rendered by ``config.docs`` and checked by a test),
``--set`` parsing (by the field's type) and the error messages (which name the key).

To add a key, add a field to its section below with ``help=...``, then run
``make config-docs`` (the test ``test_generated_config_docs_are_current`` fails until you do).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from mmpack_udfs.constants import S3_SCHEMES

SPARK_LOG_LEVELS = ("ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN")


# -- value rules: each says in words what it wants, and errors say it after the key ---------
def _rule(phrase: str, convert: Callable[[Any], Any]) -> PlainValidator:
    """A validator that returns ``convert(value)`` or fails with ``<key> <phrase>, got <value>``."""

    def check(value: Any) -> Any:
        try:
            return convert(value)
        except (TypeError, ValueError):
            raise PydanticCustomError("mmpack", phrase) from None

    return PlainValidator(check)


def _number(value: Any) -> int | float:
    """An int or float (text such as ``1e8`` counts, as ``--set`` gives it); never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError
    if isinstance(value, str):
        number = float(value)
        return (
            int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        )
    return value


def _whole(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        number = _number(value)
        if not float(number).is_integer() or number < minimum:
            raise ValueError
        return int(number)

    return convert


def _positive(value: Any) -> int | float:
    number = _number(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError
    return number


def _cost(value: Any) -> float:
    number = float(_number(value))
    if not math.isfinite(number) or number < 0:
        raise ValueError
    return number


def _fraction(value: Any) -> float:
    number = float(_number(value))
    if not 0 <= number < 1:
        raise ValueError
    return number


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError
    return value


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _choice(*allowed: str | None) -> PlainValidator:
    names = ", ".join("null" if a is None else a for a in allowed)

    def convert(value: Any) -> Any:
        if value not in allowed:
            raise ValueError
        return value

    return _rule(f"must be one of {names}", convert)


def _text_or_texts(value: Any) -> str | list[str]:
    """A non-empty string, or a non-empty list of them (paths, role tags)."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return value
    raise TypeError


def _names(value: Any) -> list[str]:
    names = _text_or_texts(value)
    return [names] if isinstance(names, str) else names


def _log_level(value: Any) -> str:
    if str(value).upper() not in SPARK_LOG_LEVELS:
        raise ValueError
    return value


def _spark_setting(value: Any) -> Any:
    if not isinstance(value, str | int | float | bool):
        raise TypeError
    return value


PositiveInt = Annotated[int, _rule("must be a positive integer", _whole(1))]
NonNegativeInt = Annotated[int, _rule("must be a non-negative integer", _whole(0))]
OptionalPositiveInt = Annotated[int | None, _rule("must be a positive integer or null", _optional(_whole(1)))]
OptionalNonNegativeInt = Annotated[
    int | None, _rule("must be a non-negative integer or null", _optional(_whole(0)))
]
Seconds = Annotated[int | float, _rule("must be a positive number of seconds", _positive)]
Cost = Annotated[float, _rule("must be a finite number >= 0", _cost)]
Seconds = Cost  # the same rule: a finite number >= 0
Weight = Cost
Flag = Annotated[bool, _rule("must be true or false", _flag)]
OptionalFlag = Annotated[bool | None, _rule("must be true, false or null", _optional(_flag))]
Text = Annotated[str, _rule("must be a non-empty string", _text)]
OptionalText = Annotated[str | None, _rule("must be a non-empty string or null", _optional(_text))]
LogLevel = Annotated[str, _rule(f"must be one of {', '.join(SPARK_LOG_LEVELS)}", _log_level)]
SparkSetting = Annotated[
    str | int | float | bool, _rule("must be a string, number or boolean", _spark_setting)
]


class Section(BaseModel):
    """A config section: unknown keys are errors; values are checked when assigned too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# -- sections ------------------------------------------------------------------------------
class SparkConfig(Section):
    """The embedded SparkSession (spark-submit passes its own master)."""

    master: Text = Field("local[*]", description="Spark master of the embedded session (`--master`); "
                         "ignored under spark-submit")  # fmt: skip
    app_name: Text = Field("mmpack", description="Spark application name")
    log_level: LogLevel = Field(
        "ERROR", description="Spark's log level (`--verbose`: Spark's start-up lines and at least WARN)"
    )
    progress_seconds: Seconds = Field(
        10,
        description="seconds between progress lines of a stage when stderr is not a terminal "
        "(CI, Airflow); on a terminal one line updates in place; `0`: no progress",
    )
    quick_jit: OptionalFlag = Field(
        None,
        description="the embedded JVM compiles with HotSpot's quick compiler only "
        "(`-XX:TieredStopAtLevel=1`): for short runs on small data (tests, demos), where the "
        "optimizing compiler's start-up work is most of the JVM's CPU; a large local pack runs "
        "~15 % slower with it (bench/RESULTS.md); `null`: on for a run that starts with normalize "
        "on input files of under 256 MiB; ignored under spark-submit",
    )
    conf: dict[str, SparkSetting] = Field(
        default_factory=lambda: {
            "spark.sql.shuffle.partitions": "8",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "2000",
            "spark.ui.showConsoleProgress": "false",
        },
        description="any Spark setting, passed through as-is (`--set spark.conf.spark.executor.memory=8g`); "
        "an embedded local session has no web UI unless `spark.ui.enabled` is `true` here, and its "
        "Python workers import pyspark from its package (`spark.python.daemon.module`: "
        "`mmpack_udfs.io.worker_daemon`; `pyspark.daemon` is Spark's own)",
    )


class S3Config(Section):
    """S3 access (pyarrow.fs.S3FileSystem). Credentials come from the standard AWS chain."""

    endpoint_override: OptionalText = Field(
        None, description="S3-compatible endpoint, e.g. `http://127.0.0.1:9000`"
    )
    region: OptionalText = Field(None, description="S3 region (`null`: pyarrow's default resolution)")
    scheme: Annotated[str | None, _choice("http", "https", None)] = Field(
        None, description="`http` or `https` (`null`: pyarrow decides)"
    )
    connect_timeout: Seconds = Field(10, description="seconds to connect")
    request_timeout: Seconds = Field(60, description="seconds per request")
    retries: PositiveInt = Field(5, description="attempts per S3 request (AWS standard retry strategy)")


OptionalKey = Annotated[
    str | None, _rule("must be a non-empty string (a key of the records)", _optional(_text))
]
RoleTag = Annotated[
    str | list[str] | None, _rule("must be a role tag or a list of role tags", _optional(_text_or_texts))
]


def _tag(name: str, lf_name: str | None, help_text: str) -> Any:
    """A tag field; LLaMA-Factory's name for it (``role_tag``, ``user_tag``, ...) is accepted too."""
    choices = AliasChoices(name, lf_name) if lf_name else None
    return Field(None, validation_alias=choices, description=help_text)


class ColumnsConfig(Section):
    """Record keys of a dataset, where they differ from its dialect's (null: the dialect's)."""

    messages: OptionalKey = Field(None, description="the turns (sharegpt: conversations, openai: messages)")
    system: OptionalKey = Field(None, description="the system prompt")
    images: OptionalKey = Field(
        None, description="the images: a list (or one) of paths, URIs or inline images"
    )
    videos: OptionalKey = Field(None, description="the videos, as images")
    image: OptionalKey = Field(None, description="a single image")
    audios: OptionalKey = Field(None, description="the audio clips, as images (`<audio>` placeholders)")
    prompt: OptionalKey = Field(None, description="alpaca: the instruction")
    query: OptionalKey = Field(None, description="alpaca: the input, appended to the instruction")
    response: OptionalKey = Field(None, description="alpaca: the output")
    history: OptionalKey = Field(None, description="alpaca: earlier [instruction, output] pairs")
    chosen: OptionalKey = Field(None, description="ranking datasets: the chosen answer")
    rejected: OptionalKey = Field(None, description="ranking datasets: the rejected answer")
    weight: OptionalKey = Field(
        None, description="the sample's loss weight, a number >= 0 (default key: weight; absent: 1)"
    )


class TagsConfig(Section):
    """Role and placeholder tags of a dataset, where they differ from its dialect's."""

    role_key: OptionalKey = _tag("role_key", "role_tag", "the key of a turn's role")
    content_key: OptionalKey = _tag("content_key", "content_tag", "the key of a turn's content")
    user: RoleTag = _tag("user", "user_tag", "the user role")
    assistant: RoleTag = _tag("assistant", "assistant_tag", "the assistant role")
    system: RoleTag = _tag("system", "system_tag", "the system role")
    function_call: RoleTag = _tag("function_call", "function_tag", "the function-call role (model side)")
    observation: RoleTag = _tag("observation", "observation_tag", "the tool-result role (user side)")
    image_placeholder: OptionalKey = _tag("image_placeholder", None, "the image placeholder (<image>)")
    video_placeholder: OptionalKey = _tag("video_placeholder", None, "the video placeholder (<video>)")
    audio_placeholder: OptionalKey = _tag("audio_placeholder", None, "the audio placeholder (<audio>)")


class DatasetConfig(Section):
    """One input dataset: files (``paths``), or entries of a LLaMA-Factory ``dataset_info``."""

    name: Text = Field(description="dataset name (kept in every row)")
    paths: Annotated[
        str | list[str] | None, _rule("must be a path or a list of paths", _optional(_text_or_texts))
    ] = Field(None, description="files, directories or globs (local or s3://), relative to the config file")
    format: Annotated[str, _choice("auto", "json", "jsonl", "parquet", "webdataset")] = Field(
        "auto",
        description="auto | json | jsonl | parquet | webdataset (auto: by extension, .tar: webdataset)",
    )
    dialect: Annotated[str, _choice("auto", "sharegpt", "openai", "alpaca")] = Field(
        "auto", description="auto | sharegpt | openai | alpaca (auto: per record, by which key is present)"
    )
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig, description="overrides of the record keys")
    tags: TagsConfig = Field(
        default_factory=TagsConfig, description="overrides of the role and placeholder tags"
    )
    media_root: OptionalText = Field(
        None,
        description="directory or s3:// prefix that media paths resolve against (with dataset_info: "
        "its folder unless given; not needed when every medium is inline)",
    )
    dataset_info: OptionalText = Field(
        None, description="a LLaMA-Factory dataset_info.json (or its folder), instead of paths"
    )
    names: Annotated[
        list[str] | None, _rule("must be a non-empty list of entry names", _optional(_names))
    ] = Field(
        None, description="with dataset_info: the entries to read (each becomes dataset <name>/<entry>)"
    )
    weight: Weight = Field(
        1.0,
        description="repeat factor of its training samples: 2 = every sample twice, 0.3 = a deterministic "
        "30 % subset, 1.5 = once plus a deterministic half (README: Mixing datasets and evaluation)",
    )
    loss_weight: Weight = Field(
        1.0,
        description="multiplies the loss of each of its samples' tokens (times a record's own `weight`); "
        "unlike `weight`, no sample is repeated (README: Per-sample loss weights)",
    )
    max_samples: OptionalPositiveInt = Field(
        None,
        description="at most this many of its training samples (a deterministic choice), before `weight`",
    )
    ranking: bool = Field(
        False,
        description="preference pairs (a prompt, a chosen and a rejected answer: DPO) instead of SFT "
        "conversations (README: Preference data (DPO))",
    )
    eval_samples: OptionalNonNegativeInt = Field(
        None, description="this many of its samples held out for evaluation (`null`: `eval.fraction`)"
    )
    base_dir: str | None = Field(None, alias="_base_dir")  # set by load_config: where the file was

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if self.dataset_info is None:
            if self.paths is None:
                raise PydanticCustomError(
                    "mmpack_here", "'paths' is required (or 'dataset_info' with 'names')"
                )
            if self.names is not None:
                raise PydanticCustomError("mmpack_here", "'names' goes with 'dataset_info'")
        else:
            if self.paths is not None:
                raise PydanticCustomError("mmpack_here", "give 'paths' or 'dataset_info', not both")
            if self.names is None:
                raise PydanticCustomError("mmpack_here", "'names' is required with 'dataset_info'")
        return self


class NormalizeConfig(Section):
    """Stage 1: reading the inputs and probing their media."""

    max_image_pixels: PositiveInt = Field(
        89478485, description="images above this many pixels are quarantined (`image_too_large`)"
    )
    decode_images: Flag = Field(
        True, description="decode every image (reduced-scale for JPEG) to catch corrupt files"
    )
    video_check_frames: PositiveInt = Field(
        1, description="frames that must decode for a video to be accepted"
    )
    max_audio_seconds: Seconds = Field(
        1200, description="audio longer than this is quarantined (`audio_too_long`)"
    )
    split_bytes: PositiveInt = Field(
        67108864,
        description="JSONL files are read in byte ranges of at most this size (smaller where that gives "
        "every core two or more, down to 1 MiB)",
    )
    rows_per_file: PositiveInt = Field(
        100000, description="target rows per Parquet file of the output tables"
    )
    max_raw_chars: PositiveInt = Field(
        1048576, description="quarantine rows keep at most this much of the raw record"
    )


def _tokenizer_dir(value: Any) -> str | None:
    path = _optional(_text)(value)
    if path is None or path.startswith(S3_SCHEMES) or os.path.isdir(path):
        return path
    raise PydanticCustomError(
        "mmpack",
        "must be a tokenizer directory, and there is none at {path} (a local Hugging Face "
        "tokenizer directory, present on the driver and every executor; null: the built-in Qwen2)",
        {"path": path},
    )


class TokenizeConfig(Section):
    """Stage 2: turning conversations and media into token ids and labels."""

    model: OptionalText = Field(
        None,
        description="a Hugging Face model directory (local, or an `s3://` prefix fetched once to a local "
        "cache): its `config.json` `model_type` picks the family, its processor configs give every vision "
        "setting, its tokenizer and chat template are used; the profile is then `profiles.model` (keys set "
        "there override the directory's values)",
    )
    profile: Text = Field("qwen2_vl", description="a key of `profiles` (with `model`: `model`)")
    tokenizer: Annotated[str | None, PlainValidator(_tokenizer_dir)] = Field(
        None,
        description="a local Hugging Face tokenizer directory; `null`: the built-in Qwen2 vocabulary with "
        "the Qwen2-VL special tokens (built offline, cached under ~/.cache/mmpack or $MMPACK_CACHE)",
    )
    max_tokens: PositiveInt = Field(16384, description="longest sample, in tokens")
    over_length: Annotated[str, _choice("drop", "truncate", "split")] = Field(
        "drop", description="longer samples: `drop` (quarantine, `too_long`), `truncate`, `split`"
    )
    loss: Annotated[str, _choice("assistant", "all", "last")] = Field(
        "assistant",
        description="supervised tokens: `assistant` (every assistant turn), `all`, "
        "`last` (last assistant turn)",
    )
    rows_per_file: PositiveInt = Field(
        5000, description="samples per Spark task and per Parquet file of `tokenized`"
    )
    use_audio_in_video: Flag = Field(
        False,
        description="a video brings its own audio track, interleaved with its frames in 2 s chunks "
        "(Qwen2.5-Omni's `use_audio_in_video`, LLaMA-Factory's name; Qwen3-Omni merges them by time): "
        "normalize counts each video's track and quarantines a video without one (`audio_no_stream`); "
        "only for profiles of kind `qwen2_5_omni` and `qwen3_omni`",
    )


class PackConfig(Section):
    """Stage 3: packing samples into bins and writing the shards."""

    budget: OptionalPositiveInt = Field(None, description="tokens per bin; `null`: `tokenize.max_tokens`")
    second_budget_by: Annotated[str, _choice("none", "media_items", "vision_patches", "audio_tokens")] = (
        Field(
            "none",
            description="a second limit per bin: `none`, `media_items`, `vision_patches`, `audio_tokens` "
            "(the audio encoder's tokens)",
        )
    )
    second_budget: OptionalPositiveInt = Field(
        None, description="that limit (required when `second_budget_by` is not `none`)"
    )
    oversize: Annotated[str, _choice("error", "skip")] = Field(
        "error",
        description="a sample over a budget: `error` (the job fails naming it) or `skip` (left out, listed "
        "in `report/pack_skipped.json`)",
    )
    bins_per_shard: PositiveInt = Field(2048, description="bins (Parquet rows) per shard file")
    bins_per_row_group: PositiveInt = Field(
        32, description="bins per Parquet row group: the unit a loader reads and shuffles"
    )
    media: Annotated[str, _choice("original", "prepared")] = Field(
        "original",
        description="embedded media as the `original` files' bytes, or `prepared`: 8-bit patches already "
        "at their grid (qwen2_vl; the loader only copies them out; larger shards)",
    )
    embed_media: Flag = Field(
        True,
        description="store every media file's bytes in the shard, once per bin (a video and its own "
        "audio track, a preference pair's two sides share one copy); `false`: URIs only",
    )
    seed: NonNegativeInt = Field(
        0,
        description="seeds the order of bins of equal cost and which samples a `weight` or `max_samples` "
        "keeps",
    )

    @model_validator(mode="after")
    def _second_budget_given(self) -> PackConfig:
        if self.second_budget_by != "none" and self.second_budget is None:
            raise PydanticCustomError(
                "mmpack_named",
                "pack.second_budget must be a positive integer when pack.second_budget_by is set",
            )
        return self


class EvalConfig(Section):
    """The evaluation split: samples held out of training, packed into `packed-eval/`."""

    fraction: Annotated[float, _rule("must be a number in [0, 1)", _fraction)] = Field(
        0.0,
        description="share of every dataset's samples held out for evaluation (by a stable hash of the "
        "sample id; a dataset's `eval_samples` overrides it)",
    )
    seed: NonNegativeInt = Field(0, description="seeds which samples the evaluation split takes")


class CostModelConfig(Section):
    """Cost of a bin per phase, in FLOPs (only ratios matter)."""

    llm_token: Cost = Field(description="LLM cost per token (≈ 6 × LLM parameters)")
    llm_pair: Cost = Field(description="LLM attention cost per Σ l² (≈ 6 × layers × hidden)")
    vision_patch: Cost = Field(description="vision cost per patch (≈ 6 × vision-tower parameters)")
    vision_pair: Cost = Field(description="vision attention cost per Σ patches² (≈ 12 × layers × width)")


def _seven_b_llm(vision_patch: float, vision_pair: float) -> CostModelConfig:
    """A 7B LLM (32 layers × 4096) with the given vision tower."""
    return CostModelConfig(
        llm_token=3.9e10, llm_pair=7.9e5, vision_patch=vision_patch, vision_pair=vision_pair
    )


class BalanceConfig(Section):
    """Balancing data-parallel ranks. Each profile's cost model prices a bin per phase:
    LLM = llm_token × tokens + llm_pair × Σ length²; vision = vision_patch × patches +
    vision_pair × Σ patches² (per attention block). Defaults: training FLOPs of a 7B LLM and
    of the profile's vision tower (docs/BALANCE.md derives them); calibrate from one
    profiled step. pack orders bins into cost-stratified row groups with it; the loader and
    `mmpack balance-report` plan balanced steps with it."""

    cost_model: dict[str, CostModelConfig] = Field(
        default_factory=lambda: {
            "qwen2_vl": _seven_b_llm(4.0e9, 4.9e5),  # Qwen2-VL's 675 M-parameter ViT (32 × 1280)
            "qwen2_5_vl": _seven_b_llm(4.0e9, 4.9e5),  # the same ViT size (32 × 1280)
            "qwen3_vl": _seven_b_llm(2.4e9, 3.7e5),  # Qwen3-VL-8B's ~0.4 B ViT (27 × 1152)
            "qwen3_5": _seven_b_llm(2.4e9, 3.7e5),  # Qwen3-VL's vision tower
            "internvl": _seven_b_llm(1.8e9, 2.95e5),  # InternViT-300M (24 × 1024)
            "internvl_chat": _seven_b_llm(1.8e9, 2.95e5),  # the same tower
            "llava_onevision": _seven_b_llm(2.4e9, 3.7e5),  # SigLIP so400m (27 × 1152)
            "gemma3": _seven_b_llm(2.4e9, 3.7e5),  # SigLIP so400m (27 × 1152), 896 px
            # Gemma 4's vision encoder (16 × 768, ~0.15 B: Gemma4VisionConfig's defaults)
            "gemma4": _seven_b_llm(9.1e8, 1.5e5),
            # GLM-4.1V-9B: a 9 B LLM (40 × 4096) and its ~0.7 B ViT (24 × 1536)
            "glm4v": CostModelConfig(llm_token=5.4e10, llm_pair=9.8e5, vision_patch=4.1e9, vision_pair=4.4e5),
            # Qwen2-Audio-7B: Qwen-7B and its Whisper-large-v3 encoder (32 × 1280); a clip is priced as
            # its padded 30 s (1500 encoder positions), which the encoder always runs
            "qwen2_audio": _seven_b_llm(4.0e9, 4.9e5),
            # Qwen2.5-Omni-7B: Qwen2.5-7B, Qwen2.5-VL's ViT (32 × 1280), its Whisper-style audio encoder
            "qwen2_5_omni": _seven_b_llm(4.0e9, 4.9e5),
            # Qwen3-Omni-30B-A3B: a MoE of ~3.3 B active parameters, 48 layers of 32 × 128 attention
            # width; Qwen3-VL's ViT (27 × 1152)
            "qwen3_omni": CostModelConfig(
                llm_token=2.0e10, llm_pair=1.2e6, vision_patch=2.4e9, vision_pair=3.7e5
            ),
        },
        description="the cost model of each profile, by profile name",
    )


Number = Annotated[int | float, _rule("must be a positive number", _positive)]
CHAT_MODES = (
    "chatml",
    "gemma3",
    "gemma4",
    "glm4v",
    "glm45v",
    "glm41v",
    "internvl",
    "llava_onevision",
    "qwen3",
    "qwen2_audio",
    "qwen3_thinking",
    "qwen3_omni",
    "qwen3_5",
)  # families/chat.py: CHAT_RENDERERS
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # OpenAI CLIP (Qwen2-VL, Qwen2.5-VL)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]  # Qwen3-VL, Qwen3.5
IMAGENET_MEAN = [0.485, 0.456, 0.406]  # InternVL
IMAGENET_STD = [0.229, 0.224, 0.225]
OptionalNumber = Annotated[
    int | float | None, _rule("must be a positive number or null", _optional(_positive))
]


def _triple(value: Any) -> list[float]:
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError
    numbers = [float(_number(v)) for v in value]
    if not all(math.isfinite(n) for n in numbers):
        raise ValueError
    return numbers


Triple = Annotated[list[float], _rule("must be a list of 3 numbers", _triple)]


class QwenVision(Section):
    """The vision tower's patching (the same for images and videos)."""

    patch_size: PositiveInt = Field(14, description="vision patch side in pixels")
    merge_size: PositiveInt = Field(2, description="patches merged per side into one LLM token")
    temporal_patch_size: PositiveInt = Field(2, description="frames per temporal patch")


class Qwen2VLImage(Section):
    min_pixels: PositiveInt = Field(3136, description="smallest resized image (56 × 56)")
    max_pixels: PositiveInt = Field(1003520, description="largest resized image (28 × 28 × 1280)")
    mean: Triple = Field(CLIP_MEAN, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(CLIP_STD, description="per-channel standard deviation")


class Qwen2VLVideo(Section):
    fps: Number = Field(2.0, description="frames sampled per second of video")
    min_frames: PositiveInt = Field(4, description="fewest sampled frames")
    max_frames: PositiveInt = Field(768, description="most sampled frames")
    min_pixels: PositiveInt = Field(100352, description="smallest resized frame (128 × 28 × 28)")
    max_pixels: PositiveInt = Field(602112, description="largest resized frame (28 × 28 × 768)")
    mean: Triple = Field(CLIP_MEAN, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(CLIP_STD, description="per-channel standard deviation")


class ProfileSection(Section):
    """What every profile has; ``kind`` picks the model family (and so the other keys)."""

    kind: str = Field(description="which model family the profile describes")
    default_system: str = Field(
        "You are a helpful assistant.", description="system prompt of samples that have none (empty: none)"
    )
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field(
        "chatml",
        description="how turns render (families/chat.py): `chatml`, `gemma3`, `glm4v`, `glm45v`, `glm41v`, "
        "`internvl`, `llava_onevision`, `qwen2_audio`, `qwen3`, `qwen3_thinking`, `qwen3_omni`, `qwen3_5`; "
        "with `tokenize.model`: the one that reproduces the directory's chat template",
    )


class Qwen2VLProfile(ProfileSection):
    """Qwen2-VL: dynamic resolution, (h/28)(w/28) tokens per image."""

    kind: Literal["qwen2_vl"] = Field("qwen2_vl", description="which model family the profile describes")
    vision: QwenVision = QwenVision()
    image: Qwen2VLImage = Qwen2VLImage()
    video: Qwen2VLVideo = Qwen2VLVideo()


class Qwen25VLProfile(Qwen2VLProfile):
    """Qwen2.5-VL: Qwen2-VL's processor; the mRoPE time axis scaled by seconds."""

    kind: Literal["qwen2_5_vl"] = Field("qwen2_5_vl", description="which model family the profile describes")
    tokens_per_second: Number = Field(
        2, description="mRoPE time positions per second of video (config.json vision_config)"
    )


class Qwen3VLImage(Qwen2VLImage):
    min_pixels: PositiveInt = Field(65536, description="smallest resized image (size.shortest_edge)")
    max_pixels: PositiveInt = Field(16777216, description="largest resized image (size.longest_edge)")
    mean: Triple = Field(HALF, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(HALF, description="per-channel standard deviation")


class Qwen3VLVideo(Qwen2VLVideo):
    do_sample_frames: Flag = Field(True, description="sample frames at `fps` (false: every frame)")
    min_pixels: PositiveInt = Field(
        4096, description="smallest resized video, all frames (size.shortest_edge)"
    )
    max_pixels: PositiveInt = Field(
        25165824, description="largest resized video, all frames (size.longest_edge)"
    )
    cap_pixels_per_frame: Flag = Field(False, description="qwen-vl-utils' per-frame pixel cap")
    max_video_tokens: PositiveInt = Field(768, description="tokens per frame under that cap")
    mean: Triple = Field(HALF, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(HALF, description="per-channel standard deviation")


class Qwen3VLProfile(ProfileSection):
    """Qwen3-VL (dense and MoE): patch 16, whole-video pixel budget, timestamped frame groups."""

    kind: Literal["qwen3_vl"] = Field("qwen3_vl", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("qwen3", description="how turns render")
    vision: QwenVision = QwenVision(patch_size=16)
    image: Qwen3VLImage = Qwen3VLImage()
    video: Qwen3VLVideo = Qwen3VLVideo()


class Qwen35Profile(Qwen3VLProfile):
    """Qwen3.5: Qwen3-VL's processor; hybrid Gated DeltaNet + attention language model."""

    kind: Literal["qwen3_5"] = Field("qwen3_5", description="which model family the profile describes")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("qwen3_5", description="how turns render")


class GlmVImage(Qwen2VLImage):
    min_pixels: PositiveInt = Field(
        12544, description="smallest resized image, its two temporal copies counted (size.shortest_edge)"
    )
    max_pixels: PositiveInt = Field(
        11760000, description="largest resized image, its two temporal copies counted (size.longest_edge)"
    )


class GlmVVideo(Section):
    sampling: Annotated[str, _choice("glm4v", "glm46v")] = Field(
        "glm4v",
        description="frame sampling: `glm4v` (Glm4vVideoProcessor: `fps` frames a second up to "
        "`max_duration` seconds), `glm46v` (Glm46VVideoProcessor: a rate by clip length)",
    )
    fps: Number = Field(2.0, description="frames sampled per second of video (`glm4v` sampling)")
    max_duration: PositiveInt = Field(
        300, description="longest clip sampled at `fps`; longer ones get max_duration × fps frames"
    )
    min_pixels: PositiveInt = Field(
        12544, description="smallest resized video, all frames (size.shortest_edge)"
    )
    max_pixels: PositiveInt = Field(
        47040000, description="largest resized video, all frames (size.longest_edge)"
    )


class GlmVProfile(ProfileSection):
    """The GLM-V line (GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR): patch 14, videos as timestamped
    image blocks. Video frames are normalized as images (the image's mean and std)."""

    kind: Literal["glm4v"] = Field("glm4v", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("glm4v", description="how turns render")
    vision: QwenVision = QwenVision()
    image: GlmVImage = GlmVImage()
    video: GlmVVideo = GlmVVideo()
    frame_label: Annotated[str, _choice("integer", "seconds")] = Field(
        "integer",
        description="the time after each video frame: `integer` (`int(t)`, Glm4vProcessor) or `seconds` "
        "(`{t:.1f} seconds`, Glm46VProcessor)",
    )


class InternVLImage(Section):
    tile_size: PositiveInt = Field(448, description="tile side in pixels")
    tokens_per_tile: PositiveInt = Field(256, description="`<IMG_CONTEXT>` tokens per tile")
    min_tiles: PositiveInt = Field(1, description="fewest tiles per image")
    max_tiles: PositiveInt = Field(12, description="most tiles per image (before the thumbnail)")
    thumbnail: Flag = Field(
        True, description="add a thumbnail tile when an image is split into more than one tile"
    )


class InternVLChatVideo(Section):
    frames: PositiveInt = Field(8, description="frames sampled uniformly per video, one tile each")


class InternVLChatProfile(ProfileSection):
    """InternVL in the original repository's format: 448 px tiles of 256 tokens, dynamic tiling."""

    kind: Literal["internvl_chat"] = Field(
        "internvl_chat", description="which model family the profile describes"
    )
    image: InternVLImage = InternVLImage()
    video: InternVLChatVideo = InternVLChatVideo()


class InternVLHFImage(InternVLImage):
    mean: Triple = Field(IMAGENET_MEAN, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(IMAGENET_STD, description="per-channel standard deviation")


class ProcessorVideo(Section):
    """A transformers video processor's settings: every frame, or a sample of them, resized."""

    height: PositiveInt = Field(384, description="frame height the vision encoder sees")
    width: PositiveInt = Field(384, description="frame width the vision encoder sees")
    do_sample_frames: Flag = Field(
        False, description="sample frames (false: every frame, the processor's default)"
    )
    num_frames: OptionalPositiveInt = Field(None, description="frames sampled per video (null: by `fps`)")
    fps: OptionalNumber = Field(
        None, description="frames sampled per second of video, when `num_frames` is null"
    )
    mean: Triple = Field(HALF, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(HALF, description="per-channel standard deviation")


class InternVLVideo(ProcessorVideo):
    height: PositiveInt = Field(448, description="frame height the vision encoder sees (one tile per frame)")
    width: PositiveInt = Field(448, description="frame width the vision encoder sees")
    initial_shift: Flag = Field(True, description="sampled frames start half a step into the clip")
    mean: Triple = Field(IMAGENET_MEAN, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(IMAGENET_STD, description="per-channel standard deviation")


class InternVLProfile(ProfileSection):
    """InternVL 3 / 3.5 in transformers (`-hf` checkpoints): GotOcr2 tiles, frames one tile each."""

    kind: Literal["internvl"] = Field("internvl", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("internvl", description="how turns render")
    image: InternVLHFImage = InternVLHFImage()
    video: InternVLVideo = InternVLVideo()


LLAVA_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]  # llava-onevision-*-ov-hf


def _pinpoints(value: Any) -> list[list[int]]:
    if not isinstance(value, list) or not value:
        raise ValueError
    pairs = [
        [_whole(1)(v) for v in pair] for pair in value if isinstance(pair, list | tuple) and len(pair) == 2
    ]
    if len(pairs) != len(value):
        raise ValueError
    return pairs


Pinpoints = Annotated[list[list[int]], _rule("must be a list of [height, width] pairs", _pinpoints)]


class LlavaOnevisionImage(Section):
    crop_size: PositiveInt = Field(384, description="crop side in pixels (the vision tower's image size)")
    tokens_per_crop: PositiveInt = Field(729, description="`<image>` tokens per crop (a square number)")
    pinpoints: Pinpoints = Field(
        LLAVA_PINPOINTS, description="the anyres resolutions [height, width], multiples of `crop_size`"
    )
    max_crops: PositiveInt = Field(9, description="crops' worth of grid features kept (`anyres_max_9`)")
    mean: Triple = Field(HALF, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(HALF, description="per-channel standard deviation")


class LlavaOnevisionVideo(ProcessorVideo):
    """LlavaOnevisionVideoProcessor: 384 px frames (its image size), mean/std 0.5."""


class LlavaOnevisionProfile(ProfileSection):
    """LLaVA-OneVision in transformers (`-ov-hf` checkpoints): anyres crops, pooled video frames."""

    kind: Literal["llava_onevision"] = Field(
        "llava_onevision", description="which model family the profile describes"
    )
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("llava_onevision", description="how turns render")
    image: LlavaOnevisionImage = LlavaOnevisionImage()
    video: LlavaOnevisionVideo = LlavaOnevisionVideo()

    @model_validator(mode="after")
    def _crops_fit(self) -> LlavaOnevisionProfile:
        size, tokens = self.image.crop_size, self.image.tokens_per_crop
        if math.isqrt(tokens) ** 2 != tokens:
            raise PydanticCustomError(
                "mmpack_named", "image.tokens_per_crop {n} is not a square number", {"n": tokens}
            )
        for pin in self.image.pinpoints:
            if pin[0] % size or pin[1] % size:
                raise PydanticCustomError(
                    "mmpack_named",
                    "image.pinpoints: {pin} is not a multiple of image.crop_size {size}",
                    {"pin": str(pin), "size": size},
                )
        return self


class Gemma3Image(Section):
    size: PositiveInt = Field(896, description="side of the square every image is resized to (bilinear)")
    tokens_per_image: PositiveInt = Field(256, description="`<image_soft_token>` tokens per image")
    patch_size: PositiveInt = Field(14, description="vision patch side in pixels (the cost model's patches)")
    mean: Triple = Field(HALF, description="per-channel mean the pixels are normalized with")
    std: Triple = Field(HALF, description="per-channel standard deviation")


class Gemma3Profile(ProfileSection):
    """Gemma 3 in transformers (4B, 12B, 27B): one 896 px square of 256 tokens per image, no videos."""

    kind: Literal["gemma3"] = Field("gemma3", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("gemma3", description="how turns render")
    image: Gemma3Image = Gemma3Image()
    image_token_id: PositiveInt = Field(
        262144, description="id of `<image_soft_token>` (config.json image_token_index): the loader's masks"
    )
    sliding_window: PositiveInt = Field(
        1024,
        description="tokens a sliding-attention layer sees (config.json text_config.sliding_window): the "
        "loader's masks of packed batches",
    )


class WhisperFeatures(Section):
    """The log-mel features every clip becomes (WhisperFeatureExtractor's settings)."""

    feature_size: PositiveInt = Field(128, description="mel bins per frame")
    hop_length: PositiveInt = Field(160, description="16 kHz samples per feature frame")
    n_fft: PositiveInt = Field(400, description="samples per STFT window")
    n_samples: PositiveInt = Field(
        480000,
        description="16 kHz samples the feature extractor pads every clip to (Qwen2-Audio: 30 s, "
        "Qwen2.5-Omni: 300 s); longer clips are refused (Qwen3-Omni's processor pads and cuts none)",
    )
    padding_value: float = Field(0.0, description="the waveform's padding")


class Qwen2AudioProfile(ProfileSection):
    """Qwen2-Audio in transformers (7B, 7B-Instruct): clips of up to 30 s, no images or videos."""

    kind: Literal["qwen2_audio"] = Field(
        "qwen2_audio", description="which model family the profile describes"
    )
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("qwen2_audio", description="how turns render")
    audio: WhisperFeatures = WhisperFeatures()
    audio_token_id: PositiveInt = Field(
        151646, description="id of `<|AUDIO|>` (config.json audio_token_index)"
    )


class Qwen25OmniProfile(ProfileSection):
    """The Qwen2.5-Omni thinker: Qwen2.5-VL's images and videos, audio clips of up to 300 s."""

    kind: Literal["qwen2_5_omni"] = Field(
        "qwen2_5_omni", description="which model family the profile describes"
    )
    vision: QwenVision = QwenVision()
    image: Qwen2VLImage = Qwen2VLImage(max_pixels=12845056)
    video: Qwen2VLVideo = Qwen2VLVideo()
    audio: WhisperFeatures = WhisperFeatures(
        n_samples=4800000
    )  # the published preprocessor_config.json: chunk_length 300
    position_id_per_seconds: Number = Field(
        25, description="TMRoPE time positions per second of video (config.json position_id_per_seconds)"
    )
    seconds_per_chunk: Number = Field(
        2,
        description="seconds of a video and its audio interleaved per chunk (config.json seconds_per_chunk)",
    )
    use_audio_in_video: Flag = Field(False, description="set from `tokenize.use_audio_in_video`")
    audio_token_id: PositiveInt = Field(
        151646, description="id of `<|AUDIO|>` (config.json audio_token_index)"
    )


class Qwen3OmniProfile(ProfileSection):
    """The Qwen3-Omni thinker: Qwen2-VL's image and video processors at patch 16, audio clips
    uncut, float time positions (13 a second)."""

    kind: Literal["qwen3_omni"] = Field("qwen3_omni", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("qwen3_omni", description="how turns render")
    vision: QwenVision = QwenVision(patch_size=16)
    image: Qwen2VLImage = Qwen2VLImage(max_pixels=12845056, mean=HALF, std=HALF)
    video: Qwen2VLVideo = Qwen2VLVideo(
        min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, mean=HALF, std=HALF
    )  # the frame limits Qwen3OmniMoeProcessor passes its video processor on every call
    audio: WhisperFeatures = WhisperFeatures(
        n_samples=4800000
    )  # the published preprocessor_config.json (its processor pads to a call's longest clip, cuts none)
    position_id_per_seconds: Number = Field(
        13, description="TMRoPE time positions per second of video (config.json position_id_per_seconds)"
    )
    audio_window: PositiveInt = Field(
        50,
        description="half the audio encoder's chunk of feature frames (config.json audio_config.n_window): "
        "13 tokens per 2 · n_window frames",
    )
    use_audio_in_video: Flag = Field(False, description="set from `tokenize.use_audio_in_video`")
    audio_token_id: PositiveInt = Field(
        151675, description="id of `<|audio_pad|>` (config.json audio_token_id)"
    )


SOFT_TOKEN_BUDGETS = ("70", "140", "280", "560", "1120")  # Gemma 4's processors: _SUPPORTED_SOFT_TOKENS


def _soft_tokens(value: Any) -> int:
    if isinstance(value, bool) or str(value) not in SOFT_TOKEN_BUDGETS:
        raise ValueError
    return int(value)


SoftTokens = Annotated[int, _rule(f"must be one of {', '.join(SOFT_TOKEN_BUDGETS)}", _soft_tokens)]


class Gemma4Image(Section):
    max_soft_tokens: SoftTokens = Field(
        280,
        description="most soft tokens per image (the aspect-kept resize's budget: max_soft_tokens × 9 "
        "patches)",
    )
    patch_size: PositiveInt = Field(16, description="vision patch side in pixels")
    pooling_kernel_size: PositiveInt = Field(3, description="patches pooled into one soft token, per side")


class Gemma4Video(Gemma4Image):
    max_soft_tokens: SoftTokens = Field(70, description="most soft tokens per video frame")
    num_frames: PositiveInt = Field(
        32, description="frames sampled uniformly per video (clips with fewer frames are refused)"
    )


class Gemma4Profile(ProfileSection):
    """Gemma 4 in transformers (E2B, E4B, 26B-A4B, 31B): aspect-kept images of up to 280 soft
    tokens, videos of timestamped frames, no audio."""

    kind: Literal["gemma4"] = Field("gemma4", description="which model family the profile describes")
    default_system: str = Field("", description="system prompt of samples that have none (empty: none)")
    chat: Annotated[str, _choice(*CHAT_MODES)] = Field("gemma4", description="how turns render")
    image: Gemma4Image = Gemma4Image()
    video: Gemma4Video = Gemma4Video()
    image_token_id: PositiveInt = Field(
        258880, description="id of the image token (config.json image_token_id)"
    )
    video_token_id: PositiveInt = Field(
        258884, description="id of the video token (config.json video_token_id)"
    )
    sliding_window: PositiveInt = Field(
        1024,
        description="tokens a sliding-attention layer sees (config.json text_config.sliding_window): the "
        "loader's masks of packed batches",
    )
    bidirectional_media: Flag = Field(
        True,
        description="image and video tokens attend within their image on sliding layers "
        '(text_config.use_bidirectional_attention: "vision"): the loader\'s masks of packed batches',
    )


ProfileConfig = Annotated[
    Qwen2VLProfile
    | Qwen25VLProfile
    | Qwen3VLProfile
    | Qwen35Profile
    | InternVLProfile
    | InternVLChatProfile
    | LlavaOnevisionProfile
    | Gemma3Profile
    | Gemma4Profile
    | GlmVProfile
    | Qwen2AudioProfile
    | Qwen25OmniProfile
    | Qwen3OmniProfile,
    Field(discriminator="kind"),
]
WRITE_MODES = ("overwrite", "append")  # config key `mode`, the CLI's --mode
PROFILE_KINDS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "internvl",
    "internvl_chat",
    "llava_onevision",
    "gemma3",
    "gemma4",
    "glm4v",
    "qwen2_audio",
    "qwen2_5_omni",
    "qwen3_omni",
)
PROFILE_MODELS: dict[str, type[ProfileSection]] = {
    "qwen2_vl": Qwen2VLProfile,
    "qwen2_5_vl": Qwen25VLProfile,
    "qwen3_vl": Qwen3VLProfile,
    "qwen3_5": Qwen35Profile,
    "internvl": InternVLProfile,
    "internvl_chat": InternVLChatProfile,
    "llava_onevision": LlavaOnevisionProfile,
    "gemma3": Gemma3Profile,
    "gemma4": Gemma4Profile,
    "glm4v": GlmVProfile,
    "qwen2_audio": Qwen2AudioProfile,
    "qwen2_5_omni": Qwen25OmniProfile,
    "qwen3_omni": Qwen3OmniProfile,
}
MODEL_PROFILE = "model"  # the profile built from tokenize.model
QWEN_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v")  # patch-based (prepared media, mRoPE)


class Config(Section):
    """mmpack's configuration. Defaults here; `--config FILE` and `--set key=value` override
    them (unknown keys are an error)."""

    output: Text = Field(
        "demo-out",
        description="output root of a run: `tables/`, `packed/`, `report/`; a path or `s3://bucket/prefix` "
        "(`--out`)",
    )
    run_id: OptionalText = Field(
        None,
        description="run id of the idempotent commits; `null`: derived from the config and the input files "
        "(`--run-id`)",
    )
    mode: Annotated[str, _choice(*WRITE_MODES)] = Field(
        "overwrite",
        description="Delta write mode: `overwrite` replaces a table's content, `append` adds to it "
        "(`--mode`)",
    )
    spark: SparkConfig = SparkConfig()
    s3: S3Config = S3Config()
    datasets: list[DatasetConfig] = Field(
        default_factory=list,
        description="input datasets: `name`, `paths`, `format`, `dialect`, `columns`, `tags`, `media_root` "
        "(see [Running it on your data](#running-it-on-your-data))",
    )
    normalize: NormalizeConfig = NormalizeConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    pack: PackConfig = PackConfig()
    eval: EvalConfig = EvalConfig()
    balance: BalanceConfig = BalanceConfig()
    profiles: dict[str, ProfileConfig] = Field(
        default_factory=lambda: {
            "qwen2_vl": Qwen2VLProfile(),
            "qwen2_5_vl": Qwen25VLProfile(),
            "qwen3_vl": Qwen3VLProfile(),
            "qwen3_5": Qwen35Profile(),
            "internvl": InternVLProfile(),
            "internvl_chat": InternVLChatProfile(),
            "llava_onevision": LlavaOnevisionProfile(),
            "gemma3": Gemma3Profile(),
            "gemma4": Gemma4Profile(),
            "glm4v": GlmVProfile(),
            "qwen2_audio": Qwen2AudioProfile(),
            "qwen2_5_omni": Qwen25OmniProfile(),
            "qwen3_omni": Qwen3OmniProfile(),
        },
        description="how each model turns a conversation and its media into tokens, by profile name; "
        "add one under a new name",
    )

    @model_validator(mode="after")
    def _profiles_are_complete(self) -> Config:
        if self.tokenize.profile not in self.profiles:
            raise PydanticCustomError(
                "mmpack_named",
                "tokenize.profile '{name}' is not a profile (known: {known})",
                {"name": self.tokenize.profile, "known": ", ".join(sorted(self.profiles))},
            )
        for name in self.profiles:
            if name not in self.balance.cost_model:
                raise PydanticCustomError(
                    "mmpack_named",
                    "balance.cost_model.{name}: profile '{name}' has no cost model",
                    {"name": name},
                )
        if self.pack.media == "prepared" and (
            self.profile.kind not in QWEN_KINDS or not self.pack.embed_media
        ):
            raise PydanticCustomError(
                "mmpack_named",
                "pack.media: prepared needs pack.embed_media true and a Qwen-VL profile (tokenize.profile "
                "'{name}' is {kind})",
                {"name": self.tokenize.profile, "kind": self.profile.kind},
            )
        if "use_audio_in_video" in type(self.profile).model_fields:  # one switch: tokenize's
            self.profile.use_audio_in_video = self.tokenize.use_audio_in_video
        elif self.tokenize.use_audio_in_video:
            raise PydanticCustomError(
                "mmpack_named",
                "tokenize.use_audio_in_video: profile '{name}' ({kind}) takes no audio from videos "
                "(Qwen2.5-Omni and Qwen3-Omni profiles do)",
                {"name": self.tokenize.profile, "kind": self.profile.kind},
            )
        names = [d.name for d in self.datasets]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise PydanticCustomError(
                    "mmpack_named", "datasets[{i}]: duplicate dataset name '{name}'", {"i": i, "name": name}
                )
        return self

    # -- views the stages use --------------------------------------------------------------
    @property
    def profile(self) -> ProfileSection:
        """The profile the run tokenizes with (``profiles[tokenize.profile]``)."""
        return self.profiles[self.tokenize.profile]

    @property
    def pack_budget(self) -> int:
        """Tokens per bin: ``pack.budget``, or ``tokenize.max_tokens`` when that is null."""
        return self.pack.budget or self.tokenize.max_tokens

    def as_dict(self) -> dict[str, Any]:
        """The configuration as plain data, as the manifest and run ids record it: every key,
        except that each dataset keeps only the keys its entry gave."""
        data = self.model_dump(by_alias=True)
        data["datasets"] = [d.model_dump(by_alias=True, exclude_unset=True) for d in self.datasets]
        return data
