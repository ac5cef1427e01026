"""``python -m mpi_allreduce draw -a ring -p 4 -o ring.png``: an algorithm, round by round.

The pictures are drawn from the very schedules the executor runs: the
simulator (:func:`~mpi_allreduce.simulate.execute`) runs every rank's
schedule in place on vectors whose elements are *sets of contributions*
(rank ``r`` starts with ``{r}`` in every element; a reduction is the union,
a message a copy), and tells what happened when.  So a block's colour is
what it really holds at that moment, and an arrow is a message the
schedules really post.

:func:`contributions` gives that record (a :class:`Drawing`): per round, the
sets every rank's vector holds when the round's messages are posted, and
the messages themselves; and the timeline of every message on a machine
where each message takes one unit of time and local work none.
:func:`draw` turns it into one panel per round plus a space-time diagram
(PNG, SVG or PDF), or into an animated GIF with a frame per round.  Above
:data:`DETAIL_RANKS` ranks (or :data:`DETAIL_ELEMENTS` elements) a panel is a
summary: a heat map of how many contributions each element holds, without
arrows.

Rounds are each rank's own: panel ``k`` shows every rank at the start of
its round ``k`` (a rank with fewer rounds shows its result), and the
messages ranks send in their round ``k``.  A received block is combined at
the start of the receiver's next round, so it shows there.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from ..schedule import RECV, SEND, Ref

__all__ = ["Arrow", "Frame", "Drawing", "contributions", "draw", "FORMATS", "DETAIL_RANKS",
           "DETAIL_ELEMENTS", "label_of", "memory_needed"]

#: file types :func:`draw` writes
FORMATS = (".png", ".svg", ".pdf", ".gif")
#: the most ranks a panel draws block by block, with arrows
DETAIL_RANKS = 16
#: the most elements a panel draws block by block
DETAIL_ELEMENTS = 64


class Arrow(NamedTuple):
    """One message: ``src`` sends its range ``src_ref`` into ``dst``'s ``dst_ref``."""

    src: int
    dst: int
    src_ref: Ref
    dst_ref: Ref


class Frame(NamedTuple):
    """Round ``round`` (None: the result): ``holds[rank, element]``, the
    set of ranks whose contributions that element holds (a bit mask, bit
    ``r`` for rank ``r``), and the round's messages."""

    round: Optional[int]
    holds: np.ndarray
    arrows: list


class Message(NamedTuple):
    """A message on the unit machine's clock: sent in ``src``'s round
    ``round``, from ``begin`` (both sides posted) to ``end``."""

    src: int
    dst: int
    round: int
    begin: float
    end: float
    elements: int


class Drawing(NamedTuple):
    algorithm: str
    size: int
    count: int
    options: dict
    frames: list  # of Frame, the last one the result
    messages: list  # of Message
    rounds: list  # per rank: ((start, end) of each round)

    @property
    def full(self) -> int:
        """The mask of an element that holds every rank's contribution."""
        return (1 << self.size) - 1


def contributions(algorithm: str, size: int, count: Optional[int] = None,
                  segment_size: Optional[int] = None, options: Optional[dict] = None) -> Drawing:
    """Run ``algorithm``'s schedules for ``size`` ranks on ``count``
    elements (default ``size``: one element a rank) in place, on sets of
    contributions; see the module docstring.  ``segment_size`` in elements
    (default: ``count``, one segment); ``options`` as
    :func:`~mpi_allreduce.simulate.schedules` takes them."""
    from .. import registry
    from ..simulate import Machine, execute, schedules

    registry.check_name(algorithm)
    if algorithm == "auto":
        raise ValueError("draw a named algorithm, not 'auto' (its choice depends on the machine)")
    _whole(size, 1, "the number of ranks must be a positive integer")
    count = size if count is None else count
    _whole(count, 0, "count must be a non-negative integer")
    segment = max(1, count) if segment_size is None else segment_size
    _whole(segment, 1, "segment_size must be a positive integer")
    options = dict(options or {})
    scheds = schedules(algorithm, size, count, segment, options)

    vectors = np.zeros((size, count), dtype=object)
    for rank in range(size):
        vectors[rank, :] = 1 << rank
    rows = [vectors[rank] for rank in range(size)]  # in place: send and result are one array
    arrays = [(row, row, np.zeros(max(s.scratch, 1), dtype=object))
              for row, s in zip(rows, scheds)]
    posted: list = [dict() for _ in range(size)]  # rank -> {round: vector then}
    arrows: dict = {}
    messages: list = []
    rounds: list = [[] for _ in range(size)]

    def observe(event: str, **f) -> None:
        if event == "post":
            posted[f["rank"]][f["round"]] = rows[f["rank"]].copy()
        elif event == "message":
            arrows.setdefault(f["src_round"], []).append(
                Arrow(f["src"], f["dst"], f["src_ref"], f["dst_ref"]))
            messages.append(Message(f["src"], f["dst"], f["src_round"], f["begin"], f["end"],
                                    f["elements"]))
        elif event == "end":
            rounds[f["rank"]].append((f["start"], f["end"]))

    execute(scheds, arrays, Machine(alpha=1.0), np.bitwise_or, 1,
            f"{algorithm}, p={size}, count={count}", observe)

    frames = []
    for k in range(max(len(s.rounds) for s in scheds)):
        holds = np.array([posted[rank].get(k, vectors[rank]) for rank in range(size)],
                         dtype=object).reshape(size, count)
        frames.append(Frame(k, holds, sorted(arrows.get(k, []))))
    frames.append(Frame(None, vectors.copy(), []))
    return Drawing(algorithm, size, count, options, frames, messages, rounds)


def _whole(value, least: int, what: str) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{what}, got {value!r}")


def label_of(mask: int) -> str:
    """``0b1011`` -> ``"0,1,3"``; runs of three or more as ``"0-3"``."""
    ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j - i >= 2 else
                     ",".join(map(str, ranks[i:j + 1])))
        i = j + 1
    return ",".join(parts)


def _fractions(holds: np.ndarray, size: int) -> np.ndarray:
    counts = np.vectorize(lambda m: bin(m).count("1"), otypes=[float])(holds) \
        if holds.size else np.zeros(holds.shape)
    return counts / size


def _in_vector(ref: Ref) -> bool:
    return ref.buf in (SEND, RECV)


def _title(drawing: Drawing, frame: Frame) -> str:
    if frame.round is None:
        return "result"
    return f"round {frame.round}: {len(frame.arrows)} message{'s' * (len(frame.arrows) != 1)}"


def _panel(ax, drawing: Drawing, frame: Frame, cmap) -> None:
    size, count = drawing.size, drawing.count
    fractions = _fractions(frame.holds, size)
    ax.set_title(_title(drawing, frame), fontsize=10)
    if size > DETAIL_RANKS or count > DETAIL_ELEMENTS or count == 0:
        if count:
            ax.imshow(fractions, cmap=cmap, vmin=0, vmax=1, aspect="auto",
                      interpolation="nearest")
        ax.set_xlabel("element")
        ax.set_ylabel("rank")
        return
    from matplotlib.patches import Rectangle

    text = size <= 8 and count <= 16
    for rank in range(size):
        for e in range(count):
            colour = cmap(fractions[rank, e])
            ax.add_patch(Rectangle((e, rank - 0.3), 0.94, 0.6, facecolor=colour,
                                   edgecolor="0.3", linewidth=0.5))
            if text:
                light = sum(colour[:3]) / 3 < 0.5
                ax.text(e + 0.47, rank, label_of(frame.holds[rank, e]), ha="center",
                        va="center", fontsize=6 if size > 4 else 7,
                        color="white" if light else "black")
    for arrow in frame.arrows:
        sx = arrow.src_ref.offset + arrow.src_ref.length / 2 if _in_vector(arrow.src_ref) else None
        dx = arrow.dst_ref.offset + arrow.dst_ref.length / 2 if _in_vector(arrow.dst_ref) else None
        sx = dx if sx is None else sx
        dx = sx if dx is None else dx
        if sx is None:  # scratch to scratch: drawn past the vector's end
            sx = dx = count + 0.5
        shift = 0.3 if arrow.dst > arrow.src else -0.3
        ax.annotate("", xy=(dx, arrow.dst - shift), xytext=(sx, arrow.src + shift),
                    arrowprops=dict(arrowstyle="->", color="crimson", lw=1.1,
                                    connectionstyle="arc3,rad=0.15"))
        where = arrow.src_ref if _in_vector(arrow.src_ref) else arrow.dst_ref
        into = "" if _in_vector(arrow.dst_ref) else " (to scratch)"
        if size <= 8:
            ax.text((sx + dx) / 2 + 0.1, (arrow.src + arrow.dst) / 2,
                    f"[{where.offset}:{where.stop}){into}", fontsize=6, color="crimson",
                    ha="left", va="center")
    ax.set_xlim(-0.2, count + 1.2)
    ax.set_ylim(size - 0.4, -0.6)
    ax.set_yticks(range(size))
    ax.set_yticklabels([f"rank {r}" for r in range(size)], fontsize=7)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def _timeline(ax, drawing: Drawing) -> None:
    """Space-time diagram: ranks down, time across, a line per message."""
    for rank, spans in enumerate(drawing.rounds):
        for start, end in spans:
            ax.plot([start, end], [rank, rank], color="0.75", lw=3, solid_capstyle="butt")
    for m in drawing.messages:
        ax.annotate("", xy=(m.end, m.dst), xytext=(m.begin, m.src),
                    arrowprops=dict(arrowstyle="->", color="tab:blue", lw=0.8))
    ax.set_ylim(drawing.size - 0.5, -0.5)
    ax.set_xlim(-0.1, max([m.end for m in drawing.messages], default=1.0) + 0.1)
    ax.set_xlabel("time (one message takes one unit; local work none)")
    ax.set_ylabel("rank")
    ax.set_title(f"space-time: {len(drawing.messages)} messages", fontsize=10)


def _heading(drawing: Drawing) -> str:
    extra = "".join(f", {k}={v}" for k, v in sorted(drawing.options.items()))
    return (f"{drawing.algorithm}: p={drawing.size}, {drawing.count} elements{extra} -- "
            f"colour: share of the ranks' contributions an element holds")


def _figure(size: int, count: int, frames: int, gif: bool) -> tuple:
    """(width, height in inches, dots per inch, columns, rows) of the
    figure :func:`draw` makes: a GIF's frame is one panel; else the panels
    in rows of up to four and the space-time diagram below them."""
    width = min(max(4.0, 0.45 * min(count, DETAIL_ELEMENTS) + 2.0), 12.0)
    height = max(2.2, 0.35 * min(size, DETAIL_RANKS) + 1.0)
    if gif:
        return width, height, 100, 1, 1
    columns = min(4, frames)
    rows = -(-frames // columns)
    return width * columns * 0.8, height * rows + height + 1.0, 110, columns, rows


#: bytes matplotlib holds per thing a panel draws (tracemalloc, matplotlib
#: 3.x): an axes, a block of a detailed panel (a Rectangle), its label (a
#: Text), an arrow (an annotation), a round's span (a Line2D)
_AXES_BYTES, _BLOCK_BYTES, _LABEL_BYTES, _ARROW_BYTES, _LINE_BYTES = (
    230_000, 9_000, 9_000, 6_000, 10_000)
#: what importing pyplot and its first picture of text, images and
#: colours in a process load besides (modules, fonts, caches; measured:
#: 48 MB for pyplot and a figure, the rest for text and images)
_FIRST_BYTES = 65_000_000
#: per message: its Message (two clocks) and its Arrow, in their lists
_MESSAGE_BYTES = (sys.getsizeof(Message(0, 0, 0, 0.0, 0.0, 0)) + 2 * 32
                  + sys.getsizeof(Arrow(0, 0, None, None)) + 2 * 8)
#: a numpy array's own object (besides its elements)
_ARRAY_BYTES = sys.getsizeof(np.empty(0))


def memory_needed(algorithm: str, size: int, count: Optional[int] = None,
                  segment_size: Optional[int] = None, options: Optional[dict] = None,
                  output: str = "drawing.png") -> int:
    """Bytes drawing ``algorithm`` into ``output`` holds at its peak, known
    before a schedule is made (:func:`~mpi_allreduce.simulate.footprint`,
    arguments as :func:`contributions` takes them):

    * :func:`contributions`: the schedules and the simulator's own
      (:meth:`~mpi_allreduce.simulate.Footprint.bytes` without data); the
      vectors and scratch of sets (object arrays), every set a reduction
      makes (an int of ``size`` bits), each rank's vector copied at each
      of its rounds, a frame of every rank's vector per round (the
      longest rank's rounds), the messages and rounds' spans;
    * :func:`draw`: pyplot and its first picture's fonts and caches, its
      axes, blocks, labels, arrows and spans (``_AXES_BYTES`` ...), a
      summary panel's shares (the fractions and the image's copy,
      float64) and the canvas (RGBA, and the file's copy of it); a GIF's
      frames as RGB images (and RGBA ones freed).
    """
    from ..simulate import footprint

    count = size if count is None else count
    segment = max(1, count) if segment_size is None else segment_size
    f = footprint(algorithm, size, count, segment, options)
    frames = f.longest + 1
    cells = size * count
    intsize = sys.getsizeof((1 << size) - 1)
    need = (f.bytes(count, "u1", data=False) + (cells + f.scratch) * 8
            + (size + f.reduced) * intsize + f.rounds * (count * 8 + _ARRAY_BYTES)
            + frames * (cells * 8 + _ARRAY_BYTES) + f.messages * _MESSAGE_BYTES
            + f.rounds * 2 * 32 + _FIRST_BYTES)
    gif = Path(output).suffix.lower() == ".gif"
    summary = size > DETAIL_RANKS or count > DETAIL_ELEMENTS or count == 0
    panel = _AXES_BYTES + (3 * cells * 8 if summary else cells * _BLOCK_BYTES
                           + (cells * _LABEL_BYTES if size <= 8 and count <= 16 else 0))
    width, height, dpi, _, _ = _figure(size, count, frames, gif)
    pixels = int(width * dpi) * int(height * dpi)
    if gif:  # a figure at a time; each frame kept as an RGB image, and the RGBA
        # one it was read from, whose memory the allocator keeps (measured)
        return need + panel + pixels * 4 * 2 + frames * pixels * (3 + 4)
    arrows = 0 if summary else f.messages
    return (need + frames * panel + (arrows + f.messages) * _ARROW_BYTES + _AXES_BYTES
            + f.rounds * _LINE_BYTES + pixels * 4 * 2)


def draw(drawing: Drawing, output: str) -> int:
    """Write ``drawing`` to ``output`` (:data:`FORMATS`); the panels (or
    frames) written."""
    suffix = Path(output).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot draw into {output!r}: the name must end in one of "
                         f"{', '.join(FORMATS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("YlGnBu")
    frames = drawing.frames
    if suffix == ".gif":
        width, height, dpi, _, _ = _figure(drawing.size, drawing.count, len(frames), True)
        from PIL import Image

        images = []
        for frame in frames:
            fig, ax = plt.subplots(figsize=(width, height))
            _panel(ax, drawing, frame, cmap)
            fig.suptitle(_heading(drawing), fontsize=8)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=dpi)
            plt.close(fig)
            buf.seek(0)
            images.append(Image.open(buf).convert("RGB"))
        images[0].save(output, save_all=True, append_images=images[1:], duration=1200, loop=0)
        return len(images)
    width, height, dpi, columns, rows = _figure(drawing.size, drawing.count, len(frames), False)
    fig = plt.figure(figsize=(width, height))
    grid = fig.add_gridspec(rows + 1, columns)
    for i, frame in enumerate(frames):
        _panel(fig.add_subplot(grid[i // columns, i % columns]), drawing, frame, cmap)
    _timeline(fig.add_subplot(grid[rows, :]), drawing)
    fig.suptitle(_heading(drawing), fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=dpi)
    plt.close(fig)
    return len(frames)
