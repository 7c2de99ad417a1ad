"""A JSON file's top-level array, element by element, read in chunks.

``json.loads`` of a whole file holds the file's bytes, its text and every element's objects
at once (~5× the file in a Python worker). ``elements`` reads the file a chunk at a time and
parses one element at a time with the standard library's own decoder, so a task holds one
chunk and one element however large the file, and each element is exactly what
``json.loads`` gives for it. A file whose top-level value is not an array gives that value.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

CHUNK_BYTES = 1 << 20
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json.loads skips it
_MAY_CONTINUE = re.compile(r"[0-9.eE+\-]*[ \t\n\r]*\Z")  # "0" of "0.5": a number may go on


class _Text:
    """A file's text read on demand; ``text`` holds what has not been consumed yet and
    ``consumed`` how many characters came before it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        head = f.read(max(CHUNK_BYTES, 4))
        # BOM / UTF-16 / UTF-32 detection as json.loads does on bytes
        self._decoder = codecs.getincrementaldecoder(json.detect_encoding(head))()
        self.text, self.consumed, self.eof = "", 0, False
        self._feed(head)

    def _feed(self, chunk: bytes) -> None:
        self.eof = not chunk
        self.text += self._decoder.decode(chunk, final=self.eof)

    def read_on(self, pos: int) -> bool:
        """Drop the text before ``pos`` (so ``pos`` becomes 0) and read more; False at the end."""
        if self.eof:
            return False
        self.text, self.consumed = self.text[pos:], self.consumed + pos
        self._feed(self._f.read(max(CHUNK_BYTES, len(self.text))))  # doubling for huge elements
        return True

    def skip_space(self, pos: int) -> int:
        """The position of the next non-space character (``len(text)`` at the end of the file)."""
        while True:
            pos = _SPACE.match(self.text, pos).end()
            if pos < len(self.text) or not self.read_on(pos):
                return pos
            pos = 0

    def value(self, pos: int) -> tuple[Any, int]:
        """The JSON value at ``pos`` and the position of the next non-space character after it;
        reads on while what follows the value up to the end of what is read could still belong
        to it (a number cut by a chunk boundary parses as a shorter number)."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, pos)
                if self.eof or not _MAY_CONTINUE.match(self.text, end):
                    return value, _SPACE.match(self.text, end).end()
            except json.JSONDecodeError as err:
                if self.eof:
                    raise self.error(err.msg, err.pos) from None
            self.read_on(pos)
            pos = 0

    def expect_end(self, pos: int) -> None:
        pos = self.skip_space(pos)
        if pos < len(self.text):
            raise self.error("Extra data", pos)

    def error(self, message: str, pos: int) -> ValueError:
        return ValueError(f"{message}: char {self.consumed + pos}")


def elements(f: BinaryIO) -> Iterator[Any]:
    """Each element of the file's top-level array (or its one top-level value), parsed as
    ``json.loads`` parses it. Raises ValueError where ``json.loads`` would (after yielding
    the elements before the fault), UnicodeDecodeError on bytes that are not text, and
    RecursionError on nesting too deep to parse."""
    stream = _Text(f)
    pos = stream.skip_space(0)
    if not stream.text.startswith("[", pos):
        value, pos = stream.value(pos)
        stream.expect_end(pos)
        yield value
        return
    pos = stream.skip_space(pos + 1)
    if stream.text.startswith("]", pos):
        stream.expect_end(pos + 1)
        return
    while True:
        value, pos = stream.value(pos)
        yield value
        if stream.text.startswith("]", pos):
            stream.expect_end(pos + 1)
            return
        if not stream.text.startswith(",", pos):
            raise stream.error("Expecting ',' delimiter", pos)
        pos = stream.skip_space(pos + 1)
