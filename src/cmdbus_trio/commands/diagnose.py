"""``cmdbus-trio diagnose [URL]``: one look at a writer's control face, and a verdict.

It reads ``/healthz`` and ``/metrics``, waits ``--interval`` seconds, reads both again,
and says which of these holds, worst first, each with the evidence lines that show it:

- **unreachable**: nothing answers at the URL;
- **stalled**: the event loop is blocked. ``/healthz`` does not answer in time, or says
  the heartbeat was late; requests are *not* being shed, they are not being looked at;
- **poisoned** / **contended**: a store refuses writes / waits for its write lock;
- **face crashed** / **task crashed**: a data face or a background task (a committer,
  claim timers, a sampler, the consumer groups) died; only a restart brings it back;
- **not ready**: `/readyz` fails for another reason (starting, draining);
- **disk slow**: a store's group commits (fsync included) took long: p99 over the interval
  from ``cmdbus_commit_seconds``, the same for every request of the store;
- **saturated**: the loop is fine but a face sheds requests or queues them long: it
  has more work than its Gate admits (which face, which op, shed rate, queue wait); or
  the loop turns but is busy over 75% of the time, client work waiting for turns: the
  writer's CPU is the limit;
- **backlog growing**: a subject's lag rose between the scrapes (which subject, pool;
  and whether anything was delivered from it at all);
- **backlog stuck**: a subject has a backlog and nothing was delivered from it between
  the scrapes (no consumer takes from that pool): growing or not, nobody works it;
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
from collections import defaultdict
from typing import Any

import attrs

from ._addresses import default_control_url
from ._output import Output, fail
from ._scrape import Scrape, control_url, delta, histogram_deltas, label, quantile, show
from .client import fetch

QUEUE_WAIT_SATURATED = 0.1
"""Seconds: a p99 queue wait above this, with requests waiting, counts as saturated."""
COMMIT_SLOW = 0.25
"""Seconds: a p99 group commit above this counts as a slow disk (a healthy fsync takes
milliseconds; every publish and ack of the store waits for one)."""
LOOP_BUSY_SATURATED = 0.75
"""Share of the interval the event loop ran tasks (``cmdbus_loop_busy_seconds``) above
which, with data-plane work waiting for turns, the loop itself is saturated."""
CONTROL_FLOODED = 0.15
"""Share of the interval in turns that favoured the control face
(``cmdbus_loop_control_first_seconds``) above which something floods the control port:
a kubelet's and a Prometheus's requests take ~0.1%; the favour is capped at 25% of the
loop's busy time."""


@attrs.frozen
class Finding:
    verdict: str
    summary: str
    evidence: tuple[str, ...] = ()


SEVERITY = [
    "unreachable",
    "stalled",
    "poisoned",
    "face crashed",
    "task crashed",
    "not ready",
    "disk slow",
    "saturated",
    "contended",
    "backlog growing",
    "backlog stuck",
]


def assess(
    health: tuple[dict[str, Any] | None, dict[str, Any] | None],
    before: Scrape,
    after: Scrape,
    interval: float,
) -> list[Finding]:
    """Every finding from two health documents and two scrapes ``interval`` s apart,
    worst first; ``[healthy]`` when there is none."""
    findings = [
        *_stalled(health, before, after),
        *_stores(health[1] or health[0] or {}),
        *_crashed(health[1] or health[0] or {}),
        *_not_ready(health[1] or health[0] or {}),
        *_disk_slow(before, after, interval),
        *_saturated(before, after, interval),
        *_loop_saturated(before, after, interval),
        *_control_flooded(before, after, interval),
        *_backlog(before, after, interval),
    ]
    if not findings:
        loop = (health[1] or {}).get("loop", {})
        busy = _loop_busy(before, after, interval)
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


def _loop_busy(before: Scrape, after: Scrape, interval: float) -> float:
    busy = sum(delta(before, after, "cmdbus_loop_busy_seconds_total").values())
    return min(1.0, busy / interval)  # the counter is synced each heartbeat, so it may lead


def _loop_saturated(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """The loop turns, but runs tasks most of the time and client work waits for
    turns: the writer's CPU is the limit, before any Gate is. (A blocked loop is busy
    too, but defers nothing: that is a stall, found by its heartbeat.)"""
    busy = _loop_busy(before, after, interval)
    deferred = sum(delta(before, after, "cmdbus_loop_turns_deferred_total").values())
    if busy < LOOP_BUSY_SATURATED or deferred <= 0:
        return []
    return [
        Finding(
            "saturated",
            f"event loop: busy {busy:.0%} of the time, client work waiting for turns: the "
            "writer's CPU is the limit (more shards, or less load per writer)",
            (
                f"cmdbus_loop_busy_seconds_total +{busy * interval:.2f} in {interval:.1f} s",
                f"cmdbus_loop_turns_deferred_total +{deferred:.0f} in {interval:.1f} s",
            ),
        )
    ]


def _control_flooded(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """The control face goes first in the loop's turns, and takes a share of the loop
    (both bounded): a flood of probes or scrapes takes those from the client work, and
    once its share is spent its requests wait."""
    favoured = sum(delta(before, after, "cmdbus_loop_control_first_seconds_total").values())
    paced = sum(delta(before, after, "cmdbus_control_paced_seconds_total").values())
    if favoured < CONTROL_FLOODED * interval and paced <= 0:
        return []
    flood = "something floods the control port (a scraper in a loop, a probe period in ms)"
    said = (
        f"control face: its requests waited {paced:.2f} s for their share of the event loop "
        f"(a tenth of it): {flood}"
        if paced > 0
        else f"control face: its requests went first for {favoured / interval:.0%} of the "
        f"event loop (at most 25%), ahead of client work: {flood}"
    )
    evidence = (
        f"cmdbus_loop_control_first_seconds_total +{favoured:.2f} in {interval:.1f} s",
        f"cmdbus_control_paced_seconds_total +{paced:.2f} in {interval:.1f} s",
    )
    return [Finding("saturated", said, evidence)]


def _saturated(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    sheds = {k: v for k, v in delta(before, after, "cmdbus_shed_total").items() if v > 0}
    waits = histogram_deltas(before, after, "cmdbus_queue_wait_seconds", ("face", "op"))
    faces: dict[str, list[str]] = defaultdict(list)
    summaries: dict[str, list[str]] = defaultdict(list)
    for labels, count in sorted(sheds.items(), key=lambda item: -item[1]):
        face, op, reason = (label(labels, k) for k in ("face", "op", "reason"))
        faces[face].append(f"{show('cmdbus_shed_total', labels)} +{count:.0f} in {interval:.1f} s")
        summaries[face].append(f"{op} shed {count / interval:.1f}/s ({reason})")
    for (face, op), buckets in sorted(waits.items()):
        p99 = quantile(buckets, 0.99)
        if p99 is None:
            continue
        line = f'cmdbus_queue_wait_seconds{{face="{face}",op="{op}"}} p99 {p99 * 1000:.1f} ms'
        if face in faces:
            faces[face].append(line)
        elif p99 > QUEUE_WAIT_SATURATED:
            faces[face].append(line)
            summaries[face].append(f"{op} queue wait p99 {p99 * 1000:.0f} ms")
    findings = []
    for face in sorted(faces):
        gauges = [
            f'{metric}{{face="{face}"}} {value:.0f}'
            for metric in ("cmdbus_inflight", "cmdbus_capacity", "cmdbus_waiters")
            for labels, value in after.series(metric).items()
            if label(labels, "face") == face
        ]
        findings.append(
            Finding(
                "saturated",
                f"face {face}: " + "; ".join(summaries[face]) + " (the loop itself is fine)",
                tuple(faces[face] + gauges),
            )
        )
    return findings


def _disk_slow(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    findings = []
    for (store,), buckets in sorted(
        histogram_deltas(before, after, "cmdbus_commit_seconds", ("store",)).items()
    ):
        p99 = quantile(buckets, 0.99)
        if p99 is None or p99 <= COMMIT_SLOW:
            continue
        commits = buckets.get(float("inf"), 0.0)
        findings.append(
            Finding(
                "disk slow",
                f"store {store}: group commits take {p99 * 1000:.0f} ms (p99): every publish "
                "and ack waits for one; look at the volume's latency",
                (
                    f'cmdbus_commit_seconds{{store="{store}"}} p99 {p99 * 1000:.1f} ms over '
                    f"{commits:.0f} commits in {interval:.1f} s",
                ),
            )
        )
    return findings


def _backlog(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    delivered = {
        label(labels, "subject"): count
        for labels, count in delta(before, after, "cmdbus_deliveries_total").items()
    }
    findings = []
    for metric, key in (("ehdb_feed_subject_lag", "subject"), ("ehdb_events_group_lag", "group")):
        old = before.series(metric)
        for labels, value in sorted(after.series(metric).items(), key=lambda i: sorted(i[0])):
            grew = value - old.get(labels, 0.0)
            name = label(labels, key)
            tokens = name.split(".")
            where = (
                f"subject {name} (pool {tokens[1]})"
                if key == "subject" and len(tokens) > 1
                else f"{key} {name}"
            )
            # Deliveries are counted by subject: whether a group's backlog is worked is not
            # told apart from the other groups of the same subjects.
            idle = key == "subject" and value > 0 and delivered.get(name, 0.0) == 0
            shift = f"{show(metric, labels)} {old.get(labels, 0.0):.0f} -> {value:.0f}"
            none = f'cmdbus_deliveries_total{{subject="{name}"}} +0'
            if grew > 0:
                why = "no consumer takes from it" if idle else "consumers do not keep up"
                findings.append(
                    Finding(
                        "backlog growing",
                        f"{where}: +{grew / interval:.1f}/s, now {value:.0f}: {why}",
                        (f"{shift} in {interval:.1f} s", *([none] if idle else [])),
                    )
                )
            elif idle:
                findings.append(
                    Finding(
                        "backlog stuck",
                        f"{where}: {value:.0f} waiting and none delivered in {interval:.1f} s: "
                        "no consumer takes from it",
                        (f"{shift} in {interval:.1f} s", none),
                    )
                )
    return findings


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
    return assess((first, second), before, after, interval)


HELP = "say whether a writer is healthy, saturated, stalled, poisoned or backlogged"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        type=control_url,
        help="control face (http:// may be left out; default :9090, or the ports file's)",
    )
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between scrapes")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per request")
    parser.add_argument("--human", action="store_true", help="print text, not JSON lines")


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not args.timeout > 0:
        return fail("diagnose", "--interval and --timeout must be > 0 seconds")
    try:
        url = args.url or default_control_url()
    except ValueError as exc:
        return fail("diagnose", str(exc))
    findings = diagnose(url, interval=args.interval, timeout=args.timeout)
    if args.human:
        for index, finding in enumerate(findings):
            prefix = "" if index == 0 else "also "
            print(f"{prefix}{finding.verdict.upper()}: {finding.summary}")
            for line in finding.evidence:
                print(f"    {line}")
    else:
        output = Output(human=False)
        for finding in findings:
            output.row(finding)
    return 0 if findings[0].verdict == "healthy" else 1
