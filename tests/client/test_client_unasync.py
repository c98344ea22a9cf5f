"""The blocking client's faces are generated from the trio client's: the generated file
is what the generator makes of the source now, and the two clients offer the same
methods, parameters and docstrings."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from cmdbus_trio.client import _unasync, blocking
from cmdbus_trio.client import trio as trio_client


@pytest.mark.parametrize(
    ("source", "target", "what"), _unasync.PAIRS, ids=[pair[1].name for pair in _unasync.PAIRS]
)
def test_the_blocking_modules_are_generated_from_the_trio_ones(
    source: Path, target: Path, what: str
) -> None:
    generated = _unasync.unasync(source.read_text(), source.stem, what)
    assert target.read_text() == generated, (
        f"src/cmdbus_trio/client/{target.name} is stale: run python -m cmdbus_trio.client._unasync"
    )


def test_the_generator_refuses_trio_it_cannot_translate() -> None:
    source = (
        '"""doc"""\n\nclass A:\n    async def f(self) -> None:\n'
        "        await trio.lowlevel.checkpoint()\n"
    )
    with pytest.raises(ValueError, match="does not translate"):
        _unasync.unasync(source)


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


@pytest.mark.parametrize("name", sorted(set(trio_client.__all__) - {"ServerError"}))
def test_both_clients_offer_the_same_faces(name: str) -> None:
    async_cls, sync_cls = getattr(trio_client, name), getattr(blocking, name)
    if name == "Connection":
        # Hand-written on each side; the calls they share take the same parameters.
        for method in ("connect", "call"):
            assert inspect.signature(getattr(async_cls, method)).parameters.keys() == (
                inspect.signature(getattr(sync_cls, method)).parameters.keys()
            )
        return
    assert inspect.getdoc(async_cls) == inspect.getdoc(sync_cls)
    async_methods, sync_methods = _methods(async_cls), _methods(sync_cls)
    assert async_methods.keys() == sync_methods.keys()
    for method, signature in async_methods.items():
        assert signature.parameters.keys() == sync_methods[method].parameters.keys(), method
        assert inspect.getdoc(getattr(async_cls, method)) == inspect.getdoc(
            getattr(sync_cls, method)
        ), method


def test_both_public_modules_export_the_same_names() -> None:
    assert trio_client.__all__ == blocking.__all__
