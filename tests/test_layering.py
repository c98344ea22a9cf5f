"""The layering of docs/architecture.md, checked on the source: protocol/ and storage/ know nothing
of trio or sockets; only the offload helper enters a worker thread."""

from __future__ import annotations

import ast
import importlib
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
    assert users == ["_trio_connection.py", "_trio_faces.py"]


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
