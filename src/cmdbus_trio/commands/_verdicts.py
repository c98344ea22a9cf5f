"""The verdicts ``diagnose`` draws from two scrapes of ``/metrics`` (those from the health
documents are its own), each a list of :class:`Finding`, empty when it does not hold."""

from __future__ import annotations

from collections import defaultdict

import attrs

from ._scrape import Scrape, delta, histogram_deltas, label, quantile, show

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

NO_CHECKPOINT_AGE = 60.0
"""Seconds without a full checkpoint after which a WAL past half its ceiling counts as
one nothing checkpoints (Litestream, running, checkpoints every few seconds under
writes, and keeps a WAL at a few MiB)."""


CROWDED_OUT = "cmdbus_control_connections_crowded_out_total"


@attrs.frozen
class Finding:
    verdict: str
    summary: str
    evidence: tuple[str, ...] = ()


def loop_busy(before: Scrape, after: Scrape, interval: float) -> float:
    busy = sum(delta(before, after, "cmdbus_loop_busy_seconds_total").values())
    return min(1.0, busy / interval)  # the counter is synced each heartbeat, so it may lead


def loop_saturated(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """The loop turns, but runs tasks most of the time and client work waits for
    turns: the writer's CPU is the limit, before any Gate is. (A blocked loop is busy
    too, but defers nothing: that is a stall, found by its heartbeat.)"""
    busy = loop_busy(before, after, interval)
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


def control_flooded(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """The control face goes first in the loop's turns, and takes a share of the loop
    (both bounded): a flood of probes or scrapes takes those from the client work, and
    once its share is spent its requests wait. A port at its connection cap closes its
    quietest connection for each new one: something holds many open."""
    favoured = sum(delta(before, after, "cmdbus_loop_control_first_seconds_total").values())
    paced = sum(delta(before, after, "cmdbus_control_paced_seconds_total").values())
    crowded = sorted(
        (labels, count) for labels, count in delta(before, after, CROWDED_OUT).items() if count > 0
    )
    favoured_much = favoured >= CONTROL_FLOODED * interval
    if not favoured_much and paced <= 0 and not crowded:
        return []
    said = []
    if paced > 0:
        said.append(
            f"its requests waited {paced:.2f} s for their share of the event loop (a tenth)"
        )
    elif favoured_much:
        said.append(
            f"its requests went first for {favoured / interval:.0%} of the event loop "
            "(at most 25%), ahead of client work"
        )
    if crowded:
        ports = ", ".join(f"{label(key, 'port')} ({count:.0f} closed)" for key, count in crowded)
        said.append(f"at its connection cap on port {ports}, the quietest closed for each new one")
    summary = (
        "control face: " + "; ".join(said) + ": something floods the control port (a scraper "
        "in a loop, a probe period in ms, a client that keeps its connections open)"
    )
    evidence = (
        f"cmdbus_loop_control_first_seconds_total +{favoured:.2f} in {interval:.1f} s",
        f"cmdbus_control_paced_seconds_total +{paced:.2f} in {interval:.1f} s",
        *(f"{show(CROWDED_OUT, labels)} +{count:.0f}" for labels, count in crowded),
    )
    return [Finding("control face flooded", summary, evidence)]


def saturated(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
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


def disk_slow(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
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


def no_checkpointer(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """A store's WAL that nothing checkpoints: the writer had to (its ceiling), or it is
    past half the ceiling and went a minute without a full checkpoint. With
    ``CMDBUS_CHECKPOINTS=litestream``: Litestream is not running, or not on this store."""
    ceiling = max(after.series("cmdbus_store_wal_ceiling_bytes").values(), default=0.0)
    ages = after.series("cmdbus_store_checkpoint_age_seconds")
    forced = delta(before, after, "cmdbus_store_wal_ceiling_checkpoints_total")
    findings = []
    for labels, wal in sorted(after.series("cmdbus_store_wal_bytes").items()):
        age, store = ages.get(labels, 0.0), label(labels, "store")
        by_writer = forced.get(labels, 0.0)
        grown = ceiling > 0 and wal >= ceiling / 2 and age >= NO_CHECKPOINT_AGE
        if by_writer <= 0 and not grown:
            continue
        findings.append(
            Finding(
                "no checkpointer",
                f"store {store}: its WAL is not checkpointed (with "
                "CMDBUS_CHECKPOINTS=litestream: is Litestream running and replicating it?); "
                "the writer checkpoints it at CMDBUS_WAL_CEILING_BYTES",
                (
                    f"{show('cmdbus_store_wal_bytes', labels)} {wal:.0f} (ceiling {ceiling:.0f})",
                    f"{show('cmdbus_store_checkpoint_age_seconds', labels)} {age:.0f}",
                    f"{show('cmdbus_store_wal_ceiling_checkpoints_total', labels)} "
                    f"+{by_writer:.0f} in {interval:.1f} s",
                ),
            )
        )
    return findings


def backlog(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
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


def face_stuck(before: Scrape, after: Scrape, interval: float) -> list[Finding]:
    """Requests wait on a face (queued for its byte budget or for a Gate slot) at both
    scrapes, and the face answered none in between, but for sheds: whatever holds the
    bytes or the slots does not finish, and the probes cannot tell (the loop turns, the
    stores are fine). A saturated face answers something; a stuck one nothing."""
    waiting: dict[str, list[str]] = defaultdict(list)
    for metric in ("cmdbus_pending_bytes_waiters", "cmdbus_waiters"):
        old = {label(labels, "face"): value for labels, value in before.series(metric).items()}
        for labels, value in after.series(metric).items():
            face = label(labels, "face")
            if value > 0 and old.get(face, 0.0) > 0:
                waiting[face].append(f'{metric}{{face="{face}"}} {old[face]:.0f} -> {value:.0f}')
    if not waiting:
        return []
    answered: dict[str, float] = defaultdict(float)
    requests = "cmdbus_request_duration_seconds_count"
    for labels, count in delta(before, after, requests).items():
        if label(labels, "outcome") != "busy":  # a shed is no progress
            answered[label(labels, "face")] += count
    findings = []
    for face in sorted(waiting):
        if answered[face] > 0:
            continue
        lent = [
            f'cmdbus_pending_bytes{{face="{face}"}} {value:.0f}'
            for labels, value in after.series("cmdbus_pending_bytes").items()
            if label(labels, "face") == face
        ]
        findings.append(
            Finding(
                "face stuck",
                f"face {face}: requests wait and none was answered in {interval:.1f} s: its "
                "byte budget or Gate slots are held by work that does not finish; its clients "
                "hang while the probes say ready (restart the pod; keep its log and a "
                "/debug/loop-census for the bug report)",
                (
                    *waiting[face],
                    f'{requests}{{face="{face}",outcome!="busy"}} +0 in {interval:.1f} s',
                    *lent,
                ),
            )
        )
    return findings
