"""The campaign's records turned into a summary (markdown), the README's tables and PNG plots.

Records are the lines of ``campaign.jsonl`` (``bench.campaign``); each has ``run``, ``step``,
``op``, ``status`` (``ok``, ``error``, ``skipped``, ``cut``, ``oom``) and ``t`` (seconds since the
campaign started), and the fields of its ``op``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bench import attention, runner

PROVIDER_ORDER = ("xlnet_fast", "xlnet_fast_det", "flex", "hf", "eager", "sdpa_flash", "fa2_ref")
# docs/DESIGN.md §6: on a GPU, fwd+bwd within 2x SDPA-flash, and 10x transformers' core at L = 512
TARGET_VS_FLASH = 2.0
TARGET_VS_HF = 10.0
TARGET_HF_L = 512


def load_records(paths) -> tuple[list, list]:
    """The records of JSONL files, and a note per line that was not JSON (a torn last line)."""
    records, notes = [], []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                notes.append(f"{path}:{n}: not a JSON record (dropped)")
    return records, notes


def _ok(records, op: str) -> list:
    return [r for r in records if r.get("op") == op and r.get("status") == "ok"]


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def attention_grid(records) -> dict:
    """``{(D, L, mlen, mode): {provider: record}}`` of the sweep's measurements (latest wins; the
    repeat measurements are left out), OOM included."""
    grid = defaultdict(dict)
    for r in records:
        if r.get("op") == "xlnet_attn" and r.get("status") in ("ok", "oom") and not r.get("repeat"):
            grid[(r["D"], r["L"], r["mlen"], r["mode"])][r["provider"]] = r
    return grid


def _ms(rec) -> float | None:
    if rec is None or rec.get("status") != "ok" or not isinstance(rec.get("ms"), (int, float)):
        return None
    return rec["ms"]


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _cell(rec) -> str:
    if rec is None:
        return "–"
    if rec.get("status") == "oom":
        return "OOM"
    return f"{rec['ms']:.3g} ms ({rec['tflops']:.3g})" if rec.get("tflops") else f"{rec['ms']:.3g} ms"


def attention_section(records) -> list:
    grid = attention_grid(records)
    if not grid:
        return ["No attention measurements."]
    provs = [p for p in PROVIDER_ORDER if any(p in row for row in grid.values())]
    ratios = ["xlnet_fast / sdpa_flash", "hf / xlnet_fast", "flex / xlnet_fast"]
    header = ["D", "L", "mlen", "B", "mode"] + provs + ratios
    rows = []
    for (D, L, mlen, mode), row in sorted(grid.items()):
        xf = _ms(row.get("xlnet_fast"))
        B = next(iter(row.values()))["B"]
        rows.append([D, L, mlen, B, mode] + [_cell(row.get(p)) for p in provs]
                    + [_fmt(_ratio(xf, _ms(row.get("sdpa_flash"))), 3), _fmt(_ratio(_ms(row.get("hf")), xf), 3),
                       _fmt(_ratio(_ms(row.get("flex")), xf), 3)])
    lines = [f"Median ms (TFLOP/s, counted as {attention.FLOPS_CONVENTION}); OOM = out of memory.", ""]
    lines += _table(header, rows)
    repeats = [r for r in records if r.get("op") == "xlnet_attn" and r.get("repeat") and r.get("status") == "ok"]
    for r in repeats:
        first = _ms(grid.get((r["D"], r["L"], r["mlen"], r["mode"]), {}).get(r["provider"]))
        if first:
            lines.append(f"\nSpread: {r['provider']} {r['mode']} D={r['D']} L={r['L']} timed twice: {first:.4g} and "
                         f"{r['ms']:.4g} ms ({100 * abs(r['ms'] - first) / first:.1f}% apart); smaller differences "
                         "are noise.")
    return lines


def targets_section(records) -> list:
    """The GPU targets of docs/DESIGN.md §6, each met or missed with the measured ratio."""
    grid = attention_grid(records)
    lines = []
    for (D, L, mlen, mode), row in sorted(grid.items()):
        xf = _ms(row.get("xlnet_fast"))
        vs_flash = _ratio(xf, _ms(row.get("sdpa_flash")))
        if mode == "fwd_bwd" and vs_flash is not None:
            verdict = "met" if vs_flash <= TARGET_VS_FLASH else f"missed by {vs_flash / TARGET_VS_FLASH:.2f}x"
            lines.append(f"- fwd+bwd ≤ {TARGET_VS_FLASH:g}x SDPA-flash, D={D} L={L} mlen={mlen}: "
                         f"{vs_flash:.2f}x — {verdict}")
        vs_hf = _ratio(_ms(row.get("hf")), xf)
        if L == TARGET_HF_L and vs_hf is not None:
            verdict = "met" if vs_hf >= TARGET_VS_HF else f"missed by {TARGET_VS_HF / vs_hf:.2f}x"
            lines.append(f"- ≥ {TARGET_VS_HF:g}x transformers' attention core, {mode}, D={D} L={L} mlen={mlen}: "
                         f"{vs_hf:.1f}x — {verdict}")
    ceiling = _ok(records, "ceiling_matmul")
    if ceiling:
        best = max((r for r in _ok(records, "xlnet_attn") if r["provider"] == "xlnet_fast" and r.get("tflops")),
                   key=lambda r: r["tflops"], default=None)
        if best:
            lines.append(f"- xlnet_fast's best rate: {best['tflops']:.0f} TFLOP/s ({best['mode']}, D={best['D']}, "
                         f"L={best['L']}) = {100 * best['tflops'] / ceiling[-1]['tflops']:.0f}% of the measured bf16 "
                         f"matmul ceiling ({ceiling[-1]['tflops']:.0f} TFLOP/s)")
    return lines or ["No measurement to compare with the targets."]


# --------------------------------------------------------------------------------------------------
# Other sections
# --------------------------------------------------------------------------------------------------


def environment_section(records) -> list:
    """Per run (a report may merge the parts of a session): the device, versions and ceilings."""
    lines = []
    for run in dict.fromkeys(r.get("run") for r in records):
        mine = [r for r in records if r.get("run") == run]
        for r in _ok(mine, "environment")[-1:]:
            lines.append(f"- run {run}: {r.get('device')} ({r.get('sm_count', '–')} SMs, "
                         f"{r.get('memory_gib', '–')} GiB), torch {r.get('torch')}, triton {r.get('triton')}, "
                         f"transformers {r.get('transformers')}, CUDA {r.get('cuda')}, python {r.get('python')}; "
                         f"mode {r.get('mode')}, {r.get('date')}")
        for r in _ok(mine, "ceiling_matmul")[-1:]:
            lines.append(f"  - bf16 matmul {r['n']}³ on random data: {r['tflops']:.0f} TFLOP/s ({r['ms']:.3f} ms)")
        for r in _ok(mine, "ceiling_copy")[-1:]:
            lines.append(f"  - device-to-device copy of {r['mib']} MiB: {r['gb_per_s']:.0f} GB/s ({r['counting']})")
    return lines or ["No environment record."]


def correctness_section(records) -> list:
    lines = []
    for r in [r for r in records if r.get("op") == "pytest"]:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r.get("counts", {}).items()))
        lines.append(f"- pytest ({r['status']}): {counts or r.get('reason') or r.get('error', '')}"
                     + (f", kernels pinned to {r['pinned_config']}" if r.get("pinned_config") else "")
                     + (f"; failed: {', '.join(r['failed_tests'])}" if r.get("failed_tests") else ""))
    checks = [r for r in records if r.get("op") == "xlnet_attn_check" and "rel_err_out" in r]
    if checks:
        lines.append("")
        lines += _table(["case", "dtype", "config", "deterministic", "rel err out", "worst grad", "within tolerance"],
                        [[r["case"], r["dtype"], r.get("config", "autotuned"), r.get("deterministic", False),
                          f"{r['rel_err_out']:.2e}", f"{r['rel_err_grad']:.2e} ({r['worst_grad']})",
                          "yes" if r["within_tolerance"] else "**NO**"] for r in checks])
    agreement = _ok(records, "provider_agreement")
    if agreement:
        lines.append("")
    for r in agreement:
        errs = ", ".join(f"{p} {e:.1e}" for p, e in r["rel_err_vs_eager_fp32"].items())
        lines.append(f"- forward outputs against the eager backend in fp32, D={r['D']} L={r['L']}: {errs}")
    return lines or ["No correctness record."]


def pretrain_section(records) -> list:
    rows, by_case = [], defaultdict(dict)
    for r in records:
        if r.get("op") == "pretrain_step" and r.get("status") in ("ok", "oom"):
            by_case[r.get("case", r.get("config"))][r["provider"]] = r
    for case, provs in by_case.items():
        fast, hf = provs.get("xlnet_fast"), provs.get("hf")
        speedup = _ratio((fast or {}).get("tokens_per_s"), (hf or {}).get("tokens_per_s"))
        for prov, r in provs.items():
            tps = "OOM" if r["status"] == "oom" else f"{r['tokens_per_s']:,.0f}"
            peak = f"{r['peak_mem_mb'] / 1024:.1f}" if r.get("peak_mem_mb") else "–"
            rows.append([case, r.get("n_layer", "–"), r.get("B"), r.get("L"), r.get("mlen"), r.get("num_predict"),
                         prov, tps, _fmt(r["ms"] if r["status"] == "ok" else None, 4), peak,
                         _fmt(speedup, 3) if prov == "xlnet_fast" else ""])
    if not rows:
        return ["No pretraining-step measurement."]
    return _table(["model", "layers", "B", "seq", "mem", "targets", "provider", "tokens/s", "ms/step", "peak GiB",
                   "speedup vs hf"], rows)


def memory_section(records) -> list:
    """Issue 21: Transformer-XL evaluation with memory vs a recomputed sliding context (the paper's
    Table 9), and generation with memory vs recomputing the context."""
    def tps(r, name):
        return "OOM" if r.get(f"{name}_tokens_per_s") is None else f"{r[f'{name}_tokens_per_s']:,.1f}"

    out = []
    reuse = [r for r in records if r.get("op") == "memory_reuse" and r.get("status") in ("ok", "oom")]
    if reuse:
        out += _table(["model", "attention length", "tgt_len", "mem_len", "memory tokens/s", "recompute tokens/s",
                       "speedup"], [[f"{r['size']} {r['dtype']}", r["attention_length"], r["tgt_len"], r["mem_len"],
                                     tps(r, "memory"), tps(r, "recompute"), _fmt(r.get("speedup"), 4)] for r in reuse])
    gen = [r for r in records if r.get("op") == "generation" and r.get("status") in ("ok", "oom")]
    if gen:
        out += ([""] if out else []) + _table(
            ["model", "length", "new tokens", "cached tokens/s", "recompute tokens/s", "speedup", "same tokens"],
            [[f"{r['model']} {r['size']}", r["length"], r["new_tokens"], tps(r, "cached"), tps(r, "recompute"),
              _fmt(r.get("speedup"), 4), r.get("same_tokens", "–")] for r in gen])
    return out or ["No memory-reuse or generation measurement."]


def autotune_section(records) -> list:
    recs = _ok(records, "autotune")
    if not recs:
        return ["No autotuner record (nothing tuned: CPU, or no tuned launch ran)."]
    rows = []
    for r in recs:
        key = r["key"]
        shape = ", ".join(f"{k}={key[k]}" for k in ("M", "N_KEYS", "HEAD_DIM", "MASKING", "SEGMENTS", "BANDED_ONLY",
                                                   "DKR_ATOMIC") if k in key)
        timings = r.get("timings_ms") or {}
        rows.append([r["kernel"], r["context"], shape, r["best"],
                     ", ".join(f"{c} {_fmt(t, 3)}" for c, t in sorted(timings.items(), key=lambda x: x[1]))])
    return _table(["kernel", "first tuned in", "key", "best", "configs (median ms)"], rows)


def problems_section(records, notes=()) -> list:
    lines = [f"- {n}" for n in notes]
    for r in records:
        where = " ".join(f"{k}={r[k]}" for k in ("case", "provider", "mode", "D", "L", "mlen") if r.get(k) is not None)
        if r.get("status") == "error" and r.get("op") != "step":
            lines.append(f"- error: {r['step']}/{r['op']} {where}: {r.get('error')}")
        elif r.get("status") == "cut" and r.get("op") != "step":
            not_run = r.get("not_run") or []
            lines.append(f"- cut: {r['step']}/{r['op']}: {r.get('reason')}"
                         + (f"; not run ({len(not_run)}): {', '.join(not_run[:12])}"
                            f"{' ...' if len(not_run) > 12 else ''}" if not_run else ""))
    skipped = defaultdict(int)
    for r in records:
        if r.get("status") == "skipped":
            skipped[(r["step"], r["op"], r.get("reason"))] += 1
    lines += [f"- skipped: {step}/{op} x{n}: {reason}" for (step, op, reason), n in sorted(skipped.items())]
    return lines or ["None."]


def steps_section(records) -> list:
    steps = [r for r in records if r.get("op") == "step"]
    if not steps:
        return ["No step record."]
    return _table(["step", "status", "seconds", "share (s)", "records", "note"],
                  [[r["step"], r["status"], _fmt(r.get("seconds"), 4), _fmt(r.get("share_s"), 4), r.get("records", 0),
                    r.get("note", "")] for r in steps])


def _autotune_line(records) -> list:
    n = len(_ok(records, "autotune"))
    return [f"{n} autotuner records: the table is in summary.md." if n else autotune_section(records)[0]]


def summary_markdown(records, notes=(), title: str = "GPU campaign", compact: bool = False) -> str:
    """The summary; ``compact`` (what the campaign prints last, where a reply shows only the end of
    the output) leaves the autotuner's table to the file."""
    sections = [("Environment and ceilings", environment_section), ("Steps", steps_section),
                ("Correctness", correctness_section), ("Attention", attention_section),
                ("Targets (docs/DESIGN.md §6)", targets_section), ("Pretraining step", pretrain_section),
                ("Memory: evaluation and generation (Transformer-XL, XLNet)", memory_section),
                ("Autotuner's choices", _autotune_line if compact else autotune_section)]
    out = [f"# {title}", ""]
    for name, fn in sections:
        try:
            lines = fn(records)
        except Exception as exc:  # noqa: BLE001 - one unreadable section must not cost the others
            lines = [f"(this section could not be made from the records: {type(exc).__name__}: {exc})"]
        out += [f"## {name}", "", *lines, ""]
    out += ["## Errors, cuts, skips", "", *problems_section(records, notes), ""]
    return "\n".join(out)


def readme_tables(records) -> str:
    """The README's headline tables: the attention op against the others (D=64 first) and the
    pretraining step, with the device and versions they were measured with."""
    env = (_ok(records, "environment") or [{}])[-1]
    out = [f"Measured on {env.get('device', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
           f"{env.get('date', '?')}; `python -m bench.campaign`, records in `bench/results/`), bf16, median ms:", ""]
    grid = attention_grid(records)
    rows = []
    for (D, L, mlen, mode), row in sorted(grid.items(), key=lambda kv: (kv[0][0] != 64, kv[0])):
        xf = _ms(row.get("xlnet_fast"))
        rows.append([f"{L}", f"{mlen}", f"{D}", "fwd+bwd" if mode == "fwd_bwd" else "fwd",
                     *[("OOM" if (row.get(p) or {}).get("status") == "oom" else _fmt(_ms(row.get(p)), 3))
                       for p in ("xlnet_fast", "sdpa_flash", "flex", "hf")],
                     _fmt(_ratio(xf, _ms(row.get("sdpa_flash"))), 3), _fmt(_ratio(_ms(row.get("hf")), xf), 3)])
    if rows:
        out += _table(["qlen", "mlen", "D", "pass", "xlnet_fast", "SDPA-flash (plain)", "FlexAttention", "transformers",
                       "× flash", "speedup vs transformers"], rows)
    pre = pretrain_section(records)
    if len(pre) > 1:
        out += ["", "Pretraining step (two-stream, bf16 autocast, AdamW):", ""] + pre
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _attention_panel(ax, points: dict) -> None:
    """One (D, mode) panel: a line per provider over qlen; OOMs as crosses along the top, in the
    provider's colour (rows of crosses: one per provider)."""
    provs = [p for p in PROVIDER_ORDER if any(p in row for row in points.values())]
    ooms = []
    for prov in provs:
        color = f"C{PROVIDER_ORDER.index(prov)}"
        ok = sorted((k[1], _ms(row[prov])) for k, row in points.items() if _ms(row.get(prov)) is not None)
        if ok:
            ax.plot(*zip(*ok), marker="o", label=prov, color=color,
                    linestyle="-" if prov in attention.XLNET_PROVIDERS else "--")
        oom = sorted(k[1] for k, row in points.items() if (row.get(prov) or {}).get("status") == "oom")
        if oom:
            ooms.append((prov, color, oom))
    for n, (prov, color, qlens) in enumerate(ooms):
        y = 0.95 - 0.06 * n
        ax.plot(qlens, [y] * len(qlens), "x", color=color, transform=ax.get_xaxis_transform(), clip_on=False)
        ax.annotate(f"{prov} OOM", (qlens[0], y), xycoords=("data", "axes fraction"), xytext=(5, -3),
                    textcoords="offset points", fontsize=7, color=color)


def plot_attention(records, path: Path) -> bool:
    """Median ms against qlen, one panel per (D, mode), one line per provider, OOM marked."""
    grid = attention_grid(records)
    if not grid:
        return False
    plt = _pyplot()
    Ds, modes = sorted({k[0] for k in grid}), sorted({k[3] for k in grid}, key=["fwd", "fwd_bwd"].index)
    fig, axes = plt.subplots(len(Ds), len(modes), figsize=(5.5 * len(modes), 4 * len(Ds)), squeeze=False)
    device = next(iter(next(iter(grid.values())).values())).get("device", "")
    for (i, D), (j, mode) in ((x, y) for x in enumerate(Ds) for y in enumerate(modes)):
        ax = axes[i][j]
        _attention_panel(ax, {k: v for k, v in grid.items() if k[0] == D and k[3] == mode})
        ax.set(xscale="log", yscale="log", xlabel="qlen (mlen as recorded)", ylabel="median ms",
               title=f"{'fwd+bwd' if mode == 'fwd_bwd' else 'fwd'}, D={D}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"XLNet attention, same tensors per shape (dashed: plain attention of the same shape) — {device}")
    fig.tight_layout()
    runner.save_figure(fig, path)
    plt.close(fig)
    return True


def plot_pretrain(records, path: Path) -> bool:
    """Tokens/s of one pretraining step per model and provider, peak memory written on the bars."""
    recs = [r for r in records if r.get("op") == "pretrain_step" and r.get("status") in ("ok", "oom")]
    if not recs:
        return False
    plt = _pyplot()
    labels = list(dict.fromkeys(r.get("case", r.get("config")) for r in recs))
    provs = list(dict.fromkeys(r["provider"] for r in recs))
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 1.2 * len(labels) * len(provs)), 4))
    width = 0.8 / len(provs)
    for j, prov in enumerate(provs):
        for i, label in enumerate(labels):
            r = next((r for r in recs if r.get("case", r.get("config")) == label and r["provider"] == prov), None)
            if r is None:
                continue
            x = i + (j - (len(provs) - 1) / 2) * width
            tps = r.get("tokens_per_s") or 0.0
            ax.bar(x, tps, width, color=f"C{j}", label=prov if i == 0 else None)
            peak = f"{r['peak_mem_mb'] / 1024:.1f} GiB" if r.get("peak_mem_mb") else ""
            text = "OOM" if r["status"] == "oom" else peak
            ax.annotate(text, (x, tps), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"XLNet pretraining step (on the bars: peak memory)\n{recs[0].get('device', '')}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    runner.save_figure(fig, path)
    plt.close(fig)
    return True

