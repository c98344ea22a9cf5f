"""Generates the blocking client's faces from the trio client's (as httpcore does with
unasync): the face methods are the same calls, with and without ``await``.

    python -m cmdbus_trio.client._unasync     # rewrites _blocking_faces.py, _blocking_sharded.py

``tests/client/test_client_unasync.py`` fails when the generated file is not what this makes of
the source, so the two clients cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIRS = (
    (HERE / "_trio_faces.py", HERE / "_blocking_faces.py", "faces"),
    (HERE / "_trio_sharded.py", HERE / "_blocking_sharded.py", "sharded clients"),
)
"""Each trio source, the blocking module generated from it, and what they hold."""

# In order; whole words only. What the trio faces use of trio has a blocking twin.
REPLACEMENTS = (
    (r"async def ", "def "),
    (r"async for ", "for "),
    (r"async with ", "with "),
    (r"await ", ""),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\baclose\b", "close"),
    (r"\btrio\.current_time\b", "time.monotonic"),
    (r"\btrio\.sleep\(", "time.sleep("),
    (r"^import trio$", "import time"),
    (r"\b_trio_connection\b", "_blocking_connection"),
    (r"\b_trio_faces\b", "_blocking_faces"),
    (r"\b_trio_sharded\b", "_blocking_sharded"),
)

DOCSTRING = '''"""The {what} of the blocking client.

Generated from :mod:`.{source}` by ``python -m cmdbus_trio.client._unasync``: do not
edit; change the trio module and regenerate.
"""
'''


def unasync(source: str, name: str = "_trio_faces", what: str = "faces") -> str:
    """The blocking twin of the trio module ``name``'s ``source`` (which holds
    ``what``): its own docstring, then the source after its docstring with
    :data:`REPLACEMENTS` made."""
    if not source.startswith('"""'):
        raise ValueError("the source must start with its docstring")
    body = source[source.index('"""', 3) + 3 :]
    for pattern, replacement in REPLACEMENTS:
        body = re.sub(pattern, replacement, body, flags=re.MULTILINE)
    if re.search(r"\b(async|await|trio)\b", body):
        raise ValueError("the source uses trio in a way this does not translate")
    return DOCSTRING.format(what=what, source=name) + body


def main() -> None:
    for source, target, what in PAIRS:
        generated = unasync(source.read_text(), source.stem, what)
        if target.exists() and target.read_text() == generated:
            print(f"{target.name} is up to date")
            continue
        target.write_text(generated)
        print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
