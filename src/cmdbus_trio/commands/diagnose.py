"""``cmdbus-trio diagnose [URL]``: one look at a writer's control face, and a verdict.

It reads ``/healthz`` and ``/metrics``, waits ``--interval`` seconds, reads both again,
and says which of these holds, worst first, each with the evidence lines that show it:

- **unreachable**: nothing answers at the URL;
- **stalled**: the event loop is blocked. ``/healthz`` does not answer in time, or says
  the heartbeat was late; requests are *not* being shed, they are not being looked at;
- **poisoned** / **contended**: a store refuses writes / waits for its write lock;
- **face crashed** / **task crashed**: a data face or a background task (a committer,
  claim timers, a sampler, the consumer groups) died; only a restart brings it back;
- **face stuck**: requests wait on a face (for its byte budget or a Gate slot) at
  both scrapes and it answered none in between: what holds the bytes or slots never
  finishes, while the loop turns and the probes say ready;
- **not ready**: `/readyz` fails for another reason (starting, draining);
- **disk slow**: a store's group commits (fsync included) took long: p99 over the interval
  from ``cmdbus_commit_seconds``, the same for every request of the store;
- **no checkpointer**: a store's WAL is not checkpointed (the writer had to, at its
  ceiling, or it is past half the ceiling a minute after its last checkpoint): with
  ``CMDBUS_CHECKPOINTS=litestream``, Litestream is not running;
- **saturated**: the loop is fine but a face sheds requests or queues them long: it
  has more work than its Gate admits (which face, which op, shed rate, queue wait); or
  the loop turns but is busy over 75% of the time, client work waiting for turns: the
  writer's CPU is the limit;
- **control face flooded**: the control face (or a NoETL lag port) used its share of the
  loop and its requests waited, or went first for over 15% of the loop, or hit its
  connection cap: a scraper in a loop, a probe period in milliseconds, a client that
  holds connections open; the buses are not the matter;
- **backlog growing**: a subject's lag rose between the scrapes (which subject, pool;
  and whether anything was delivered from it at all);
- **backlog stuck**: a subject has a backlog and nothing was delivered from it between
  the scrapes (no consumer takes from that pool): growing or not, nobody works it;
- a member of a pair (docs/ha.md): **two primaries** (it and the member its lease names
  both say they are primary), **no standby in sync** (its primary acknowledges alone),
  **standby far behind**;
- **healthy**: none of the above.

"Saturated" and "stalled" look alike from outside (slow or failed requests) and need
opposite fixes: more capacity or fewer clients, against finding what blocks the loop.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.error
from collections.abc import Sequence
from typing import Any, Final

from ._addresses import add_control_url_arguments, default_control_url, server_of
from ._output import Output, add_output_arguments, fail, human_wanted
from ._scrape import Scrape, control_url, histogram_deltas
from ._verdicts import (
    Finding,
    backlog,
    control_flooded,
    disk_slow,
    face_stuck,
    loop_busy,
    loop_saturated,
    no_checkpointer,
    saturated,
)
from .client import fetch
from .ha import findings as ha_findings

SEVERITY = [
    "unreachable",
    "stalled",
    "poisoned",
    "two primaries",
    "face crashed",
    "task crashed",
    "face stuck",
    "not ready",
    "disk slow",
    "no checkpointer",
    "no standby in sync",
    "standby far behind",
    "saturated",
    "control face flooded",
    "contended",
    "backlog growing",
    "backlog stuck",
]


def assess(
    health: tuple[dict[str, Any] | None, dict[str, Any] | None],
    before: Scrape,
    after: Scrape,
    interval: float,
    also: Sequence[Finding] = (),
) -> list[Finding]:
    """Every finding from two health documents and two scrapes ``interval`` s apart (and
    ``also``: a pair's, :func:`.ha.findings`), worst first; ``[healthy]`` when there is
    none."""
    findings = [
        *also,
        *_stalled(health, before, after),
        *_stores(health[1] or health[0] or {}),
        *_crashed(health[1] or health[0] or {}),
        *_not_ready(health[1] or health[0] or {}),
        *face_stuck(before, after, interval),
        *disk_slow(before, after, interval),
        *no_checkpointer(before, after, interval),
        *saturated(before, after, interval),
        *loop_saturated(before, after, interval),
        *control_flooded(before, after, interval),
        *backlog(before, after, interval),
    ]
    if not findings:
        loop = (health[1] or {}).get("loop", {})
        busy = loop_busy(before, after, interval)
        findings.append(
            Finding(
                "healthy",
                "no shedding, no stall, stores ok, no growing backlog",
                (
                    f"loop lag last {loop.get('last_lag_ms')} ms, /healthz turn "
                    f"{loop.get('turn_ms')} ms, loop busy {busy:.0%}",
                ),
            )
        )
    return sorted(
        findings, key=lambda f: SEVERITY.index(f.verdict) if f.verdict in SEVERITY else 99
    )


def _stalled(
    health: tuple[dict[str, Any] | None, dict[str, Any] | None], before: Scrape, after: Scrape
) -> list[Finding]:
    """The writer's own judgment (its liveness threshold), with the heartbeat histogram
    as supporting evidence."""
    evidence = []
    for document in health:
        loop = (document or {}).get("loop", {})
        if loop.get("stalled"):
            evidence.append(f"/healthz loop.reason: {loop.get('reason')}")
            evidence.append(f"/healthz loop.worst_recent_lag_ms: {loop.get('worst_recent_lag_ms')}")
    if not evidence:
        return []
    for buckets in histogram_deltas(before, after, "cmdbus_loop_lag_seconds", ()).values():
        total = buckets.get(float("inf"), 0.0)
        if late := total - buckets.get(1.0, total):
            evidence.append(f"cmdbus_loop_lag_seconds: {late:.0f} heartbeats over 1 s late")
    return [
        Finding(
            "stalled",
            "the event loop is blocked: requests wait unseen, none are shed",
            tuple(dict.fromkeys(evidence)),
        )
    ]


def _stores(document: dict[str, Any]) -> list[Finding]:
    findings = []
    for name, store in sorted(document.get("stores", {}).items()):
        state = store.get("state")
        if state == "poisoned":
            findings.append(
                Finding(
                    "poisoned",
                    f"store {name} is poisoned: writes are refused until a restart",
                    (
                        f"/healthz stores.{name}.poisoned_reason: {store.get('poisoned_reason')}",
                        f'cmdbus_store_state{{store="{name}",state="poisoned"}} 1',
                    ),
                )
            )
        elif state == "contended":
            findings.append(
                Finding(
                    "contended",
                    f"store {name} is contended: writers wait for its lock",
                    (f'cmdbus_store_state{{store="{name}",state="contended"}} 1',),
                )
            )
    return findings


def _crashed(document: dict[str, Any]) -> list[Finding]:
    """Faces and background tasks that died: ``/readyz`` names them, ``/livez`` fails
    once the liveness window has passed, and only a restart brings them back."""
    findings = []
    for kind in ("face", "task"):
        reasons = [
            r
            for r in document.get("not_ready_reasons", [])
            if r.startswith(f"{kind} ") and r.endswith(" crashed")
        ]
        if reasons:
            findings.append(
                Finding(
                    f"{kind} crashed",
                    "; ".join(reasons) + ": only a restart brings it back (/livez fails "
                    "after the liveness window, so Kubernetes restarts the pod)",
                    tuple(f"/healthz not_ready_reasons: {reason}" for reason in reasons),
                )
            )
    return findings


def _not_ready(document: dict[str, Any]) -> list[Finding]:
    """Readiness failing for a reason that has no finding of its own (a poisoned store and
    a crashed face or task have theirs): starting, draining."""
    reasons = [
        r
        for r in document.get("not_ready_reasons", [])
        if not r.startswith("store ") and not r.endswith(" crashed")
    ]
    if not reasons:
        return []
    return [
        Finding(
            "not ready",
            "/readyz fails: " + "; ".join(reasons) + " (its Services send it nothing)",
            tuple(f"/healthz not_ready_reasons: {reason}" for reason in reasons),
        )
    ]


def _healthz(url: str, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """The /healthz document, or why there is none (``"timeout"`` or ``"refused: …"``)."""
    try:
        status, body = fetch(f"{url}/healthz", timeout)
    except TimeoutError:
        return None, "timeout"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError | socket.timeout):
            return None, "timeout"
        return None, f"refused: {exc.reason}"
    except OSError as exc:
        return None, f"refused: {exc}"
    if status != 200:
        return None, f"refused: HTTP {status}"
    document: dict[str, Any] = json.loads(body)
    return document, None


def diagnose(url: str, *, interval: float, timeout: float) -> list[Finding]:
    url = url.rstrip("/")
    first, problem = _healthz(url, timeout)
    if problem == "timeout":
        return [
            Finding(
                "stalled",
                "the writer accepts connections but /healthz did not answer: the event loop "
                "is blocked (or the process is frozen)",
                (f"GET {url}/healthz: no answer within {timeout:.1f} s",),
            )
        ]
    if problem is not None:
        return [
            Finding("unreachable", f"nothing answers at {url}", (f"GET {url}/healthz: {problem}",))
        ]
    try:
        before = Scrape(fetch(f"{url}/metrics", timeout)[1].decode())
        time.sleep(interval)
        second, _ = _healthz(url, timeout)
        after = Scrape(fetch(f"{url}/metrics", timeout)[1].decode())
    except OSError as exc:
        return [
            Finding(
                "stalled",
                "the control face stopped answering during the look: the loop is blocked",
                (f"GET {url}/metrics: {exc}",),
            )
        ]
    return assess((first, second), before, after, interval, ha_findings(url, timeout))


HELP = "say whether a writer is healthy, saturated, stalled, poisoned or backlogged"


EXIT_CODES: Final = {
    "healthy": 0,
    "unreachable": 3,
    "stalled": 4,
    "poisoned": 5,
    "face crashed": 6,
    "task crashed": 7,
    "face stuck": 8,
    "not ready": 9,
    "disk slow": 10,
    "saturated": 11,
    "control face flooded": 12,
    "contended": 13,
    "backlog growing": 14,
    "backlog stuck": 15,
    "no checkpointer": 16,
    "two primaries": 17,
    "no standby in sync": 18,
    "standby far behind": 19,
}
"""The exit status for the verdict (the first finding), so that a script can tell them
apart. 1 is diagnose's own failure (no ports file, say), 2 bad usage, 130 Ctrl-C."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_control_url_arguments(parser)
    parser.add_argument(
        "url_given",
        nargs="?",
        type=control_url,
        metavar="URL",
        help="the same as --url",
    )
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between scrapes")
    parser.add_argument(
        "--request-timeout",
        "--timeout",  # its older name
        dest="request_timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds to wait for each answer (default 5)",
    )
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not args.request_timeout > 0:
        return fail("diagnose", "--interval and --request-timeout must be > 0 seconds")
    try:
        url = args.url or args.url_given or default_control_url(server=server_of(args))
    except ValueError as exc:
        return fail("diagnose", str(exc))
    findings = diagnose(url, interval=args.interval, timeout=args.request_timeout)
    if human_wanted(args):
        for index, finding in enumerate(findings):
            prefix = "" if index == 0 else "also "
            print(f"{prefix}{finding.verdict.upper()}: {finding.summary}")
            for line in finding.evidence:
                print(f"    {line}")
    else:
        output = Output(human=False)
        for finding in findings:
            output.row(finding)
    return EXIT_CODES[findings[0].verdict]
