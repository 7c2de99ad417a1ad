import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack_udfs.normalize import json_array

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def loads_elements(data: bytes) -> list:
    document = json.loads(data)
    return document if isinstance(document, list) else [document]


def streamed(data: bytes) -> list:
    return list(json_array.elements(io.BytesIO(data)))


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch):
    """Chunks of a few bytes, so values, numbers and whitespace straddle chunk boundaries."""
    monkeypatch.setattr(json_array, "CHUNK_BYTES", 3)


@settings(max_examples=300, deadline=None)
@given(
    document=st.lists(VALUES, max_size=6) | VALUES,
    indent=st.sampled_from([None, 0, 2, "\t"]),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32"]),
    ascii_only=st.booleans(),
)
def test_elements_are_what_json_loads_gives(document, indent, encoding, ascii_only):
    data = json.dumps(document, indent=indent, ensure_ascii=ascii_only).encode(encoding)
    assert streamed(data) == loads_elements(data)


@settings(max_examples=300, deadline=None)
@given(
    document=st.lists(VALUES, min_size=1, max_size=5),
    cut=st.integers(min_value=0, max_value=10_000),
    junk=st.sampled_from(["", ",", "]", "x", " ,]", "[", "1"]),
)
def test_a_damaged_file_fails_where_json_loads_fails(document, cut, junk):
    text = json.dumps(document)
    text = text[: cut % (len(text) + 1)] + junk
    try:
        expected = loads_elements(text.encode())
    except ValueError:
        with pytest.raises(ValueError):
            streamed(text.encode())
    else:
        assert streamed(text.encode()) == expected


@pytest.mark.parametrize("text", ["", "  ", "[1,]", "[1 2]", "[1]]", "[1] x", "[", "[,1]", "{}{}"])
def test_malformed_arrays_are_refused(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        streamed(text.encode())


def test_a_large_file_is_read_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(json_array, "CHUNK_BYTES", 1 << 16)
    data = json.dumps([{"text": "x" * 1000, "i": i} for i in range(5000)]).encode()  # ~5 MB
    f = io.BytesIO(data)
    reads = []
    f.read = lambda n, read=f.read: reads.append(n) or read(n)
    elements = json_array.elements(f)
    assert next(elements) == {"text": "x" * 1000, "i": 0}
    assert sum(reads) <= 2 << 16 < len(data)
    assert sum(1 for _ in elements) == 4999 and max(reads) <= 2 << 16
