"""Memory a process hands back to the system once it is done with it.

A Python worker is reused by every task and every stage of a SparkSession, and its resident
memory never shrinks by itself: Arrow's pool and malloc keep freed pages for later. Without
help, a worker that normalized, tokenized and packed holds the high-water marks of all three
stages, and more of them the more it ran. Each mapInArrow body is therefore wrapped in
``releasing``, so a worker's resident memory is what it holds (its per-worker state, such as
the tokenizer), not the sum of the peaks it has been through.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import pyarrow as pa

T = TypeVar("T")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):  # macOS, musl: nothing to trim
        return None


def release_memory() -> None:
    """Give the pages that Arrow's pool and malloc keep after frees back to the system."""
    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def releasing(body: Callable[[Iterator[pa.RecordBatch]], Iterator[T]]) -> Callable[..., Iterator[T]]:
    """The mapInArrow body ``body``, releasing memory when its partition is done (or fails)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[T]:
        try:
            yield from body(batches)
        finally:
            release_memory()

    return run
