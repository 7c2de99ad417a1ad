"""Reason codes for quarantined records and samples: the one list, with what each means."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    INVALID_JSON = "invalid_json"
    MALFORMED_RECORD = "malformed_record"
    MISSING_CONVERSATION = "missing_conversation"
    MALFORMED_TURN = "malformed_turn"
    UNKNOWN_ROLE = "unknown_role"
    BROKEN_TURN_ORDER = "broken_turn_order"
    EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
    NON_STRING_CONTENT = "non_string_content"
    MALFORMED_MEDIA_FIELD = "malformed_media_field"
    PLACEHOLDER_MEDIA_MISMATCH = "placeholder_media_mismatch"
    MEDIA_PATH_ESCAPE = "media_path_escape"
    MEDIA_MISSING = "media_missing"
    MEDIA_UNREADABLE = "media_unreadable"
    IMAGE_TOO_LARGE = "image_too_large"
    VIDEO_NO_FRAMES = "video_no_frames"
    AUDIO_NO_STREAM = "audio_no_stream"
    AUDIO_CODEC_UNSUPPORTED = "audio_codec_unsupported"
    AUDIO_EMPTY = "audio_empty"
    AUDIO_CUT = "audio_cut"
    AUDIO_TOO_LONG = "audio_too_long"
    MEDIA_REMOTE = "media_remote"
    UNSUPPORTED_MODALITY = "unsupported_modality"
    PREFERENCE_MISSING_SIDE = "preference_missing_side"
    PREFERENCE_IDENTICAL_SIDES = "preference_identical_sides"
    PREFERENCE_MEDIA_MISMATCH = "preference_media_mismatch"
    INVALID_WEIGHT = "invalid_weight"
    TAR_UNREADABLE = "tar_unreadable"
    # tokenize stage
    MEDIA_UNSUPPORTED = "media_unsupported"
    TOO_LONG = "too_long"
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"
    TEMPLATE_REFUSES = "template_refuses"


DESCRIPTIONS: dict[Reason, str] = {
    Reason.INVALID_JSON: "the record (or the whole JSON file) is not valid JSON",
    Reason.MALFORMED_RECORD: "the record is not a JSON object",
    Reason.MISSING_CONVERSATION: "no conversation key, or the conversation is empty",
    Reason.MALFORMED_TURN: "a turn is not an object with a role and a content key",
    Reason.UNKNOWN_ROLE: "a turn's role is not one of the dataset's role tags",
    Reason.BROKEN_TURN_ORDER: (
        "turns must alternate user/assistant, end with an assistant turn, system only first"
    ),
    Reason.EMPTY_ASSISTANT_TURN: (
        "an assistant (or function_call) turn is empty or only whitespace: it would teach the "
        "model to answer with nothing"
    ),
    Reason.NON_STRING_CONTENT: "a turn's content or the system prompt is not a string",
    Reason.MALFORMED_MEDIA_FIELD: (
        "images/videos (or a media part) is not a path, URI, data: URI or image (bytes + path), "
        "or a list of them"
    ),
    Reason.PLACEHOLDER_MEDIA_MISMATCH: "the count of <image>/<video>/<audio> placeholders != media given",
    Reason.MEDIA_PATH_ESCAPE: "a media reference is absolute or leaves the media root (.., links)",
    Reason.MEDIA_MISSING: "a referenced media file does not exist",
    Reason.MEDIA_UNREADABLE: "a media file cannot be opened or decoded (corrupt, wrong format)",
    Reason.IMAGE_TOO_LARGE: "an image has more pixels than normalize.max_image_pixels",
    Reason.VIDEO_NO_FRAMES: "a video opens but none of its first frames decode",
    Reason.AUDIO_NO_STREAM: "an audio item (or a video whose audio is asked for) has no audio stream",
    Reason.AUDIO_CODEC_UNSUPPORTED: "an audio stream's codec has no decoder in FFmpeg (PyAV's build)",
    Reason.AUDIO_EMPTY: "an audio file is empty (0 bytes) or its stream decodes to no samples",
    Reason.AUDIO_CUT: (
        "an audio file is cut short: decoding stops with an error, it decodes to less than its header "
        "declares, or a WAV's data chunk declares more bytes than the file holds"
    ),
    Reason.AUDIO_TOO_LONG: "an audio clip is longer than normalize.max_audio_seconds",
    Reason.MEDIA_REMOTE: (
        "a media reference is an http(s)/ftp/... URL: executors are not assumed to reach the network, "
        "so nothing is downloaded; fetch the media and reference the files"
    ),
    Reason.UNSUPPORTED_MODALITY: (
        "a content part of a kind mmpack does not read (not text, image, video or audio); dropping it "
        "would train on text about media the model never sees"
    ),
    Reason.PREFERENCE_MISSING_SIDE: (
        "a record of a ranking (preference) dataset lacks its chosen or its rejected answer, or one is empty"
    ),
    Reason.PREFERENCE_IDENTICAL_SIDES: "a preference pair's chosen and rejected answers are the same",
    Reason.PREFERENCE_MEDIA_MISMATCH: (
        "a preference pair's two answers hold different media: both sequences of a pair must see the same"
    ),
    Reason.INVALID_WEIGHT: (
        "the record's loss weight is not a finite number >= 0, or a preference pair carries one "
        "(pairs take no per-sample weight)"
    ),
    Reason.TAR_UNREADABLE: (
        "a WebDataset tar ends early or is corrupt: the keys before the damage are read, the rest of "
        "the tar (the key being read included) is this one row"
    ),
    Reason.MEDIA_UNSUPPORTED: (
        "the media cannot be taken faithfully: a modality the model does not encode (audio for a "
        "vision-language model), an aspect ratio or frame count the profile refuses, or a 16-bit / "
        "32-bit / float image that 8-bit RGB would clip"
    ),
    Reason.TOO_LONG: "more tokens than tokenize.max_tokens under the configured over-length policy",
    Reason.NO_SUPERVISED_TOKENS: "no token is left to train on after loss masking",
    Reason.TEMPLATE_REFUSES: (
        "the model's chat template refuses the conversation (e.g. Qwen3.5's: no user query, only "
        "tool responses)"
    ),
}


class Rejected(Exception):
    """Raised inside record processing; becomes one quarantine row."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


TOKENIZE_REASONS = frozenset(
    {Reason.MEDIA_UNSUPPORTED, Reason.TOO_LONG, Reason.NO_SUPERVISED_TOKENS, Reason.TEMPLATE_REFUSES}
)
NORMALIZE_REASONS = frozenset(Reason) - TOKENIZE_REASONS
PREFERENCE_REASONS = frozenset(  # normalize's, for ranking (preference) datasets only
    {Reason.PREFERENCE_MISSING_SIDE, Reason.PREFERENCE_IDENTICAL_SIDES, Reason.PREFERENCE_MEDIA_MISMATCH}
)
WEBDATASET_REASONS = frozenset({Reason.TAR_UNREADABLE})  # normalize's, for WebDataset tars only
