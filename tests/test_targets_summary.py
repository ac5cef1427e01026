"""Serial tests of how ``benchmarks/run_targets.py`` judges the targets from
a bench JSON file: which ratio decides, and when a verdict is within noise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from run_targets import paired, summary, verdict  # noqa: E402


def row(size, algorithm, repeats):
    repeats = [float(t) for t in repeats]
    return {"size": size, "algorithm": algorithm, "time_avg_us": sorted(repeats)[len(repeats) // 2],
            "repeats_avg_us": repeats, "wrong": 0, "runs": None, "moves": None}


def test_paired_quartiles_are_of_the_ratios_repeat_by_repeat():
    # each repeat's ratio is 2, though the medians of the two columns differ by 3x
    q1, q2, q3 = paired(row(8, "a", [2, 4, 6, 8, 10]), row(8, "b", [1, 2, 3, 4, 5]))
    assert q1 == q2 == q3 == 2.0
    assert paired(row(8, "a", [3]), row(8, "b", [2])) == (1.5, 1.5, 1.5)


@pytest.mark.parametrize("ratio,spread,met,clear", [
    (0.80, (0.70, 0.80, 0.90), True, True),     # met, and every quartile below the limit
    (0.95, (0.80, 0.95, 1.20), True, False),    # met by the medians, within noise
    (1.05, (0.90, 1.05, 1.20), False, False),   # missed, within noise
    (1.30, (1.10, 1.30, 1.40), False, True),    # missed clearly
])
def test_verdict_marks_what_the_noise_decides(ratio, spread, met, clear):
    _, _, got_met, got_ratio, _, got_clear = verdict("t", 8, ratio, spread, 1.0)
    assert (got_met, got_clear, got_ratio) == (met, clear, ratio)


def test_summary_judges_the_targets_by_the_medians(tmp_path):
    big = 2 << 20
    rows = [
        row(8, "mpi", [1, 1, 1]), row(8, "ring", [5, 5, 5]), row(8, "driver", [2, 2, 2]),
        row(8, "auto", [2.1, 2.1, 2.1]),
        # at 2 MiB the ring beats the vendor, and auto ran 20% slower than the ring
        row(big, "mpi", [100, 100, 100]), row(big, "ring", [90, 90, 90]),
        row(big, "driver", [150, 150, 150]), row(big, "auto", [108, 108, 108]),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {}, "results": rows}))
    text = summary(path, 2)
    lines = {tuple(cell.strip() for cell in line.strip("|").split("|")[:4])
             for line in text.splitlines() if line.startswith("| ")}
    assert ("8 B auto <= 3x vendor", "8", "yes", "2.10") in lines
    assert ("auto within 10% of best of ours", "8", "yes", "1.05") in lines
    assert ("best of ours <= vendor", str(big), "yes", "0.90") in lines
    assert ("auto within 10% of best of ours", str(big), "yes", "1.20") not in lines
    assert ("auto within 10% of best of ours", str(big), "**no**", "1.20") in lines
    assert "Targets met: 3 of 4." in text
