"""The PLOT kinds of an analysis section drawn with matplotlib (Agg, no display, no pyplot state):
curves, matrix, bars and reliability. png() gives the bytes embedded in report.html, rgb() the
array logged to TensorBoard. matplotlib is imported when a plot is drawn: an optional heavy dependency
that importing the report format (training, evaluate.py) does not pay for."""
import io
import json

import numpy as np
from PIL import Image

KINDS = ("curves", "matrix", "bars", "reliability")


class PlotError(ValueError):
    """A plot dict that does not follow the section format."""


def _panels(plot):
    """The panel names of a curves plot whose series carry "panel" (small multiples), in order; else []."""
    return list(dict.fromkeys(s["panel"] for s in plot.get("series", []) if s.get("panel") is not None))


def _grid(n, columns=4):
    columns = min(columns, n)
    return columns, -(-n // columns)


def _size(plot):
    if plot["kind"] == "matrix":
        n = len(plot["labels"])
        side = min(11.0, max(4.0, 0.35 * n + 2.5))
        return side, side * 0.9
    if plot["kind"] == "bars":
        return min(14.0, max(5.0, 0.3 * len(plot["labels"]) * max(1, len(plot["series"])) ** 0.5 + 2)), 4.0
    if plot["kind"] == "reliability":
        return (11.0 if plot.get("after") else 5.5), 5.0
    panels = _panels(plot)
    if panels:
        columns, rows = _grid(len(panels))
        return 11.0, 2.9 * rows + 0.4
    return 6.0, 4.5


def _percent_axes(ax, plot):
    """Fractions drawn in per cent: the axes named in plot["percent"] ("x", "y" or "xy") get x100 ticks."""
    from matplotlib.ticker import FuncFormatter
    axes = plot.get("percent", "")
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        if name in axes:
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:.0f}"))


def _curve_axes(ax, plot, labels=True):
    if labels:
        ax.set_xlabel(plot.get("x_label", ""))
        ax.set_ylabel(plot.get("y_label", ""))
    if plot.get("x_range"):
        ax.set_xlim(*plot["x_range"])
    if plot.get("y_range"):
        ax.set_ylim(*plot["y_range"])
    _percent_axes(ax, plot)
    ax.grid(alpha=0.3)


def _line(ax, s, k):
    style = {"linestyle": s.get("style", "-")}
    if s.get("emphasis"):  # the overall curve: thick and dark, drawn on top
        style.update(color="black", linewidth=2.6, zorder=5)
    else:
        style.update(color=s.get("colour", f"C{k % 10}"), linewidth=1.5)
    ax.plot(s["x"], s["y"], label=s.get("label"), **style)


def _curves(fig, ax, plot):
    panels = _panels(plot)
    if not panels:
        for k, s in enumerate(plot["series"]):
            _line(ax, s, k)
        _curve_axes(ax, plot)
        if any(s.get("label") for s in plot["series"]) and len(plot["series"]) <= 25:
            ax.legend(fontsize=9, loc=plot.get("legend", "best"))
        return
    # small multiples: one panel per "panel" value, the same axes, each with its own short legend
    ax.remove()
    columns, rows = _grid(len(panels))
    for i, name in enumerate(panels):
        a = fig.add_subplot(rows, columns, i + 1)
        series = [s for s in plot["series"] if s.get("panel") == name]
        for k, s in enumerate(series):
            _line(a, s, k)
        _curve_axes(a, plot, labels=False)
        title = plot.get("panel_titles", {}).get(name, name)
        a.set_title(title, fontsize=10, fontweight="bold" if any(s.get("emphasis") for s in series) else "normal")
        if i % columns == 0:
            a.set_ylabel(plot.get("y_label", ""), fontsize=9)
        if i >= len(panels) - columns:
            a.set_xlabel(plot.get("x_label", ""), fontsize=9)
        a.tick_params(labelsize=8)
        if any(s.get("label") for s in series):
            a.legend(fontsize=8.5, loc=plot.get("legend", "lower left"), handlelength=1.6, borderaxespad=0.3)


def _matrix(fig, ax, plot):
    values = np.asarray(plot["values"], dtype=float)
    labels = list(plot["labels"])
    if values.shape != (len(labels), len(labels)) and values.shape[0] != len(labels):
        raise PlotError(f"matrix '{plot.get('title')}': {values.shape} values for {len(labels)} labels")
    col_labels = list(plot.get("col_labels", labels))
    shown = values
    if plot.get("normalise"):
        shown = values / np.maximum(values.sum(1, keepdims=True), 1e-12)
    from matplotlib.ticker import PercentFormatter
    image = ax.imshow(shown, cmap="Blues", vmin=0, vmax=1 if plot.get("normalise") else None, aspect="auto")
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
    if plot.get("normalise"):  # shares in per cent, as everywhere on the page
        bar.ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    small = 7 if len(labels) > 15 else 9
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=60, ha="right", fontsize=small)
    ax.set_yticks(range(len(labels)), labels, fontsize=small)
    ax.set_xlabel(plot.get("x_label", "predicted"))
    ax.set_ylabel(plot.get("y_label", "ground truth"))
    if values.size <= 400:  # numbers in the cells while they stay readable
        top = shown.max() if shown.size else 0
        for (i, j), v in np.ndenumerate(shown):
            if values[i, j]:
                text = f"{100 * v:.0f}%" if plot.get("normalise") else f"{int(values[i, j])}"
                ax.text(j, i, text, ha="center", va="center", fontsize=small - 1,
                        color="white" if v > 0.6 * (1 if plot.get("normalise") else top) else "black")


def _bars(ax, plot):
    labels = list(plot["labels"])
    series = plot["series"]
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    scale = 100 if plot.get("percent") else 1  # fractions drawn in per cent
    for k, s in enumerate(series):
        values = np.array([np.nan if v is None else scale * v for v in s["values"]], dtype=float)
        colours = s.get("colours") or None  # one colour per bar: the bars are told apart by their labels
        bars = ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=s.get("label"),
                      color=colours, edgecolor="black" if colours else None, linewidth=0.6)
        if plot.get("value_labels"):
            ax.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.1f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(x, labels, rotation=60 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center",
                  fontsize=7 if len(labels) > 15 else 9)
    ax.set_ylabel(plot.get("y_label", ""))
    if plot.get("y_range"):
        ax.set_ylim(*(scale * v for v in plot["y_range"]))
    elif plot.get("value_labels"):
        ax.margins(y=0.15)  # room for the numbers above the bars
    if len(series) > 1:  # one series: its name is the axis label, a legend would say nothing
        ax.legend(fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def _reliability_panel(fig, spec, data, title, colour):
    """Accuracy per confidence bin (bars, the gap to the diagonal shaded) over the number of samples per bin."""
    import matplotlib.gridspec as gridspec
    inner = gridspec.GridSpecFromSubplotSpec(2, 1, subplot_spec=spec, height_ratios=[3, 1], hspace=0.08)
    ax, counts = fig.add_subplot(inner[0]), fig.add_subplot(inner[1])
    bins = data["bins"]
    width = (bins[0]["hi"] - bins[0]["lo"]) if bins else 1 / 15
    centres = np.array([(b["lo"] + b["hi"]) / 2 for b in bins])
    filled = np.array([b["count"] > 0 for b in bins], bool)
    acc = np.array([b["accuracy"] for b in bins])
    conf = np.array([b["confidence"] for b in bins])
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    ax.bar(centres[filled], acc[filled], width * 0.92, color=colour, alpha=0.85, edgecolor="black", linewidth=0.4,
           label="accuracy in the bin")
    ax.bar(centres[filled], conf[filled] - acc[filled], width * 0.92, bottom=acc[filled], color="none",
           edgecolor="#c62828", hatch="///", linewidth=0.6, label="gap to its mean confidence")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xticklabels([])
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8.5, loc="upper left")
    ax.grid(alpha=0.3)
    _percent_axes(ax, {"percent": "y"})
    n = np.array([b["count"] for b in bins])
    counts.bar(centres, n, width * 0.92, color="#777")
    for c, v in zip(centres, n):
        if v:
            counts.text(c, v, f"{v}", ha="center", va="bottom", fontsize=7)
    counts.set_xlim(0, 1)
    counts.set_ylim(0, max(1, n.max()) * 1.35)
    counts.set_ylabel("samples", fontsize=9)
    counts.set_xlabel("confidence (%)")
    counts.tick_params(labelsize=8)
    _percent_axes(counts, {"percent": "x"})


def _reliability(fig, ax, plot):
    """Before and, where there is one, after temperature scaling: side by side, not overlaid."""
    import matplotlib.gridspec as gridspec
    ax.remove()
    shown = [(plot, f"as scored: ECE {100 * plot['ece']:.1f}", "C0")]
    if plot.get("after"):
        after = plot["after"]
        shown.append((after, f"after temperature {after['temperature']:.2f}: ECE {100 * after['ece']:.1f}", "C2"))
    grid = gridspec.GridSpec(1, len(shown), figure=fig, wspace=0.22)
    for spec, (data, title, colour) in zip(grid, shown):
        _reliability_panel(fig, spec, data, title, colour)


def figure(plot):
    """A matplotlib Figure (no pyplot: safe in threads) of one PLOT dict."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    kind = plot.get("kind")
    if kind not in KINDS:
        raise PlotError(f"plot '{plot.get('title')}': kind {kind!r} is not one of {', '.join(KINDS)}")
    fig = Figure(figsize=_size(plot))  # fixed margins: a constrained layout costs more than the drawing
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if kind == "curves":
        _curves(fig, ax, plot)
    elif kind == "matrix":
        _matrix(fig, ax, plot)
    elif kind == "bars":
        _bars(ax, plot)
    else:
        _reliability(fig, ax, plot)
    w, h = fig.get_size_inches()
    if kind == "reliability" or _panels(plot):
        fig.suptitle(plot.get("title", ""), fontsize=11)
        fig.subplots_adjust(left=0.7 / w, right=1 - 0.2 / w, top=1 - 0.75 / h, bottom=0.55 / h, hspace=0.45,
                            wspace=0.22)
        return fig
    ax.set_title(plot.get("title", ""), fontsize=10)
    longest = max((len(str(x)) for x in plot.get("labels", [""])), default=1)
    rotated = kind == "matrix" or kind == "bars" and len(plot["labels"]) > 6
    ticks = 0.05 * min(longest, 30) + 0.1  # inches taken by the longest (rotated) tick label
    fig.subplots_adjust(left=min(0.4, (0.6 + (ticks if kind == "matrix" else 0.15)) / w),
                        right=0.88 if kind == "matrix" else 0.97, top=1 - 0.4 / h,
                        bottom=min(0.45, (0.5 + (ticks if rotated else 0.05)) / h))
    return fig


_rendered = {}  # (plot as JSON, dpi) -> PNG bytes: report.html and TensorBoard draw a plot once


def png(plot, dpi=100):
    """PNG bytes of a plot (kept for the last few plots: the same plot is drawn once)."""
    key = (json.dumps(plot, sort_keys=True, default=str), dpi)
    if key not in _rendered:
        buffer = io.BytesIO()
        figure(plot).savefig(buffer, format="png", dpi=dpi)
        if len(_rendered) >= 16:
            _rendered.pop(next(iter(_rendered)))
        _rendered[key] = buffer.getvalue()
    return _rendered[key]


def rgb(plot, dpi=100):
    """uint8 [H, W, 3] of a plot (TensorBoard's add_image with dataformats="HWC"): png()'s pixels."""
    return np.asarray(Image.open(io.BytesIO(png(plot, dpi))).convert("RGB"))
