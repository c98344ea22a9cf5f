"""Does msgspec pay for the wire codec? One record's requests decoded both ways, in one run.

    python benchmarks/codec.py              # needs msgspec (pip install msgspec)

A record end to end is three v2 requests on the writer: a ``publish``, a ``next`` and an
``ack``. For each, it times the writer's own decoding (the envelope with its strict
JSON, then the op's fields into their typed request: ``protocol.bus.decode_op``,
``protocol.claim.decode_op``) against ``msgspec.json.decode`` of the same frame into a
``msgspec.Struct`` with the same types and integer bounds (0..2^63-1); then the same for
the replies' encoding where it is one call. It prints microseconds per request, each the
best of several rounds, and what the three together are of a record's CPU at 500/s
(docs/benchmarks.md, "What a record costs": ~1,200 µs). msgspec's side checks less than
ours (it has no depth cap before parsing, nor our messages naming each field), so its
figure is a lower bound of what a msgspec codec would cost.
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cmdbus_trio.protocol import bus, claim
from cmdbus_trio.protocol._envelope import parse_request

try:
    import msgspec
except ImportError:  # pragma: no cover - a benchmark's requirement
    sys.exit("benchmarks/codec.py needs msgspec: pip install msgspec")

RECORD_CPU_US = 1200.0
"""A record's CPU at a steady 500/s on this machine (docs/benchmarks.md)."""
U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class Record(msgspec.Struct, forbid_unknown_fields=False):
    execution_id: int | str
    payload: str
    transaction_id: str | None = None


class PublishIn(msgspec.Struct):
    id: U63
    op: str
    record: Record
    msg_id: str | None = None
    deadline_ms: U63 | None = None


class NextIn(msgspec.Struct):
    id: U63
    op: str
    filter: str
    timeout_ms: U63 | None = None
    max: U63 | None = None


class AckIn(msgspec.Struct):
    id: U63
    op: str
    sort_key: U63


def ours(frame: bytes) -> Any:
    request = parse_request(frame)
    if request.op == "publish":
        return bus.decode_op(request.op, request.fields)
    return claim.decode_op(request.op, request.fields, named_groups=False)


def best(call: Any, number: int = 20_000, rounds: int = 5) -> float:
    return min(timeit.repeat(call, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    payload = json.dumps({"execution_pool": "shared", "step": "x" * 180})
    frames = {
        "publish": (
            json.dumps(
                {"id": 7, "op": "publish", "record": {"execution_id": 42, "payload": payload}}
            ).encode(),
            PublishIn,
        ),
        "next": (
            json.dumps(
                {"id": 8, "op": "next", "filter": "commands.>", "timeout_ms": 5000}
            ).encode(),
            NextIn,
        ),
        "ack": (json.dumps({"id": 9, "op": "ack", "sort_key": 123456}).encode(), AckIn),
    }
    print(f"python {sys.version.split()[0]}; msgspec {msgspec.__version__}")
    print(f"{'request':<10}{'ours us':>10}{'msgspec us':>12}{'saved us':>10}")
    total_ours = total_theirs = 0.0
    for name, (frame, struct) in frames.items():
        ours(frame)  # it decodes, both ways, before it is timed
        decoder = msgspec.json.Decoder(struct)
        decoder.decode(frame)
        mine = best(lambda frame=frame: ours(frame))
        theirs = best(lambda frame=frame, decoder=decoder: decoder.decode(frame))
        total_ours, total_theirs = total_ours + mine, total_theirs + theirs
        print(f"{name:<10}{mine:>10.2f}{theirs:>12.2f}{mine - theirs:>10.2f}")
    saved = total_ours - total_theirs
    print(
        f"{'a record':<10}{total_ours:>10.2f}{total_theirs:>12.2f}{saved:>10.2f}  "
        f"({saved / RECORD_CPU_US:.1%} of a record's ~{RECORD_CPU_US:.0f} us at 500/s)"
    )


if __name__ == "__main__":
    main()
