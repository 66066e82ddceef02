"""Draw a Chrome/Perfetto trace as a timeline picture: one row per rank, a colour per kind of span.

    python -m sparsepipe_hpc.plot trace.json timeline.png       # a file written by --trace
    python -m sparsepipe_hpc.train ... --plot timeline.png      # the trainer draws its own

    from sparsepipe_hpc.plot import plot_trace
    plot_trace(json.load(open("trace.json")), "timeline.png", title="1F1B, 2 stages")

Needs matplotlib, the ``plot`` extra (``pip install 'sparsepipe_hpc[plot]'``); without it
:func:`require_matplotlib` raises :class:`PlotError` saying so. Reads the complete ("X") events
of the trace: each thread (tid) is a row, labelled by its ``thread_name``; top-level spans fill
the row (forward, backward, stage send/receive, all-reduce, optimizer step, ...), spans nested in
them (halo waits in a forward, kernel-map rebuilds in a receive) are drawn as thinner bars inside,
and the grey between top-level spans, from the row's first span to the end of the trace, is idle
time. Bars wide enough for it carry their name (``F3`` = forward of micro-batch 3, ``RA2<0`` =
receive micro-batch 2's activations from stage 0; see sparsepipe_hpc.pipeline.schedule).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["PlotError", "require_matplotlib", "plot_trace", "COLORS", "main"]

COLORS = {"forward": "#4878d0", "backward": "#ee854a", "send": "#6acc64", "recv": "#8de5a1",
          "halo": "#956cb4", "kmap": "#82c6e2", "allreduce": "#d65f5f", "optimizer": "#8c613c",
          "step": "#dc7ec0", "input": "#d5bb67", "idle": "#e6e6e6"}
_OTHER = "#797979"


class PlotError(ImportError):
    """matplotlib (the ``plot`` extra) is missing, or the trace has nothing to draw."""


def require_matplotlib() -> Any:
    """The ``matplotlib.pyplot`` module on the non-interactive Agg backend, or PlotError."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("drawing a timeline (--plot) needs matplotlib, which is not installed; "
                        "install the plot extra: pip install 'sparsepipe_hpc[plot]' (or pip "
                        "install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _rows(trace: dict[str, Any]) -> tuple[list[int], dict[int, str], dict[int, list[dict]]]:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    names: dict[int, str] = {}
    spans: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e.get("args", {}).get("name", f"rank {e['tid']}")
        elif e.get("ph") == "X":
            spans.setdefault(e["tid"], []).append(e)
    tids = sorted(set(names) | set(spans))
    return tids, names, spans


def _depths(spans: Sequence[dict]) -> list[tuple[dict, int]]:
    """Each span with its nesting depth in its row (0: top level)."""
    out: list[tuple[dict, int]] = []
    stack: list[float] = []  # end times of the open enclosing spans
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1] - 1e-9:
            stack.pop()
        out.append((e, len(stack)))
        stack.append(e["ts"] + e["dur"])
    return out


def plot_trace(trace: dict[str, Any], out: str | Path, title: Optional[str] = None) -> Path:
    """Draw ``trace`` (Trace Event Format, as :func:`sparsepipe_hpc.tracing.to_chrome_trace`
    returns and ``--trace`` writes) into the image file ``out`` (its suffix picks the format:
    .png, .svg, .pdf). Returns the path."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch

    tids, names, spans = _rows(trace)
    if not any(spans.values()):
        raise PlotError("the trace has no spans to draw (no complete 'X' events)")
    t0 = min(e["ts"] for row in spans.values() for e in row)
    t_end = max(e["ts"] + e["dur"] for row in spans.values() for e in row)
    scale, unit = (1e-6, "s") if t_end - t0 > 2e6 else (1e-3, "ms")
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.7 * len(tids)))
    used = set()
    for y, tid in enumerate(tids):
        row = spans.get(tid, [])
        if not row:
            continue
        first = min(e["ts"] for e in row)
        ax.barh(y, (t_end - first) * scale, left=(first - t0) * scale, height=0.8,
                color=COLORS["idle"], linewidth=0)
        used.add("idle")
        for e, depth in _depths(row):
            cat = e.get("cat", "")
            color = COLORS.get(cat, _OTHER)
            used.add(cat if cat in COLORS else "other")
            height = 0.8 if depth == 0 else 0.35
            yc = y if depth == 0 else y + 0.2
            left, width = (e["ts"] - t0) * scale, e["dur"] * scale
            ax.barh(yc, width, left=left, height=height, color=color,
                    edgecolor="white" if depth == 0 else "none", linewidth=0.3)
            if depth == 0 and width > (t_end - t0) * scale / 120:
                ax.text(left + width / 2, y, e.get("name", ""), ha="center", va="center",
                        fontsize=6, clip_on=True)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get(t, f"rank {t}") for t in tids], fontsize=8)
    ax.invert_yaxis()  # rank 0 on top, as in Perfetto
    ax.set_xlim(0, (t_end - t0) * scale)
    ax.set_xlabel(f"time ({unit})")
    if title:
        ax.set_title(title)
    order = [c for c in COLORS if c in used] + (["other"] if "other" in used else [])
    ax.legend(handles=[Patch(color=COLORS.get(c, _OTHER), label=c) for c in order],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(tids), 1)),
              ncol=len(order), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.plot",
                                description="Draw a --trace file as a timeline picture.")
    p.add_argument("trace", help="trace JSON written by --trace")
    p.add_argument("out", help="picture to write (.png, .svg, .pdf)")
    p.add_argument("--title")
    args = p.parse_args(argv)
    try:
        trace = json.loads(Path(args.trace).read_text())
    except (OSError, ValueError) as e:
        print(f"plot: cannot read the trace {args.trace}: {e}", file=sys.stderr)
        return 2
    try:
        print(plot_trace(trace, args.out, args.title))
    except PlotError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
