"""How gradients are cut into the flat buckets that cross the replica groups, one
all-reduce each: DDP and HSDP cut by the same rule, a bucket closes once it holds
`limit` bytes or more, and differ only in what they put in and in which order.

>>> sizes = {"a": 3, "b": 2, "c": 4, "d": 1}
>>> list(cut("abcd", sizes.get, limit=5))
[['a', 'b'], ['c', 'd']]
>>> list(cut("abcd", sizes.get, limit=5, first=1))
[['a'], ['b', 'c'], ['d']]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

#: Gradients are averaged in flat buckets of about this size.
BUCKET_BYTES = 25 * 1024 * 1024
#: DDP's first bucket is small, so that communication starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024


def cut(
    items: Iterable[T], nbytes: Callable[[T], int], limit: int, first: int | None = None
) -> Iterator[list[T]]:
    """`items` in their order, cut into buckets: each closes once its `nbytes` add up
    to `limit` or more (the first at `first`, if given); the last holds what is left."""
    bucket: list[T] = []
    size = 0
    cap = limit if first is None else first
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        if size >= cap:
            yield bucket
            bucket, size, cap = [], 0, limit
    if bucket:
        yield bucket
