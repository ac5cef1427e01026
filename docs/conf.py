"""Sphinx configuration: ``python -m sphinx -W -n -b html docs docs/_build/html``.

The settings reference, the command-line reference and the index of the
committed benchmark results are generated here, at every build, from
:data:`mpi_allreduce.config.SETTINGS`, the argument parsers and
``benchmarks/results/`` (into ``docs/_generated/``, which is not committed):
nothing of theirs is written by hand twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

project = "mpi_allreduce"
author = "the mpi_allreduce developers"
copyright = "2026, the mpi_allreduce developers"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "make_pictures.py"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = "mpi_allreduce"
html_static_path = ["_static"]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True}
# the optional dependencies are always stood in for, installed or not: the site
# is the same wherever it is built, and a build here imports the modules as CI's
# build (made before torch is installed) does
autodoc_mock_imports = ["torch", "cupy", "ml_dtypes"]
suppress_warnings = ["myst.header"]
# names from other projects (no internet here for intersphinx): not ours to resolve
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|mpi4py|MPI|torch|cupy|ml_dtypes|collections|typing|threading)"
               r"(\..*)?"),
    (r"py:.*", r"(ndarray|Intracomm|Comm|Op|Datatype|Request|Prequest|Work|ProcessGroup|"
               r"Callable|Optional|Any|NamedTuple|Path|BaseException|array_like|optional|"
               r"Sequence|dtype|function|callable|buffer|array|int|float|str|bool|tuple|"
               r"list|dict|None|object|bytes|Exception|BufSpec|BufSpecB|InPlace|Info|Group)"),
    (r"py:.*", r"c10d::.*"),
]


def _generate(app) -> None:
    out = DOCS / "_generated"
    out.mkdir(exist_ok=True)
    from mpi_allreduce.config import settings_table

    (out / "settings.md").write_text(settings_table() + "\n")
    (out / "cli.md").write_text(_cli())
    (out / "results-files.md").write_text(_results())


def _cli() -> str:
    from mpi_allreduce.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    text = []
    for name, command in sub.choices.items():
        command.prog = f"python -m mpi_allreduce {name}"
        text += [f"## `{name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(text)


def _results() -> str:
    results = ROOT / "benchmarks" / "results"
    text = ["Every file in `benchmarks/results/` as committed, each headed (where it is text) ",
            "by the command that made it; `benchmarks/README.md` says how to regenerate them.",
            ""]
    for path in sorted(results.rglob("*")):
        if not path.is_file():
            continue
        name = path.relative_to(results).as_posix()
        text += [f"## `{name}`", ""]
        if path.suffix == ".png":
            text += [f"![{name}](/../benchmarks/results/{name})", ""]
        elif path.suffix in (".txt", ".md") and path.stat().st_size < 200_000:
            body = path.read_text(errors="replace").rstrip()
            text += ["````text", body, "````", ""]
        else:
            text += [f"{path.stat().st_size:,} bytes of {path.suffix[1:].upper()} "
                     f"(raw data; not shown)", ""]
    return "\n".join(text)


def _numpy_sections_only(app) -> None:
    """napoleon for the numpy-style sections of functions and classes only:
    an attribute's or property's first line (``what it is: more``) is prose
    here, not napoleon's ``type: description``."""
    from sphinx.ext.napoleon import _process_docstring

    for listener in list(app.events.listeners.get("autodoc-process-docstring", [])):
        if listener.handler is _process_docstring:
            app.disconnect(listener.id)

    def sections(app, what, name, obj, options, lines):
        if what not in ("attribute", "property", "data"):
            _process_docstring(app, what, name, obj, options, lines)
    app.connect("autodoc-process-docstring", sections)


def setup(app):
    app.connect("builder-inited", _generate)
    _numpy_sections_only(app)
