"""``python -m mpi_allreduce plot r.json -o fig.png``: latency and busbw against size."""

from __future__ import annotations

import itertools
from collections import defaultdict

from .bench import load_results


def plot(paths, output: str, title=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, metas = load_results(paths)
    lines = defaultdict(list)
    for r in results:
        label = r["algorithm"] + (" (in place)" if r["in_place"] else "")
        lines[label].append((r["size"], r["time_avg_us"], r["busbw_GBs"]))
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(13, 5))
    ours = itertools.cycle(plt.cm.tab20.colors)  # (more algorithms than colours: again)
    vendor_styles = iter([("black", "--"), ("dimgray", ":"), ("gray", "-."), ("silver", "--")])
    for label in sorted(lines, key=lambda l: (not l.startswith("mpi"), l)):
        pts = sorted(lines[label])
        sizes = [p[0] for p in pts]
        style = dict(marker="o", markersize=3)
        if label.startswith("mpi"):
            color, dash = next(vendor_styles, ("gray", "--"))
            style.update(linestyle=dash, linewidth=2, color=color)
        else:
            style.update(color=next(ours))
        lat.plot(sizes, [p[1] for p in pts], label=label, **style)
        bw.plot(sizes, [p[2] for p in pts], label=label, **style)
    lat.set(xscale="log", yscale="log", xlabel="message size (bytes)",
            ylabel="time per all-reduce (us, max over ranks)", title="latency")
    bw.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s, decimal)",
           title="bus bandwidth = algbw * 2(p-1)/p")
    for ax in (lat, bw):
        ax.grid(True, which="both", alpha=0.3)
    bw.legend(fontsize=8)
    meta = metas[0]
    fig.suptitle(title or f"{meta['ranks']} ranks on {meta['nodes']} node(s); "
                          f"{meta['mpi_library'][:60]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def plot_scale(rows: list, winners: dict, algorithms: tuple, output: str, title: str) -> None:
    """Left: predicted time against p at three sizes, one line per
    algorithm.  Right: the fastest algorithm at every (p, size)
    (``winners``: ``{(p, size): (name, seconds)}``): the crossovers are
    where the colour changes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .bench import human

    ALGORITHMS = tuple(algorithms)  # noqa: N806 - as the module constant it stands for
    ranks = sorted({r["p"] for r in rows})
    sizes = sorted({r["size"] for r in rows})
    picks = [sizes[0], sizes[len(sizes) // 2], sizes[-1]]
    colors = dict(zip(ALGORITHMS, itertools.cycle(plt.cm.tab20.colors)))
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.5),
                             gridspec_kw={"width_ratios": [1, 1, 1, 1.3]})
    for ax, size in zip(axes, picks):
        for name in ALGORITHMS:
            pts = sorted((r["p"], r["seconds"]) for r in rows
                         if r["size"] == size and r["algorithm"] == name)
            ax.plot([p for p, _ in pts], [t * 1e6 for _, t in pts], marker="o", markersize=3,
                    label=name, color=colors[name])
        ax.set(xscale="log", yscale="log", xlabel="ranks p", ylabel="predicted time (us)",
               title=f"{human(size)}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    grid = np.full((len(sizes), len(ranks)), -1)
    for (p, size), (name, _) in winners.items():
        grid[sizes.index(size), ranks.index(p)] = ALGORITHMS.index(name)
    used = sorted({int(v) for v in grid.flat if v >= 0})
    cmap = matplotlib.colors.ListedColormap([colors[ALGORITHMS[i]] for i in used])
    index = {v: k for k, v in enumerate(used)}
    shown = np.vectorize(lambda v: index.get(int(v), 0))(grid)
    ax = axes[3]
    ax.imshow(shown, origin="lower", aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(used) - 0.5)
    ax.set_xticks(range(len(ranks)), [str(p) for p in ranks], rotation=45)
    ax.set_yticks(range(len(sizes)), [human(s) for s in sizes])
    ax.set(xlabel="ranks p", ylabel="message size", title="fastest algorithm (crossovers)")
    ax.legend(handles=[matplotlib.patches.Patch(color=colors[ALGORITHMS[i]], label=ALGORITHMS[i])
                       for i in used], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
