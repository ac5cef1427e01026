"""The pages the documentation tests read (README.md, docs/ and the pages
docs/ includes: benchmarks/README.md, slurm/README.md), and their lines
outside fenced code blocks: one walk for tests/test_pages.py and
tests/test_figures_serial.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "slurm" / "README.md"]
#: a fence: its marker, then what it says it holds
FENCE = re.compile(r"^(```+|~~~+)(.*)$")


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def walk(page: Path):
    """(line number, line, the language of the block the line opens, or
    None) of each line outside fenced blocks: a block's own lines and its
    closing fence (the same marker, nothing after it) are left out."""
    opened = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if opened is not None:
            if fence and fence.group(1) == opened and not fence.group(2).strip():
                opened = None
            continue
        if fence:
            opened = fence.group(1)
            yield number, line, fence.group(2).strip().split(" ")[0]
        else:
            yield number, line, None
