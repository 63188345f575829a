"""PNG plots of the benchmark records (needs the ``bench`` extra): the attention providers' time
against the sequence length, the model step's tokens/s, the CPU model ratios.

    python -m bench.plot [--results bench/results] [--device NAME] [--out DIR | --record]

``attention_<device>_<dtype>_D<D>_mlen<mlen>_<mode>.png``: time against sequence length per
provider (log-log, OOM marked), from the latest records of each configuration;
``cpu_vs_hf.png``: the CPU model ratios. Written to ``--out`` (default: the cache directory, see
``bench.runner``), or with ``--record`` next to the project's records in ``bench/results/``. The GPU
campaign (``bench.campaign``) draws its ``attention.png`` (``attention_panels``) and
``model_step.png`` (``model_bars``) from its records with the same functions.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from bench import runner
from bench.attention import PROVIDERS, XLNET_PROVIDERS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    runner.save_figure(fig, path)
    _pyplot().close(fig)
    return path


def attention_panel(ax, records: list, title: str) -> None:
    """Median ms against qlen of ``xlnet_attn`` records (the latest of each provider and qlen): a
    line per provider, dashed for plain attention; OOM as crosses along the top in its colour."""
    points = {(r["provider"], r["L"]): r for r in records}
    rank = {p: n for n, p in enumerate(PROVIDERS)}  # a provider's colour is the same in every panel
    oom_rows = 0
    for prov in sorted({p for p, _ in points}, key=lambda p: rank.get(p, len(rank))):
        color = f"C{rank.get(prov, len(rank))}"
        ok = sorted((L, r["ms"]) for (p, L), r in points.items() if p == prov and r["ms"] != runner.OOM)
        if ok:
            ax.plot(*zip(*ok), marker="o", label=prov, color=color, linestyle="-" if prov in XLNET_PROVIDERS else "--")
        oom = sorted(L for (p, L), r in points.items() if p == prov and r["ms"] == runner.OOM)
        if oom:
            y, oom_rows = 0.95 - 0.06 * oom_rows, oom_rows + 1
            ax.plot(oom, [y] * len(oom), "x", color=color, transform=ax.get_xaxis_transform(), clip_on=False)
            ax.annotate(f"{prov} OOM", (oom[0], y), xycoords=("data", "axes fraction"), xytext=(5, -3),
                        textcoords="offset points", fontsize=7, color=color)
    ax.set(xscale="log", yscale="log", xlabel="qlen", ylabel="median ms", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def plot_attention(records, out_dir: Path, device: str | None) -> list[Path]:
    """One file per (device, dtype, D, mlen, mode) of ``xlnet_attn`` records."""
    plt = _pyplot()
    groups = defaultdict(list)
    for r in records:
        if r.get("op") == "xlnet_attn" and (device is None or r["device"] == device):
            groups[(r["device"], r["dtype"], r["D"], r["mlen"], r["mode"])].append(r)
    written = []
    for (dev, dtype, D, mlen, mode), group in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        attention_panel(ax, group, f"XLNet attention {mode}, {dtype}, D={D}, mlen={mlen}\n{dev}")
        written.append(_save(fig, out_dir / f"attention_{_slug(dev)}_{dtype}_D{D}_mlen{mlen}_{mode}.png"))
    return written


def attention_panels(records, path: Path) -> bool:
    """The campaign's sweep in one figure: a panel per (D, mode); False when nothing was measured."""
    recs = [r for r in records if r.get("op") == "xlnet_attn" and r.get("status") in ("ok", "oom")
            and not r.get("repeat")]
    if not recs:
        return False
    plt = _pyplot()
    Ds, modes = sorted({r["D"] for r in recs}), [m for m in ("fwd", "fwd_bwd") if any(r["mode"] == m for r in recs)]
    fig, axes = plt.subplots(len(Ds), len(modes), figsize=(5.5 * len(modes), 4 * len(Ds)), squeeze=False)
    for (i, D), (j, mode) in ((x, y) for x in enumerate(Ds) for y in enumerate(modes)):
        attention_panel(axes[i][j], [r for r in recs if r["D"] == D and r["mode"] == mode],
                        f"{'fwd+bwd' if mode == 'fwd_bwd' else 'fwd'}, D={D}")
    fig.suptitle(f"XLNet attention, same tensors per shape (dashed: plain attention of the same shape) — "
                 f"{recs[0].get('device', '')}")
    _save(fig, path)
    return True


def model_bars(records, path: Path) -> bool:
    """Tokens/s of XLNet's training step and inference forward per model and provider, peak memory on
    the bars (``bench.model_step``, and the older ``bench.pretrain_step``); False when nothing was
    measured."""
    from bench.campaign_report import model_records

    recs = model_records(records)
    if not recs:
        return False
    plt = _pyplot()
    labels = list(dict.fromkeys(f"{r.get('case', r.get('config'))} {r['mode']}" for r in recs))
    provs = list(dict.fromkeys(r["provider"] for r in recs))
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 1.2 * len(labels) * len(provs)), 4))
    width = 0.8 / len(provs)
    for j, prov in enumerate(provs):
        for i, label in enumerate(labels):
            r = next((r for r in recs if f"{r.get('case', r.get('config'))} {r['mode']}" == label
                      and r["provider"] == prov), None)
            if r is None:
                continue
            x = i + (j - (len(provs) - 1) / 2) * width
            tps = r.get("tokens_per_s") or 0.0
            ax.bar(x, tps, width, color=f"C{j}", label=prov if i == 0 else None)
            peak = f"{r['peak_mem_mb'] / 1024:.1f} GiB" if r.get("peak_mem_mb") else ""
            ax.annotate("OOM" if r["status"] == "oom" else peak, (x, tps), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"XLNet training step and inference forward (on the bars: peak memory)\n{recs[0].get('device', '')}",
                 fontsize=10)
    ax.legend()
    _save(fig, path)
    return True


def plot_cpu(records, out_dir: Path) -> list[Path]:
    recs = [r for r in records if r.get("op") == "cpu_model_vs_hf"]
    if not recs:
        return []
    r = recs[-1]
    modes = list(r["modes"])
    fig, ax = _pyplot().subplots(figsize=(5, 3.5))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [r["modes"][m]["time_ratio"] for m in modes], 0.4, label="time")
    mem_ratios = [r["modes"][m]["mem_ratio"] for m in modes]  # None: no growth measured, no bar
    ax.bar([x + 0.2 for x in xs], [math.nan if v is None else v for v in mem_ratios], 0.4, label="peak memory growth")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), modes)
    ax.set(ylabel="xlnet_fast / transformers", title=f"CPU, {r.get('model', 'XLNet')} L={r['L']} ({r['date']})")
    ax.legend()
    return [_save(fig, out_dir / "cpu_vs_hf.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=runner.RESULTS_DIR, help="folder of the records to plot")
    p.add_argument("--device", default=None)
    runner.add_output_args(p, "")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = runner.output_path(args, "")
    records = {}
    for f in sorted(args.results.glob("*.json")):
        records[f.stem] = json.loads(f.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    written = plot_attention(records.get("attention", []), out_dir, args.device)
    written += plot_cpu(records.get("cpu_vs_hf", []), out_dir)
    for w in written:
        print(w)
    if not written:
        print("no records to plot in", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
