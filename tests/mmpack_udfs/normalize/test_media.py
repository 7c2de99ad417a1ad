import os

import pytest

from mmpack_udfs.demo import data as demo_data
from mmpack_udfs.normalize import media
from mmpack_udfs.reasons import Reason, Rejected

SETTINGS = media.ProbeSettings()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    demo_data._write_bad_media(root)
    img = demo_data._drawing(300, 120, __import__("random").Random(3))
    img.save(root / "media" / "wide.jpg", quality=80)
    img.save(root / "media" / "wide.png")
    demo_data._encode_video(root / "media" / "clip.mp4", "mp4v", 160, 120, 20, 10.0, 1)
    demo_data._encode_video(root / "media" / "clip.avi", "MJPG", 96, 64, 12, 4.0, 2)
    return root / "media"


def reason_of(fn, *args) -> Reason:
    with pytest.raises(Rejected) as info:
        fn(*args)
    return info.value.reason


@pytest.mark.parametrize(
    "ref", ["../x.jpg", "a/../../x.jpg", "/etc/passwd", "s3://b/k.jpg", "C:/x.jpg", "..", "", "."]
)
def test_references_that_leave_the_root_are_refused(ref, tmp_path):
    assert reason_of(media.resolve, ref, str(tmp_path)) == Reason.MEDIA_PATH_ESCAPE


def test_symlink_out_of_the_root_is_refused_inside_is_fine(media_root):
    assert reason_of(media.resolve, "bad/link_out.jpg", str(media_root)) == Reason.MEDIA_PATH_ESCAPE
    os.symlink("wide.jpg", media_root / "alias.jpg")
    assert media.resolve("alias.jpg", str(media_root)) == str(media_root / "alias.jpg")
    assert media.resolve("a/../wide.jpg", str(media_root)) == str(media_root / "wide.jpg")


def test_real_path_with_directories_resolved_once_equals_realpath(tmp_path):
    """``media.real_path`` resolves a directory once per cache; for files, links to files, links
    out, linked directories, links to nothing and missing files it equals ``os.path.realpath``."""
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "sub" / "a.jpg").write_bytes(b"x")
    (tmp_path / "outside" / "b.jpg").write_bytes(b"x")
    os.symlink(tmp_path / "root" / "sub", tmp_path / "root" / "linked")
    os.symlink("a.jpg", tmp_path / "root" / "sub" / "alias.jpg")
    os.symlink(tmp_path / "outside" / "b.jpg", tmp_path / "root" / "sub" / "out.jpg")
    os.symlink("gone.jpg", tmp_path / "root" / "sub" / "dangling.jpg")
    names = [
        "sub/a.jpg",
        "linked/a.jpg",
        "linked/alias.jpg",
        "sub/out.jpg",
        "sub/dangling.jpg",
        "sub/none.jpg",
        "none/a.jpg",
    ]
    cache: dict[str, str] = {}
    for _ in range(2):  # the second time from the cache
        for name in names:
            path = str(tmp_path / "root" / name)
            assert media.real_path(path, cache) == os.path.realpath(path), name
    assert media.resolve("linked/alias.jpg", str(tmp_path / "root"), cache) == str(
        tmp_path / "root/linked/alias.jpg"
    )
    assert reason_of(media.resolve, "sub/out.jpg", str(tmp_path / "root"), cache) == Reason.MEDIA_PATH_ESCAPE


def test_s3_references_join_the_prefix():
    assert media.resolve("img/a.jpg", "s3://bucket/media/") == "s3://bucket/media/img/a.jpg"
    assert reason_of(media.resolve, "../a.jpg", "s3://bucket/media") == Reason.MEDIA_PATH_ESCAPE


@pytest.mark.parametrize("name", ["wide.jpg", "wide.png"])
def test_images_are_probed_for_size(media_root, name):
    info = media.probe("image", str(media_root / name), SETTINGS)
    assert (info.kind, info.width, info.height) == ("image", 300, 120)
    assert info.file_bytes == (media_root / name).stat().st_size


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("bad/truncated.jpg", Reason.MEDIA_UNREADABLE),
        ("bad/not_an_image.png", Reason.MEDIA_UNREADABLE),
        ("bad/bomb.png", Reason.IMAGE_TOO_LARGE),
        ("nope.jpg", Reason.MEDIA_MISSING),
        ("bad", Reason.MEDIA_UNREADABLE),
    ],
)
def test_bad_images(media_root, name, reason):
    assert reason_of(media.probe, "image", str(media_root / name), SETTINGS) == reason


def test_pixel_limit_is_configurable(media_root):
    small = media.ProbeSettings(max_image_pixels=300 * 120 - 1)
    assert reason_of(media.probe, "image", str(media_root / "wide.png"), small) == Reason.IMAGE_TOO_LARGE


@pytest.mark.parametrize(
    ("name", "size", "frames", "fps"),
    [("clip.mp4", (160, 120), 20, 10.0), ("clip.avi", (96, 64), 12, 4.0)],
)
def test_videos_are_probed(media_root, name, size, frames, fps):
    info = media.probe("video", str(media_root / name), SETTINGS)
    assert (info.width, info.height, info.frames, info.fps) == (*size, frames, fps)
    assert info.duration == pytest.approx(frames / fps)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("bad/frameless.avi", Reason.VIDEO_NO_FRAMES),
        ("bad/empty.avi", Reason.VIDEO_NO_FRAMES),
        ("bad/garbage.mp4", Reason.MEDIA_UNREADABLE),
        ("missing.mp4", Reason.MEDIA_MISSING),
    ],
)
def test_bad_videos(media_root, name, reason):
    assert reason_of(media.probe, "video", str(media_root / name), SETTINGS) == reason


def test_media_on_s3(s3_bucket, media_root):
    import boto3

    from mmpack_udfs.io.fs import S3Options, Storage

    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.upload_file(str(media_root / "wide.jpg"), bucket, "m/wide.jpg")
    client.upload_file(str(media_root / "clip.mp4"), bucket, "m/clip.mp4")
    storage = Storage(S3Options(endpoint_override=endpoint))
    image = media.probe("image", media.resolve("wide.jpg", f"s3://{bucket}/m"), SETTINGS, storage)
    video = media.probe("video", f"s3://{bucket}/m/clip.mp4", SETTINGS, storage)
    assert (image.width, image.height, video.frames) == (300, 120, 20)
    missing = reason_of(media.probe, "image", f"s3://{bucket}/m/none.jpg", SETTINGS, storage)
    assert missing == Reason.MEDIA_MISSING


def test_rejection_details_are_the_same_on_every_run(media_root):
    details = set()
    for _ in range(2):
        with pytest.raises(Rejected) as info:
            media.probe("image", str(media_root / "bad/not_an_image.png"), SETTINGS)
        details.add(info.value.detail)
    assert len(details) == 1 and " at 0x" not in details.pop()


def high_bit_depth_images(root) -> dict[str, str]:
    """A real 16-bit PNG and a real float TIFF, written by Pillow."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 65535, 64 * 48).reshape(48, 64)
    paths = {"png16": str(root / "deep.png"), "float_tiff": str(root / "float.tif")}
    Image.fromarray(ramp.astype(np.uint16)).save(paths["png16"])
    Image.fromarray((ramp / 65535).astype(np.float32)).save(paths["float_tiff"])
    return paths


@pytest.mark.parametrize("kind", ["png16", "float_tiff"])
def test_images_8_bit_rgb_would_clip_are_unsupported_in_normalize_and_the_loader(tmp_path, kind):
    from loader.vision import MediaDecodeError, decode_image

    path = high_bit_depth_images(tmp_path)[kind]
    with pytest.raises(Rejected) as rejected:
        media.probe("image", path, media.ProbeSettings())
    assert rejected.value.reason == Reason.MEDIA_UNSUPPORTED and "would clip" in rejected.value.detail
    with open(path, "rb") as f, pytest.raises(MediaDecodeError, match="would clip"):
        decode_image(f.read())


def test_a_truncated_video_is_planned_from_the_frames_that_decode(tmp_path):
    """The header of a cut-off AVI still claims all its frames: the probe counts the frames
    that decode, tokenize plans from that count, and the loader decodes every planned frame."""
    import cv2
    import numpy as np

    from loader.vision import decode_frames
    from mmpack_udfs.config import load_config
    from mmpack_udfs.families import make_family

    whole, cut = tmp_path / "whole.avi", tmp_path / "cut.avi"
    writer = cv2.VideoWriter(str(whole), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    for i in range(60):
        writer.write(np.full((48, 64, 3), i * 4, np.uint8))
    writer.release()
    cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * 0.35)])
    capture = cv2.VideoCapture(str(cut))
    claimed, decodable = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), 0
    while capture.read()[0]:
        decodable += 1
    assert claimed == 60 and 0 < decodable < 60

    info = media.probe("video", str(cut), media.ProbeSettings())
    assert info.frames == decodable and info.duration == decodable / info.fps
    profile = make_family("qwen2_vl", load_config().profiles["qwen2_vl"].model_dump())
    planned = profile.plan_video(info.frames, info.fps, info.width, info.height).frame_indices
    from_header = profile.plan_video(claimed, info.fps, info.width, info.height).frame_indices
    assert max(from_header) >= decodable  # what the loader could not read before
    frames = decode_frames(cut.read_bytes(), list(planned), str(cut))
    assert len(frames) == len(planned) and max(planned) < decodable


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("https://example.invalid/cat.jpg", "https:// media are not downloaded"),
        ("HTTP://example.invalid/cat.jpg", "http:// media are not downloaded"),
        ("ftp://example.invalid/cat.jpg", "ftp:// media are not downloaded"),
    ],
)
def test_urls_are_refused_not_fetched(ref, says, tmp_path):
    with pytest.raises(Rejected) as rejected:
        media.resolve(ref, str(tmp_path))
    assert rejected.value.reason == Reason.MEDIA_REMOTE and says in rejected.value.detail


def test_data_uris_decode_and_bad_ones_are_unreadable():
    assert media.data_uri_bytes("data:image/png;base64,aGVsbG8=") == b"hello"
    assert media.data_uri_bytes("data:text/plain,a%20b") == b"a b"
    with pytest.raises(Rejected) as rejected:
        media.data_uri_bytes("data:image/png;base64,@@not base64@@")
    assert rejected.value.reason == Reason.MEDIA_UNREADABLE


def test_symlink_loops_and_dangling_links_are_unreadable_not_missing(tmp_path):
    os.symlink("b.jpg", tmp_path / "a.jpg")
    os.symlink("a.jpg", tmp_path / "b.jpg")
    os.symlink("gone.jpg", tmp_path / "dangling.jpg")
    for name, says in (("a.jpg", "a loop of links"), ("dangling.jpg", "target is missing")):
        with pytest.raises(Rejected) as rejected:
            media.probe("image", str(tmp_path / name), media.ProbeSettings())
        assert rejected.value.reason == Reason.MEDIA_UNREADABLE and says in rejected.value.detail


def jpeg_variants() -> dict[str, bytes]:
    """JPEGs as encoders write them and as storage breaks them: subsamplings, progressive,
    optimized tables, gray, CMYK, odd sizes, an EXIF rotation; cut at several points, without
    their end marker, with bytes after it, and with bytes flipped in their scans."""
    import io
    import random

    from PIL import Image

    def encode(image, **options) -> bytes:
        out = io.BytesIO()
        image.save(out, "JPEG", **options)
        return out.getvalue()

    drawing = demo_data._drawing(203, 77, random.Random(5))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90
    whole = {
        "baseline_420": encode(drawing, quality=85),
        "baseline_444": encode(drawing, quality=90, subsampling=0),
        "baseline_422": encode(drawing, quality=75, subsampling=1),
        "progressive": encode(drawing, quality=85, progressive=True),
        "optimized": encode(drawing, quality=60, optimize=True),
        "gray": encode(drawing.convert("L"), quality=85),
        "cmyk": encode(drawing.convert("CMYK"), quality=85),
        "tiny": encode(drawing.resize((1, 1)), quality=85),
        "odd_size": encode(drawing.resize((13, 7)), quality=85),
        "exif_rotated": encode(drawing, quality=85, exif=exif),
    }
    variants = dict(whole)
    rng = random.Random(11)
    for name in ("baseline_420", "progressive", "gray"):
        data = whole[name]
        for cut in (0.3, 0.6, 0.95):
            variants[f"{name}_cut_{cut}"] = data[: int(len(data) * cut)]
        variants[f"{name}_no_end_marker"] = data[:-2]
        variants[f"{name}_bytes_after_end"] = data + b"\x00garbage" * 8
        scan = data.rindex(b"\xff\xda")  # the last start of scan
        for flip in range(6):
            broken = bytearray(data)
            at = rng.randrange(scan + 20, len(data) - 2)
            broken[at] ^= 1 << rng.randrange(8)
            variants[f"{name}_flipped_{flip}"] = bytes(broken)
    variants["header_only"] = whole["baseline_420"][: whole["baseline_420"].index(b"\xff\xda")]
    return variants


def outcome(probe, data: bytes, settings: media.ProbeSettings):
    try:
        return probe("x.jpg", data, settings)
    except Rejected as rejected:
        return rejected.reason, rejected.detail


@pytest.mark.parametrize("max_pixels", [89_478_485, 10_000])
def test_jpegs_are_probed_as_pillow_alone_decides_through_the_loaders_fast_path(max_pixels):
    """Normalize checks a YCbCr or gray JPEG with libjpeg-turbo, as the loader decodes it; on
    every variant it accepts, sizes and refuses (with the same words) as Pillow alone."""
    from loader.vision import decode_image

    settings = media.ProbeSettings(max_image_pixels=max_pixels)
    fast_taken = []
    for name, data in jpeg_variants().items():
        probed = outcome(media._probe_image, data, settings)
        assert probed == outcome(media._probe_with_pillow, data, settings), name
        if media._probe_fast_jpeg("x.jpg", data, settings) is not None:
            fast_taken.append(name)
        if isinstance(probed[0], media.MediaInfo):  # what normalize keeps, the loader decodes
            assert decode_image(data).size == (probed[0].width, probed[0].height), name
    if max_pixels > 10_000:  # the fast path does the work on the files it should
        assert {"baseline_420", "progressive", "gray", "exif_rotated", "tiny"} <= set(fast_taken)
        assert "cmyk" not in fast_taken and not any("cut" in name for name in fast_taken)
    else:  # 203 x 77 is over the limit: Pillow words the refusal
        assert set(fast_taken) == {"tiny", "odd_size"}
