"""What a run did, read back from its ``metrics.jsonl``: the rows, the smoothed training loss, and the
summary ``xlnet-fast pretrain`` prints at the end (also after SIGTERM)."""

from __future__ import annotations

import json
import os

import numpy as np

from .run_dir import METRICS_NAME

MAX_SMOOTHING_WINDOW = 100


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
    """``(training rows, eval rows)`` of ``run_dir/metrics.jsonl`` in file order (unreadable lines
    skipped; none when the file is missing)."""
    train, evals = [], []
    try:
        with open(os.path.join(run_dir, METRICS_NAME), "rb") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return [], []
    for raw in lines:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            if _is_number(row.get("eval_loss")):
                evals.append(row)
            elif _is_number(row.get("loss")):
                train.append(row)
    return train, evals


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def smoothing_window(n: int) -> int:
    """Rows averaged by the smoothed loss: a tenth of the rows, between 1 and 100."""
    return max(1, min(MAX_SMOOTHING_WINDOW, n // 10))


def smooth(values: list[float] | np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start): ``(n,)`` -> ``(n,)``."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return x
    csum = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def loss_ends(train: list[dict]) -> tuple[float, float, int] | None:
    """``(mean of the first window of losses, mean of the last window, window)``; None without rows."""
    if not train:
        return None
    w = smoothing_window(len(train))
    losses = [r["loss"] for r in train]
    return float(np.mean(losses[:w])), float(np.mean(losses[-w:])), w


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _throughput_line(result: dict) -> str:
    session = result.get("session") or {}
    if not session.get("tokens_per_s"):
        return "throughput: no training step in this session"
    line = f"throughput: {session['tokens_per_s']:,.0f} tokens/s (mean over this session's training steps)"
    if session.get("mfu") is not None:
        return line + f", MFU {100 * session['mfu']:.1f}% ({result.get('mfu_note', '')})"
    return line + f"; {result.get('mfu_note', 'MFU omitted')}"


def _loss_lines(train: list[dict], evals: list[dict]) -> list[str]:
    lines = []
    ends = loss_ends(train)
    if ends is not None:
        first, last, w = ends
        lines.append(f"training loss: {first:.4f} -> {last:.4f} (means of the first and last {w} logged "
                     f"step{'s' if w > 1 else ''})")
    if evals:
        e = evals[-1]
        lines.append(f"eval loss: {e['eval_loss']:.4f} (perplexity {e['eval_ppl']:.1f}, {e['eval_tokens']:,} "
                     f"targets) at step {e['step']}")
    else:
        lines.append("eval loss: none yet (evaluations run every --eval-every steps and at the end)")
    return lines


def _how_to_lines(result: dict) -> list[str]:
    out, ckpt = result["out"], result.get("checkpoint")
    if ckpt is None:
        return [f"checkpoints: none in {os.path.join(out, 'checkpoints')}"]
    cls = result.get("model_class", "XLNetLMHeadModel")
    whose = "xlnet_fast's or transformers'" if cls == "XLNetLMHeadModel" else "xlnet_fast's or transformers 4.x's"
    return [
        f"checkpoints: {os.path.dirname(ckpt)} (newest: {os.path.basename(ckpt)})",
        f"load: xlnet-fast export {ckpt} --out DIR, then {cls}.from_pretrained(DIR) ({whose}); in Python: "
        f"xlnet_fast.pretrain.checkpoint.load_model_weights(model, {ckpt!r})",
        f"resume: xlnet-fast pretrain --out {out} --resume" + ("" if result.get("preempted") else " --steps N"),
        f"evaluate: xlnet-fast eval --model {ckpt}   export: xlnet-fast export {out} --out DIR",
    ]


def format_summary(result: dict) -> str:
    """The end-of-run summary: steps, tokens, time, throughput, losses, checkpoints and how to use
    them. ``result``: what ``pretrain`` returns."""
    train, evals = read_metrics(result["out"])
    session = result.get("session") or {}
    ended = f"stopped by {result.get('stopped_by') or 'SIGTERM'}" if result.get("preempted") else "finished"
    head = (f"pretrain {ended} at step {result['step']} of {result['steps']}: "
            f"{result['step'] * result['tokens_per_step']:,} tokens seen ({result['tokens_per_step']:,} per step); "
            f"this session {session.get('steps', 0)} steps in {_duration(session.get('wall_s', 0.0))}")
    lines = [head, _throughput_line(result), *_loss_lines(train, evals), *_how_to_lines(result)]
    extras = [f"metrics: {os.path.join(result['out'], METRICS_NAME)}"]
    if result.get("plot"):
        extras.append(f"plot: {result['plot']}")
    lines.append("; ".join(extras))
    return "\n".join(lines)
