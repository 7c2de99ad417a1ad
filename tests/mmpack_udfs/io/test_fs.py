"""Storage's writes: a file appears whole or not at all, also when two tasks write it at once."""

from __future__ import annotations

import multiprocessing

from mmpack_udfs.io import fs


def write_many(path: str, data: bytes, times: int) -> None:
    for _ in range(times):
        fs.LOCAL.write_bytes(path, data)


def test_writers_of_the_same_content_addressed_file_never_trip_over_each_other(tmp_path):
    """Normalize's tasks keep inline media under their sha256: two tasks meeting the same image
    write one file at the same moment. Each writes its own temporary file and renames it."""
    target, data = str(tmp_path / "media" / "ab" / "abcdef.jpg"), b"\xff\xd8 the same bytes" * 1000
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=write_many, args=(target, data, 200)) for _ in range(2)]
    for writer in writers:
        writer.start()
    write_many(target, data, 200)
    for writer in writers:
        writer.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]
    assert (tmp_path / "media" / "ab" / "abcdef.jpg").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "media" / "ab").iterdir()) == ["abcdef.jpg"]  # no temporaries
