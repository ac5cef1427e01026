"""``python -m mpi_allreduce plot r.json -o fig.png``: latency and busbw against size."""

from __future__ import annotations

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
    ours = iter(plt.cm.tab10.colors)
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
