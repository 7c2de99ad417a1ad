import pytest

from mmpack_udfs.io import memory


def test_releasing_gives_the_body_s_output_and_releases_once_even_when_the_body_fails(monkeypatch):
    released = []
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(1))

    def body(batches):
        for b in batches:
            if b == "bad":
                raise ValueError("bad batch")
            yield b * 2

    assert list(memory.releasing(body)(iter([1, 2]))) == [2, 4]
    assert released == [1]
    with pytest.raises(ValueError, match="bad batch"):
        list(memory.releasing(body)(iter([1, "bad"])))
    assert released == [1, 1]


def test_release_memory_finds_glibc_s_malloc_trim_on_linux():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert memory._malloc_trim() is not None
    memory.release_memory()
