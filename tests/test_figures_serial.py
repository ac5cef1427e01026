"""Every figure a page quotes is read from a file in the repository.

A *figure* is a number with a unit of time, speed-up, memory or share
(``2.57 us``, ``1.2–3.5x``, ``19.6 GB``, ``17%``, ``20 minutes``), or a
decimal number in a Markdown table row, anywhere in README.md, docs/ and the
pages docs/ includes, outside code (fenced blocks and inline code spans:
those are commands, run and checked by tests/test_pages.py).

Each paragraph (or list, or table) that quotes figures is followed by a
comment naming where they come from::

    <!-- figures: benchmarks/results/floor-np2.txt, benchmarks/results/bench-np2.json -->

and every figure of it must be found there: some number of those files,
rounded to the figure's decimals, is the figure (both ends of a range).  A
results file regenerated with other numbers, or a figure retyped wrongly,
fails with the page and line.  A figure that is not ours to measure carries
its citation instead: ``<!-- figures: cited: <where it was published> -->``.
A paragraph with figures and no such comment fails: nothing passes
unnoticed.  Sizes of messages (``16 MiB``, ``8 B``) are inputs, not figures.

To see which figures of a page have no source:
``python -m pytest tests/test_figures_serial.py -k PAGE``."""

from __future__ import annotations

import re
import sys
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path

import pytest

from .pages import PAGES, ROOT, walk
from .pages import name as page_name


NUMBER = r"\d+(?:[.,]\d+)*"
UNIT = r"(?:us|µs|ms|s|x|×|GB|MB|%|seconds?|minutes?|min|hours?|h)"
#: a figure in prose: a number or a range of two, then its unit
FIGURE = re.compile(rf"(?<![\w.,\-/])({NUMBER})(?:\s?[–-]\s?({NUMBER}))?\s?{UNIT}(?![\w/])")
#: a decimal number in a table cell
CELL = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.])")
SOURCE = re.compile(r"<!-- figures: (.+?) -->")


def _paragraphs(page: Path):
    """(first line, lines) of each run of non-blank lines outside fences."""
    block, start = [], 0
    for number, line, language in walk(page):
        if language is not None:
            continue
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield start, block
            block = []
    if block:
        yield start, block


def figures(text: str) -> list:
    """(the number as written, the other end of a range or None) of each
    figure in one line of prose or table."""
    text = re.sub(r"`[^`]*`", "", text)  # (inline code)
    text = re.sub(r"<!--.*?-->|\]\([^)]*\)", "", text)  # (comments, link targets)
    found = [(m.group(1), m.group(2)) for m in FIGURE.finditer(text)]
    if text.lstrip().startswith("|") and not re.fullmatch(r"[\s|:\-]+", text):
        found += [(m.group(1), None) for m in CELL.finditer(text)]
    return found


@lru_cache(maxsize=None)
def _numbers(path: Path) -> tuple:
    text = path.read_text(errors="replace")
    out = []
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # (thousands, not lists)
    for word in re.findall(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", text):
        try:
            out.append(Decimal(word))
        except InvalidOperation:
            pass
    return tuple(sorted(set(out)))


def found_in(figure: str, paths: list) -> bool:
    """Whether some number of ``paths``, rounded to ``figure``'s decimals, is it."""
    figure = figure.replace(",", "")
    want = Decimal(figure)
    step = Decimal(1).scaleb(-len(figure.split(".")[1])) if "." in figure else Decimal(1)
    for path in paths:
        for value in _numbers(path):
            if abs(value - want) <= step / 2:  # (either way at a half)
                return True
    return False


def problems(page: Path) -> list:
    """What is wrong with the figures of one page: (line, message)."""
    out = []
    paragraphs = list(_paragraphs(page))
    for k, (start, block) in enumerate(paragraphs):
        text = [line for line in block if not SOURCE.search(line)]
        sources = [m.group(1) for line in block for m in SOURCE.finditer(line)]
        if not sources and k + 1 < len(paragraphs):
            nxt = paragraphs[k + 1][1]
            if all(SOURCE.fullmatch(line.strip()) for line in nxt):
                sources = [m.group(1) for line in nxt for m in SOURCE.finditer(line)]
        quoted = [(start + n, f) for n, line in enumerate(text) for f in figures(line)]
        if not quoted:
            continue
        if not sources:
            out += [(n, f"{'–'.join(filter(None, f))}: no source (add <!-- figures: FILE -->"
                        " after the paragraph)") for n, f in quoted]
            continue
        if any(s.startswith("cited: ") and len(s) > len("cited: ") + 3 for s in sources):
            continue
        paths = []
        for source in sources:
            for name in (s.strip() for s in source.split(",")):
                path = ROOT / name
                if not path.is_file():
                    out.append((start, f"source {name}: no such file"))
                else:
                    paths.append(path)
        for n, ends in quoted:
            for end in filter(None, ends):
                if paths and not found_in(end, paths):
                    out.append((n, f"{end} is in none of {', '.join(p.name for p in paths)}"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_figure_is_read_from_its_source(page):
    found = problems(page)
    assert not found, "\n".join(f"{page.relative_to(ROOT)}:{n}: {why}" for n, why in found)


def test_a_figure_without_its_source_or_changed_in_it_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "floor.txt").write_text("ring 1.412 us\nauto 1.004 us\n")
    page = tmp_path / "page.md"
    page.write_text("The ring takes 1.41 us and auto 1.0 us.\n"
                    "<!-- figures: floor.txt -->\n\nWithout a source: 3.5x.\n\n"
                    "Drifted: 2.57 us.\n<!-- figures: floor.txt -->\n\n"
                    "| size | us |\n|---|---|\n| 8 | 1.41 |\n| 16 | 9.99 |\n\n"
                    "<!-- figures: floor.txt -->\n\nA paper's 2.6x.\n"
                    "<!-- figures: cited: Author et al., SC 2024, table 2 -->\n")
    assert problems(page) == [(4, "3.5: no source (add <!-- figures: FILE --> after the "
                                  "paragraph)"),
                              (6, "2.57 is in none of floor.txt"),
                              (12, "9.99 is in none of floor.txt")]
