"""Swing's and Bine's published claims, in direction, on the simulator's networks.

    python benchmarks/published/claims.py

* Swing (NSDI'24): on a 2D torus Swing is ahead of recursive doubling and
  of the ring.  Printed: the simulated time of each algorithm on 8x8 and
  16x16 tori, 1 rank a node, from 32 B to 64 MiB, and which is fastest.
* Bine (SC'25): on a Dragonfly Bine moves fewer bytes over global links.
  Printed: bytes on global links per algorithm, on the LUMI description,
  for jobs of 64 and 256 nodes placed from the first group on, and spread
  over 4 and 5 groups (5: the runs of nodes do not start where the
  butterflies' partners would stay inside a group).

The machine: the LUMI description's network with alpha_inter 2 us and
beta_inter for 25 GB/s (its documented link), gamma 0.1 ns a byte; the
tori the same with links as fast as the NIC.  Output in
benchmarks/results/published/claims.txt.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from mpi_allreduce.network import Network, placement, traffic
from mpi_allreduce.simulate import Machine, simulate
from mpi_allreduce.tools.measured import spread

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "published" / "claims.txt"
PARAMS = dict(alpha_inter=2e-6, beta_inter=1 / 25e9, gamma=1e-10)
TORUS_ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "swing_latency",
                    "swing_bandwidth", "bine_latency", "bine_bandwidth", "torus")
SIZES = (32, 2048, 131072, 1 << 20, 8 << 20, 64 << 20)
DRAGONFLY_ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "swing_bandwidth",
                        "bine_latency", "bine_bandwidth")


def _time(algorithm: str, network: Network, nodes: tuple, nbytes: int) -> tuple:
    count = max(1, nbytes // 4)
    out = simulate(algorithm, len(nodes), count, "int32", segment_size=count, data=False,
                   machine=Machine(**PARAMS, network=network, nodes=nodes))
    return out.seconds * 1e6, traffic(out.link_bytes)


def main() -> None:
    lines = [f"$ python benchmarks/published/claims.py", f"# machine: {PARAMS}", ""]
    for dims in ((8, 8), (16, 16)):
        network = Network("torus", dims=dims)
        size = network.size
        nodes = placement("block", size, 1, network)
        lines.append(f"## Swing: a {dims[0]}x{dims[1]} torus, {size} nodes, 1 rank a node: "
                     "microseconds (fastest marked *)")
        lines.append(f"{'bytes':>10} " + " ".join(f"{a:>18}" for a in TORUS_ALGORITHMS))
        for nbytes in SIZES:
            times = [_time(a, network, nodes, nbytes)[0] for a in TORUS_ALGORITHMS]
            best = min(times)
            lines.append(f"{nbytes:>10} " + " ".join(
                f"{t:>17.1f}{'*' if t == best else ' '}" for t in times))
            print(lines[-1], flush=True)
        lines.append("")
    fly = Network("dragonfly", groups=24, routers=32, router_nodes=4, global_width=23)
    group = fly.routers * fly.router_nodes
    nbytes = 64 << 20
    lines.append(f"## Bine: bytes on global links, LUMI's Dragonfly, {nbytes >> 20} MiB")
    lines.append(f"{'nodes':>6} {'groups':>7} " + " ".join(f"{a:>20}" for a in DRAGONFLY_ALGORITHMS))
    for size, groups in itertools.product((64, 256), (None, 4, 5)):
        if groups is None:
            nodes = placement("block", size, 1, fly)
        else:
            nodes = spread(size, groups, group)
        bytes_global = [_time(a, fly, nodes, nbytes)[1]["global"] for a in DRAGONFLY_ALGORITHMS]
        lines.append(f"{size:>6} {groups or -(-size // group):>7} "
                     + " ".join(f"{b:>20}" for b in bytes_global))
        print(lines[-1], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
