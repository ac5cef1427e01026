"""`draw`: what the pictures show is what the schedules do, checked for
every algorithm at p = 1..9 without MPI; the files it writes; its errors;
and the simulator's refusal of a simulation too big for memory."""

from __future__ import annotations

import pytest

from mpi_allreduce import registry
from mpi_allreduce.__main__ import main
from mpi_allreduce.schedule import Send
from mpi_allreduce.simulate import schedules
from mpi_allreduce.tools.draw import contributions, draw, label_of

ALL = list(registry.ALGORITHMS)
SIZES = range(1, 10)


def options_for(algorithm: str, size: int) -> dict:
    return {"ranks_per_node": 2} if algorithm == "hierarchical" else {}


def bits(mask: int) -> int:
    return bin(mask).count("1")


@pytest.mark.parametrize("size", SIZES, ids=lambda p: f"p={p}")
@pytest.mark.parametrize("algorithm", ALL)
def test_contributions_follow_the_schedules(algorithm, size):
    """Every element starts with its own rank's contribution alone, never
    loses one, and ends holding all; every arrow is a send of the schedule
    in the sender's round; every rank's rounds are all recorded."""
    for count in (size, 2 * size + 1):
        options = options_for(algorithm, size)
        d = contributions(algorithm, size, count, segment_size=2, options=options)
        scheds = schedules(algorithm, size, count, 2, options)
        assert len(d.frames) == max(len(s.rounds) for s in scheds) + 1
        first, result = d.frames[0], d.frames[-1]
        assert result.round is None
        for rank in range(size):
            assert all(m & (1 << rank) for m in first.holds[rank])
            assert all(m == d.full for m in result.holds[rank]), (rank, list(result.holds[rank]))
        for before, after in zip(d.frames, d.frames[1:]):
            for rank in range(size):
                for old, new in zip(before.holds[rank], after.holds[rank]):
                    assert old & new == old, f"rank {rank} lost a contribution: {old:b} -> {new:b}"
        for frame in d.frames[:-1]:
            expected = sorted((rank, a.peer, a.src) for rank, s in enumerate(scheds)
                              if frame.round < len(s.rounds)
                              for a in s.rounds[frame.round] if isinstance(a, Send))
            assert sorted((a.src, a.dst, a.src_ref) for a in frame.arrows) == expected
        assert [len(spans) for spans in d.rounds] == [len(s.rounds) for s in scheds]
        assert len(d.messages) == sum(s.messages for s in scheds)
        for m in d.messages:  # the unit machine: each message takes one unit once posted
            assert m.end - m.begin == pytest.approx(1.0)


@pytest.mark.parametrize("size", range(2, 10), ids=lambda p: f"p={p}")
def test_ring_holds_what_its_definition_says(size):
    """One element a rank: after the p-1 reduce-scatter rounds each rank
    holds exactly one complete block, and before round k (k < p) the block
    it last combined holds k+1 consecutive ranks' contributions."""
    d = contributions("ring", size)
    at_allgather = d.frames[size - 1].holds
    for rank in range(size):
        assert sum(m == d.full for m in at_allgather[rank]) == 1
    for k in range(1, size - 1):
        for rank in range(size):
            widest = max(bits(m) for m in d.frames[k].holds[rank])
            assert widest == k + 1, (k, rank)


def test_recursive_doubling_doubles_every_round():
    """p = 8: before round k every element of rank r holds the 2^k ranks
    that share r's bits above bit k."""
    d = contributions("recursive_doubling", 8, 5)
    for k in range(3):
        group = 1 << k
        for rank in range(8):
            mask = ((1 << group) - 1) << (rank & ~(group - 1))
            assert set(d.frames[k].holds[rank]) == {mask}, (k, rank)


def test_label_of():
    assert label_of(0b1) == "0"
    assert label_of(0b1011) == "0,1,3"
    assert label_of(0b11101) == "0,2-4"
    assert label_of(0b110) == "1,2"


@pytest.mark.parametrize("suffix", [".png", ".svg", ".gif"])
def test_draw_writes_the_file(tmp_path, suffix):
    d = contributions("ring", 4)
    out = tmp_path / f"ring{suffix}"
    panels = draw(d, str(out))
    assert panels == len(d.frames) == 7
    data = out.read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    elif suffix == ".svg":
        assert b"<svg" in data[:2000]
    else:
        from PIL import Image

        with Image.open(out) as image:
            assert image.n_frames == len(d.frames)


def test_summary_view_above_sixteen_ranks(tmp_path):
    d = contributions("rabenseifner", 20, 45)
    assert all(m == d.full for m in d.frames[-1].holds.ravel())
    assert draw(d, str(tmp_path / "r.png")) == len(d.frames)


@pytest.mark.parametrize("argv, message", [
    (["draw", "-a", "rung", "-p", "4"], "unknown algorithm 'rung'"),
    (["draw", "-a", "auto", "-p", "4"], "a named algorithm"),
    (["draw", "-a", "ring", "-p", "0"], "positive integer"),
    (["draw", "-a", "ring", "-p", "4", "--count", "-1"], "non-negative"),
    (["draw", "-a", "ring", "-p", "4", "--segment", "0"], "segment_size"),
    (["draw", "-a", "ring", "-p", "4", "-o", "ring.txt"], ".png, .svg, .pdf, .gif"),
])
def test_bad_arguments_are_clear(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert message in str(info.value)
    assert not list(tmp_path.iterdir())


def test_draw_command(tmp_path, capsys):
    out = tmp_path / "h.png"
    assert main(["draw", "-a", "hierarchical", "-p", "6", "-o", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert "ranks_per_node" not in capsys.readouterr().err


def test_simulate_refuses_what_does_not_fit(monkeypatch, capsys):
    """Estimated before any buffer is made: a clear message, not the kernel's kill."""
    from mpi_allreduce import simulate as sim

    monkeypatch.setattr(sim, "available_memory", lambda: 10_000_000)
    need = sim.memory_needed("naive", 50, 1001, "float32")
    assert need > 50 * 50 * 1001 * 4  # the scratch of every rank: every rank's vector
    with pytest.raises(MemoryError, match="10 MB is available"):
        sim.simulate("naive", 50, 1001)
    with pytest.raises(SystemExit, match="use fewer ranks"):
        main(["simulate", "-p", "50", "-a", "naive", "--count", "1001"])
    sim.simulate("naive", 5, 11)  # small enough for the 10 MB it is told of


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "hierarchical", "driver"])
def test_simulated_trace(tmp_path, algorithm, capsys):
    """The prediction in the real traces' format: valid, every message on
    both ranks, every rank's call ending at the simulator's finish time."""
    from mpi_allreduce.simulate import Machine, simulate
    from mpi_allreduce.tools import traces

    machine = Machine(alpha=2e-6, beta=1e-9, gamma=5e-10, overhead=3e-7)
    options = options_for(algorithm, 5)
    events = traces.simulated(algorithm, 5, 1001, "float32", machine, 128, options)
    doc = {"traceEvents": events}
    counts = traces.validate(doc)
    out = simulate(algorithm, 5, 1001, segment_size=128, options=options, machine=machine,
                   data=False)
    assert counts["messages"] == sum(out.messages)
    assert counts["call"] == 5
    ends = sorted(e["ts"] + e["dur"] for e in events if e.get("cat") == "call")
    finish = sorted(f * 1e6 for f in out.finish)
    assert ends == pytest.approx([f - min(e["ts"] for e in events if "ts" in e) for f in finish],
                                 abs=1e-3)
    rows = traces.breakdown(doc)
    assert rows and all(r["algorithm"] == algorithm for r in rows)
    assert sum(r["reduce_us"] for r in rows) == pytest.approx(
        sum(out.bytes_reduced) * 5e-10 * 1e6, rel=1e-6)
    path = tmp_path / "p.json"
    assert main(["simulate", "-a", algorithm, "-p", "5", "--count", "1001", "--trace",
                 str(path)]) == 0
    traces.validate(traces.load(str(path)))
    assert main(["report", str(path), "-o", str(tmp_path / "p.png")]) == 0
    assert algorithm in capsys.readouterr().out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_trace_commands_refuse_what_is_not_a_trace(tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a trace"):
        main(["report", str(tmp_path / "x.json")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no rank-"):
        main(["trace", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["trace", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="one algorithm"):
        main(["simulate", "-p", "4", "--trace", str(tmp_path / "t.json")])
    with pytest.raises(SystemExit, match="unknown algorithm"):
        main(["simulate", "-a", "rung", "-p", "4", "--trace", str(tmp_path / "t.json")])


def test_validate_catches_a_lonely_message():
    from mpi_allreduce import trace
    from mpi_allreduce.tools import traces

    events = traces.simulated("ring", 3, 7, "float64", __import__(
        "mpi_allreduce.simulate", fromlist=["Machine"]).Machine(alpha=1e-6), 8)
    recv = next(i for i, e in enumerate(events) if e.get("name") == "recv" and e["ph"] == "X")
    with pytest.raises(trace.TraceError, match="without their other side"):
        traces.validate({"traceEvents": events[:recv] + events[recv + 1:]})
