"""The tables `simulate --measured` checks, made from the published measurements in source/.

    python benchmarks/published/tables.py

source/*.csv hold every all-reduce time of the Bine Trees paper's data
(HLC-Lab/pico, MIT licence: source/LICENSE) as extracted (README.md says
how); this keeps the rows of the algorithms we have, names them as we do
(``published_as`` keeps the paper's name), adds ``groups`` (the Dragonfly
groups or Dragonfly+ cells the job's nodes spanned, from its allocation)
and writes one table per machine description: lumi.csv, leonardo.csv,
marenostrum5.csv and fugaku-<shape>.csv (Fugaku's jobs each had a torus
of their own shape).
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the paper's names of the algorithms we have, per system, and ours: one
#: implementation family per system (LUMI: the authors' own over MPI
#: point-to-point; Leonardo and MareNostrum 5: Open MPI's own, forced with
#: coll_tuned's dynamic rules, and the authors' Bine; Fugaku: the authors'
#: uTofu code driving one network interface)
NAMES = {
    "lumi": {"ring_over": "ring", "recursive_doubling_over": "recursive_doubling",
             "rabenseifner_over": "rabenseifner", "bine_lat_over": "bine_latency",
             "bine_bdw_remap_over": "bine_bandwidth"},
    "leonardo": {"ring_ompi": "ring", "recursive_doubling_ompi": "recursive_doubling",
                 "rabenseifner_ompi": "rabenseifner", "bine_lat_over": "bine_latency",
                 "bine_bdw_remap_over": "bine_bandwidth"},
    "fugaku": {"RECDOUB-L-UTOFU-0-1": "recursive_doubling",
               "RECDOUB-B_CONT-UTOFU-0-1": "rabenseifner", "BINE-L-UTOFU-0-1": "bine_latency",
               "BINE-B_CONT-UTOFU-0-1": "bine_bandwidth"},
}
NAMES["mare_nostrum"] = NAMES["leonardo"]
#: the vendor's default, kept (not modelled: the check lists it apart)
DEFAULTS = {"lumi": "default_mpich", "leonardo": "default_ompi", "mare_nostrum": "default_ompi",
            "fugaku": "default-default"}
#: runs left out: LUMI's 2048 ranks on 37 nodes (uneven ranks a node);
#: Leonardo's development runs on a custom Open MPI 5.0.7 (4, 8, 16 nodes)
LEFT_OUT = {"2025_03_28___00_20_34", "2025_05_06___19_06_52", "2025_05_10___18_33_42",
            "2025_05_10___18_34_08"}
OUTPUT = {"lumi": "lumi", "leonardo": "leonardo", "mare_nostrum": "marenostrum5"}
COLUMNS = ("algorithm", "nodes", "ranks_per_node", "bytes", "microseconds", "source",
           "published_as", "groups", "run")


def _groups(allocation: str) -> str:
    found = re.search(r"in (\d+) Dragonfly group|(\d+) Dragonfly\+ cell", allocation)
    return next((g for g in found.groups() if g), "") if found else ""


def main() -> None:
    for system in ("lumi", "leonardo", "mare_nostrum", "fugaku"):
        tables = defaultdict(list)
        with open(HERE / "source" / f"{system}.csv", newline="") as f:
            for row in csv.DictReader(f):
                name = row["algorithm"]
                ours = NAMES[system].get(name, name if name == DEFAULTS[system] else None)
                if ours is None or row["run"] in LEFT_OUT:
                    continue
                table = f"fugaku-{row['shape']}" if system == "fugaku" else OUTPUT[system]
                tables[table].append({
                    "algorithm": ours, "nodes": row["nodes"],
                    "ranks_per_node": row["ranks_per_node"], "bytes": row["bytes"],
                    "microseconds": row["median_us"], "source": row["source"],
                    "published_as": name, "groups": _groups(row["allocation"]),
                    "run": row["run"]})
        for table, rows in sorted(tables.items()):
            rows.sort(key=lambda r: (int(r["nodes"]), r["run"], r["algorithm"], int(r["bytes"])))
            with open(HERE / f"{table}.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            print(f"{table}.csv: {len(rows)} rows")


if __name__ == "__main__":
    main()
