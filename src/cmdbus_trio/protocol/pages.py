"""Paged replies, cut by bytes: a page of records (tier reads, dead letters) is assembled
from their pre-encoded fragments, and stops growing before it would pass the reply cap.
The records' fragments come from the store's thread (:class:`Fragments`); no Python code
runs per record to cut a page."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from ._errors import ErrorCode, LocalProtocolError
from ._json import dumps


def with_records(head: dict[str, Any], fragments: Sequence[bytes], tail: dict[str, Any]) -> bytes:
    """``head`` + ``"records": [fragments]`` + ``tail`` as one JSON object."""
    return _with_joined(head, [b",".join(fragments)], tail)


def _with_joined(
    head: dict[str, Any], records: Sequence[bytes | memoryview], tail: dict[str, Any]
) -> bytes:
    """As :func:`with_records`, ``records`` being the fragments already comma-separated
    (in pieces): the reply is copied once, whatever its size."""
    parts: list[bytes | memoryview] = [dumps(head)[:-1]]
    if head:
        parts.append(b",")
    parts += [b'"records":[', *records, b"]"]
    if tail:
        parts += [b",", dumps(tail)[1:-1]]
    parts.append(b"}")
    return b"".join(parts)


@attrs.frozen
class Fragments:
    """Records' reply fragments, comma-separated, as one blob: a reply takes a prefix of
    it without touching each record.

    A reader's page is built this way so that it holds the GIL a few times, not a few
    times per record: beside a busy loop every take of the GIL can wait (issue 16 item 1,
    docs/benchmarks.md). Iterating yields ``(key, fragment)`` pairs (for v1 and tests).
    """

    keys: Sequence[int]
    ends: Sequence[int]
    """Where each record's fragment ends in ``blob`` (the comma after it excluded)."""
    blob: bytes

    @classmethod
    def of(cls, items: Iterable[tuple[int, bytes]]) -> Fragments:
        keys: list[int] = []
        fragments: list[bytes] = []
        for key, fragment in items:
            keys.append(key)
            fragments.append(fragment)
        return cls.joined(keys, list(map(len, fragments)), b",".join(fragments))

    @classmethod
    def joined(cls, keys: Sequence[int], lengths: Iterable[int], blob: bytes) -> Fragments:
        """From the fragments' lengths, ``blob`` being them joined by commas. The ends are
        computed in C (``accumulate``, ``map``): no Python code runs per record."""
        ends = list(map(operator.add, itertools.accumulate(lengths), itertools.count()))
        if len(ends) != len(keys) or (ends[-1] if ends else 0) != len(blob):
            raise ValueError("fragments: keys, lengths and blob disagree")
        return cls(keys, ends, blob)

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        start = 0
        for key, end in zip(self.keys, self.ends, strict=True):
            yield key, self.blob[start:end]
            start = end + 1


def page(
    head: dict[str, Any],
    pages: Iterable[Fragments],
    *,
    limit: int,
    max_reply: int,
    name: str,
    returned: bool = False,
) -> bytes:
    """A paged reply: ``head``, then ``"records"``: the fragments of ``pages`` (in order)
    up to ``limit`` of them or as many as keep the reply within ``max_reply``, then
    ``next_after``: the last key returned when there may be more, else null. With
    ``returned``, the head also says how many were returned. Stops reading ``pages`` at
    the first it does not take whole (a caller's generator does no more work).

    Error handling: raises :class:`LocalProtocolError` (``too_large``, not fatal) when
    the first record alone would pass the cap; ``name`` names it in the message."""
    # The head and tail are as large as they can get for this page, and the same for
    # every record: that overhead is computed once.
    worst_head = head | ({"returned": limit} if returned else {})
    overhead = reply_size(worst_head, 0, 0, {"next_after": 1 << 63})
    parts: list[bytes | memoryview] = []
    size = 0  # the fragments and the commas between them
    count = 0
    last: int | None = None
    more = False
    for fragments in pages:
        if not fragments.keys:
            continue
        if count == limit:
            more = True
            break
        comma = 1 if count else 0
        # Records of this page that fit: by count, then by bytes (ends are increasing).
        fit = bisect.bisect_right(
            fragments.ends,
            max_reply - overhead - size - comma,
            hi=min(limit - count, len(fragments)),
        )
        if fit == 0:
            if not count:
                raise LocalProtocolError(
                    f"{name} {fragments.keys[0]} alone needs a reply of "
                    f"{overhead + fragments.ends[0]} bytes, over the {max_reply}-byte cap",
                    code=ErrorCode.TOO_LARGE,
                    fatal=False,
                )
            more = True
            break
        end = fragments.ends[fit - 1]
        if comma:
            parts.append(b",")
        parts.append(fragments.blob if fit == len(fragments) else memoryview(fragments.blob)[:end])
        size += comma + end
        count += fit
        last = fragments.keys[fit - 1]
        if fit < len(fragments):
            more = True
            break
    if returned:
        head["returned"] = count
    return _with_joined(head, parts, {"next_after": last if more else None})


def reply_size(head: dict[str, Any], fragment_sizes: int, count: int, tail: dict[str, Any]) -> int:
    """The size :func:`with_records` would produce, without building it."""
    return (
        len(dumps(head))
        - 1
        + (1 if head else 0)
        + len(b'"records":[]')
        + fragment_sizes
        + max(0, count - 1)
        + (len(dumps(tail)) - 1 if tail else 0)
        + 1
    )
