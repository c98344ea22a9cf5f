"""``cmdbus-trio ha status|switchover|promote``: the members of a pair, as an operator
sees and moves them (docs/ha.md).

``status`` reads ``GET /ha`` from each member given (``--url``, repeatable; default the
control face on ``--server``) and says what is wrong first: two members that both say
they are primary, no standby in sync, a standby far behind. ``switchover`` asks a
primary to hand the lease to its standby in sync and follow it. ``promote --force`` asks
a standby to take the lease once it expires, in sync or not: it says what that may lose,
and on a terminal asks for the member's name before it goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Final

from ._addresses import add_server_argument, default_control_url, server_of
from ._output import Output, add_output_arguments, fail, human_wanted
from ._scrape import control_url
from ._verdicts import Finding
from .client import TOKEN_VARIABLE, fetch

HELP = "a standby per shard: status, switchover, promote --force"
FAR_BEHIND: Final = 10_000
"""Transactions a standby may be behind before ``status`` says so."""
EXIT_CODES: Final = {
    "ok": 0,
    "unreachable": 3,
    "two primaries": 20,
    "no primary": 23,
    "no standby in sync": 21,
    "far behind": 22,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="each member's role, epoch, sync and lag")
    switchover = actions.add_parser(
        "switchover", help="the primary hands the lease to its standby in sync, then follows it"
    )
    promote = actions.add_parser(
        "promote", help="a standby takes the lease once it expires, in sync or not"
    )
    promote.add_argument(
        "--force", action="store_true", required=True, help="yes: it may lose records"
    )
    promote.add_argument("--yes", action="store_true", help="do not ask on a terminal")
    for action in (status, switchover, promote):
        action.add_argument(
            "--url",
            type=control_url,
            action="append" if action is status else "store",
            help="a member's control face (default :9090 on --server)"
            + ("; repeat it for each member" if action is status else ""),
        )
        add_server_argument(action)
        action.add_argument(
            "--token", help=f"the control face's auth token (default ${TOKEN_VARIABLE})"
        )
        add_output_arguments(action)


def run(args: argparse.Namespace) -> int:
    command = f"ha {args.action}"
    try:
        urls = args.url if args.url else default_control_url(server=server_of(args))
    except ValueError as exc:
        return fail(command, str(exc))
    if args.action == "status":
        return _status(args, urls if isinstance(urls, list) else [urls])
    url = urls[0] if isinstance(urls, list) else urls
    if args.action == "promote" and not args.yes and sys.stdin.isatty():
        name = _member(url).get("name")
        print(f"A forced promotion of {name} may lose what the primary acknowledged that "
              "it lacks.", file=sys.stderr)  # fmt: skip
        if input(f"Type the member's name ({name}) to promote it: ").strip() != name:
            return fail(command, "not promoted")
    query = "?force=1" if args.action == "promote" else ""
    status, document = _post(f"{url}/ha/{args.action}{query}", args.token)
    output = Output(human=human_wanted(args))
    output.row(document)
    output.close()
    return 0 if status == 202 else fail(command, str(document.get("error", f"HTTP {status}")))


def _status(args: argparse.Namespace, urls: list[str]) -> int:
    members = [{"url": url, **_member(url)} for url in urls]
    verdict, why = assess(members)
    output = Output(human=human_wanted(args))
    if output.human:
        print(f"{verdict.upper()}: {why}")
    for member in members:
        output.row({key: value for key, value in member.items() if key != "primary_faces"})
    output.close()
    if not output.human:
        print(json.dumps({"verdict": verdict, "why": why}))
    return EXIT_CODES[verdict]


def assess(members: list[dict[str, Any]]) -> tuple[str, str]:
    """The worst of what ``members`` (their ``GET /ha``) say, and why."""
    primaries = [m for m in members if m.get("role") == "primary"]
    if len(primaries) > 1:
        names = ", ".join(str(m.get("name")) for m in primaries)
        return "two primaries", f"{names} each say they hold the lease"
    if not primaries:
        away = [m for m in members if m.get("role") == "unreachable"]
        if len(away) == len(members):
            return "unreachable", "; ".join(f"{m['url']}: {m.get('error')}" for m in away)
        return "no primary", "no member given says it holds the lease: the shard cannot write"
    for primary in primaries:
        if not primary.get("in_sync"):
            return "no standby in sync", f"{primary.get('name')} acknowledges alone"
    for member in members:
        if member.get("role") == "standby" and (member.get("behind_records") or 0) > FAR_BEHIND:
            behind = member.get("behind_records")
            return "far behind", f"{member.get('name')} is {behind} transactions behind"
    if away := [m for m in members if m.get("role") == "unreachable"]:
        return "unreachable", "; ".join(f"{m['url']}: {m.get('error')}" for m in away)
    return "ok", "one primary, its standby in sync"


def _member(url: str, timeout: float = 5.0) -> dict[str, Any]:
    try:
        status, body = fetch(f"{url}/ha", timeout)
    except OSError as exc:
        return {"role": "unreachable", "error": str(exc)}
    if status != 200:
        return {"role": "unreachable", "error": f"HTTP {status}"}
    document: dict[str, Any] = json.loads(body)
    return document


def _post(url: str, token: str | None) -> tuple[int, dict[str, Any]]:
    token = token or os.environ.get(TOKEN_VARIABLE)
    request = urllib.request.Request(url, method="POST", data=b"")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError as exc:
        return 0, {"error": f"{url}: no answer: {exc}"}


def findings(url: str, timeout: float = 5.0) -> list[Finding]:
    """What ``diagnose`` says of a member of a pair at ``url`` (nothing for a writer
    alone): it and the member it names primary (from ``primary_faces``) looked at."""
    member = _member(url, timeout)
    if member.get("role") in (None, "single", "unreachable"):
        return []
    members = [{"url": url, **member}]
    control = (member.get("primary_faces") or {}).get("control")
    if control and member.get("primary") != member.get("name"):
        other = control_url(str(control))
        members.append({"url": other, **_member(other, timeout)})
    verdict, why = assess([m for m in members if m.get("role") != "unreachable"])
    evidence = tuple(
        f"GET {m['url']}/ha: role {m.get('role')}, in_sync {m.get('in_sync')}, "
        f"behind_records {m.get('behind_records')}, epoch {m.get('epoch')}"
        for m in members
    )
    named = {"far behind": "standby far behind"}.get(verdict, verdict)
    if named in ("two primaries", "no standby in sync", "standby far behind"):
        return [Finding(named, why, evidence)]
    return []
