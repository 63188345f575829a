"""``RUN_DIR/loss.png``: the training loss (raw and smoothed) and the eval loss against the step (bottom
axis) and the tokens seen (top axis), the learning rate on a second y axis. Needs matplotlib (the
``bench`` extra)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

from .errors import UsageError, naming_path
from .outputs import check_output_file, ensure_parent
from .run_dir import METRICS_NAME
from .summary import read_metrics, smooth, smoothing_window

logger = logging.getLogger(__name__)

PLOT_NAME = "loss.png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _tokens_label(x: float, _pos=None) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _draw(fig, train: list[dict], evals: list[dict], title: str) -> None:
    from matplotlib.ticker import FuncFormatter

    ax = fig.add_subplot(1, 1, 1)
    steps = [r["step"] for r in train]
    losses = [r["loss"] for r in train]
    w = smoothing_window(len(train))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="training loss")
    if w > 1:
        ax.plot(steps, smooth(losses, w), color="tab:blue", linewidth=2, label=f"training loss, mean of {w} rows")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], color="tab:red", marker="o",
                linewidth=2, markersize=5, label="eval loss (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.grid(True, alpha=0.3)
    lr_ax = ax.twinx()
    with_lr = [r for r in train if isinstance(r.get("lr"), (int, float))]  # a row may lack it (hand-made, older)
    lr_ax.plot([r["step"] for r in with_lr], [r["lr"] for r in with_lr], color="tab:gray", linestyle="--",
               linewidth=1.2, label="learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:gray")
    lr_ax.tick_params(axis="y", colors="tab:gray")
    lr_ax.set_ylim(bottom=0)
    per_step = _tokens_per_step(train)
    if per_step:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
        top.set_xlabel("tokens seen")
        top.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    handles = ax.get_legend_handles_labels()
    lr_handles = lr_ax.get_legend_handles_labels()
    ax.legend(handles[0] + lr_handles[0], handles[1] + lr_handles[1], loc="upper right", fontsize=9)
    ax.set_title(title, fontsize=10)


def _tokens_per_step(train: list[dict]) -> float | None:
    for r in reversed(train):
        if r.get("tokens") and r["step"] > 0:
            return r["tokens"] / r["step"]
    return None


def _title(run_dir: str, train: list[dict], evals: list[dict]) -> str:
    parts = [os.path.basename(os.path.abspath(run_dir)), f"step {train[-1]['step']}"]
    if evals:
        parts.append(f"eval loss {evals[-1]['eval_loss']:.3f} at step {evals[-1]['step']}")
    return " | ".join(parts)


def write_loss_plot(run_dir: str, out: str | None = None) -> str:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/loss.png``), written atomically;
    returns the path. ``UsageError`` when matplotlib is missing, the run has no ``metrics.jsonl`` or no
    training rows in it."""
    if not have_matplotlib():
        raise UsageError("plotting needs matplotlib: pip install 'xlnet_fast[bench]'")
    check_plot_out(run_dir, out)
    metrics = os.path.join(run_dir, METRICS_NAME)
    if not os.path.isfile(metrics):
        raise UsageError(f"{metrics} does not exist: {run_dir} is not a pretraining run's --out, or its run has "
                         "logged no step yet")
    train, evals = read_metrics(run_dir)
    if not train:
        raise UsageError(f"{metrics}: no training rows to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    _draw(fig, train, evals, _title(run_dir, train, evals))
    out = out or os.path.join(run_dir, PLOT_NAME)
    ensure_parent(out)
    tmp = f"{out}.tmp{os.getpid()}.png"
    try:
        with naming_path(out):
            fig.savefig(tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return out


def _is_png(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == PNG_MAGIC
    except OSError:
        return False


def check_plot_out(run_dir: str, out: str | None) -> None:
    """``--out`` by the output rule (``outputs.check_output_file``): an existing file is replaced only
    when it is a PNG image, never the run's metrics. Without ``--out``, RUN_DIR/loss.png likewise (a
    file of the user's by that name was replaced, by ``plot`` and at the end of every run)."""
    if out is not None:
        check_output_file(out, command="plot", inputs=[os.path.join(run_dir, METRICS_NAME)], replaceable=_is_png)
        return
    default = os.path.join(run_dir, PLOT_NAME)
    if os.path.isdir(default) or (os.path.lexists(default) and not _is_png(default)):
        raise UsageError(f"{default} exists and is not a plot this command drew: move it, or pass --out PATH")


def plot_at_end(run_dir: str) -> str:
    """After a run: the plot's path, or why there is none (never raises)."""
    if not have_matplotlib():
        return (f"no {PLOT_NAME} (matplotlib not installed: pip install 'xlnet_fast[bench]', then "
                f"xlnet-fast plot {run_dir})")
    try:
        return write_loss_plot(run_dir)
    except Exception as exc:  # a plot must never fail the run
        logger.warning("could not draw %s: %s", os.path.join(run_dir, PLOT_NAME), exc)
        return f"no {PLOT_NAME} ({exc})"
