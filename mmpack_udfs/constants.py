"""Numbers and names every side of the pipeline must agree on: the Spark stages that write
shards, the validator that checks them, the loader that feeds a model from them and the
configuration that names their files."""

from __future__ import annotations

IGNORE_INDEX = -100  # the label of a token that is not trained (transformers' ignore_index)

PATCH_SIZE = 14  # vision encoder patch side, in pixels (Qwen2-VL and InternVL)
AUDIO_SAMPLE_RATE = 16_000  # Whisper features: every audio model mmpack supports reads 16 kHz mono
MERGE_SIZE = 2  # patches merged per side into one LLM token
TEMPORAL_PATCH_SIZE = 2  # Qwen2-VL: video frames (or a repeated image) per temporal patch
VISION_PATCHES_PER_TOKEN = MERGE_SIZE * MERGE_SIZE

S3_SCHEMES = ("s3://", "s3a://", "s3n://")  # what Spark and Hadoop write for S3; all read alike
