"""The command line refuses a bad argument as argparse does: a usage line
and one ``error:`` line naming the option, exit status 2, no traceback and
no abort of the job, and nothing measured or written first (``tune`` with
an output it cannot write stops before its first timing).  Every command
runs as its own process, without mpiexec (MPI starts as a singleton).
Also: every option of every command checks its value by its type (an
option added without one fails here), and good arguments still run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_allreduce.__main__ import build_parser, main, parse_args

ROOT = Path(__file__).resolve().parent.parent

#: (label, arguments, the option the error line names); in the arguments,
#: {tmp} is an empty directory, {file} a regular file that is neither a
#: trace, a table nor a model (so {file}/x is a path nothing can write)
BAD = [
    # simulate
    ("simulate -p 0", ["simulate", "-p", "0"], "-p/--size"),
    ("simulate -p above the most", ["simulate", "-p", "65537"], "-p/--size"),
    ("simulate -p not a number", ["simulate", "-p", "four"], "-p/--size"),
    ("simulate --count negative", ["simulate", "--count", "-5"], "--count"),
    ("simulate --count fraction", ["simulate", "--count", "1.5"], "--count"),
    ("simulate -a unknown", ["simulate", "-a", "rung"], "-a/--algorithms"),
    ("simulate -a auto", ["simulate", "-a", "auto"], "-a/--algorithms"),
    ("simulate -a empty list", ["simulate", "-a", ","], "-a/--algorithms"),
    ("simulate -a all and more", ["simulate", "-a", "all,ring"], "-a/--algorithms"),
    ("simulate -d unknown", ["simulate", "-d", "float33"], "-d/--dtype"),
    ("simulate -o unknown", ["simulate", "-o", "average"], "-o/--op"),
    ("simulate -d with an op it lacks", ["simulate", "-d", "float32", "-o", "band"],
     "-d/--dtype"),
    ("simulate --params missing", ["simulate", "--params", "{tmp}/missing.json"], "--params"),
    ("simulate --params not a model", ["simulate", "--params", "{file}"], "--params"),
    ("simulate --predict without --params", ["simulate", "--predict"], "--predict"),
    ("simulate --ranks zero", ["simulate", "--ranks", "2,0"], "--ranks"),
    ("simulate --ranks not numbers", ["simulate", "--ranks", "2,many"], "--ranks"),
    ("simulate -b unknown suffix", ["simulate", "-b", "1T"], "-b/--minbytes"),
    ("simulate -e zero", ["simulate", "-e", "0"], "-e/--maxbytes"),
    ("simulate -f one", ["simulate", "-f", "1"], "-f/--stepfactor"),
    ("simulate -b above -e", ["simulate", "-b", "1M", "-e", "1K"], "-b/--minbytes"),
    ("simulate --png under a file", ["simulate", "--png", "{file}/p.png"], "--png"),
    ("simulate --png not a picture", ["simulate", "--png", "{tmp}/p.txt"], "--png"),
    ("simulate --png without --predict", ["simulate", "--png", "{tmp}/p.png"], "--png"),
    ("simulate --json under a file", ["simulate", "--json", "{file}/p.json"], "--json"),
    ("simulate --trace under a file", ["simulate", "-a", "ring", "--trace", "{file}/t.json"],
     "--trace"),
    ("simulate --trace of all", ["simulate", "--trace", "{tmp}/t.json"], "--trace"),
    ("simulate --ranks-per-node 0", ["simulate", "--ranks-per-node", "0"], "--ranks-per-node"),
    ("simulate --inner hierarchical", ["simulate", "--inner", "hierarchical"], "--inner"),
    ("simulate --segment-bytes 0", ["simulate", "--segment-bytes", "0"], "--segment-bytes"),
    # bench
    ("bench -b 1T", ["bench", "-b", "1T"], "-b/--minbytes"),
    ("bench -b negative", ["bench", "-b", "-8"], "-b/--minbytes"),
    ("bench -e above 64G", ["bench", "-e", "65G"], "-e/--maxbytes"),
    ("bench -e not a size", ["bench", "-e", "lots"], "-e/--maxbytes"),
    ("bench -b above -e", ["bench", "-b", "64M", "-e", "8"], "-b/--minbytes"),
    ("bench -m reversed", ["bench", "-m", "64M:8"], "-m/--message-sizes"),
    ("bench -m not sizes", ["bench", "-m", "8:many"], "-m/--message-sizes"),
    ("bench -f below one", ["bench", "-f", "0.5"], "-f/--stepfactor"),
    ("bench -f nan", ["bench", "-f", "nan"], "-f/--stepfactor"),
    ("bench -f too many sizes", ["bench", "-f", "1.0001"], "-f/--stepfactor"),
    ("bench -n 0", ["bench", "-n", "0"], "-n/--iters"),
    ("bench -w negative", ["bench", "-w", "-1"], "-w/--warmup"),
    ("bench -r 0", ["bench", "-r", "0"], "-r/--repeats"),
    ("bench -d unknown", ["bench", "-d", "float33"], "-d/--dtype"),
    ("bench -o unknown", ["bench", "-o", "average"], "-o/--op"),
    ("bench -d with an op it lacks", ["bench", "-d", "float64", "-o", "bxor"], "-d/--dtype"),
    ("bench -a unknown", ["bench", "-a", "ring,rung"], "-a/--algorithms"),
    ("bench -i unknown", ["bench", "-i", "maybe"], "-i/--inplace"),
    ("bench --device unknown", ["bench", "--device", "tpu"], "--device"),
    ("bench --json under a file", ["bench", "--json", "{file}/b.json"], "--json"),
    ("bench --json a directory", ["bench", "--json", "{tmp}"], "--json"),
    ("bench --csv under a file", ["bench", "--csv", "{file}/b.csv"], "--csv"),
    ("bench --json and --csv one file",
     ["bench", "--json", "{tmp}/b.out", "--csv", "{tmp}/b.out"], "--json"),
    ("bench --trace under a file", ["bench", "--trace", "{file}/trace"], "--trace"),
    ("bench --ranks-per-node negative", ["bench", "--ranks-per-node", "-2"],
     "--ranks-per-node"),
    ("bench --segment-bytes above 1T", ["bench", "--segment-bytes", "2048G"],
     "--segment-bytes"),
    # verify
    ("verify --counts -3", ["verify", "--counts", "-3"], "--counts"),
    ("verify --counts empty", ["verify", "--counts", ","], "--counts"),
    ("verify --counts not numbers", ["verify", "--counts", "1,two"], "--counts"),
    ("verify -a unknown", ["verify", "-a", "rung"], "-a/--algorithms"),
    ("verify -d unknown", ["verify", "-d", "int32,float33"], "-d/--dtypes"),
    ("verify -o unknown", ["verify", "-o", "sum,average"], "-o/--ops"),
    ("verify --seed negative", ["verify", "--seed", "-1"], "--seed"),
    ("verify --trace under a file", ["verify", "--trace", "{file}/trace"], "--trace"),
    ("verify --inner unknown", ["verify", "--inner", "rung"], "--inner"),
    ("verify --segment-bytes unknown suffix", ["verify", "--segment-bytes", "1Q"],
     "--segment-bytes"),
    # draw
    ("draw -p 0", ["draw", "-a", "ring", "-p", "0"], "-p/--size"),
    ("draw -p above the most", ["draw", "-a", "ring", "-p", "5000"], "-p/--size"),
    ("draw without -a", ["draw", "-p", "4"], "-a/--algorithm"),
    ("draw -a auto", ["draw", "-a", "auto", "-p", "4"], "-a/--algorithm"),
    ("draw --count negative", ["draw", "-a", "ring", "-p", "4", "--count", "-1"], "--count"),
    ("draw --segment 0", ["draw", "-a", "ring", "-p", "4", "--segment", "0"], "--segment"),
    ("draw --ranks-per-node 0", ["draw", "-a", "hierarchical", "-p", "4",
                                 "--ranks-per-node", "0"], "--ranks-per-node"),
    ("draw --inner unknown", ["draw", "-a", "hierarchical", "-p", "4", "--inner", "x"],
     "--inner"),
    ("draw -o not a drawing", ["draw", "-a", "ring", "-p", "4", "-o", "{tmp}/r.txt"],
     "-o/--output"),
    ("draw -o under a file", ["draw", "-a", "ring", "-p", "4", "-o", "{file}/r.png"],
     "-o/--output"),
    # trace, report, plot
    ("trace input missing", ["trace", "{tmp}/missing"], "inputs"),
    ("trace -o under a file", ["trace", "{tmp}", "-o", "{file}/t.json"], "-o/--output"),
    ("report trace missing", ["report", "{tmp}/missing.json"], "trace"),
    ("report trace a directory", ["report", "{tmp}"], "trace"),
    ("report -o under a file", ["report", "{file}", "-o", "{file}/r.png"], "-o/--output"),
    ("report -o not a picture", ["report", "{file}", "-o", "{tmp}/r.json"], "-o/--output"),
    ("report --against missing", ["report", "{file}", "--against", "{tmp}/missing.json"],
     "--against"),
    ("plot input missing", ["plot", "{tmp}/missing.json"], "inputs"),
    ("plot -o under a file", ["plot", "{file}", "-o", "{file}/b.png"], "-o/--output"),
    # model
    ("model -n 0", ["model", "-n", "0"], "-n/--iters"),
    ("model -r negative", ["model", "-r", "-3"], "-r/--repeats"),
    ("model -b 1T", ["model", "-b", "1T"], "-b/--minbytes"),
    ("model -f 1", ["model", "-f", "1"], "-f/--stepfactor"),
    ("model -b above -e", ["model", "-b", "1G", "-e", "1M"], "-b/--minbytes"),
    ("model --json under a file", ["model", "--json", "{file}/m.json"], "--json"),
    # tune
    ("tune -o under a file", ["tune", "-o", "{file}/tuning.json"], "-o/--output"),
    ("tune -o a directory", ["tune", "-o", "{tmp}"], "-o/--output"),
    ("tune --merge into what is no table", ["tune", "-o", "{file}", "--merge"], "-o/--output"),
    ("tune -n 0", ["tune", "-n", "0"], "-n/--iters"),
    ("tune -r 0", ["tune", "-r", "0"], "-r/--repeats"),
    ("tune -e unknown suffix", ["tune", "-e", "64Mi"], "-e/--maxbytes"),
    ("tune -f 1", ["tune", "-f", "1"], "-f/--stepfactor"),
    # info, and no command
    ("info --device unknown", ["info", "--device", "tpu"], "--device"),
    ("unknown command", ["frobnicate"], "command"),
]


#: (label, arguments) that parse: the documentation's command lines and
#: more; {params} is a `model --json` file
GOOD = [
    ("bench as the results were made",
     ["bench", "-b", "8", "-e", "16M", "-f", "2", "-n", "300", "-w", "10", "-r", "21",
      "--quiet", "--json", "{tmp}/bench-np2.json", "-c", "--memory"]),
    ("bench of the vendor alone", ["bench", "-a", "mpi", "--label-vendor", "mpi:ring"]),
    ("bench with a size range", ["bench", "-m", "8:64M", "-i", "both", "--csv", "{tmp}/b.csv",
                                 "--trace", "{tmp}/new/trace", "--segment-bytes", "256K"]),
    ("verify on a GPU", ["verify", "--device", "cuda", "--no-large"]),
    ("verify of lists", ["verify", "-a", "ring,hierarchical", "-d",
                         "int32,float16,float32,complex64,bool", "--counts", "0,1,5,8,97"]),
    ("simulate hierarchical", ["simulate", "-p", "1024", "--ranks-per-node", "16",
                               "--inner", "rabenseifner"]),
    ("simulate --trace", ["simulate", "-a", "ring", "-p", "4", "--count", "16384",
                          "--params", "{params}", "--trace", "{tmp}/new/predicted.json"]),
    ("simulate --predict", ["simulate", "--predict", "--params", "{params}",
                            "--ranks-per-node", "16", "--ranks", "2,16,64,65536", "-b", "8",
                            "-e", "256M", "-f", "8", "--png", "{tmp}/scale.png",
                            "--json", "{tmp}/scale.json"]),
    ("draw a GIF", ["draw", "-a", "recursive_doubling", "-p", "8", "-o", "{tmp}/rd.gif"]),
    ("trace of a directory", ["trace", "{tmp}"]),
    ("report against another", ["report", "{file}", "-o", "{tmp}/r.png", "--against",
                                "{file}"]),
    ("plot", ["plot", "{file}", "{file}", "-o", "{tmp}/b.svg", "--title", "two runs"]),
    ("model", ["model", "-n", "100", "--json", "{tmp}/model-np2-1.json", "--two-level"]),
    ("tune merged", ["tune", "-o", "{tmp}/tuning.json", "--merge", "-b", "8", "-e", "16M",
                     "-f", "4", "-n", "300", "-r", "9"]),
    ("tune where auto finds it", ["tune"]),
    ("info", ["info", "--settings"]),
]


@pytest.fixture
def places(tmp_path):
    """{tmp}, {file} and {params} of :data:`BAD` and :data:`GOOD`."""
    from mpi_allreduce.simulate import Machine

    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("neither a trace nor a decision table\n")
    params = tmp_path / "model.json"
    params.write_text(json.dumps({"params": Machine(alpha=2e-6, beta=1e-9,
                                                    gamma=5e-10).parameters()}))
    return {"tmp": str(empty), "file": str(plain), "params": str(params)}


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpi_allreduce"] + args, capture_output=True,
                          text=True, timeout=60, cwd=str(ROOT), **kwargs)


@pytest.mark.parametrize("args, option", [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_a_bad_argument_is_a_usage_error(args, option, places, capsys):
    """In this process (``main`` as ``python -m mpi_allreduce`` runs it):
    SystemExit(2) with one error line naming the option, nothing printed
    on stdout (nothing run, measured or written)."""
    with pytest.raises(SystemExit) as refused:
        main([a.format(**places) for a in args])
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith("python -m mpi_allreduce") and option in errors[0], errors[0]
    assert err.rstrip().endswith(errors[0]), err
    assert out == "", out


#: one bad command line per command, run as its own process: the same
#: error, exit status 2, and no traceback or abort of the job
AS_PROCESSES = ["simulate -p 0", "bench -b 1T", "verify --counts -3",
                "tune -o under a file", "draw -p 0"]


@pytest.mark.parametrize("label", AS_PROCESSES)
def test_a_bad_argument_ends_the_process_cleanly(label, places):
    (args, option), = [case[1:] for case in BAD if case[0] == label]
    result = run([a.format(**places) for a in args])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and option in errors[0], result.stderr
    assert "Traceback" not in output and "abort" not in output.lower(), output
    assert result.stdout == "", result.stdout


def test_the_table_covers_every_command():
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) <= {case[1][0] for case in BAD}


#: options that take free text: a label, a title
FREE_TEXT = {"label_vendor", "title"}


def test_every_option_checks_its_value_by_its_type():
    """An option that takes a value has a type (or choices): a new option
    gets its check by choosing one, and is refused here without."""
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    untyped = []
    for name, parser in commands.items():
        for action in parser._actions:
            takes_value = action.nargs != 0 and not isinstance(action, argparse._HelpAction)
            if takes_value and action.type is None and action.choices is None \
                    and action.dest not in FREE_TEXT:
                untyped.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not untyped, untyped


def test_tune_stops_before_measuring_when_it_cannot_write(places):
    """With -o under a regular file (which not even root can write) and
    with the default file under one: refused at once, nothing timed."""
    result = run(["tune", "-o", places["file"] + "/tuning.json", "-b", "8", "-e", "64",
                  "-n", "1", "-r", "1"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "-o/--output" in result.stderr and "is not a directory" in result.stderr
    assert "comm size" not in result.stdout and "wrote" not in result.stdout
    # no -o: the file auto finds, under MPI_ALLREDUCE_TUNING_DIR (a setting, not an argument)
    import os

    env = dict(os.environ, MPI_ALLREDUCE_TUNING_DIR=places["file"] + "/cache")
    result = run(["tune", "-b", "8", "-e", "64", "-n", "1", "-r", "1"], env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "tune: cannot write" in result.stderr and "Traceback" not in result.stderr
    assert "comm size" not in result.stdout and "wrote" not in result.stdout


def test_main_in_process_raises_the_error_line():
    """Called in the same process, ``main`` raises SystemExit(2) whose text
    is the error line (the tests of other commands match on it)."""
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "-p", "0"])
    assert refused.value.code == 2
    assert "-p/--size" in str(refused.value) and "got '0'" in str(refused.value)


@pytest.mark.parametrize("args", [case[1] for case in GOOD], ids=[case[0] for case in GOOD])
def test_good_arguments_parse(args, places):
    """Parsed and checked, and nothing written yet (no file, no directory)."""
    parsed = parse_args([a.format(**places) for a in args])
    assert parsed.command == args[0]
    assert not list(Path(places["tmp"]).iterdir())


def test_parsed_values():
    args = parse_args(["bench", "-m", "8:64K", "-f", "4", "-a", "ring,auto,ring", "-d", "f4",
                       "-o", "MAX", "--segment-bytes", "256K", "--ranks-per-node", "2", "-c"])
    assert args.message_sizes == (8, 64 << 10) and args.stepfactor == 4.0
    assert args.check is True and args.minbytes == 8 and args.maxbytes == 64 << 20
    assert args.algorithms == ["ring", "auto"]  # each once
    assert (args.dtype, args.op, args.segment_bytes, args.ranks_per_node) == \
        ("float32", "max", 256 << 10, 2)
    args = parse_args(["tune", "-b", "1.5K", "-e", "16MB"])
    assert (args.minbytes, args.maxbytes, args.output) == (1536, 16 << 20, None)
    args = parse_args(["verify", "--counts", "0,7,7,1000", "-d", "int32,bool", "-o", "sum"])
    assert (args.counts, args.dtypes, args.ops) == ([0, 7, 1000], ["int32", "bool"], ["sum"])


def test_good_arguments_run():
    result = run(["simulate", "-a", "ring", "-p", "4", "--count", "16"])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [row[:2] for row in rows[1:]] == [["ring", "0"]]  # one row, nothing wrong
    result = run(["simulate", "-a", "ring,tree,ring", "-p", "3", "--count", "5", "-d", "i4",
                  "-o", "max", "--segment-bytes", "8"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "p=3, count=5, int32 max, segment 2 elements" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [row[:2] for row in rows[1:]] == [["ring", "0"], ["tree", "0"]]
