"""Turn the benchmark records in bench/results/*.json into PNG plots (needs the ``bench`` extra).

    python -m bench.plot [--results bench/results] [--device NAME] [--out DIR | --record]

``attention_<device>_<dtype>_D<D>_mlen<mlen>_<mode>.png``: time against sequence length per
provider (log-log, OOM marked), from the latest records of each configuration;
``cpu_vs_hf.png``: the CPU model ratios. Written to ``--out`` (default: the cache directory, see
``bench.runner``), or with ``--record`` next to the project's records in ``bench/results/``.
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


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


def plot_attention(records, out_dir: Path, device: str | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(dict)
    for r in records:
        if r.get("op") != "xlnet_attn" or (device and r["device"] != device):
            continue
        key = (r["device"], r["dtype"], r["D"], r["mlen"], r["mode"])
        groups[key][(r["provider"], r["L"])] = r  # later records win
    written = []
    for (dev, dtype, D, mlen, mode), rows in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for prov in sorted({p for p, _ in rows}):
            pts = sorted((L, r["ms"]) for (p, L), r in rows.items() if p == prov)
            ok = [(L, ms) for L, ms in pts if ms != "OOM"]
            if ok:
                ax.plot(*zip(*ok), marker="o", label=prov)
            for L, ms in pts:
                if ms == "OOM":
                    ax.annotate("OOM", (L, ax.get_ylim()[1]), ha="center", fontsize=7)
        ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="ms (median)",
               title=f"XLNet attention {mode}, {dtype}, D={D}, mlen={mlen}\n{dev}")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        path = out_dir / f"attention_{_slug(dev)}_{dtype}_D{D}_mlen{mlen}_{mode}.png"
        fig.tight_layout()
        runner.save_figure(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def plot_cpu(records, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r.get("op") == "cpu_model_vs_hf"]
    if not recs:
        return []
    r = recs[-1]
    modes = list(r["modes"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [r["modes"][m]["time_ratio"] for m in modes], 0.4, label="time")
    mem_ratios = [r["modes"][m]["mem_ratio"] for m in modes]  # None: no growth measured, no bar
    ax.bar([x + 0.2 for x in xs], [math.nan if v is None else v for v in mem_ratios], 0.4, label="peak memory growth")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), modes)
    ax.set(ylabel="xlnet_fast / transformers", title=f"CPU, {r.get('model', 'XLNet')} L={r['L']} ({r['date']})")
    ax.legend()
    path = out_dir / "cpu_vs_hf.png"
    fig.tight_layout()
    runner.save_figure(fig, path)
    plt.close(fig)
    return [path]


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
