"""The study's report, written again after every trial: study.md and study.html (self-contained, its
plots embedded), best.yaml (the best trial's config, trained with train.py as it is) and every trial in
TensorBoard's hparams view (<study>/tensorboard). The plots are Optuna's matplotlib ones."""
import io
import logging
import os
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from optuna.visualization import matplotlib as optuna_plots  # noqa: E402

from engine.files import atomic_write  # noqa: E402
from engine.logger import TensorBoard  # noqa: E402
from engine.report.html import STYLE, _data_uri, _esc, table_html  # noqa: E402
from tuning.study import counts, interrupted  # noqa: E402

log = logging.getLogger(__name__)

PLOTS = (("history", "Optimisation history", optuna_plots.plot_optimization_history),
         ("importances", "Parameter importances", optuna_plots.plot_param_importances),
         ("slices", "Slices", optuna_plots.plot_slice),
         ("parallel", "Parallel coordinates", optuna_plots.plot_parallel_coordinate),
         ("intermediate", "Evaluations of each trial (what the pruner saw)", optuna_plots.plot_intermediate_values))


def _png(draw, study):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's "experimental" warnings
        result = draw(study)
    fig = result.figure if hasattr(result, "figure") else result[0].figure if hasattr(result, "__len__") else result
    fig.set_size_inches(max(fig.get_size_inches()[0], 6), max(fig.get_size_inches()[1], 4))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close("all")
    return buffer.getvalue()


def plots(study):
    """[(name, title, png bytes or None, why left out)] of Optuna's plots that the study's trials allow."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    out = []
    for name, title, draw in PLOTS:
        if len(done) < (2 if name in ("importances", "parallel") else 1):
            out.append((name, title, None, f"needs {'2 completed trials' if name in ('importances', 'parallel') else 'a completed trial'}"))
            continue
        try:
            out.append((name, title, _png(draw, study), None))
        except Exception as e:  # a plot Optuna cannot draw for this study (e.g. one distinct value)
            plt.close("all")
            out.append((name, title, None, f"{type(e).__name__}: {e}"))
    return out


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)


def trial_rows(study, space):
    gone = interrupted(study)
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            continue
        state = "interrupted" if t.number in gone else t.state.name.lower()
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and \
            t.datetime_start else None
        pruned = t.user_attrs.get("pruned_at")
        note = (f"{pruned.get('pruner', '')} pruner at epoch {pruned['epoch']} (step {pruned['step']}): "
                f"{_fmt(pruned['value'])}" if pruned else
                t.user_attrs.get("error", "").splitlines()[0][:160] if t.user_attrs.get("error") else
                f"resumes trial {t.system_attrs['failed_trial']}" if "failed_trial" in t.system_attrs else "")
        values = space.values(t.params)
        rows.append([t.number, state, t.value, *[values.get(p.key) for p in space], seconds, note])
    return rows


def summary(study, space, objective, wall_seconds=None):
    """The facts the report leads with: the best trial, the counts, the time and the pruned share."""
    c = counts(study)
    finished = c.get("complete", 0) + c.get("pruned", 0) + c.get("fail", 0)
    try:
        best = study.best_trial
    except ValueError:
        best = None
    spent = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in study.get_trials(deepcopy=False)
                if t.datetime_complete and t.datetime_start)
    return {"planned": study.user_attrs.get("planned"), "counts": c, "finished": finished,
            "pruned_share": c.get("pruned", 0) / finished if finished else 0.0, "trial_seconds": spent,
            "wall_seconds": wall_seconds, "objective": objective,
            "best": None if best is None else {"number": best.number, "value": best.value,
                                                "params": space.values(best.params),
                                                "folder": best.user_attrs.get("folder")}}


def headline(s, direction):
    best = s["best"]
    c = s["counts"]
    lines = [f"{s['finished']} of {s['planned']} trials finished: {c.get('complete', 0)} complete, "
             f"{c.get('pruned', 0)} pruned ({100 * s['pruned_share']:.0f}%), {c.get('fail', 0)} failed"
             + (f", {c['interrupted']} interrupted and resumed as new trials" if c.get("interrupted") else "")
             + (f", {c['running']} running" if c.get("running") else "") + "."]
    lines.append(f"Time in trials: {s['trial_seconds']:.0f} s" +
                 (f"; this tune.py's wall time: {s['wall_seconds']:.0f} s." if s["wall_seconds"] else "."))
    if best:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items())
        lines.insert(0, f"Best: trial {best['number']}, {s['objective']} {best['value']:.4f} ({direction}), "
                        f"with {params}. Train it again: python train.py --config best.yaml")
    else:
        lines.insert(0, "No trial has completed yet.")
    return lines


def write(study, space, study_dir, objective, wall_seconds=None):
    """study.md, study.html, plots/*.png and best.yaml in study_dir; returns the summary."""
    s = summary(study, space, objective, wall_seconds)
    direction = study.direction.name.lower()
    if s["best"] and s["best"]["folder"]:
        config = os.path.join(s["best"]["folder"], "trial.yaml")
        if os.path.isfile(config):
            text = open(config).read()
            atomic_write(os.path.join(study_dir, "best.yaml"), lambda f: f.write(
                f"# tune.py: the best trial ({s['best']['number']}) of {study.study_name}, {objective} "
                f"{s['best']['value']:.4f}\n" + text))
    columns = ["trial", "state", objective, *[p.key for p in space], "seconds", "pruned at / error"]
    rows = trial_rows(study, space)
    drawn = plots(study)
    os.makedirs(os.path.join(study_dir, "plots"), exist_ok=True)
    md = [f"# Study {study.study_name}", "", *[f"- {l}" for l in headline(s, direction)], "",
          "## Space", "", *[f"- `{p.key}`: {p.describe()}" for p in space], "", "## Trials", "",
          "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    md += ["", "## Plots", ""]
    for name, title, png, why in drawn:
        if png:
            path = os.path.join(study_dir, "plots", f"{name}.png")
            atomic_write(path, lambda f, data=png: f.write(data), binary=True)
            md.append(f"![{title}](plots/{name}.png)")
        else:
            md.append(f"- {title}: not drawn ({why})")
    atomic_write(os.path.join(study_dir, "study.md"), lambda f: f.write("\n".join(md) + "\n"))
    body = [f"<h1>Study {_esc(study.study_name)}</h1>"] + [f"<p><b>{_esc(l)}</b></p>" if i == 0 else f"<p>{_esc(l)}</p>"
                                                          for i, l in enumerate(headline(s, direction))]
    body += ["<h2>Space</h2><ul>"] + [f"<li><code>{_esc(p.key)}</code>: {_esc(p.describe())}</li>" for p in space]
    body += ["</ul><h2>Trials</h2>", table_html({"columns": columns, "rows": rows}), "<h2>Plots</h2><div class=plots>"]
    for name, title, png, why in drawn:
        body.append(f'<figure><img class=plot alt="{_esc(title)}" src="{_data_uri(png, "image/png")}">'
                    f"<figcaption>{_esc(title)}</figcaption></figure>" if png else
                    f"<p class=note>{_esc(title)}: not drawn ({_esc(why)})</p>")
    body.append("</div>")
    page = ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            f"<title>Study {_esc(study.study_name)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    atomic_write(os.path.join(study_dir, "study.html"), lambda f: f.write(page.encode("utf-8")), binary=True)
    return s


def hparams(study_dir, trial_number, params, metrics):
    """The trial in TensorBoard's hparams view: <study>/tensorboard/trial_NNN."""
    metrics = {k: v for k, v in metrics.items() if v is not None}
    tb = TensorBoard(os.path.join(study_dir, "tensorboard", f"trial_{trial_number:03d}"))
    tb.scalars(metrics, 0, "tune")
    tb.hparams({k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()},
               {f"tune/{k}": v for k, v in metrics.items()})
    tb.close()
