"""The layering of docs/architecture.md, checked on the source: which room may import
which (faces -> bus / tier -> storage -> protocol; the loop's room imports none of them;
the control plane reads, never writes); protocol/ and storage/ know nothing of trio or
sockets; only the offload helper enters a worker thread."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from cmdbus_trio import metrics
from cmdbus_trio.storage import LoopThreadError, refuses_loop_thread

SRC = Path(__file__).resolve().parent.parent / "src" / "cmdbus_trio"
MAX_MODULE_LINES = 450
"""Issue 19: a module longer than this carries more than one idea; split it."""


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


SHARED = {"__init__", "metrics", "logs"}
"""Every room may use these: the version, the metric catalogue, the log helper."""
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "storage": {"protocol"},
    "config": {"protocol"},
    "client": {"protocol"},
    "admission": set(),
    "loop": {"admission"},
    # The span catalogue, as metrics is the metric catalogue: it names a shed by the Gate's
    # exception and a record's context by the protocol's.
    "tracing": {"admission", "protocol"},
    "bus": {"loop", "admission", "storage", "protocol", "config", "tracing"},
    "tier": {"loop", "admission", "storage", "protocol", "config", "tracing"},
    "faces": {"bus", "tier", "loop", "admission", "storage", "protocol", "config", "tracing"},
    # High availability: the lease stores block as storage does, and use its guard.
    "ha": {"loop", "admission", "storage", "protocol", "config"},
    # The control plane reads in-memory state (health) and the stores' own reports; it
    # imports no room that acts on a request.
    "control": {"loop", "admission", "storage", "config"},
    # The offline tools (backup, restore, check) work on the stores' files, as SQLite's.
    "commands": {"client", "config", "protocol", "storage"},
}
"""The rooms each room may import (beside :data:`SHARED`); the wiring (``app``, ``cli``,
``__main__``) may import any."""
WIRING = {"app", "cli", "__main__", "supervision", "member", "measures"}


def room_of(path: Path) -> str:
    relative = path.relative_to(SRC)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def rooms_imported(path: Path) -> set[str]:
    """The rooms of ``cmdbus_trio`` that ``path`` imports, relative imports resolved."""
    package = list(path.relative_to(SRC).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "cmdbus_trio":
                found.update(parts[1:2] or [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1]
            parts = base + (node.module.split(".") if node.module else [])
            found.update(parts[:1] or [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cmdbus_trio."):
                    found.add(alias.name.split(".")[1])
    return {name.removesuffix(".py") for name in found} - {"__version__"}


def layering_violations(imports: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{room} imports {other}"
        for room, others in imports.items()
        if room not in WIRING
        for other in others - {room} - SHARED - ALLOWED.get(room, set())
    )


def test_each_room_imports_only_the_rooms_below_it() -> None:
    imports: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        imports.setdefault(room_of(path), set()).update(rooms_imported(path))
    assert set(imports) - WIRING - SHARED <= set(ALLOWED), "a room the rule does not know"
    assert not layering_violations(imports)
    # The check itself: what it must catch.
    assert layering_violations({"loop": {"bus"}, "control": {"faces"}, "bus": {"tier"}}) == [
        "bus imports tier",
        "control imports faces",
        "loop imports bus",
    ]
    assert layering_violations({"app": {"faces", "bus"}, "faces": {"metrics"}}) == []


def test_tests_and_benchmarks_never_import_each_other() -> None:
    """What both use (the deployment harness) lives where both may import it."""
    root = SRC.parent.parent
    rule = {"tests": "benchmarks", "benchmarks": "tests", "harness": "tests"}
    found = {
        f"{path.relative_to(root)} imports {rule[folder]}"
        for folder in rule
        for path in (root / folder).rglob("*.py")
        if rule[folder] in imported_modules(path)
    }
    assert not found
    assert "harness" in imported_modules(root / "benchmarks" / "workload.py")  # it looks


def test_no_module_is_longer_than_the_cap() -> None:
    lengths = {p.relative_to(SRC): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    too_long = {str(path): n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"over {MAX_MODULE_LINES} lines: {too_long}"
    assert len(lengths) > 50  # the walk found the package


@pytest.mark.parametrize("package", ["protocol", "storage"])
def test_sans_io_packages_never_import_trio_or_sockets(package: str) -> None:
    files = sorted((SRC / package).rglob("*.py"))
    assert files
    for path in files:
        forbidden = imported_modules(path) & {"trio", "socket", "hypercorn", "asyncio"}
        assert not forbidden, f"{path.relative_to(SRC)} imports {forbidden}"


def test_only_the_trio_client_imports_trio_in_the_client_package() -> None:
    users = sorted(
        path.name for path in (SRC / "client").glob("*.py") if "trio" in imported_modules(path)
    )
    assert users == ["_trio_connection.py", "_trio_faces.py", "_trio_sharded.py"]


def test_the_command_line_imports_the_server_only_to_serve() -> None:
    """Every other command (``ha status`` at night, a script's ``client publish``) starts
    without importing the server: hypercorn, the faces, the buses."""
    code = "import sys, cmdbus_trio.cli; print(sorted(m for m in sys.modules if m in NAMES))"
    names = ["cmdbus_trio.app", "cmdbus_trio.faces", "cmdbus_trio.bus", "hypercorn"]
    done = subprocess.run([sys.executable, "-c", f"NAMES = {names!r}; {code}"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout


def test_only_the_offload_helper_enters_a_thread() -> None:
    users = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if "to_thread" in path.read_text() or "abandon_on_cancel=True" in path.read_text()
    )
    assert users == ["admission/_threads.py"]
    assert "abandon_on_cancel=True" not in (SRC / "admission" / "_threads.py").read_text()


@refuses_loop_thread
def storage_entry_point(value: int) -> int:
    return value + 1


def blocked_calls() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "cmdbus_loop_blocking_calls_total", {"entry": "storage_entry_point"}
    )
    return value or 0.0


def test_storage_runs_in_plain_threads() -> None:
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(storage_entry_point(1)))
    thread.start()
    thread.join()
    assert results == [2]
    assert storage_entry_point(2) == 3  # no loop running in this thread either


async def test_storage_refuses_the_loop_thread_and_counts_it() -> None:
    from cmdbus_trio import admission

    assert (
        await admission.run_in_thread(storage_entry_point, 4, limiter=trio.CapacityLimiter(1)) == 5
    )
    before = blocked_calls()
    with pytest.raises(LoopThreadError, match="storage_entry_point was called on the event-loop"):
        storage_entry_point(1)
    assert blocked_calls() == before + 1
    # This test blocks deliberately; take it back out so the session check stays meaningful.
    metrics.LOOP_BLOCKING_CALLS.remove("storage_entry_point")


@pytest.mark.parametrize(
    "module",
    ["cmdbus_trio.client", "cmdbus_trio.client.trio", "cmdbus_trio.client.blocking",
     "cmdbus_trio.protocol", "cmdbus_trio.storage", "cmdbus_trio.config"],
)  # fmt: skip
def test_every_name_a_public_module_lists_can_be_imported(module: str) -> None:
    """`from cmdbus_trio.client import DeadPage` failed: `__all__` listed it, the package
    did not import it, and docs/protocol.md told users `dead()` returns one."""
    imported = importlib.import_module(module)
    missing = [name for name in getattr(imported, "__all__", ()) if not hasattr(imported, name)]
    assert not missing, missing
