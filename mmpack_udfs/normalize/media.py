"""Media references → resolved, probed media. Runs on executors.

Resolution keeps every reference inside its dataset's media root: absolute paths,
URIs, ``..`` that climbs out and (locally) symlinks that point out are refused.
Probing reads an image's header, then decodes it to catch corrupt files as the loader would
meet them: a YCbCr or gray JPEG through libjpeg-turbo (the loader's fast path, at 1/8 scale),
a plain 8-bit PNG's image data through zlib-ng (``png``), any other image, and a file either
check reports on, through Pillow (JPEGs at reduced scale). It opens videos with OpenCV to
read their geometry, frame count and fps, and decodes their frames to count those that decode.
Audio is decoded whole by FFmpeg (``loader.audio``, the decoder every stage uses): its rate,
channels and decoded length, and whether it is cut short.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import os
import posixpath
import re
import tempfile
import urllib.parse
import warnings
from dataclasses import dataclass

os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")

import cv2
import pyarrow.fs as pafs
from PIL import Image

from loader import audio, vision
from mmpack_udfs import schemas
from mmpack_udfs.io import fs
from mmpack_udfs.normalize import png
from mmpack_udfs.reasons import Reason, Rejected

REMOTE_SCHEMES = {"http", "https", "ftp", "gs", "hdfs", "s3a", "s3n", "abfs", "abfss", "wasb", "wasbs"}

# We enforce our own pixel limit before decoding; Pillow's would raise a different error.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class ProbeSettings:
    max_image_pixels: int = 89_478_485
    decode_images: bool = True
    video_check_frames: int = 1
    max_audio_seconds: float = 1200.0
    video_audio: bool = False  # count each video's audio track (tokenize.use_audio_in_video)


@dataclass(frozen=True, slots=True)
class MediaInfo:
    kind: str
    uri: str
    file_bytes: int
    width: int | None  # None for audio
    height: int | None
    frames: int | None = None
    fps: float | None = None
    duration: float | None = None
    sample_rate: int | None = None
    channels: int | None = None
    audio_samples: int | None = None  # a video's audio track, when counted (ProbeSettings.video_audio)

    def as_row(self) -> dict:
        return {
            "kind": self.kind,
            "uri": self.uri,
            "file_bytes": self.file_bytes,
            "width": self.width,
            "height": self.height,
            "frames": self.frames,
            "fps": self.fps,
            "duration": self.duration,
            "sample_rate": self.sample_rate,
            "channels": self.channels,
            "audio_samples": self.audio_samples,
        }


def is_data_uri(reference: str) -> bool:
    return reference[:5].lower() == "data:"


def data_uri_bytes(reference: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URI; Rejected(media_unreadable) if it
    does not decode."""
    header, sep, payload = reference.partition(",")
    try:
        if not sep:
            raise ValueError("no ',' before the data")
        if header.lower().endswith(";base64"):
            return base64.b64decode(payload, validate=True)
        return urllib.parse.unquote_to_bytes(payload)
    except (ValueError, binascii.Error) as err:
        raise Rejected(
            Reason.MEDIA_UNREADABLE, f"{reference[:40]!r}...: not a valid data: URI ({err})"
        ) from err


def resolve(reference: str, media_root: str, real_dirs: dict[str, str] | None = None) -> str:
    """The URI of ``reference`` under ``media_root``; Rejected if it would leave the root, or
    if it is a URL (nothing is downloaded). ``real_dirs``: a cache of directories' real paths
    that the caller keeps for a task (see ``real_path``)."""
    ref = reference.replace("\\", "/")
    scheme = ref.split(":", 1)[0].lower() if ":" in ref else ""
    if scheme in REMOTE_SCHEMES:
        raise Rejected(
            Reason.MEDIA_REMOTE,
            f"{reference[:80]!r}: {scheme}:// media are not downloaded; fetch them and reference the files",
        )
    if not ref or ref.startswith("/") or "://" in ref or (len(ref) > 1 and ref[1] == ":"):
        raise Rejected(Reason.MEDIA_PATH_ESCAPE, f"{reference!r} is not a relative path")
    relative = posixpath.normpath(ref)
    if relative == ".." or relative.startswith("../") or relative == ".":
        raise Rejected(Reason.MEDIA_PATH_ESCAPE, f"{reference!r} leaves the media root")
    if fs.is_s3(media_root):
        return fs.join(media_root, relative)
    root = os.path.abspath(media_root)
    path = os.path.join(root, relative)
    real_root = _real_dir(root, real_dirs)
    real = real_path(path, real_dirs)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise Rejected(Reason.MEDIA_PATH_ESCAPE, f"{reference!r} resolves outside the media root")
    return path


def _real_dir(directory: str, cache: dict[str, str] | None) -> str:
    if cache is None:
        return os.path.realpath(directory)
    if directory not in cache:
        cache[directory] = os.path.realpath(directory)
    return cache[directory]


def real_path(path: str, real_dirs: dict[str, str] | None = None) -> str:
    """``os.path.realpath(path)``, with its directory's real path taken from ``real_dirs`` (filled
    on first use): the directory's real path joined with the name, unless the name is itself a
    link. One ``lstat`` a file instead of one per path component."""
    directory, name = os.path.split(path)
    candidate = os.path.join(_real_dir(directory, real_dirs), name)
    return os.path.realpath(candidate) if os.path.islink(candidate) else candidate


def _link_problem(path: str) -> str:
    try:
        os.stat(path)
    except OSError as err:
        return (
            "a loop of links" if err.errno == errno.ELOOP else f"its target is missing: {os.readlink(path)}"
        )
    return "unreadable"


def probe(kind: str, uri: str, settings: ProbeSettings, storage: fs.Storage = fs.LOCAL) -> MediaInfo:
    """Probe one media file; raise Rejected with the reason it cannot be used."""
    return probe_file(kind, uri, file_status(uri, storage), settings, storage)


def file_status(uri: str, storage: fs.Storage = fs.LOCAL) -> pafs.FileInfo:
    """The file's size and modification time; Rejected when it is missing, a link to nothing or
    not a file."""
    try:
        info = storage.file_info(uri)
    except OSError as err:
        raise Rejected(Reason.MEDIA_UNREADABLE, f"{uri}: {err}") from err
    if info.type == pafs.FileType.NotFound:
        if not fs.is_s3(uri) and os.path.islink(uri):  # a link whose target is gone or loops back
            raise Rejected(
                Reason.MEDIA_UNREADABLE, f"{uri}: a symbolic link to nothing ({_link_problem(uri)})"
            )
        raise Rejected(Reason.MEDIA_MISSING, uri)
    if info.type != pafs.FileType.File:
        raise Rejected(Reason.MEDIA_UNREADABLE, f"{uri} is not a file")
    return info


def probe_file(
    kind: str, uri: str, status: pafs.FileInfo, settings: ProbeSettings, storage: fs.Storage = fs.LOCAL
) -> MediaInfo:
    """Probe a file whose ``file_status`` is ``status``; raise Rejected if it cannot be used."""
    if kind == "image":
        return probe_image(uri, storage.read_bytes(uri), settings)
    if kind == "audio":
        return probe_audio(uri, uri if not fs.is_s3(uri) else storage.read_bytes(uri), status.size, settings)
    return probe_video(uri, status.size, settings, storage)


IMAGE_SUFFIXES = {
    "JPEG": ".jpg",
    "PNG": ".png",
    "GIF": ".gif",
    "WEBP": ".webp",
    "BMP": ".bmp",
    "TIFF": ".tif",
}


def probe_data(
    kind: str, data: bytes, name: str, label: str, settings: ProbeSettings
) -> tuple[MediaInfo, str]:
    """Probe inline bytes exactly like a file (the same checks and reasons); the MediaInfo
    (``uri``: ``label``) and the file suffix the bytes should be kept under."""
    suffix = os.path.splitext(name)[1].lower()
    if kind == "image":
        info, image_format = _probe_image(label, data, settings)
        return info, IMAGE_SUFFIXES.get(image_format or "", suffix or ".img")
    if kind == "audio":
        info, container = _probe_audio(label, data, len(data), settings)
        return info, suffix or AUDIO_SUFFIXES.get(container, ".audio")
    suffix = suffix or ".mp4"
    with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
        tmp.write(data)
        tmp.flush()
        return _probe_video_file(label, tmp.name, len(data), settings), suffix


def _stable(err: Exception) -> str:
    """The error message without object addresses (``<_io.BytesIO object at 0x7f...>``), so
    that quarantine rows are the same on every run."""
    return re.sub(r" at 0x[0-9a-f]+>", ">", str(err))


def probe_image(uri: str, data: bytes, settings: ProbeSettings) -> MediaInfo:
    """Header first (size, pixel limit), then an optional decode to catch corrupt data."""
    return _probe_image(uri, data, settings)[0]


def _probe_image(uri: str, data: bytes, settings: ProbeSettings) -> tuple[MediaInfo, str | None]:
    """``probe_image``, and the image's format as Pillow names it (JPEG, PNG, ...). A YCbCr or
    gray JPEG is checked as the loader decodes it, through libjpeg-turbo directly; a plain
    8-bit PNG's image data through zlib-ng (``png``); any other file, and one either check
    reports on, through Pillow, which decides and words the reason."""
    fast = _probe_fast_jpeg(uri, data, settings)
    return (fast, "JPEG") if fast is not None else _probe_with_pillow(uri, data, settings)


def _probe_fast_jpeg(uri: str, data: bytes, settings: ProbeSettings) -> MediaInfo | None:
    """The MediaInfo of a JPEG that ``vision.decode_image`` decodes through libjpeg-turbo and
    that decodes there cleanly; None for every other file (Pillow probes it)."""
    size = vision.fast_jpeg_size(data) if settings.decode_images else None
    if size is None or not 0 < size[0] * size[1] <= settings.max_image_pixels:
        return None
    return MediaInfo("image", uri, len(data), *size) if vision.fast_jpeg_decodes(data) else None


def _probe_with_pillow(uri: str, data: bytes, settings: ProbeSettings) -> tuple[MediaInfo, str | None]:
    """Header first (mode, size, pixel limit), then an optional decode to catch corrupt data."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                image_format = image.format
                if image.mode not in schemas.RGB_CONVERTIBLE_MODES:
                    raise Rejected(
                        Reason.MEDIA_UNSUPPORTED,
                        f"{uri}: pixel mode {image.mode} (16-bit, 32-bit or float) would clip in 8-bit RGB",
                    )
                if width * height > settings.max_image_pixels:
                    raise Rejected(
                        Reason.IMAGE_TOO_LARGE,
                        f"{uri}: {width}x{height} = {width * height} pixels > {settings.max_image_pixels}",
                    )
                if settings.decode_images and not png.image_data_decodes(image, data):
                    if image.format == "JPEG":
                        image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                    image.load()
    except Rejected:
        raise
    except Exception as err:  # Pillow raises many types for bad data
        raise Rejected(Reason.MEDIA_UNREADABLE, f"{uri}: {type(err).__name__}: {_stable(err)}") from err
    if width <= 0 or height <= 0:
        raise Rejected(Reason.MEDIA_UNREADABLE, f"{uri}: empty image {width}x{height}")
    return MediaInfo("image", uri, len(data), width, height), image_format


def probe_video(uri: str, size: int, settings: ProbeSettings, storage: fs.Storage = fs.LOCAL) -> MediaInfo:
    """Geometry, fps and duration from OpenCV; the first frames must decode, and the frame
    count is the frames that decode (up to what the header claims), not the header's claim."""
    if not fs.is_s3(uri):
        return _probe_video_file(uri, uri, size, settings)
    suffix = os.path.splitext(uri)[1]
    with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
        tmp.write(storage.read_bytes(uri))
        tmp.flush()
        return _probe_video_file(uri, tmp.name, size, settings)


def _frames_that_decode(capture, claimed: int) -> int:
    """How many of the next ``claimed`` frames decode, read in order as the loader reads them.
    A truncated file's header still claims every frame: tokenize plans frame indices from
    this honest count, so whatever a shard references decodes."""
    decoded = 0
    while decoded < claimed and capture.grab():
        decoded += 1
    return decoded


def open_video(path: str) -> cv2.VideoCapture:
    """OpenCV's capture of a video file, decoding on one thread: the same frames as FFmpeg's
    default of one thread per core, at a quarter less CPU for short clips (threads are started
    per file), and normalize's tasks already use every core."""
    return cv2.VideoCapture(path, cv2.CAP_ANY, [cv2.CAP_PROP_N_THREADS, 1])


def _probe_video_file(uri: str, path: str, size: int, settings: ProbeSettings) -> MediaInfo:
    capture = open_video(path)
    try:
        if not capture.isOpened():
            raise Rejected(Reason.MEDIA_UNREADABLE, f"{uri}: OpenCV cannot open it as a video")
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(capture.get(cv2.CAP_PROP_FPS))
        for i in range(settings.video_check_frames):
            ok, frame = capture.read()
            if not ok or frame is None:
                raise Rejected(Reason.VIDEO_NO_FRAMES, f"{uri}: frame {i} does not decode")
        if frames > settings.video_check_frames:
            frames = settings.video_check_frames + _frames_that_decode(
                capture, frames - settings.video_check_frames
            )
    finally:
        capture.release()
    if frames <= 0 or fps <= 0 or width <= 0 or height <= 0:
        raise Rejected(Reason.VIDEO_NO_FRAMES, f"{uri}: {frames} frames at {fps} fps, {width}x{height}")
    samples = _video_track(uri, path, size, settings) if settings.video_audio else None
    return MediaInfo("video", uri, size, width, height, frames, fps, frames / fps, audio_samples=samples)


def _video_track(uri: str, path: str, size: int, settings: ProbeSettings) -> int:
    """The samples of a video's audio track at 16 kHz, probed as a clip is; a video without one
    (or with one that cannot be used) is refused with its audio reason: the model's positions
    count every video as one with sound (``tokenize.use_audio_in_video``)."""
    try:
        return _probe_audio(uri, path, size, settings)[0].frames
    except Rejected as rejected:
        note = f"{rejected.detail} (tokenize.use_audio_in_video takes each video's sound)"
        raise Rejected(rejected.reason, note) from None


AUDIO_SUFFIXES = {
    "wav": ".wav",
    "flac": ".flac",
    "mp3": ".mp3",
    "ogg": ".ogg",
    "mov,mp4,m4a,3gp,3g2,mj2": ".m4a",
}
AUDIO_REASONS = {
    "unreadable": Reason.MEDIA_UNREADABLE,
    "no_audio_stream": Reason.AUDIO_NO_STREAM,
    "codec_unsupported": Reason.AUDIO_CODEC_UNSUPPORTED,
    "empty": Reason.AUDIO_EMPTY,
    "cut": Reason.AUDIO_CUT,
}


def probe_audio(uri: str, source: str | bytes, size: int, settings: ProbeSettings) -> MediaInfo:
    """Rate, channels and decoded length of an audio file (a local path or its bytes), decoded
    whole; Rejected when it is unreadable, empty, cut short or longer than the limit."""
    return _probe_audio(uri, source, size, settings)[0]


def _probe_audio(uri: str, source: str | bytes, size: int, settings: ProbeSettings) -> tuple[MediaInfo, str]:
    """``probe_audio``, and the container's format as FFmpeg names it."""
    try:
        info = audio.probe(source)
    except audio.AudioProblem as problem:
        raise Rejected(AUDIO_REASONS[problem.kind], f"{uri}: {problem}") from problem
    if info.duration > settings.max_audio_seconds:
        raise Rejected(
            Reason.AUDIO_TOO_LONG,
            f"{uri}: {info.duration:.1f} s > normalize.max_audio_seconds = {settings.max_audio_seconds:g}",
        )
    row = MediaInfo(
        "audio", uri, size, None, None, info.samples_16k, None, info.duration, info.sample_rate, info.channels
    )
    return row, info.container
