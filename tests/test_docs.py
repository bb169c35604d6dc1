"""The README stays a front page, the docs' links lead somewhere, and the README's test command is CI's.

Links are checked as a reader follows them: every relative Markdown link in README.md and docs/ must name a
file or folder that exists inside the repository (anchors are not checked); links to the web are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 200

# [text](target) and [text](target "title"); images too. Targets in <...> may hold spaces.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target reference definitions
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a link is a link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(page: Path) -> Iterator[str]:
    text = prose(page.read_text(encoding="utf-8"))
    for match in [*LINK.finditer(text), *REFERENCE.finditer(text)]:
        target = match.group(1).strip("<>")
        if SCHEME.match(target) or target.startswith("#"):
            continue
        yield target


def test_docs_exist() -> None:
    assert len(PAGES) > 1, "docs/ holds no pages"


def test_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move reference and results into docs/"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path.startswith("/"):
            broken.append(f"{target} (absolute: links must be relative)")
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _ci_command() -> str:
    """What .ci/run runs: ``scripts/test`` when it hands over to it, else its last command line."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in lines if line and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert commands, ".ci/run runs nothing"
    if any(re.search(r"(^|[\s/\"'])scripts/test\b", line) for line in commands):
        return "scripts/test"
    return commands[-1]


def _readme_test_command() -> str:
    """The code block that follows the README's sentence about the test suite."""
    after_mention = False
    fence: list[str] | None = None  # the lines of the code block being read, if inside one
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if fence is None:
                fence = []
                continue
            if after_mention:
                return " ".join(part.strip() for part in fence if part.strip())
            fence = None
        elif fence is not None:
            fence.append(line)
        elif "test suite" in line.lower():
            after_mention = True
    raise AssertionError("README.md has no code block after a sentence naming the test suite")


def test_readme_test_command_is_what_ci_runs() -> None:
    def normal(command: str) -> str:
        return command.removeprefix("./")

    assert normal(_readme_test_command()) == normal(_ci_command())


def test_every_test_the_threat_model_names_exists() -> None:
    """docs/security.md shows each promise by a test: a renamed or deleted test must take its row with it."""
    page = (ROOT / "docs" / "security.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", page)
    assert len(named) >= 30, "docs/security.md names too few tests"
    missing = [f"{path}::{name}" for path, name in named
               if not re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.MULTILINE)]
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"
