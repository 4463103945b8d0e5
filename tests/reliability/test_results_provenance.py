"""Every result section of bench/RESULTS.md names the commit it was produced at (a "- Provenance:" line
with a commit id), so a number can be traced to code; the checker itself is tested on knowable snippets."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMIT_ID = re.compile(r"\b[0-9a-f]{7,40}\b")


def sections_without_provenance(markdown: str) -> list[str]:
    """The level-2 headings (outside code fences) whose section has no '- Provenance:' line naming a
    commit id before the next level-2 heading."""
    missing, heading, named, in_fence = [], None, False, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        if line.startswith("## "):
            if heading is not None and not named:
                missing.append(heading)
            heading, named = line, False
        elif line.startswith("- Provenance:") and COMMIT_ID.search(line):
            named = True
    if heading is not None and not named:
        missing.append(heading)
    return missing


def test_checker_finds_the_section_without_a_commit():
    snippet = ("# R\n\n## A\n\n- Provenance: recorded at commit 1a2b3c4.\n\n## B\n\n- Provenance: someday.\n"
               "```bash\n## not a heading (a comment in a command block)\n```\n\n## C\n\ntext\n")
    assert sections_without_provenance(snippet) == ["## B", "## C"]


def test_every_results_section_names_its_commit():
    missing = sections_without_provenance((REPO / "bench" / "RESULTS.md").read_text())
    assert missing == [], f"bench/RESULTS.md sections without a '- Provenance:' line naming a commit: {missing}"
