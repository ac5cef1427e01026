"""The documentation: the README short and with its two commands, no
setting or command option documented by hand, every public name with a
docstring, and the Sphinx site built with warnings as errors (broken
cross-references and internal links included) where Sphinx is installed
(``pip install -e '.[docs]'``; CI installs it).  CI builds the site itself
with the same options before the tests and names the output in
``MPI_ALLREDUCE_TEST_DOCS_BUILT``: the test then checks that build (made
after the last change to docs/) instead of building it a second time."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: the modules whose ``__all__`` the API reference documents
PUBLIC = ("mpi_allreduce", "mpi_allreduce.simulate", "mpi_allreduce.schedule",
          "mpi_allreduce.trace", "mpi_allreduce.tools.draw", "mpi_allreduce.config",
          "mpi_allreduce.spec", "mpi_allreduce.selection", "mpi_allreduce.reproducible")

TWO_COMMANDS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[mpi,test,plot,numba]' "
    "&& python -m mpi_allreduce.demo",
    ". .venv/bin/activate && python -m pytest",
)


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in TWO_COMMANDS:
        assert command in readme


def test_no_setting_is_documented_by_hand():
    """The settings table exists once, generated from config.SETTINGS at
    build time (and by ``info --settings``); no page copies its rows."""
    from mpi_allreduce.config import SETTINGS

    pages = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
    for page in pages:
        rows = re.findall(r"^\| `(MPI_ALLREDUCE_\w+)`", page.read_text(), re.M)
        assert not rows, f"{page.name} documents {rows} by hand"
    assert "_generated/settings.md" in (DOCS / "settings.md").read_text()
    names = {s.name for s in SETTINGS}
    assert "MPI_ALLREDUCE_TRACE" in names and len(names) == len(SETTINGS)


def test_every_public_name_has_a_docstring():
    missing = []
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            missing.append(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not (getattr(obj, "__doc__", None) or "").strip():
                missing.append(f"{module_name}.{name}")
    assert not missing, f"no docstring: {missing}"


def test_the_generated_references_cover_every_command_and_setting():
    sys.path.insert(0, str(DOCS))
    try:
        spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
        conf = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(conf)
    finally:
        sys.path.remove(str(DOCS))
    from mpi_allreduce.__main__ import COMMANDS
    from mpi_allreduce.config import SETTINGS

    cli = conf._cli()
    for command in COMMANDS:
        assert f"## `{command}`" in cli and f"python -m mpi_allreduce {command}" in cli
    assert "--trace" in cli and "--against" in cli
    from mpi_allreduce.config import settings_table

    table = settings_table()
    assert all(f"`{s.name}`" in table for s in SETTINGS)
    results = conf._results()
    for path in (ROOT / "benchmarks" / "results").glob("*.txt"):
        assert f"`{path.name}`" in results


#: the output directory of a build that CI made with SPHINX_OPTIONS (.ci/run)
BUILT_ENV = "MPI_ALLREDUCE_TEST_DOCS_BUILT"
#: warnings as errors, nitpicky (every broken cross-reference), from scratch
SPHINX_OPTIONS = ("-E", "-W", "-n", "--keep-going", "-q", "-b", "html")


def _check_site(html: Path) -> None:
    assert (html / "seeing.html").exists()
    assert (html / "_static" / "draw" / "ring-p4.png").exists()


def test_ci_builds_the_docs_with_warnings_as_errors_and_names_them():
    """The build the next test may reuse is made with the same options."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"python -m sphinx {' '.join(SPHINX_OPTIONS)} docs docs/_build/html" in ci
    assert f'export {BUILT_ENV}="$PWD/docs/_build/html"' in ci


@pytest.mark.skipif(not os.environ.get(BUILT_ENV) and any(
                        importlib.util.find_spec(m) is None
                        for m in ("sphinx", "myst_parser", "furo")),
                    reason="Sphinx, myst-parser and furo are not installed (the docs extra)")
def test_the_docs_build_without_warnings(tmp_path):
    built = os.environ.get(BUILT_ENV)
    if built:
        # built by CI (which stops at a warning) before this session: every
        # page newer than the docs' sources, so it is the build of these docs
        html = Path(built)
        _check_site(html)
        sources = [f for f in DOCS.rglob("*") if f.is_file() and "_build" not in f.parts
                   and "_generated" not in f.parts]
        newest = max(f.stat().st_mtime for f in sources)
        assert (html / "index.html").stat().st_mtime >= newest, \
            f"{html} is older than docs/: rebuild it, or unset {BUILT_ENV}"
        return
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", *SPHINX_OPTIONS, str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    _check_site(tmp_path / "html")
