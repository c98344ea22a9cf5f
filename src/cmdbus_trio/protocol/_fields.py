"""Field checks shared by every face's request decoder; each error names its field."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final, TypeGuard

from ._errors import ErrorCode, RemoteProtocolError
from ._json import MAX_DEPTH, TooDeep, loads

MAX_TRANSACTION_ID: Final = 256
_EXECUTION_ID = re.compile(r"[A-Za-z0-9_.:+-]{1,128}")
_I64 = range(-(1 << 63), 1 << 63)
I64_MAX: Final = (1 << 63) - 1


class FieldError(RemoteProtocolError):
    """A request field is missing or malformed; ``str()`` starts with the field's name."""

    def __init__(self, field: str, why: str, code: ErrorCode = ErrorCode.INVALID) -> None:
        super().__init__(f"{field}: {why}", code=code, fatal=False)


class UnsupportedOp(FieldError):
    def __init__(self, op: str, ops: Iterable[str]) -> None:
        super().__init__("op", f"unknown op {op!r}; ops: {', '.join(ops)}", ErrorCode.UNSUPPORTED)
        self.op = op


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(value: Any, field: str, *, lowest: int = 0) -> int:
    """``value`` as an integer in ``lowest`` .. 2^63-1: what SQLite stores and a float of
    seconds holds. Larger ones (JSON has no limit) once answered ``internal`` from deep
    in a handler (``OverflowError``); they are now the field's error."""
    if not (is_int(value) and lowest <= value <= I64_MAX):
        raise FieldError(field, f"expected an integer in {lowest}..{I64_MAX}")
    return value


def execution_id(value: Any, field: str = "execution_id") -> str | int:
    """An execution id as given: an integer fitting i64, or 1-128 characters of
    ``A-Z a-z 0-9 _ . : + -``. Ids are data, never paths."""
    if is_int(value):
        if value not in _I64:
            raise FieldError(field, "integer out of the signed 64-bit range")
        return value
    if isinstance(value, str) and _EXECUTION_ID.fullmatch(value):
        return value
    raise FieldError(field, "expected an integer or 1-128 characters of A-Z a-z 0-9 _ . : + -")


def transaction_id(value: Any, field: str = "transaction_id") -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TRANSACTION_ID:
        raise FieldError(field, f"expected a string of at most {MAX_TRANSACTION_ID} characters")
    return storable_text(value, field)


SURROGATE: Final = re.compile("[\ud800-\udfff]")


def storable_text(value: str, field: str) -> str:
    """``value``, which is stored as text as it is: refused if it holds a lone surrogate
    (JSON can escape one, ``"\\ud800"``; UTF-8 cannot hold it, so storing it would fail
    the whole transaction it joined)."""
    if SURROGATE.search(value):
        raise FieldError(field, "expected Unicode text; a lone surrogate (\\ud800-\\udfff) is not")
    return value


def payload_text(value: Any, field: str = "payload") -> str:
    if not isinstance(value, str):
        raise FieldError(field, "expected JSON text (a string)")
    return value


def payload_json(payload: str, field: str = "payload") -> Any:
    """The payload's JSON value, at most :data:`MAX_DEPTH` levels deep. Runs in a worker
    thread: it parses the whole payload."""
    try:
        return loads(payload.encode("utf-8", "surrogatepass"), max_depth=MAX_DEPTH)
    except TooDeep as exc:
        raise FieldError(field, exc.hint) from None
    except RemoteProtocolError:
        raise FieldError(field, "not valid JSON text") from None
