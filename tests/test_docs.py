"""The repository's text stands alone: every link in the docs resolves, and no product file points
at documents the repository does not contain or speaks of how it was developed.

Product files are the ``*.py``, ``*.md`` and ``*.toml`` files of the repository, outside version
control, virtual environments, caches, run folders and the golden codegen files. The README is
also the wheel's long description, so its links into the repository are absolute GitHub URLs;
they must name files that exist here, and their anchors headings that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/coda-agent/coda-agent/blob/main/"

SKIPPED_DIRS = {
    ".git",
    ".venv",
    "venv",
    "runs",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
}
SKIPPED_PATHS = {Path("tests/golden"), Path("bench/out")}

# Documents outside the repository. Spelled in pieces so this file does not name them itself.
FOREIGN_DOCUMENTS = re.compile(
    "|".join(
        [
            "CODA" + "_MATH",
            "DESIGN" + r"\.md",
            "DESIGN" + r" §",
            r"(?<![\w/.])" + "GPU" + r"\.md",
            r"\.\./" + "shared",
        ]
    )
)
# Words about how the product was developed. The word for a period of work ("ses" + "sion") has
# product meanings only in these spellings: a subprocess detached from the caller's terminal, an
# HTTP client object, a pytest fixture scope.
WORK_PERIOD = re.compile("ses" + "sion", re.IGNORECASE)
WORK_PERIOD_ALLOWED = re.compile(
    r"start_new_"
    + "ses"
    + "sion"
    + r"|\b(?:requests|aiohttp)\.(?:Client)?"
    + "Ses"
    + "sion\b"
    + r"|scope=[\"']"
    + "ses"
    + "sion"
    + r"[\"']"
)
PROCESS_PHRASES = re.compile(r"\b" + "issue" + r" \d+|\bdevice " + "call" + r"s?\b", re.IGNORECASE)

MARKDOWN_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _product_files() -> list[Path]:
    """Every product file, relative to the repository root, in a stable order."""
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.suffix not in {".py", ".md", ".toml"} or not path.is_file():
            continue
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if any(rel.is_relative_to(skipped) for skipped in SKIPPED_PATHS):
            continue
        found.append(rel)
    return sorted(found)


def _offending_lines(pattern: re.Pattern[str], allowed: re.Pattern[str] | None = None) -> list[str]:
    """``file:line: text`` for every line of a product file that matches ``pattern`` once the
    ``allowed`` spellings are taken out."""
    hits = []
    for rel in _product_files():
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            checked = allowed.sub("", line) if allowed else line
            if pattern.search(checked):
                hits.append(f"{rel}:{number}: {line.strip()}")
    return hits


def _doc_files() -> list[Path]:
    """The markdown a reader follows links in: the README, docs/ and the benchmark results."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *docs]


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (fenced code blocks excluded)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


def _links(path: Path) -> list[str]:
    """Link targets of a markdown file, outside fenced code blocks."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return MARKDOWN_LINK.findall(text)


def _broken(source: Path, target: str) -> str | None:
    """Why a link target from ``source`` does not resolve, or None when it does."""
    if target.startswith(REPO_URL):
        file_part, _, anchor = target[len(REPO_URL) :].partition("#")
        resolved = ROOT / file_part
    elif re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None  # another site: not checked here
    else:
        file_part, _, anchor = target.partition("#")
        resolved = (source.parent / file_part) if file_part else source
    if not resolved.exists():
        return f"{file_part} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
        return f"{resolved.relative_to(ROOT)} has no heading with anchor #{anchor}"
    return None


def test_no_product_file_points_at_documents_outside_the_repository() -> None:
    hits = _offending_lines(FOREIGN_DOCUMENTS)
    assert not hits, (
        "these lines name documents the repository does not contain; point them at docs/ "
        "(algebra.md §N, architecture.md, sandbox.md, export.md, gpu.md) instead:\n"
        + "\n".join(hits)
    )


def test_no_product_file_speaks_of_how_it_was_developed() -> None:
    hits = _offending_lines(WORK_PERIOD, WORK_PERIOD_ALLOWED) + _offending_lines(PROCESS_PHRASES)
    assert not hits, (
        "these lines describe how the product was developed; identify a result by its date, "
        "hardware, software versions and command (bench/RESULTS.md labels runs like "
        "2026-12-01c) instead:\n" + "\n".join(hits)
    )


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_in_the_docs_resolves(doc: Path) -> None:
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    broken = []
    for target in _links(doc):
        why = _broken(doc, target)
        if why:
            broken.append(f"{target}: {why}")
    assert not broken, f"broken links in {doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_links_into_the_repository_by_absolute_url() -> None:
    """The README is the package page's text too, where a relative link leads nowhere."""
    relative = [t for t in _links(ROOT / "README.md") if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]
    assert not relative, (
        "README.md links relatively (broken on the package page); use "
        f"{REPO_URL}<path> instead: " + ", ".join(relative)
    )


def test_the_checks_see_what_they_must() -> None:
    """The patterns catch what they are for, and the file walk finds the product."""
    assert FOREIGN_DOCUMENTS.search("see " + "CODA" + "_MATH §4")
    assert FOREIGN_DOCUMENTS.search("(see " + "GPU" + ".md)")
    assert not FOREIGN_DOCUMENTS.search("see docs/gpu.md")
    word = "ses" + "sion"
    assert WORK_PERIOD.search(WORK_PERIOD_ALLOWED.sub("", f"the twelfth {word}"))
    assert not WORK_PERIOD.search(WORK_PERIOD_ALLOWED.sub("", f"Popen(start_new_{word}=True)"))
    assert PROCESS_PHRASES.search("(" + "issue" + " 5)")
    files = {str(p) for p in _product_files()}
    assert {"README.md", "pyproject.toml", "docs/algebra.md", "sandbox/runner.py"} <= files
    assert not any(f.startswith(("tests/golden/", ".venv/")) for f in files)
    assert _slug("## 7. A Llama layer as GEMM-epilogue programs".lstrip("# ")) == (
        "7-a-llama-layer-as-gemm-epilogue-programs"
    )
