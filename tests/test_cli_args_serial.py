"""The command line refuses a bad argument as argparse does: a usage line
and one ``error:`` line naming the option, exit status 2, no traceback and
no abort of the job, and nothing measured or written first (``tune`` with
an output it cannot write stops before its first timing).  So too a file
whose fault only reading it shows (a trace without its events' fields),
and a bad ``MPI_ALLREDUCE_*`` setting (the line names the variable).
Every command runs as its own process, without mpiexec (MPI starts as a
singleton).  Also: every option of every command checks its value by its
type (an option added without one fails here), and good arguments still
run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mpi_allreduce.__main__ import build_parser, main, parse_args

ROOT = Path(__file__).resolve().parent.parent

#: cupy installed here: ``--device cuda`` is then a good argument
CUPY = importlib.util.find_spec("cupy") is not None

#: (label, arguments, the option the error line names[, what it says of
#: the problem]); in the arguments, {tmp} is an empty directory, {file} a
#: regular file that is neither a trace, a table nor a model (so {file}/x
#: is a path nothing can write), {json} a JSON object of none of them,
#: {trace} a trace, {traces} a directory of one rank's trace file, {junk}
#: a directory of a rank file whose event lacks its fields, {bench} a
#: ``bench --json`` file, {socket} a file that is not a regular one
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
    ("simulate --radix 1", ["simulate", "--radix", "1"], "--radix"),
    ("simulate --row-size 0", ["simulate", "--row-size", "0"], "--row-size"),
    ("simulate --row-size not dividing -p", ["simulate", "-p", "12", "-a", "torus",
                                             "--row-size", "5"], "--row-size"),
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
    ("bench --label-vendor empty", ["bench", "--label-vendor", ""], "--label-vendor"),
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
    ("verify --counts an empty item", ["verify", "--counts", "1,,2"], "--counts"),
    ("verify -a unknown", ["verify", "-a", "rung"], "-a/--algorithms"),
    ("verify -d unknown", ["verify", "-d", "int32,float33"], "-d/--dtypes"),
    ("verify -o unknown", ["verify", "-o", "sum,average"], "-o/--ops"),
    ("verify --seed negative", ["verify", "--seed", "-1"], "--seed"),
    ("verify --trace under a file", ["verify", "--trace", "{file}/trace"], "--trace"),
    ("verify --inner unknown", ["verify", "--inner", "rung"], "--inner"),
    ("verify --radix not a number", ["verify", "--radix", "four"], "--radix"),
    ("verify --row-size not dividing the ranks", ["verify", "-a", "torus", "--row-size", "2"],
     "--row-size"),
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
    ("draw --radix 0", ["draw", "-a", "knomial", "-p", "9", "--radix", "0"], "--radix"),
    ("draw --row-size not dividing -p", ["draw", "-a", "torus", "-p", "6", "--row-size", "4"],
     "--row-size"),
    # an option of algorithms none of those run takes (it would be ignored)
    ("simulate --row-size of no torus", ["simulate", "-p", "7", "-a", "ring", "--row-size", "2"],
     "--row-size"),
    ("bench --inner of no hierarchical", ["bench", "-a", "ring,auto", "--inner", "ring"],
     "--inner"),
    ("verify --radix of no radix-k", ["verify", "-a", "ring", "--radix", "3"], "--radix"),
    ("draw --ranks-per-node of no hierarchical", ["draw", "-a", "ring", "-p", "4",
                                                  "--ranks-per-node", "2"], "--ranks-per-node"),
    ("verify -d and -o of no pair", ["verify", "-d", "float64,float32", "-o", "band,bor"],
     "-d/--dtypes"),
    ("draw -o not a drawing", ["draw", "-a", "ring", "-p", "4", "-o", "{tmp}/r.txt"],
     "-o/--output"),
    ("draw -o under a file", ["draw", "-a", "ring", "-p", "4", "-o", "{file}/r.png"],
     "-o/--output"),
    # trace, report, plot
    ("trace input missing", ["trace", "{tmp}/missing"], "inputs"),
    ("trace -o under a file", ["trace", "{traces}", "-o", "{file}/t.json"], "-o/--output"),
    ("report trace missing", ["report", "{tmp}/missing.json"], "trace"),
    ("report trace a directory", ["report", "{tmp}"], "trace"),
    ("report -o under a file", ["report", "{trace}", "-o", "{file}/r.png"], "-o/--output"),
    ("report -o not a picture", ["report", "{trace}", "-o", "{tmp}/r.json"], "-o/--output"),
    ("report --against missing", ["report", "{trace}", "--against", "{tmp}/missing.json"],
     "--against"),
    ("plot input missing", ["plot", "{tmp}/missing.json"], "inputs"),
    ("plot -o under a file", ["plot", "{bench}", "-o", "{file}/b.png"], "-o/--output"),
    # model
    ("model -n 0", ["model", "-n", "0"], "-n/--iters"),
    # (these tests run on one rank: the fit needs two, which the command says at once)
    ("model on one rank", ["model"], "model", "at least 2 ranks"),
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
    # integers of counts, iterations and repeats within a sane range
    ("bench -n above the most", ["bench", "-b", "8", "-e", "8", "-n", "99999999999999999999",
                                 "-a", "ring"], "-n/--iters", "at most 1000000"),
    ("bench -w above the most", ["bench", "-w", "1000001"], "-w/--warmup", "at most"),
    ("bench -r above the most", ["bench", "-r", "100000"], "-r/--repeats", "at most 1000"),
    ("bench -n times -r above the most", ["bench", "-n", "100000", "-r", "101"],
     "-n/--iters", "timed calls"),
    ("model -n above the most", ["model", "-n", "10000000"], "-n/--iters", "at most"),
    ("model -r above the most", ["model", "-r", "1001"], "-r/--repeats", "at most"),
    ("tune -n above the most", ["tune", "-n", "99999999999999999999"], "-n/--iters", "at most"),
    ("tune -r above the most", ["tune", "-r", "5000"], "-r/--repeats", "at most"),
    ("tune -n times -r above the most", ["tune", "-n", "1000000", "-r", "11"], "-n/--iters",
     "timed calls"),
    ("verify --counts at the old most", ["verify", "--counts", "68719476736"], "--counts",
     "at most 16777216"),
    ("verify --counts one above the most", ["verify", "--counts", "0,16777217"], "--counts",
     "at most"),
    ("verify --seed above the most", ["verify", "--seed", str(1 << 64)], "--seed", "at most"),
    ("simulate more than memory holds", ["simulate", "-a", "ring", "-p", "1024", "--count",
                                         "68719476736"], "--count", "GB is available"),
    ("draw --segment above the most", ["draw", "-a", "ring", "-p", "4", "--segment",
                                       "99999999999999999999"], "--segment", "at most"),
    ("draw --ranks-per-node above the most", ["draw", "-a", "hierarchical", "-p", "4",
                                              "--ranks-per-node", "5000"], "--ranks-per-node",
     "at most"),
    # files that are not what the command reads
    ("plot not JSON", ["plot", "{file}"], "inputs", "not JSON"),
    ("plot JSON of no bench", ["plot", "{json}"], "inputs", "not a `bench --json` file"),
    ("plot bench without its fields", ["plot", "{bench}", "{badbench}"], "inputs",
     "has no 'time_avg_us'"),
    ("plot a device", ["plot", "{socket}"], "inputs", "not a regular file"),
    ("trace of an empty directory", ["trace", "{tmp}"], "inputs", "no rank-*.json"),
    ("trace of junk files", ["trace", "{junktext}"], "inputs", "not JSON"),
    ("trace of events without their fields", ["trace", "{junk}"], "inputs",
     "an event without"),
    ("report of no trace", ["report", "{file}"], "trace", "not a trace"),
    ("report of JSON of no trace", ["report", "{json}"], "trace", "no 'traceEvents'"),
    ("report --against no trace", ["report", "{trace}", "--against", "{json}"], "--against",
     "no 'traceEvents'"),
    # outputs that cannot be written, or must not be replaced
    ("verify --trace under /proc", ["verify", "--trace", "/proc/x"], "--trace",
     "cannot make a file in /proc"),
    ("bench --trace under /proc", ["bench", "--trace", "/proc/x/y"], "--trace",
     "cannot make a file in /proc"),
    ("simulate --trace a socket", ["simulate", "-a", "ring", "-p", "4", "--trace", "{socket}"],
     "--trace", "not a regular file"),
    ("trace -o a socket", ["trace", "{traces}", "-o", "{socket}"], "-o/--output",
     "not a regular file"),
    ("draw -o a socket", ["draw", "-a", "ring", "-p", "4", "-o", "{socket}.png"],
     "-o/--output", "not a regular file"),
    ("tune -o a socket", ["tune", "-o", "{socket}"], "-o/--output", "not a regular file"),
    ("bench --json a socket", ["bench", "--json", "{socket}"], "--json", "not a regular file"),
    ("bench --csv a socket", ["bench", "--csv", "{socket}"], "--csv", "not a regular file"),
    ("model --json a socket", ["model", "--json", "{socket}"], "--json", "not a regular file"),
    ("simulate --png a socket", ["simulate", "--predict", "--params", "{params}", "--png",
                                 "{socket}.png"], "--png", "not a regular file"),
    ("report -o a socket", ["report", "{trace}", "-o", "{socket}.png"], "-o/--output",
     "not a regular file"),
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
    ("verify of lists", ["verify", "-a", "ring,hierarchical", "-d",
                         "int32,float16,float32,complex64,bool", "--counts", "0,1,5,8,97"]),
    ("simulate hierarchical", ["simulate", "-p", "1024", "--ranks-per-node", "16",
                               "--inner", "rabenseifner"]),
    ("simulate radix and rows", ["simulate", "-p", "12", "-a", "knomial,torus,ring",
                                 "--radix", "3", "--row-size", "4"]),
    ("verify the pair types' ops", ["verify", "-o", "maxloc,minloc"]),
    ("verify radix and rows", ["verify", "-a", "knomial,torus", "--radix", "5",
                               "--row-size", "1"]),
    ("draw the torus", ["draw", "-a", "torus", "-p", "6", "--row-size", "3", "-o",
                        "{tmp}/t.png"]),
    ("simulate --trace", ["simulate", "-a", "ring", "-p", "4", "--count", "16384",
                          "--params", "{params}", "--trace", "{tmp}/new/predicted.json"]),
    ("simulate --predict", ["simulate", "--predict", "--params", "{params}",
                            "--ranks-per-node", "16", "--ranks", "2,16,64,65536", "-b", "8",
                            "-e", "256M", "-f", "8", "--png", "{tmp}/scale.png",
                            "--json", "{tmp}/scale.json"]),
    ("draw a GIF", ["draw", "-a", "recursive_doubling", "-p", "8", "-o", "{tmp}/rd.gif"]),
    ("trace of a directory", ["trace", "{traces}"]),
    ("trace of a rank's file", ["trace", "{traces}/rank-0.json", "-o", "{tmp}/new/t.json"]),
    ("report against another", ["report", "{trace}", "-o", "{tmp}/r.png", "--against",
                                "{trace}"]),
    ("plot", ["plot", "{bench}", "{bench}", "-o", "{tmp}/b.svg", "--title", "two runs"]),
    ("model", ["model", "-n", "100", "--json", "{tmp}/model-np2-1.json", "--two-level"]),
    ("tune merged", ["tune", "-o", "{tmp}/tuning.json", "--merge", "-b", "8", "-e", "16M",
                     "-f", "4", "-n", "300", "-r", "9"]),
    ("tune where auto finds it", ["tune"]),
    ("info", ["info", "--settings"]),
]


@pytest.fixture
def places(tmp_path):
    """{tmp}, {file}, {params} and the other files of :data:`BAD` and :data:`GOOD`."""
    from mpi_allreduce.simulate import Machine
    from mpi_allreduce.tools.bench import Result, write_json
    from mpi_allreduce.tools.traces import simulated
    from mpi_allreduce.trace import write

    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("neither a trace nor a decision table\n")
    params = tmp_path / "model.json"
    params.write_text(json.dumps({"params": Machine(alpha=2e-6, beta=1e-9,
                                                    gamma=5e-10).parameters()}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"a": 1}))
    trace = tmp_path / "trace.json"
    write(str(trace), simulated("ring", 4, 16, "float32", Machine(alpha=1e-6), 16),
          {"ranks": [0, 1, 2, 3]})
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(trace, traces / "rank-0.json")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "rank-0.json").write_text('[\n{"name": "x", "ph": "X", "pid": 0}\n]\n')
    junktext = tmp_path / "junktext"
    junktext.mkdir()
    (junktext / "rank-0.json").write_text("junk\n")
    bench = tmp_path / "bench.json"
    write_json(str(bench), [Result(8, 2, "float32", "sum", "ring", False, 5.0, 4.0, 6.0,
                                   0.001, 0.001)],
               {"ranks": 2, "nodes": 1, "mpi_library": "an MPI"})
    badbench = tmp_path / "badbench.json"
    badbench.write_text(json.dumps({"meta": {"ranks": 2, "nodes": 1, "mpi_library": "x"},
                                    "results": [{"algorithm": "ring", "size": 8,
                                                 "in_place": False}]}))
    # a socket: not a regular file, and harmless where a check were missing (opening it
    # fails at once; a name short enough for a socket's address)
    short = tempfile.mkdtemp(prefix="cli")
    listeners = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    for listener, name in zip(listeners, ("s", "s.png")):
        listener.bind(os.path.join(short, name))
    yield {"tmp": str(empty), "file": str(plain), "params": str(params), "json": str(other),
           "trace": str(trace), "traces": str(traces), "junk": str(junk),
           "junktext": str(junktext), "bench": str(bench), "badbench": str(badbench),
           "socket": os.path.join(short, "s")}
    for listener in listeners:
        listener.close()
    shutil.rmtree(short, ignore_errors=True)


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpi_allreduce"] + args, capture_output=True,
                          text=True, timeout=60, cwd=str(ROOT), **kwargs)


def _case(label: str) -> tuple:
    """(arguments, option, problem or None) of :data:`BAD`'s case ``label``."""
    case, = [c for c in BAD if c[0] == label]
    return case[1], case[2], case[3] if len(case) > 3 else None


@pytest.mark.parametrize("label", [case[0] for case in BAD])
def test_a_bad_argument_is_a_usage_error(label, places, capsys):
    """In this process (``main`` as ``python -m mpi_allreduce`` runs it):
    SystemExit(2) with one error line naming the option (and the problem,
    where the table says it), no traceback, nothing printed on stdout
    (nothing run, measured or written)."""
    args, option, problem = _case(label)
    with pytest.raises(SystemExit) as refused:
        main([a.format(**places) for a in args])
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith("python -m mpi_allreduce") and option in errors[0], errors[0]
    assert problem is None or problem in errors[0], errors[0]
    assert err.rstrip().endswith(errors[0]) and "Traceback" not in err, err
    assert out == "", out


#: bad command lines run as their own processes (one per command, and every
#: kind of refusal): the same error, exit status 2, and no traceback or
#: abort of the job
AS_PROCESSES = ["simulate -p 0", "bench -b 1T", "model on one rank", "verify --counts -3",
                "tune -o under a file", "draw -p 0", "bench -n above the most",
                "verify --counts at the old most", "simulate more than memory holds",
                "plot not JSON", "plot JSON of no bench", "trace of junk files",
                "trace of events without their fields", "report of JSON of no trace",
                "verify --trace under /proc", "simulate --trace a socket",
                "bench --json a socket"]


@pytest.mark.parametrize("label", AS_PROCESSES)
def test_a_bad_argument_ends_the_process_cleanly(label, places):
    args, option, problem = _case(label)
    result = run([a.format(**places) for a in args])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and option in errors[0], result.stderr
    assert problem is None or problem in errors[0], errors[0]
    assert result.stderr.splitlines()[0].startswith("usage:"), result.stderr
    assert "Traceback" not in output and "abort" not in output.lower(), output
    assert result.stdout == "", result.stdout


def test_nothing_replaces_what_is_no_regular_file(places):
    """The sockets the refused outputs named are sockets still (a writer
    that renames a new file over its target would have made them files)."""
    import stat

    for args in (["simulate", "-a", "ring", "-p", "4", "--trace", "{socket}"],
                 ["trace", "{traces}", "-o", "{socket}"],
                 ["draw", "-a", "ring", "-p", "4", "-o", "{socket}.png"]):
        with pytest.raises(SystemExit) as refused:
            main([a.format(**places) for a in args])
        assert refused.value.code == 2
    for name in (places["socket"], places["socket"] + ".png"):
        assert stat.S_ISSOCK(os.stat(name).st_mode), name


@pytest.mark.skipif(CUPY, reason="cupy is installed here: --device cuda is a good argument")
@pytest.mark.parametrize("args", [["bench", "-b", "8", "-e", "8", "-a", "ring"],
                                  ["verify", "--no-large"], ["info"]],
                         ids=["bench", "verify", "info"])
@pytest.mark.parametrize("spelling", ["cuda", "CUDA"])
def test_cuda_without_cupy_is_a_usage_error(args, spelling, capsys):
    """--device cuda where cupy is not installed: refused by the parser,
    saying so (not a RuntimeError and an abort when the buffers are made)."""
    with pytest.raises(SystemExit) as refused:
        main(args + ["--device", spelling])
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--device" in errors[0], err
    assert "cupy, which is not installed" in errors[0] and "Traceback" not in err, err
    assert out == ""


@pytest.mark.skipif(CUPY, reason="cupy is installed here: --device cuda is a good argument")
@pytest.mark.parametrize("args", [["bench", "-b", "8", "-e", "8", "-a", "ring"],
                                  ["verify", "--no-large"], ["info"]],
                         ids=["bench", "verify", "info"])
def test_cuda_without_cupy_ends_the_process_cleanly(args):
    """The usage line and this one error line, exit status 2: no traceback,
    no abort (and so no Open MPI help text)."""
    result = run(args + ["--device", "cuda"])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert _error_lines(result.stderr) == [
        f"python -m mpi_allreduce {args[0]}: error: argument --device: 'cuda' needs cupy, "
        "which is not installed (pip install 'mpi_allreduce[gpu]'); or use --device cpu"], output
    assert "Traceback" not in output and "abort" not in output.lower(), output
    assert result.stdout == ""


@pytest.mark.skipif(not CUPY, reason="cupy is not installed here")
def test_cuda_parses_where_cupy_is_installed():
    assert parse_args(["verify", "--device", "cuda", "--no-large"]).device == "cuda"


def _error_lines(err: str) -> list:
    return [line for line in err.splitlines() if "error:" in line]


#: cupy installed but unusable, as a package put first on the path: (its
#: __init__.py, the reason the error line gives)
UNUSABLE_CUPY = {
    # cupy's own ImportError: a screen of advice, the cause after "Original error:"
    "does not import": (
        'raise ImportError("""\n' + "=" * 64 + '\nFailed to import CuPy.\n\n'
        'If you installed CuPy via wheels (cupy-cudaXXX or cupy-rocm-X-X), make sure that '
        'the package matches with the version of CUDA or ROCm installed.\n\n'
        'Original error:\n  ImportError: libcuda.so.1: cannot open shared object file: '
        'No such file or directory\n' + "=" * 64 + '\n""")\n',
        "cupy does not import: ImportError: libcuda.so.1: cannot open shared object file: "
        "No such file or directory"),
    # a machine without a GPU: cupy imports, CUDA finds no device
    "no GPU": (
        "import types\n\n\n"
        "class CUDARuntimeError(RuntimeError):\n    pass\n\n\n"
        "def getDeviceCount():\n"
        "    raise CUDARuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')\n"
        "\n\ncuda = types.SimpleNamespace(runtime=types.SimpleNamespace("
        "getDeviceCount=getDeviceCount))\n",
        "cupy finds no GPU: cudaErrorNoDevice: no CUDA-capable device is detected"),
}


@pytest.mark.parametrize("command", [["verify", "--no-large"], ["bench", "-e", "64"],
                                     ["info"]], ids=["verify", "bench", "info"])
@pytest.mark.parametrize("kind", list(UNUSABLE_CUPY))
def test_cuda_with_an_unusable_cupy_ends_the_process_cleanly(kind, command, tmp_path):
    """cupy installed, but not importing or finding no GPU: past the parser
    (which only looks cupy up), the command refuses --device as a usage
    error all the same: one error line saying why, exit status 2, no
    traceback and no abort."""
    source, reason = UNUSABLE_CUPY[kind]
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = run(command + ["--device", "cuda"], env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert _error_lines(result.stderr) == [
        f"python -m mpi_allreduce {command[0]}: error: --device: 'cuda' cannot be used here: "
        f"{reason}; or use --device cpu"], output
    assert "Traceback" not in output and "abort" not in output.lower(), output
    assert result.stdout == ""


class _OtherRankLacksAGPU:
    """The world as rank 0 of 2 sees it, where rank 1 finds no GPU (the
    only message :func:`backend.select_device` sends before refusing is
    this agreement, on the library's context of the world)."""

    def Get_size(self):  # noqa: N802 - mpi4py's names
        return 2

    def Get_rank(self):  # noqa: N802
        return 0

    def allgather_object(self, value, purpose, what):
        return [value, "cupy finds no GPU: cudaErrorNoDevice: no CUDA-capable device is detected"]


@pytest.mark.parametrize("command", [["verify", "--no-large"], ["bench", "-e", "64"],
                                     ["info"]], ids=["verify", "bench", "info"])
def test_cuda_refused_on_every_rank_where_one_lacks_it(command, monkeypatch, capsys):
    """A rank that could use its GPU refuses too, naming the rank that
    cannot (so none waits in a message for a rank that has stopped)."""
    import types

    from mpi_allreduce import __main__ as cli, backend, context

    monkeypatch.setattr(cli, "device", str.lower)  # (cupy "installed")
    monkeypatch.setattr(backend, "device_unavailable", lambda device: None)
    world = _OtherRankLacksAGPU()
    monkeypatch.setattr(cli, "MPI", types.SimpleNamespace(COMM_WORLD=world))
    monkeypatch.setattr(context, "context_for", lambda comm: comm)
    with pytest.raises(SystemExit) as refused:
        main(command + ["--device", "cuda"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    assert _error_lines(err) == [
        f"python -m mpi_allreduce {command[0]}: error: --device: 'cuda' cannot be used here: "
        "rank 1: cupy finds no GPU: cudaErrorNoDevice: no CUDA-capable device is detected; "
        "or use --device cpu"], err
    assert "Traceback" not in err and out == ""


#: (variable, value, command line): a setting the library refuses
BAD_SETTINGS = [
    ("MPI_ALLREDUCE_WATCHDOG", "soon", ["verify"]),
    ("MPI_ALLREDUCE_SEGMENT_BYTES", "0", ["bench", "-b", "8", "-e", "8", "-a", "ring"]),
    ("MPI_ALLREDUCE_CHECK", "maybe", ["info"]),
    ("MPI_ALLREDUCE_SELECTION", "fastest", ["tune", "-b", "8", "-e", "8", "-n", "1", "-r", "1",
                                             "-o", "{tmp}/t.json"]),
    ("MPI_ALLREDUCE_RANKS_PER_NODE", "-4", ["model", "-b", "8", "-e", "8", "-n", "1"]),
    ("MPI_ALLREDUCE_TRACE", "/proc/x", ["verify", "-a", "ring", "--no-large"]),
]


@pytest.fixture
def settings_restored():
    """The settings read again after the test (its environment undone)."""
    from mpi_allreduce.config import refresh

    yield
    refresh()


@pytest.mark.parametrize("variable, value, args", BAD_SETTINGS,
                         ids=[f"{v}={x}" for v, x, _ in BAD_SETTINGS])
def test_a_bad_setting_is_a_usage_error(variable, value, args, places, monkeypatch,
                                        settings_restored, capsys):
    """Read before the command runs: one error line naming the variable,
    exit status 2, nothing run (no traceback, no abort)."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as refused:
        main([a.format(**places) for a in args])
    out, err = capsys.readouterr()
    assert refused.value.code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"environment: {variable}=" in errors[0], err
    assert "Traceback" not in err and out == "", err + out
    assert not list(Path(places["tmp"]).iterdir())


def test_a_bad_setting_ends_the_process_cleanly():
    env = dict(os.environ, MPI_ALLREDUCE_WATCHDOG="soon")
    result = run(["verify", "--no-large"], env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "MPI_ALLREDUCE_WATCHDOG='soon'" in errors[0], result.stderr
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
    args = parse_args(["bench", "-m", "8:64K", "-f", "4", "-a", "ring,hierarchical,auto,ring",
                       "-d", "f4", "-o", "MAX", "--segment-bytes", "256K", "--ranks-per-node",
                       "2", "-c"])
    assert args.message_sizes == (8, 64 << 10) and args.stepfactor == 4.0
    assert args.check is True and args.minbytes == 8 and args.maxbytes == 64 << 20
    assert args.algorithms == ["ring", "hierarchical", "auto"]  # each once
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


@pytest.mark.parametrize("command,option", [(["verify", "-d", "float32,longdouble"],
                                             "-d/--dtypes"),
                                            (["bench", "-d", "longdouble"], "-d/--dtype")],
                         ids=["verify", "bench"])
def test_a_dtype_cupy_cannot_hold_is_refused_before_any_message(command, option, monkeypatch,
                                                                capsys):
    """cupy has no long double: named with --device cuda it is a usage
    error, not a traceback in the middle of the run (found on a GPU)."""
    import numpy as np

    from mpi_allreduce import __main__ as cli

    if np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("long double is float64 on this platform")
    monkeypatch.setattr(cli, "device", str.lower)  # (cupy "installed")
    with pytest.raises(SystemExit) as refused:
        main(command + ["--device", "cuda"])
    assert refused.value.code == 2
    name = np.dtype(np.longdouble).name
    assert _error_lines(capsys.readouterr().err) == [
        f"python -m mpi_allreduce {command[0]}: error: argument {option}: cuda arrays cannot "
        f"hold {name} (cupy has no long double); leave it out or use --device cpu"]


def test_verify_on_a_device_checks_every_dtype_its_arrays_hold():
    import numpy as np

    from mpi_allreduce.backend import held_on
    from mpi_allreduce.ops import SUPPORTED_DTYPES

    assert held_on("cpu", SUPPORTED_DTYPES) == list(SUPPORTED_DTYPES)
    on_gpu = held_on("cuda", SUPPORTED_DTYPES)
    assert {"float16", "float64", "complex128", "bool"} <= set(on_gpu)
    if np.dtype(np.longdouble) != np.dtype(np.float64):
        assert set(SUPPORTED_DTYPES) - set(on_gpu) == {np.dtype(np.longdouble).name,
                                                      np.dtype(np.clongdouble).name}


def test_verify_gives_each_variant_only_the_options_its_algorithm_takes():
    """``verify --radix 4`` runs every algorithm, hierarchical's second run
    on emulated nodes included: that run too is given only the options
    hierarchical takes (before: --radix reached it, and the valid command
    aborted the job)."""
    from mpi_allreduce.options import options as resolve
    from mpi_allreduce.tools.verify import variants

    runs = variants(["knomial", "hierarchical"], {"radix": 4, "inner": "ring"})
    assert [label for label, _, _ in runs] == ["knomial", "hierarchical", "hierarchical/rpn=2"]
    assert runs[0][2] == {"radix": 4}
    assert runs[2][2] == {"inner": "ring", "ranks_per_node": 2}
    for _, algorithm, given in runs:
        resolve(algorithm=algorithm, **given)  # (refused with ValueError before)
