"""The docs stand alone: every file the repository's text cites (a ``*.md`` page, a
markdown link, a ``docs/``, ``src/``, ``tests/``, ``benchmarks/``, ``harness/`` or ``deploy/``
path)
is in the repository. The docs once cited design notes and contracts that were not."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    ROOT / "README.md",
    *ROOT.glob("docs/*.md"),
    *ROOT.glob("src/**/*.py"),
    *ROOT.glob("tests/**/*.py"),
    *ROOT.glob("benchmarks/**/*.py"),
    *ROOT.glob("harness/**/*.py"),
    *ROOT.glob("deploy/**/*.yaml"),
    ROOT / "deploy" / "Dockerfile",
    ROOT / "pyproject.toml",
    ROOT / "noxfile.py",
]
CITED_PAGE = re.compile(r"(?<![\w/.-])([\w./-]*[\w-]+\.md)\b")
CITED_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|src|tests|benchmarks|harness|deploy|fuzz)/[\w./*-]*[\w*-])(?:::|\b)"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # markdown's: only in *.md


def cited(text: str, *, markdown: bool = True) -> set[str]:
    found = set(CITED_PAGE.findall(text)) | set(CITED_PATH.findall(text))
    if markdown:
        found |= {link for link in LINK.findall(text) if "://" not in link}
    return found


def exists(citation: str, citing: Path) -> bool:
    path = citation.rstrip(".")
    if any(char in path for char in "*<>{}"):
        return True  # a pattern, not a file
    return any((base / path).exists() for base in (ROOT, citing.parent, ROOT / "docs"))


def test_nothing_cites_a_file_the_repository_lacks() -> None:
    missing = sorted(
        f"{text.relative_to(ROOT)}: {citation}"
        for text in TEXTS
        if text.exists() and text != Path(__file__)
        for citation in cited(text.read_text(), markdown=text.suffix == ".md")
        if not exists(citation, text)
    )
    assert not missing, "\n".join(missing)


def test_the_check_finds_a_missing_citation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = "See PROTOCOL.md and docs/nowhere.md, [the runbook](runbook.md), docs/protocol.md."
    assert {c for c in cited(text) if not exists(c, page)} == {"PROTOCOL.md", "docs/nowhere.md"}
