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


USER_DOCS = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
SECTION_REFERENCE = re.compile(r"([\w/.-]+\.md)(?:,|\s*\()\s*\"([^\"]+)\"")
SECTION_IN_PAGE = re.compile(r"\"([^\"]+)\"\s+in\s+([\w/.-]+\.md)\b")
"""The same reference the other way round: ``"A heading" in page.md``."""
ANCHOR_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
DATE_HEADING = re.compile(r"^#+ .*\b20\d\d-\d\d-\d\d", re.M)
TIME_OF_DAY_HEADING = re.compile(r"^#+ .*\b(morning|afternoon|evening|night)\b", re.M | re.I)
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? \d+\b|(?<![\w/])#\d+\b")
COMMIT_HASH = re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}`")


BOLD_LABEL = re.compile(r"^(?:- )?\*\*([^*]+)\*\*")


def headings(page: Path) -> list[str]:
    """A page's headings, and the bold labels that open a paragraph or a list item."""
    found = []
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            found.append(" ".join(line.lstrip("#").split()))
        elif label := BOLD_LABEL.match(line):
            found.append(" ".join(label.group(1).split()).rstrip(".:"))
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to
    hyphens."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def broken_anchors(text: str, citing: Path) -> list[str]:
    """``[text](page.md#anchor)`` and ``[text](#anchor)`` whose page has no heading with
    that anchor."""
    broken = []
    for page_name, anchor in ANCHOR_LINK.findall(text):
        page = citing if not page_name else citing.parent / page_name
        if page.suffix != ".md" or not page.is_file():
            continue  # a missing page is the citation check's
        anchors = {
            slug(" ".join(line.lstrip("#").split()))
            for line in page.read_text().splitlines()
            if line.startswith("#")
        }
        if anchor not in anchors:
            shown = citing.relative_to(ROOT) if citing.is_relative_to(ROOT) else citing.name
            broken.append(f"{shown}: {page_name}#{anchor}")
    return broken


def test_every_anchor_a_link_names_is_there() -> None:
    broken = [b for text in USER_DOCS for b in broken_anchors(text.read_text(), text)]
    assert not broken, "\n".join(broken)


def test_the_anchor_check_finds_a_missing_one(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n## The WAL is not checkpointed\n")
    text = "[a](#the-wal-is-not-checkpointed) [b](page.md#top) [c](#nowhere) [d](page.md#gone)"
    assert [b.split(": ")[1] for b in broken_anchors(text, page)] == ["#nowhere", "page.md#gone"]


def broken_section_references(text: str, citing: Path) -> list[str]:
    """``page.md, "A heading"``, ``page.md ("A heading")`` or ``"A heading" in page.md``
    whose page has no heading starting so (a reference may name a heading by its first
    words)."""
    broken = []
    references = SECTION_REFERENCE.findall(text)
    references += [(page, section) for section, page in SECTION_IN_PAGE.findall(text)]
    for page_name, section in references:
        page = next(
            (base / page_name for base in (ROOT, citing.parent, ROOT / "docs")
             if (base / page_name).is_file()),
            None,
        )  # fmt: skip
        wanted = " ".join(section.split()).rstrip(".,")
        if page is not None and not any(h.startswith(wanted) for h in headings(page)):
            broken.append(f'{citing.relative_to(ROOT)}: {page_name}, "{wanted}"')
    return broken


def test_every_section_a_page_names_is_there() -> None:
    texts = [*USER_DOCS, *ROOT.glob("src/**/*.py"), ROOT / "CHANGELOG.md"]
    broken = [b for text in texts for b in broken_section_references(text.read_text(), text)]
    assert not broken, "\n".join(broken)


def history_in(text: str) -> list[str]:
    """What a user doc must not carry: the project's history (it is in git and the
    changelog), dated or timed headings, issue numbers, commit hashes."""
    found = [f"date in a heading: {m.group(0)}" for m in DATE_HEADING.finditer(text)]
    found += [f"time of day in a heading: {m.group(0)}" for m in TIME_OF_DAY_HEADING.finditer(text)]
    found += [f"issue number: {m.group(0)}" for m in ISSUE_NUMBER.finditer(text)]
    found += [f"commit hash: {m.group(0)}" for m in COMMIT_HASH.finditer(text)]
    return found


def test_user_docs_carry_no_history() -> None:
    found = [
        f"{page.relative_to(ROOT)}: {f}" for page in USER_DOCS for f in history_in(page.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_history_check_finds_each_kind() -> None:
    text = (
        "## Results (2026-12-05)\n### Runs, evening\nSince issue 48 and #12, "
        "`3b8ffd5` beside `deadbeef1`; `abcdefa` is a word, 2026-12-05 in text is a date.\n"
    )
    assert [f.split(":")[0] for f in history_in(text)] == [
        "date in a heading", "time of day in a heading", "issue number", "issue number",
        "commit hash", "commit hash",
    ]  # fmt: skip
    page = ROOT / "docs" / "benchmarks.md"
    assert broken_section_references('See benchmarks.md, "No such heading".', page)
    assert not broken_section_references('See benchmarks.md ("The bus benchmark").', page)


def test_the_section_check_reads_a_reference_either_way_round() -> None:
    page = ROOT / "docs" / "scale-out.md"
    found = broken_section_references(
        'See "CPU and latency at a\nrate" in sizing.md and "Sizing a writer" in sizing.md.',
        page,
    )
    assert found == ['docs/scale-out.md: sizing.md, "Sizing a writer"']
