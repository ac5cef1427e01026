"""The pages tested as code: every fenced code block of README.md, docs/ and
the pages docs/ includes (benchmarks/README.md, slurm/README.md), read with
Sybil's Markdown parser (a well-kept doc-testing library whose evaluators
are ours: its own Python evaluator runs a block in this process, and ours
must run under ``mpiexec``).

* A ``python`` block is written to ``example.py`` and run as its first line
  says, ``# mpiexec -n N --oversubscribe python example.py`` (without such a
  line: ``python example.py``), with a time limit.
* A ``bash`` block runs as written, in a scratch directory (the checkout's
  folders linked into it), with this environment's ``mpiexec`` and
  ``python`` first on ``PATH`` and a time limit.
* Before any block runs, each of its command lines is checked: the package's
  own parser accepts ``python -m mpi_allreduce ...``; a benchmark script's
  ``--help`` names each option given; ``mpiexec -n N`` above 2 ranks carries
  ``--oversubscribe`` (on a 2-core laptop Open MPI has no slots for more);
  ``pip install -e '.[x]'`` names extras pyproject.toml has; a script or
  file named exists.
* A block that cannot run here (installs, a cluster's ``module load`` or
  ``sbatch``, minutes of measurement) carries, on the line before it,
  ``<!-- page-test: not run: REASON -->``: its command lines are still
  checked, and the test then skips with that reason.  Nothing is skipped
  without a reason: a ``python`` block that imports torch where torch is not
  installed skips saying so.
* Every other fence names what it holds (``text``, ``json``, a Sphinx
  directive): a block without a language fails, so a runnable block cannot
  pass unnoticed.
* Commands quoted inline (`` `python -m mpi_allreduce ...` ``,
  `` `mpiexec ...` ``) are checked the same way.

A failing block fails with its page and line in the test's name
(``test_block[README.md:67]``)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sybil = pytest.importorskip("sybil", reason="the page tests need Sybil: pip install -e '.[test]'")

from sybil.parsers.markdown import CodeBlockParser  # noqa: E402

from mpi_allreduce.launch import find_mpiexec, mpiexec_env, run  # noqa: E402

from .pages import PAGES, ROOT, name as _name, walk  # noqa: E402

#: fences that are run (or carry the reason they are not)
RUN = ("bash", "python")
#: fences that hold no command: output, drawings, files, Sphinx directives
NOT_RUN = ("text", "json", "{eval-rst}", "{include}", "{toctree}")
#: seconds one block may take
BLOCK_TIMEOUT = 300
#: ranks above which Open MPI wants --oversubscribe on a 2-core laptop
CORES = 2
DIRECTIVE = re.compile(r"<!-- page-test: not run: (.+?) -->\s*$")
WORLD = re.compile(r"#\s*mpiexec -n (\d+) --oversubscribe python example\.py\s*$")
#: the checkout's folders a bash block may name (linked into its directory)
LINKED = ("benchmarks", "slurm", "docs", "tests", "mpi_allreduce", "pyproject.toml")


def _blocks():
    parser = sybil.Sybil([CodeBlockParser(language) for language in RUN])
    for page in PAGES:
        for example in parser.parse(page).examples():
            yield pytest.param(page, example, id=f"{_name(page)}:{example.line}")


BLOCKS = list(_blocks())


# --- checking a command line ---------------------------------------------------

def _words(line: str) -> list:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def commands(source: str):
    """The simple commands of a shell block: [words], comments dropped,
    continuation lines joined, split at ``&&``, ``||``, ``;`` and ``|``,
    parentheses, redirections and leading ``NAME=value`` assignments left
    out."""
    for line in source.replace("\\\n", " ").splitlines():
        words: list = []
        redirect = False
        for word in _words(line) + ["&&"]:
            if redirect:
                redirect = False
            elif word in (">", ">>", "<", ">&"):  # (a redirection and its file)
                redirect = True
                if words and words[-1].isdigit():
                    words.pop()
            elif word in ("(", ")"):
                pass
            elif word in ("&&", "||", ";", "|", "&"):
                while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                    words.pop(0)
                if words:
                    yield words
                words = []
            else:
                words.append(word)


def _extras() -> set:
    from importlib.metadata import metadata

    return set(metadata("mpi_allreduce").get_all("Provides-Extra") or [])


def _program(words: list) -> list:
    """The program a launcher (``mpiexec``, ``srun``) starts: its words from
    the first ``python``/``python3`` on."""
    for k, word in enumerate(words):
        if word in ("python", "python3"):
            return words[k:]
    return []


def _check_launcher(words: list, problems: list) -> None:
    if words[0] in ("mpiexec", "mpirun"):
        for flag in ("-n", "-np"):
            if flag in words and words[words.index(flag) + 1].isdigit():
                ranks = int(words[words.index(flag) + 1])
                if ranks > CORES and "--oversubscribe" not in words:
                    problems.append(f"{' '.join(words[:4])}...: {ranks} ranks without "
                                    "--oversubscribe (Open MPI has no slots for them on a "
                                    f"{CORES}-core laptop)")
    program = _program(words)
    if program:
        _check_python(program, problems)


#: a refusal about this machine, not about the command: a file an earlier
#: step writes, a library an extra installs
ELSEWHERE = re.compile(r"cannot read .*: no such file|which is not installed")
#: a word that stands for what the user puts there (ALGORITHM, TRACE.json)
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(\.\w+)?|\[.*|[^\[]*\]|.*\$.*|\.\.\.")


def _parser_refusal(args: list):
    """What the package's own parser says of ``args`` (None: it accepts
    them, or refuses only for :data:`ELSEWHERE`)."""
    from mpi_allreduce.__main__ import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            why = err.getvalue().strip().splitlines()[-1] if exc.code else ""
            return None if ELSEWHERE.search(why) else why or None
    return None


@functools.lru_cache(maxsize=None)
def _help(script: Path) -> str:
    return subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT)).stdout


def _check_script(script: Path, args: list, problems: list) -> None:
    if not script.exists():
        problems.append(f"{script.relative_to(ROOT)} does not exist")
        return
    if script.suffix != ".py" or script.parent.name != "benchmarks":
        return
    help_text = _help(script)
    for word in args:
        option = word.split("=", 1)[0]
        if option.startswith("-") and not re.search(rf"(^|[\s,\[]){re.escape(option)}\b",
                                                    help_text):
            problems.append(f"{script.name} has no option {option} (its --help)")


def _check_python(words: list, problems: list) -> None:
    if len(words) > 2 and words[1] == "-m":
        module, args = words[2], words[3:]
        if module == "mpi_allreduce":
            why = _parser_refusal(args)
            if why:
                problems.append(f"python -m mpi_allreduce {' '.join(args)}: {why}")
        elif module.startswith("mpi_allreduce.") and importlib.util.find_spec(module) is None:
            problems.append(f"no module {module}")
    elif len(words) > 1 and words[1].endswith(".py") and words[1] != "example.py":
        _check_script(ROOT / words[1], words[2:], problems)


def check(words: list, problems: list) -> None:
    """Append to ``problems`` what is wrong with one command line."""
    if words[0] in ("mpiexec", "mpirun", "srun"):
        _check_launcher(words, problems)
    elif words[0] in ("python", "python3"):
        _check_python(words, problems)
    elif words[0] == "pip" and "-e" in words:
        target = words[words.index("-e") + 1]
        extras = set(filter(None, re.findall(r"\[(.*)\]", target)[0].split(","))) \
            if "[" in target else set()
        if extras - _extras():
            problems.append(f"pip install {target}: no extra {sorted(extras - _extras())} "
                            f"(pyproject.toml has {sorted(_extras())})")
    elif words[0] == "sbatch":
        script = next(w for w in words[1:] if not w.startswith("-"))
        if not (ROOT / script).exists():
            problems.append(f"sbatch {script}: no such script")


def problems_of(source: str) -> list:
    """What is wrong with the command lines of ``source`` (a pattern such as
    ``draw -a ALGORITHM -p P`` is not a command line: left out)."""
    problems: list = []
    for words in commands(source):
        if not any(PLACEHOLDER.fullmatch(word) for word in words):
            check(words, problems)
    return problems


# --- running a block ------------------------------------------------------------

def _reason(example) -> str | None:
    """The reason on the line before the block's fence, if it is not run."""
    before = example.document.text[:example.start].rstrip("\n").rsplit("\n", 1)[-1]
    m = DIRECTIVE.search(before)
    return m.group(1) if m else None


def _environment(timeout: float) -> dict:
    env = mpiexec_env(timeout)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run_bash(source: str, where: Path):
    for name in LINKED:
        (where / name).symlink_to(ROOT / name)
    return run(["bash", "-e", "-o", "pipefail", "-c", source], BLOCK_TIMEOUT,
               env=_environment(BLOCK_TIMEOUT), cwd=str(where))


def _run_python(source: str, where: Path):
    missing = sorted({name for name in re.findall(r"^\s*(?:import|from) (\w+)", source, re.M)
                      if importlib.util.find_spec(name) is None})
    if missing:
        pytest.skip(f"the block needs {', '.join(missing)}, not installed here (torch: "
                    "pip install -e '.[torch]'; the frameworks: pip install lightning "
                    "accelerate)")
    (where / "example.py").write_text(source)
    first = source.splitlines()[0]
    m = WORLD.match(first)
    if m is None:
        return run([sys.executable, "example.py"], BLOCK_TIMEOUT, env=_environment(BLOCK_TIMEOUT),
                   cwd=str(where))
    if find_mpiexec() is None:
        pytest.skip("no mpiexec: pip install -e '.[mpi]'")
    return run(["mpiexec", "-n", m.group(1), "--oversubscribe", sys.executable, "example.py"],
               BLOCK_TIMEOUT, env=_environment(BLOCK_TIMEOUT), cwd=str(where))


@pytest.mark.parametrize("page,example", BLOCKS)
def test_block(page, example, tmp_path):
    """Each block's command lines pass the checks above; then it runs (or
    skips with the reason its page gives) and exits 0."""
    language = example.region.lexemes["arguments"]
    source = example.parsed
    problems = problems_of(source if language == "bash" else
                           "\n".join(line.lstrip("# ") for line in source.splitlines()[:1]))
    assert not problems, f"{_name(page)}:{example.line}: " + "; ".join(problems)
    reason = _reason(example)
    if reason:
        pytest.skip(f"command lines checked; not run here: {reason}")
    result = (_run_bash if language == "bash" else _run_python)(source, tmp_path)
    assert result.returncode == 0, (f"{_name(page)}:{example.line} exited "
                                    f"{result.returncode}:\n{result.stdout[-3000:]}")


# --- every fence, and the commands quoted in prose -------------------------------

def _fences(page: Path):
    """(line, language) of each fence that opens a block."""
    return [(number, language) for number, _, language in walk(page) if language is not None]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_fence_says_what_it_holds(page):
    unnamed = [f"{_name(page)}:{n}: ```{language}" for n, language in _fences(page)
               if language not in RUN + NOT_RUN]
    assert not unnamed, ("fences without a language this test knows (run: "
                         f"{', '.join(RUN)}; not commands: {', '.join(NOT_RUN)}): {unnamed}")


INLINE = re.compile(r"`((?:mpiexec|mpirun|srun|python3?) [^`]+)`")


def _inline(page: Path):
    """(line, command) of each command quoted inline outside fences."""
    for number, line, language in walk(page):
        if language is None:
            for m in INLINE.finditer(line):
                yield number, m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_commands_quoted_in_the_text_are_accepted(page):
    problems = []
    for number, command in _inline(page):
        problems += [f"{_name(page)}:{number}: {p}" for p in problems_of(command)]
    assert not problems, "\n".join(problems)


def test_the_readme_lists_the_main_jobs_own_commands():
    """"You can type them yourself": the README's block is what the demo runs."""
    from mpi_allreduce.demo import typed

    readme = (ROOT / "README.md").read_text()
    block = readme.split("you can type them yourself:", 1)[1].split("```bash\n", 1)[1]
    assert block.split("```", 1)[0].strip().splitlines() == typed()


@pytest.mark.parametrize("line,problem", [
    ("mpiexec -n 4 python -m mpi_allreduce verify", "without --oversubscribe"),
    ("python -m mpi_allreduce bench --bogus 1", "unrecognized arguments: --bogus"),
    ("X=1 mpiexec -n 2 python -m mpi_allreduce draw -a nope -p 4", "unknown algorithm 'nope'"),
    ("pip install -e '.[mpi,gpus]'", "no extra ['gpus']"),
    ("python benchmarks/floor.py --bogus 3 > out.txt", "floor.py has no option --bogus"),
    ("(echo a; python benchmarks/nothing.py) > x", "benchmarks/nothing.py does not exist"),
    ("sbatch --nodes=2 slurm/nothing.sbatch", "no such script"),
], ids=["oversubscribe", "option", "algorithm", "extra", "script-option", "script", "sbatch"])
def test_the_checks_catch_a_drifted_command(line, problem):
    assert any(problem in p for p in problems_of(line)), problems_of(line)


def test_a_pattern_or_a_missing_input_file_is_not_a_drift():
    assert problems_of("python -m mpi_allreduce draw -a ALGORITHM -p P [--count N]") == []
    assert problems_of("python -m mpi_allreduce report nowhere/trace.json -o r.png") == []
