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


def _size(plot):
    if plot["kind"] == "matrix":
        n = len(plot["labels"])
        side = min(11.0, max(4.0, 0.35 * n + 2.5))
        return side, side * 0.9
    if plot["kind"] == "bars":
        return min(14.0, max(5.0, 0.3 * len(plot["labels"]) + 2)), 4.0
    return 5.5, 4.0


def _curves(ax, plot):
    for s in plot["series"]:
        ax.plot(s["x"], s["y"], label=s.get("label"), linewidth=1.4)
    ax.set_xlabel(plot.get("x_label", ""))
    ax.set_ylabel(plot.get("y_label", ""))
    if plot.get("x_range"):
        ax.set_xlim(*plot["x_range"])
    if plot.get("y_range"):
        ax.set_ylim(*plot["y_range"])
    if any(s.get("label") for s in plot["series"]) and len(plot["series"]) <= 25:
        ax.legend(fontsize=7, loc=plot.get("legend", "best"))
    ax.grid(alpha=0.3)


def _matrix(fig, ax, plot):
    values = np.asarray(plot["values"], dtype=float)
    labels = list(plot["labels"])
    if values.shape != (len(labels), len(labels)) and values.shape[0] != len(labels):
        raise PlotError(f"matrix '{plot.get('title')}': {values.shape} values for {len(labels)} labels")
    col_labels = list(plot.get("col_labels", labels))
    shown = values
    if plot.get("normalise"):
        shown = values / np.maximum(values.sum(1, keepdims=True), 1e-12)
    image = ax.imshow(shown, cmap="Blues", vmin=0, vmax=1 if plot.get("normalise") else None, aspect="auto")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
    small = 6 if len(labels) > 15 else 8
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=60, ha="right", fontsize=small)
    ax.set_yticks(range(len(labels)), labels, fontsize=small)
    ax.set_xlabel(plot.get("x_label", "predicted"))
    ax.set_ylabel(plot.get("y_label", "ground truth"))
    if values.size <= 400:  # numbers in the cells while they stay readable
        top = shown.max() if shown.size else 0
        for (i, j), v in np.ndenumerate(shown):
            if values[i, j]:
                text = f"{v:.2f}" if plot.get("normalise") else f"{int(values[i, j])}"
                ax.text(j, i, text, ha="center", va="center", fontsize=small - 1,
                        color="white" if v > 0.6 * (1 if plot.get("normalise") else top) else "black")


def _bars(ax, plot):
    labels = list(plot["labels"])
    series = plot["series"]
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for k, s in enumerate(series):
        values = [np.nan if v is None else v for v in s["values"]]
        ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=s.get("label"))
    ax.set_xticks(x, labels, rotation=60 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center",
                  fontsize=7 if len(labels) > 15 else 8)
    ax.set_ylabel(plot.get("y_label", ""))
    if plot.get("y_range"):
        ax.set_ylim(*plot["y_range"])
    if len(series) > 1 or series and series[0].get("label"):
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _reliability(ax, plot):
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    shown = [("before", plot)] + ([("after", plot["after"])] if plot.get("after") else [])
    for k, (name, data) in enumerate(shown):
        bins = [b for b in data["bins"] if b["count"] > 0]
        centres = [(b["lo"] + b["hi"]) / 2 for b in bins]
        width = (bins[0]["hi"] - bins[0]["lo"]) if bins else 0.066
        label = data.get("label") or (f"temperature {data['temperature']:.2f}" if "temperature" in data else name)
        ax.bar(np.array(centres) + (k - (len(shown) - 1) / 2) * width / len(shown), [b["accuracy"] for b in bins],
               width / len(shown), alpha=0.75, label=f"{label}: ECE {100 * data['ece']:.2f}%", edgecolor="black",
               linewidth=0.4)
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", markersize=3,
                linewidth=1, color=f"C{k}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel(plot.get("x_label", "confidence"))
    ax.set_ylabel(plot.get("y_label", "accuracy"))
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)


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
        _curves(ax, plot)
    elif kind == "matrix":
        _matrix(fig, ax, plot)
    elif kind == "bars":
        _bars(ax, plot)
    else:
        _reliability(ax, plot)
    ax.set_title(plot.get("title", ""), fontsize=10)
    w, h = fig.get_size_inches()
    longest = max((len(str(x)) for x in plot.get("labels", [""])), default=1)
    rotated = kind == "matrix" or kind == "bars" and len(plot["labels"]) > 6
    ticks = 0.045 * min(longest, 30) + 0.1  # inches taken by the longest (rotated) tick label
    fig.subplots_adjust(left=min(0.4, (0.5 + (ticks if kind == "matrix" else 0.15)) / w),
                        right=0.88 if kind == "matrix" else 0.97, top=1 - 0.4 / h,
                        bottom=min(0.45, (0.45 + (ticks if rotated else 0.05)) / h))
    return fig


_rendered = {}  # (plot as JSON, dpi) -> PNG bytes: report.html and TensorBoard draw a plot once


def png(plot, dpi=80):
    """PNG bytes of a plot (kept for the last few plots: the same plot is drawn once)."""
    key = (json.dumps(plot, sort_keys=True, default=str), dpi)
    if key not in _rendered:
        buffer = io.BytesIO()
        figure(plot).savefig(buffer, format="png", dpi=dpi)
        if len(_rendered) >= 16:
            _rendered.pop(next(iter(_rendered)))
        _rendered[key] = buffer.getvalue()
    return _rendered[key]


def rgb(plot, dpi=80):
    """uint8 [H, W, 3] of a plot (TensorBoard's add_image with dataformats="HWC"): png()'s pixels."""
    return np.asarray(Image.open(io.BytesIO(png(plot, dpi))).convert("RGB"))
