"""The campaign's records turned into its summary (markdown) and the README's tables.

Records are the lines of ``campaign.jsonl`` (``bench.campaign``); each has ``run``, ``step``,
``op``, ``status`` (``ok``, ``error``, ``skipped``, ``cut``, ``oom``) and ``t`` (seconds since the
campaign started), and the fields of its ``op``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bench.attention import FLOPS_CONVENTION, PROVIDERS

# docs/DESIGN.md §6: on a GPU, fwd+bwd within 2x SDPA-flash, and 10x transformers' core at L = 512
TARGET_VS_FLASH = 2.0
TARGET_VS_HF = 10.0
TARGET_HF_L = 512
README_PROVIDERS = ("xlnet_fast", "sdpa_flash", "flex", "hf")


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


def _ms(rec) -> float | None:
    if rec is None or rec.get("status") != "ok" or not isinstance(rec.get("ms"), (int, float)):
        return None
    return rec["ms"]


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def attention_grid(records) -> dict:
    """``{(D, L, mlen, B, H, mode): {provider: record}}`` of the sweep's measurements (latest wins;
    the repeat measurements are left out), OOM included."""
    grid = defaultdict(dict)
    for r in records:
        if r.get("op") == "xlnet_attn" and r.get("status") in ("ok", "oom") and not r.get("repeat"):
            grid[_grid_key(r)][r["provider"]] = r
    return grid


def _grid_key(r: dict) -> tuple:
    """A measurement's shape in ``attention_grid`` (B, H: a shape off the sweep's grid can share
    its L and mlen, e.g. issue 33's 8x12 at 512/384)."""
    return r["D"], r["L"], r["mlen"], r["B"], r["H"], r["mode"]


def _ratios(row: dict) -> tuple:
    """xlnet_fast over SDPA-flash, transformers over xlnet_fast, FlexAttention over xlnet_fast."""
    xf = _ms(row.get("xlnet_fast"))
    return _ratio(xf, _ms(row.get("sdpa_flash"))), _ratio(_ms(row.get("hf")), xf), _ratio(_ms(row.get("flex")), xf)


def attention_section(records) -> list:
    grid = attention_grid(records)
    if not grid:
        return ["No attention measurements."]
    provs = [p for p in PROVIDERS if any(p in row for row in grid.values())]

    def cell(rec):
        if rec is None or rec.get("status") == "oom":
            return "–" if rec is None else "OOM"
        return f"{rec['ms']:.3g} ms ({rec['tflops']:.3g})" if rec.get("tflops") else f"{rec['ms']:.3g} ms"

    rows = [[D, L, mlen, B, H, mode] + [cell(row.get(p)) for p in provs]
            + [_fmt(x) for x in _ratios(row)] for (D, L, mlen, B, H, mode), row in sorted(grid.items())]
    lines = [f"Median ms (TFLOP/s, counted as {FLOPS_CONVENTION}); OOM = out of memory.", ""]
    lines += _table(["D", "L", "mlen", "B", "H", "mode", *provs, "xlnet_fast / sdpa_flash", "hf / xlnet_fast",
                     "flex / xlnet_fast"], rows)
    for r in [r for r in _ok(records, "xlnet_attn") if r.get("repeat")]:
        first = _ms(grid.get(_grid_key(r), {}).get(r["provider"]))
        if first:
            lines.append(f"\nSpread: {r['provider']} {r['mode']} D={r['D']} L={r['L']} timed twice: {first:.4g} and "
                         f"{r['ms']:.4g} ms ({100 * abs(r['ms'] - first) / first:.1f}% apart); smaller differences "
                         "are noise.")
    return lines


def profile_section(records, compact: bool = False) -> list:
    """Per provider, the GPU time per call of each kernel it launches (``kernel_profile`` records);
    ``compact``: the three largest only."""
    recs = _ok(records, "kernel_profile")
    if not recs:
        return ["No kernel profile (it needs CUDA)."]
    out = ["GPU time per call from torch.profiler, after a warm-up (ms; launches per call); host time: "
           "the median wall time of a call issued to an idle GPU, to its return (unprofiled)."]
    for r in recs:
        head = (f"{r['provider']} {r['mode']}, D={r['D']} L={r['L']} mlen={r['mlen']} B={r['B']}: "
                f"{_fmt(r['gpu_ms_per_call'], 3)} ms of GPU time in {r['launches_per_call']:.0f} launches"
                # (records before 2026-11-29 have no host time)
                + (f", {_fmt(r['host_ms_per_call'], 3)} ms of host time" if r.get("host_ms_per_call") else ""))
        if compact:
            out.append(f"- {head}; largest: " + ", ".join(f"{k['kernel'][:40]} {_fmt(k['ms_per_call'], 3)}"
                                                          for k in r["kernels"][:3]))
            continue
        out += ["", head, ""]
        out += _table(["kernel", "ms", "launches"],
                      [[k["kernel"], _fmt(k["ms_per_call"], 3), f"{k['launches_per_call']:.0f}"] for k in r["kernels"]])
    return out


def ncu_section(records) -> list:
    """Per kernel profiled by the ``ncu`` step: time, shared-memory bank conflicts against the
    wavefronts (ld/st), occupancy, L1 and issue utilisation, the three largest stall reasons."""
    recs = _ok(records, "ncu_kernel")
    if not recs:
        return ["No Nsight Compute record (the ncu step needs CUDA and ncu)."]

    def metric(r, name):
        value = r["metrics"].get(name, [None])[0]
        return value if isinstance(value, float) else None

    def share(r, op):
        conflicts = metric(r, f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum")
        fronts = metric(r, f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum")
        return "-" if conflicts is None or not fronts else f"{conflicts:,.0f} / {fronts:,.0f}"

    def cell(r, name, digits=3):
        value = metric(r, name)
        return "-" if value is None else _fmt(value, digits)

    return _table(["run", "kernel", "time", "regs", "bank conflicts / wavefronts, ld", "... st", "warps active %",
                   "L1/TEX %", "issue active %", "top stalls (warps per issued instruction)"],
                  [[r["run_name"], r["kernel"], cell(r, "gpu__time_duration.sum") + " "
                    + (r["metrics"].get("gpu__time_duration.sum", [None, ""])[1] or ""),
                    cell(r, "launch__registers_per_thread"), share(r, "ld"), share(r, "st"),
                    cell(r, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                    cell(r, "l1tex__throughput.avg.pct_of_peak_sustained_active"),
                    cell(r, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
                    ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:3])] for r in recs])


def targets_section(records) -> list:
    """The GPU targets of docs/DESIGN.md §6, each met or missed with the measured ratio."""
    lines = []
    for (D, L, mlen, B, H, mode), row in sorted(attention_grid(records).items()):
        vs_flash, vs_hf, _ = _ratios(row)
        if mode == "fwd_bwd" and vs_flash is not None:
            verdict = "met" if vs_flash <= TARGET_VS_FLASH else f"missed by {vs_flash / TARGET_VS_FLASH:.2f}x"
            lines.append(f"- fwd+bwd ≤ {TARGET_VS_FLASH:g}x SDPA-flash, D={D} L={L} mlen={mlen} {B}x{H}: "
                         f"{vs_flash:.2f}x — {verdict}")
        if L == TARGET_HF_L and vs_hf is not None:
            verdict = "met" if vs_hf >= TARGET_VS_HF else f"missed by {TARGET_VS_HF / vs_hf:.2f}x"
            lines.append(f"- ≥ {TARGET_VS_HF:g}x transformers' attention core, {mode}, D={D} L={L} mlen={mlen} "
                         f"{B}x{H}: {vs_hf:.1f}x — {verdict}")
    ceiling = _ok(records, "ceiling_matmul")[-1:]
    best = max((r for r in _ok(records, "xlnet_attn") if r["provider"] == "xlnet_fast" and r.get("tflops")),
               key=lambda r: r["tflops"], default=None)
    if ceiling and best:
        lines.append(f"- xlnet_fast's best rate: {best['tflops']:.0f} TFLOP/s ({best['mode']}, D={best['D']}, "
                     f"L={best['L']}) = {100 * best['tflops'] / ceiling[0]['tflops']:.0f}% of the measured bf16 "
                     f"matmul ceiling ({ceiling[0]['tflops']:.0f} TFLOP/s)")
    return lines or ["No measurement to compare with the targets."]


def environment_section(records) -> list:
    """Per run (a report may merge the calls of a session): the device, versions and ceilings."""
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
                     + (f"; failed: {', '.join(r['failed_tests'])}" if r.get("failed_tests") else "")
                     + (f"; timed out: {', '.join(r['timed_out_tests'])}" if r.get("timed_out_tests") else ""))
    for r in [r for r in records if r.get("op") == "pytest_rerun"]:
        lines.append(f"- the failed tests alone ({r['status']}): "
                     + "; ".join(f"{what}: {', '.join(r[key])}" for what, key in (
                         ("failed again", "failed_tests"), ("passed alone", "passed_alone")) if r.get(key))
                     + (f" (failure text in the record, {len(r['failure_text'])} characters)"
                        if r.get("failure_text") else ""))
    checks = [r for r in records if r.get("op") == "xlnet_attn_check" and "rel_err_out" in r]
    if checks:
        lines += [""] + _table(
            ["case", "dtype", "config", "deterministic", "rel err out", "worst grad", "within tolerance"],
            [[r["case"], r["dtype"], r.get("config", "autotuned"), r.get("deterministic", False),
              f"{r['rel_err_out']:.2e}", f"{r['rel_err_grad']:.2e} ({r['worst_grad']})",
              "yes" if r["within_tolerance"] else "**NO**"] for r in checks])
    for n, r in enumerate(_ok(records, "provider_agreement")):
        errs = ", ".join(f"{p} {e:.1e}" for p, e in r["rel_err_vs_eager_fp32"].items())
        lines += [""] * (n == 0) + [f"- forward outputs against the eager backend in fp32, D={r['D']} L={r['L']}: "
                                    f"{errs}"]
    return lines or ["No correctness record."]


def model_records(records) -> list:
    """The model-level measurements, ``bench.model_step``'s (``mode`` train or infer) and the older
    ``bench.pretrain_step``'s (a training step; ``xlnet_fast`` is today's ``native``), ok or OOM."""
    out = []
    for r in records:
        if r.get("status") not in ("ok", "oom"):
            continue
        if r.get("op") == "model_step":
            out.append(r)
        elif r.get("op") == "pretrain_step":
            out.append({**r, "mode": "train", "provider": {"xlnet_fast": "native"}.get(r["provider"], r["provider"])})
    return out


def model_section(records) -> list:
    """Per model, mode and provider: tokens/s, ms per step, peak memory, MFU, against transformers."""
    rows, by_case = [], defaultdict(dict)
    for r in model_records(records):
        by_case[(r.get("case", r.get("config")), r["mode"])][r["provider"]] = r
    for (case, mode), provs in by_case.items():
        hf = provs.get("hf") or {}
        for prov, r in provs.items():
            ok = r["status"] == "ok"
            rows.append([case, mode, r.get("n_layer", "–"), r.get("B"), r.get("L"), r.get("mlen"), r.get("num_predict"),
                         prov, f"{r['tokens_per_s']:,.0f}" if ok else "OOM", _fmt(r["ms"] if ok else None, 4),
                         _fmt(r.get("gpu_ms"), 4), _fmt(r.get("host_ms"), 4), _fmt(r.get("host_waits"), 3),
                         f"{r['peak_mem_mb'] / 1024:.1f}" if r.get("peak_mem_mb") else "–",
                         f"{r['mfu']:.1%}" if r.get("mfu") else "–",
                         _fmt(_ratio(_ms(hf), r["ms"]) if ok else None, 3),
                         _fmt(_ratio(r.get("peak_mem_mb"), hf.get("peak_mem_mb")), 2)])
    if not rows:
        return ["No model-level measurement."]
    return _table(["model", "mode", "layers", "B", "seq", "mem", "targets", "provider", "tokens/s", "ms/step",
                   "GPU ms/step", "host ms/step", "host waits", "peak GiB", "MFU", "speedup vs hf", "memory vs hf"], rows)


def memory_section(records) -> list:
    """Transformer-XL evaluation with memory against a recomputed sliding context (the paper's Table
    9), and generation with memory against recomputing the context."""
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
        out += [""] * bool(out) + _table(
            ["model", "length", "new tokens", "cached tokens/s", "recompute tokens/s", "speedup", "same tokens"],
            [[f"{r['model']} {r['size']}", r["length"], r["new_tokens"], tps(r, "cached"), tps(r, "recompute"),
              _fmt(r.get("speedup"), 4), r.get("same_tokens", "–")] for r in gen])
    return out or ["No memory-reuse or generation measurement."]


def autotune_section(records, compact: bool = False) -> list:
    recs = _ok(records, "autotune")
    if not recs:
        return ["No autotuner record (nothing tuned: CPU, or no tuned launch ran)."]
    if compact:
        return [f"{len(recs)} autotuner records: the table is in summary.md."]
    rows = []
    for r in recs:
        shape = ", ".join(f"{k}={r['key'][k]}" for k in ("M", "N_KEYS", "HEAD_DIM", "MASKING", "SEGMENTS",
                                                         "BANDED_ONLY", "DKR_ATOMIC") if k in r["key"])
        timings = sorted((r.get("timings_ms") or {}).items(), key=lambda x: x[1])
        rows.append([r["kernel"], r["context"], shape, r["best"], ", ".join(f"{c} {_fmt(t, 3)}" for c, t in timings)])
    return _table(["kernel", "first tuned in", "key", "best", "configs (median ms)"], rows)


def problems_section(records, notes=()) -> list:
    lines = [f"- {n}" for n in notes]
    skipped = defaultdict(int)
    for r in records:
        where = " ".join(f"{k}={r[k]}" for k in ("case", "provider", "mode", "D", "L", "mlen") if r.get(k) is not None)
        not_run = r.get("not_run") or []
        if r.get("status") == "error" and r.get("op") != "step":
            lines.append(f"- error: {r['step']}/{r['op']} {where}: {r.get('error')}")
        elif r.get("status") == "cut" and r.get("op") != "step":
            lines.append(f"- cut: {r['step']}/{r['op']}: {r.get('reason')}"
                         + (f"; not run ({len(not_run)}): {', '.join(not_run[:12])}"
                            f"{' ...' if len(not_run) > 12 else ''}" if not_run else ""))
        elif r.get("status") == "skipped":
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


def summary_markdown(records, notes=(), title: str = "GPU campaign", compact: bool = False) -> str:
    """The summary; ``compact`` (what the campaign prints last, where a reply shows only the end of
    the output) leaves the autotuner's table to the file."""
    sections = [("Environment and ceilings", environment_section), ("Steps", steps_section),
                ("Correctness", correctness_section), ("Attention", attention_section),
                ("Where the GPU time goes", lambda recs: profile_section(recs, compact)),
                ("Nsight Compute", ncu_section),
                ("Targets (docs/DESIGN.md §6)", targets_section), ("Model: training step and inference", model_section),
                ("Memory: evaluation and generation (Transformer-XL, XLNet)", memory_section),
                ("Autotuner's choices", lambda recs: autotune_section(recs, compact)),
                ("Errors, cuts, skips", lambda recs: problems_section(recs, notes))]
    out = [f"# {title}", ""]
    for name, fn in sections:
        try:
            lines = fn(records)
        except Exception as exc:  # noqa: BLE001 - one unreadable section must not cost the others
            lines = [f"(this section could not be made from the records: {type(exc).__name__}: {exc})"]
        out += [f"## {name}", "", *lines, ""]
    return "\n".join(out)


def readme_tables(records) -> str:
    """The README's headline tables: the attention op against the others (D=64 first) and the
    model's step, with the device and versions they were measured with."""
    env = (_ok(records, "environment") or [{}])[-1]
    out = [f"Measured on {env.get('device', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
           f"{env.get('date', '?')}; `python -m bench.campaign`, records in `bench/results/`), bf16, median ms:", ""]
    d64_first = sorted(attention_grid(records).items(), key=lambda kv: (kv[0][0] != 64, kv[0]))
    rows = [[f"{B}×{H}", L, mlen, D, "fwd+bwd" if mode == "fwd_bwd" else "fwd",
             *["OOM" if (row.get(p) or {}).get("status") == "oom" else _fmt(_ms(row.get(p))) for p in README_PROVIDERS],
             *[_fmt(x) for x in _ratios(row)[:2]]] for (D, L, mlen, B, H, mode), row in d64_first]
    if rows:
        out += _table(["B×H", "qlen", "mlen", "D", "pass", "xlnet_fast", "SDPA-flash (plain)", "FlexAttention", "transformers",
                       "× flash", "speedup vs transformers"], rows)
    pre = model_section(records)
    if len(pre) > 1:
        out += ["", "XLNet's training step (two-stream, bf16 autocast, AdamW) and inference forward:", ""] + pre
    return "\n".join(out)
