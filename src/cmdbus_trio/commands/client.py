"""``cmdbus-trio client …``: one request or a loop of them from the shell, over the
blocking client (docs/clients.md, "Command line"). Output is a table on a terminal and
JSON lines otherwise (``--human``, ``--json``)."""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs

from cmdbus_trio.client import CannotConnect, ClientError, ShardMap, blocking
from cmdbus_trio.client._retry import RECONNECT_FOR
from cmdbus_trio.protocol.subjects import as_i64

from ._addresses import (
    STARTING_WAIT,
    add_control_url_arguments,
    add_server_argument,
    default_address,
    default_control_url,
    server_of,
)
from ._follow import add_subscribe_arguments, subscribe
from ._output import Output, UsageError, add_output_arguments, fail, human_wanted

TOKEN_VARIABLE = "CMDBUS_CLIENT_TOKEN"
CALL_TIMEOUT = 30.0
"""Seconds each request may take (sent as its deadline_ms); ``claim`` waits on top."""
CLAIM_BATCH = 64
"""Records ``claim`` takes in one request (and acks in one), at most."""


HELP = "talk to a running writer"


def add_arguments(client: argparse.ArgumentParser) -> None:
    ops = client.add_subparsers(dest="client_command", required=True, metavar="OP")

    def op(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = ops.add_parser(name, help=help, description=help)
        _common(parser)
        return parser

    publish = op("publish", "publish records (from the flags, or JSON lines on stdin)")
    publish.add_argument("--addr", help="ingest face (default 127.0.0.1:9100, events :9103)")
    publish.add_argument(
        "--writers",
        help="route by shard: 0@HOST:PORT,1@HOST:PORT,… (default: $CMDBUS_CMD_WRITERS or "
        "$NOETL_COMMAND_BUS_WRITER_ADDRS; with --events, the EVT / EVENT ones)",
    )
    publish.add_argument("--events", action="store_true", help="the event bus, not commands")
    publish.add_argument("--execution-id", help="one record with this id (else read stdin)")
    publish.add_argument("--payload", help="the record's payload, JSON text")
    publish.add_argument("--msg-id", help="dedup key (one record only)")

    claim = op("claim", "claim records: next, print, ack, until --max or --timeout")
    claim.add_argument("--addr", help="claim face (default :9101, or :9104 with --group)")
    claim.add_argument("--writers", help="claim from every shard: 0@HOST:PORT,1@HOST:PORT,…")
    claim.add_argument("--filter", required=True, help="subject filter, e.g. commands.>")
    claim.add_argument("--group", help="an event consumer group (event claim face)")
    claim.add_argument("--from", dest="start", choices=["beginning", "tail"], help="new group")
    claim.add_argument("--max", type=int, help="stop after this many deliveries")
    claim.add_argument("--timeout", type=float, help="stop after this many seconds with nothing")
    claim.add_argument("--no-ack", action="store_true", help="print only; leases end at exit")

    add_subscribe_arguments(
        op("subscribe", "follow the event bus: history after --after, then live records")
    )

    tier = ops.add_parser("tier", help="the tier service", description="The tier service.")
    tier_ops = tier.add_subparsers(dest="tier_command", required=True, metavar="OP")
    for name, help in (
        ("append", "append one payload"),
        ("read", "every record of an execution (all pages)"),
        ("scan", "records of every execution, by sequence"),
        ("delete", "delete an execution's history, durably (clean-up tooling)"),
    ):
        parser: argparse.ArgumentParser = tier_ops.add_parser(name, help=help, description=help)
        _common(parser)
        parser.add_argument("--addr", help="tier face (default :9110, or the ports file's)")
        parser.add_argument("--tier", help="eventlog (default), projection or catalog")
        if name == "scan":
            parser.add_argument("--after", type=int, help="start after this sequence")
            parser.add_argument("--limit", type=int, help="print at most this many records")
        else:
            parser.add_argument("--execution-id", required=True)
        if name == "append":
            parser.add_argument("--payload", required=True, help="JSON text")

    for name, help in (("lag", "backlog per subject"), ("dead", "dead-lettered records")):
        parser = op(name, help)
        parser.add_argument("--addr", help="claim face (default :9101, or :9104 with --group)")
        parser.add_argument("--filter", help="subject filter")
        parser.add_argument("--group", help="an event consumer group")
        if name == "dead":
            move = parser.add_mutually_exclusive_group()
            move.add_argument(
                "--requeue",
                action="store_true",
                help="put them back in the queue with a fresh delivery count",
            )
            move.add_argument("--purge", action="store_true", help="drop them for good")
            parser.add_argument(
                "--sort-key",
                type=int,
                action="append",
                dest="sort_keys",
                help="with --requeue or --purge: only this one (repeatable; else --filter's)",
            )
            parser.add_argument(
                "--all",
                action="store_true",
                help="with --requeue or --purge and no --filter or --sort-key: every dead letter",
            )

    delete = op("delete-group", "delete an event consumer group and all it recorded")
    delete.add_argument("--addr", help="event claim face (default :9104)")
    delete.add_argument("--group", required=True)

    health_help = "the writer's /healthz (exit 1 when degraded)"
    health = ops.add_parser("health", help=health_help, description=health_help)
    add_output_arguments(health)
    add_control_url_arguments(health)


def _common(parser: argparse.ArgumentParser) -> None:
    add_output_arguments(parser)
    add_server_argument(parser)
    add_connection_arguments(parser)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--token`` and ``--tls-ca``, for every command that opens data-face connections."""
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_VARIABLE),
        help=f"the writer's auth token (default: ${TOKEN_VARIABLE})",
    )
    parser.add_argument("--tls-ca", type=Path, help="speak TLS, trusting this CA (PEM)")
    parser.add_argument(
        "--reconnect-for",
        type=float,
        default=RECONNECT_FOR,
        metavar="SECONDS",
        help=f"ride through a writer that is away this long (default {RECONNECT_FOR:g}; "
        "0: fail at once)",
    )


Client = TypeVar("Client", bound=blocking.Connection)


def _connect(cls: type[Client], face: str, args: argparse.Namespace) -> Client:
    """A client of ``face`` (``--addr``, else :func:`default_address`), waiting up to
    :data:`STARTING_WAIT` for a writer that is starting (no longer than
    ``--reconnect-for``: 0 fails at once)."""
    options = connection_options(args)  # (reads the CA file: once, not each attempt)
    deadline = time.monotonic() + min(STARTING_WAIT, options["reconnect_for"])
    while True:
        address = args.addr or default_address(face, server=server_of(args))
        try:
            return cls.connect(address, **options)
        except CannotConnect as exc:
            if time.monotonic() >= deadline:
                waited = options["reconnect_for"] and min(STARTING_WAIT, options["reconnect_for"])
                said = f" (waited {waited:g} s)" if waited else ""
                raise CannotConnect(f"{exc}{said}") from None
            time.sleep(0.1)


def connection_options(args: argparse.Namespace) -> dict[str, Any]:
    """The clients' ``connect`` options from :func:`add_connection_arguments`' flags
    (``health`` has none of them)."""
    tls_ca = getattr(args, "tls_ca", None)
    context = None if tls_ca is None else ssl.create_default_context(cafile=str(tls_ca))
    reconnect_for = getattr(args, "reconnect_for", RECONNECT_FOR)
    if not 0 <= reconnect_for < math.inf:
        raise UsageError(f"--reconnect-for must be >= 0 seconds and finite, got {reconnect_for}")
    token = getattr(args, "token", None)
    return {"token": token, "ssl_context": context, "reconnect_for": reconnect_for}


def run(args: argparse.Namespace) -> int:
    command = args.client_command
    if command == "tier":
        command = f"tier {args.tier_command}"
    output = Output(human=human_wanted(args), follow=command in ("claim", "subscribe"))
    try:
        return _RUNNERS[command](args, output)
    except ClientError as exc:
        return fail(f"client {command}", str(exc))
    except UsageError as exc:
        return fail(f"client {command}", str(exc), code=2)
    except (ValueError, OSError) as exc:  # OSError: an unreadable --tls-ca
        return fail(f"client {command}", str(exc))
    finally:
        output.close()


def _claim_face(args: argparse.Namespace) -> str:
    return "evt_claim" if args.group else "cmd_claim"


def _execution_id(text: str) -> str | int:
    """An id that reads as a 64-bit integer is sent as one (NoETL's ids are integers)."""
    number = as_i64(text)
    return text if number is None else number


def _records(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.execution_id is not None:
        if args.payload is None:
            raise UsageError("--payload is required with --execution-id")
        yield {"execution_id": _execution_id(args.execution_id), "payload": args.payload}
        return
    if args.payload is not None or args.msg_id is not None:
        raise UsageError("--payload and --msg-id need --execution-id")
    for number, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"stdin line {number}: not JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(f"stdin line {number}: expected a JSON object")
        yield record


def _publish(args: argparse.Namespace, output: Output) -> int:
    face = "evt_ingest" if args.events else "cmd_ingest"
    if args.writers and args.addr:
        raise UsageError("give --addr or --writers, not both")
    shards = ShardMap.parse(args.writers) if args.writers else None
    if shards is None and not args.addr:  # CMDBUS_*_WRITERS, or NoETL's *_WRITER_ADDRS
        shards = ShardMap.from_environ("events" if args.events else "commands")
    records = _records(args)
    first = next(records, None)  # a bad first record is refused before any connection
    if first is None:
        return 0
    publisher: blocking.Router | blocking.IngestClient = (
        blocking.Router(shards, **connection_options(args))
        if shards is not None
        else _connect(blocking.IngestClient, face, args)
    )
    with publisher:
        for record in itertools.chain([first], records):
            published = publisher.publish(record, msg_id=args.msg_id, timeout=CALL_TIMEOUT)
            output.row({"sort_key": published.sort_key, "subject": published.subject})
    return 0


def _claim(args: argparse.Namespace, output: Output) -> int:
    if args.max is not None and args.max < 1:
        raise UsageError(f"--max must be at least 1, got {args.max}")
    if args.timeout is not None and args.timeout < 0:
        raise UsageError(f"--timeout must be >= 0, got {args.timeout}")
    if args.writers and args.addr:
        raise UsageError("give --addr or --writers, not both")
    options = {"wait": args.timeout, "group": args.group, "timeout": CALL_TIMEOUT}
    claimed = 0
    if args.writers:  # round robin over the shards' claim faces
        shards = ShardMap.parse(args.writers)
        with blocking.ShardedClaimClient(shards, **connection_options(args)) as many:
            while args.max is None or claimed < args.max:
                got = many.next_batch(
                    args.filter, _batch(args, claimed), start=args.start, **options
                )
                if not got:
                    break
                for one in got:
                    output.row({"shard": one.shard, **attrs.asdict(one.delivery)})
                claimed += len(got)
                if not args.no_ack:
                    _refused(many.ack_many(got, group=args.group, timeout=CALL_TIMEOUT))
        return 0
    with _connect(blocking.ClaimClient, _claim_face(args), args) as claim:
        while args.max is None or claimed < args.max:
            batch = claim.next_batch(
                args.filter, _batch(args, claimed), start=args.start, **options
            )
            if not batch:
                break
            for delivery in batch:
                output.row(delivery)
            claimed += len(batch)
            if not args.no_ack:
                _refused(claim.ack_many(batch, group=args.group, timeout=CALL_TIMEOUT))
    return 0


def _refused(acked: list[bool]) -> None:
    """Say so when records printed were not acked: they come again."""
    if not all(acked):
        print(
            f"claim: {acked.count(False)} of the {len(acked)} records just printed were not "
            "acked (the lease ended first: see CMDBUS_ACK_WAIT_MS); they will be delivered again",
            file=sys.stderr,
        )


def _batch(args: argparse.Namespace, claimed: int) -> int:
    """Records to take in the next request: a batch, never past ``--max``."""
    return CLAIM_BATCH if args.max is None else min(CLAIM_BATCH, args.max - claimed)


def _tier_append(args: argparse.Namespace, output: Output) -> int:
    with _connect(blocking.TierClient, "tier", args) as tier:
        output.row(
            tier.append(args.execution_id, args.payload, tier=args.tier, timeout=CALL_TIMEOUT)
        )
    return 0


def _tier_read(args: argparse.Namespace, output: Output) -> int:
    with _connect(blocking.TierClient, "tier", args) as tier:
        for record in tier.read_all(args.execution_id, tier=args.tier, timeout=CALL_TIMEOUT):
            output.row(record)
    return 0


def _tier_delete(args: argparse.Namespace, output: Output) -> int:
    with _connect(blocking.TierClient, "tier", args) as tier:
        deleted = tier.delete_execution(args.execution_id, tier=args.tier, timeout=CALL_TIMEOUT)
        output.row({"deleted": deleted})
    return 0


def _tier_scan(args: argparse.Namespace, output: Output) -> int:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}")
    remaining = args.limit
    after = args.after
    with _connect(blocking.TierClient, "tier", args) as tier:
        while remaining is None or remaining > 0:
            size = 1000 if remaining is None else min(1000, remaining)
            page = tier.scan(tier=args.tier, after=after, limit=size, timeout=CALL_TIMEOUT)
            for record in page.records:
                output.row(record)
            if remaining is not None:
                remaining -= len(page.records)
            if page.next_after is None:
                break
            after = page.next_after
    return 0


def _lag(args: argparse.Namespace, output: Output) -> int:
    with _connect(blocking.ClaimClient, _claim_face(args), args) as claim:
        output.row(claim.lag(args.filter, group=args.group, timeout=CALL_TIMEOUT))
    return 0


def _dead(args: argparse.Namespace, output: Output) -> int:
    """List every dead letter (all pages), or requeue or purge them."""
    moving = args.requeue or args.purge
    if (args.sort_keys or args.all) and not moving:
        raise UsageError("--sort-key and --all go with --requeue or --purge")
    if moving and not (args.filter or args.sort_keys or args.all):
        # Every dead letter, without a word, was one flag away: say which ones.
        flag = "--requeue" if args.requeue else "--purge"
        raise UsageError(f"{flag}: name --filter F or --sort-key K, or --all for every one")
    with _connect(blocking.ClaimClient, _claim_face(args), args) as claim:
        if moving:
            move = claim.requeue if args.requeue else claim.purge
            filter = None if args.sort_keys else (args.filter or ">")
            moved = move(args.sort_keys, filter=filter, group=args.group, timeout=CALL_TIMEOUT)
            output.row({"requeued" if args.requeue else "purged": moved})
            return 0
        after = None
        while True:
            page = claim.dead(
                args.filter, group=args.group, limit=1000, after=after, timeout=CALL_TIMEOUT
            )
            for delivery in page.records:
                output.row(delivery)
            if page.next_after is None:
                return 0
            after = page.next_after


def _delete_group(args: argparse.Namespace, output: Output) -> int:
    with _connect(blocking.ClaimClient, "evt_claim", args) as claim:
        output.row({"deleted": claim.delete_group(args.group, timeout=CALL_TIMEOUT)})
    return 0


def fetch(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``url``: the status and body; raises :class:`OSError` when there is no whole
    answer (none at all, or one cut off: a writer killed while it answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except http.client.HTTPException as exc:  # IncompleteRead, BadStatusLine: not OSErrors
        raise ConnectionError(f"{url}: the answer was cut off: {exc!r}") from None


def _health(args: argparse.Namespace, output: Output) -> int:
    url = (args.url or default_control_url(server=server_of(args))) + "/healthz"
    try:
        status, body = fetch(url)
    except OSError as exc:
        raise ValueError(f"{url}: no answer: {exc}") from None
    if status != 200:
        raise ValueError(f"{url}: HTTP {status}")
    document = json.loads(body)
    output.row(document)
    return 0 if document.get("status") == "ok" else 1


def _subscribe(args: argparse.Namespace, output: Output) -> int:
    return subscribe(
        args, output, lambda: _connect(blocking.SubscribeClient, "evt_subscribe", args)
    )


_RUNNERS = {
    "publish": _publish,
    "claim": _claim,
    "tier append": _tier_append,
    "tier read": _tier_read,
    "tier delete": _tier_delete,
    "tier scan": _tier_scan,
    "lag": _lag,
    "dead": _dead,
    "delete-group": _delete_group,
    "health": _health,
    "subscribe": _subscribe,
}
