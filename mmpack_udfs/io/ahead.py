"""Work on the next item of an iterator while the caller uses this one.

A task that reads, sorts and writes Parquet in turns (a samples file, a shard) keeps one core
busy however many are idle; most of each turn runs in Arrow's C++ with the GIL released, so
one thread that makes the next item meanwhile overlaps the two. The cost: one more item held.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_END = object()


def read_ahead(items: Iterable[T]) -> Iterator[T]:
    """``items`` in order, each next one made on a thread of its own while this one is used; an
    error raised making one is raised where it would have been."""
    source = iter(items)
    with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
        pending = pool.submit(next, source, _END)
        while (item := pending.result()) is not _END:
            pending = pool.submit(next, source, _END)
            yield item
