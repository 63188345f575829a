"""Compile report: the fused kernels' machine code for every NVIDIA architecture, without a GPU.

    python -m bench.compile_report [--arch 80 86 89 90 100 120] [--D 64 128]
        [--streams content two-stream] [--dropout off on] [--deterministic off on] [--dtype bf16 fp32 fp32-tf32]
        [--configs 64x64w4s1 ...] [--candidates all|first] [--no-reference] [--jobs N]
        [--json PATH | --record] [--table] [--lines ROLE ...] [--check] [--gate]
    python -m bench.compile_report --record-all [--jobs N]   # every committed record again (triton 3.6)
    python -m bench.compile_report --calibrate               # the time model against the GPU runs' times

Runs the op's own launch code (``xlnet_fast.kernels.forward`` / ``backward``) on CPU tensors (the
launcher's row tables keep their values, which place the skew's gather; float tensors are kept as meta)
inside ``rel_attention.compiling_for(arch)``, where the launcher launches each kernel once per
candidate config of that arch (``rel_attention.configs_for``), and records those launches
(``bench.compiler.aot``); compiles each distinct launch for the arch with the launch's
flags, and reads registers and spills (``ptxas -v``: stores + loads, both kept), shared memory and
Blackwell's tensor-memory columns (what triton checks at launch: ``launchable`` is
``rel_attention.launchable``, the per-block opt-in limit of the arch and 512 TMEM columns), the MMA
kind (``tcgen05``, ``wgmma``, ``mma.sync`` or ``none (FMA)``) and, per iteration of the key loop and
per score element, the SASS instructions by class (``bench.compiler.sass``; how loops are counted:
``bench.compiler.launches``), the shared-memory bytes and 128-byte wavefronts (bank conflicts
included, from the PTX's lane addresses: ``sass.smem_traffic``; "B-eq" = wavefronts x 128 B) and the
key loop's spill bytes, resident warps per SM (``targets.resident_warps``) and the time model's
``predicted`` cycles per score (``targets.MODEL``, calibrated by ``--calibrate`` against the GPU runs'
kernel times: bench/NOTES.md, "What ranks real speed"). A plain FlashAttention-2
(``bench.compiler.fa2_reference``) is compiled for the same arch, D and config (tiles, warps, stages,
``maxnreg``) as each op binary: ``ratio_to_reference`` compares like with like, or is null with ``reference.error`` saying why the
reference has no such binary. Dropout binaries carry ``dropout_overhead``: inst/score over the same
kernel's at the same config and scenario without dropout.

Each op record: ``arch``, ``kernel``, ``role`` (``fwd``/``dkdv``/``dq``/``dkr``/``fixup``: the role
the launcher asked ``configs_for`` about; ``fixup`` is the dK/dV kernel's second launch with segments,
held to launchability, spills and register cliffs only), ``candidate`` (its place in ``configs_for``), ``D``,
``scenarios``, ``flags``, ``config``, ``regs``, ``spill_bytes`` (= ``spill_store_bytes`` +
``spill_load_bytes``), ``smem_bytes``, ``tmem_columns``, ``launchable``, ``mma``, ``per_iteration``,
``inst_per_score``, ``smem_bytes_per_score``, ``smem_beq_per_score``, ``smem_traffic`` (by kind of
access), ``local_bytes_per_score``, ``free_loops`` (the forward's loop over the key tiles every row
sees, ``FREE_TILES``: its address, inst/score and local bytes/score; the other columns are the general
loop's), ``resident_warps``, ``predicted``, ``ratio_to_reference``,
``reference`` (the same figures of the reference binary) and, with dropout, ``dropout_overhead``. The
reference is also compiled at its own tiles (``REFERENCE_CONFIG``, what a GPU run times it at).
Per (arch, D, role) the report prints the configs compiled and launchable, the best launchable
spill-free config (lowest inst/score; a config's figures are its worst over the scenarios; where none
is spill-free, the lowest within the spill cap) with its ratio and dropout overhead, the config the
time model predicts fastest with its predicted time over the reference's (``predicted_ratio``), and
problems against issue 20's targets (``bench.compiler.targets``; ``--check`` exits 1 on any) and regressions
(``--gate``, what CI runs: every target that is met, the measured ceilings of ``SHORTFALLS``
where one is not yet, and the predicted ratio's ceiling of ``PREDICTED_CEILINGS``). Output: ``--json
PATH`` (one file), ``--record``
(``bench/results/compile_sm<arch>.json`` per arch, overwritten: one snapshot of the kernels), else
the cache directory (``bench.runner``). Compiled records are cached there too, by everything that
makes the binary, so a re-run compiles only what changed. The reference role of the dk_r kernel
(which accumulates over query tiles) and of the fix-up is dK/dV.

``--lines ROLE ...`` (e.g. ``--lines fwd --arch 90 --D 64 --configs 64x64w4s2 --streams content``)
prints, for each op binary of those roles, where its key loop spends per source line
(``launches.line_profile``): instructions and shared-memory B-eq per score, by kind of access; the
lines sum to the binary's figures. Kernel work starts there: which product, load or gather costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

from bench import runner
from bench.compiler import aot
from bench.compiler.launches import (DTYPES, ROLES, ROW_HEADER, Case, compile_all, line_profile, log, op_tasks,
                                     reference_tasks, row)
from bench.compiler.targets import (attach_dropout_overhead, attach_ratios, calibration, calibration_markdown,
                                    launchability, measured_times, number, summarise)

ARCHS = (80, 86, 89, 90, 100, 120)
REPORT = "compile_report.json"  # --json's default, in the cache directory
RECORD = "compile_sm{arch}.json"  # --record: one file per arch under bench/results
FP32_RECORD = "compile_fp32.json"
# --record-all: every committed compile record, made again (with the GPU machines' triton, 3.6)
RECORD_ALL = (
    ["--arch", *map(str, ARCHS), "--D", "64", "128", "--streams", "content", "two-stream", "--dropout", "off", "on",
     "--deterministic", "off", "on", "--record"],
    ["--arch", *map(str, ARCHS), "--D", "64", "--streams", "two-stream", "--dropout", "off", "--deterministic", "off",
     "--dtype", "fp32", "fp32-tf32", "--json", str(runner.RESULTS_DIR / FP32_RECORD)],
)


def table(records: list) -> str:
    """Every binary's row, by arch, D, role and config."""
    ordered = sorted(records, key=lambda r: (r["arch"], r["D"], ROLES.index(r["role"]) if r["role"] in ROLES else 9,
                                             r["config"], r["scenarios"][0]))
    lines = ["| " + " | ".join(ROW_HEADER) + " |", "|" + "---|" * len(ROW_HEADER)]
    return "\n".join(lines + ["| " + row(r) + " |" for r in ordered])


def summary_line(s: dict) -> str:
    dtype = "" if s.get("dtype", "bf16") == "bf16" else f" {s['dtype']}"
    head = f"sm_{s['arch']} D={s['D']} {s['role']}{dtype}: {s['launchable']}/{s['compiled']} configs launchable"
    best = s["best"]
    if best is None:
        text = head + "; none " + ("spill-free" if not s["spill_cap"] else f"within {s['spill_cap']} B of spill")
        if s["least_spill"]:
            text += f" (least: {s['least_spill']['config']}, {s['least_spill']['spill_bytes']} B)"
    else:
        text = (f"{head}; best {best['config']}: {best['regs']} regs, {best['spill_bytes']} B spill, "
                f"{'/'.join(best['mma'])}, {number(best['inst_per_score'], '{:.1f}')} inst/score, "
                f"{number(best['ratio_to_reference'], '{:.2f}')}x ref"
                + ("" if best["dropout_overhead"] is None else f", dropout {best['dropout_overhead']:.2f}x"))
    fastest = s.get("fastest")
    if fastest is not None and s["role"] != "fixup":
        text += (f"; predicted fastest {fastest['config']}: "
                 f"{number(fastest['smem_beq_per_score'], '{:.0f}')} B-eq/score of shared memory, "
                 f"{fastest['resident_warps']} warps/SM, "
                 f"{number(s.get('predicted_ratio'), '{:.2f}')}x the reference's predicted time")
    return (text + "".join(f"\n    PROBLEM {p}" for p in s["problems"])
            + "".join(f"\n    REGRESSION {p}" for p in s.get("regressions", [])))


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def operand_problem(r: dict) -> str | None:
    """What is wrong with an operand kernel's binary (a one-pass kernel: no spill, launchable), or None."""
    where = f"sm_{r['arch']} D={r['D']} {r['kernel']}"
    if r.get("error"):
        return f"{where}: {r['error']}"
    if r["spill_bytes"] or not r["launchable"]:
        return f"{where}: {r['spill_bytes']} B of spill, {r['smem_bytes']} B shared memory"
    return None


def all_cases(dims: list, streams: list, dropouts: list, deterministic: list, dtypes=("bf16",)) -> list:
    return [Case(D, stream, drop, det, dtype) for D in dims for stream in streams for drop in dropouts
            for det in deterministic for dtype in dtypes]


def lines_table(record: dict, rows: list) -> str:
    """``--lines``: one binary's key loop per source line (``launches.line_profile``), with its total."""
    head = (f"sm_{record['arch']} D={record['D']} {record['role']} ({record['kernel']}) {record['config']}, "
            f"{', '.join(record['scenarios'])}: the key loop per source line, per score")
    out = [head, f"{'inst':>7} {'B-eq':>7} {'bytes':>7}  {'by kind (B-eq)':<24} {'where':<24} source"]
    for r in rows:
        kinds = ", ".join(f"{kind} {beq:g}" for kind, (_, beq) in r["by_kind"].items())
        where = f"{r['file']}:{r['line']}" if r["line"] is not None else "(no source line)"
        out.append(f"{r['inst_per_score']:7.2f} {r['smem_beq_per_score']:7.2f} {r['smem_bytes_per_score']:7.2f}  "
                   f"{kinds:<24} {where:<24} {r['source'][:70]}")
    total = [sum(r[k] for r in rows) for k in ("inst_per_score", "smem_beq_per_score", "smem_bytes_per_score")]
    out.append(f"{total[0]:7.2f} {total[1]:7.2f} {total[2]:7.2f}  (sum; the record: {record['inst_per_score']} "
               f"inst, {record['smem_beq_per_score']} B-eq, {record['smem_bytes_per_score']} bytes)")
    return "\n".join(out)


def write_report(path: Path, meta: dict, records: list, references: list, summary: list, operands: list) -> None:
    """JSON, one record per line: {meta..., "summary", "records", "references", "operand_kernels"}."""
    def rows(items):
        return "[\n" + ",\n".join(json.dumps(item, sort_keys=True) for item in items) + "\n]"

    head = json.dumps(meta, indent=1)[:-2]
    text = (head + ',\n "summary": ' + rows(summary) + ',\n "records": ' + rows(records)
            + ',\n "references": ' + rows(references) + ',\n "operand_kernels": ' + rows(operands) + "\n}\n")
    runner.write_text(path, text)




def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_output_args(parser, REPORT, flag="--json")
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS),
                        help="compute capabilities as 10 * major + minor (default: %(default)s)")
    parser.add_argument("--D", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--streams", nargs="+", default=["content", "two-stream"], choices=["content", "two-stream"])
    parser.add_argument("--dropout", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--deterministic", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="on: the deterministic backward (the dk_r kernel, dQ without atomics)")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES),
                        help="input dtype; fp32: torch's default (TF32 off: the kernels' tf32x3 dots), "
                             "fp32-tf32: with torch.backends.cuda.matmul.allow_tf32 (TF32 dots); "
                             "the targets and the reference are bf16's")
    parser.add_argument("--configs", nargs="+", help="only these autotuner configs, e.g. 128x64w8s2")
    parser.add_argument("--candidates", choices=["all", "first"], default="all",
                        help="every candidate config of the arch, or the first rel_attention.configs_for lists")
    parser.add_argument("--no-reference", action="store_true", help="skip the FlashAttention-2 reference")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="compile workers")
    parser.add_argument("--no-cache", action="store_true", help="compile everything again")
    parser.add_argument("--table", action="store_true", help="print every binary's row")
    parser.add_argument("--lines", nargs="+", choices=ROLES, metavar="ROLE",
                        help="for each binary of these roles (" + ", ".join(ROLES) + "), its key loop per "
                             "source line: instructions and shared-memory B-eq per score")
    parser.add_argument("--check", action="store_true", help="exit 1 on any problem against issue 20's targets")
    parser.add_argument("--record-all", action="store_true",
                        help="make every committed record again: " + " ; ".join(" ".join(run) for run in RECORD_ALL)
                             + " (with --jobs)")
    parser.add_argument("--calibrate", action="store_true",
                        help="compile nothing: the time model's rules against the measured kernel times "
                             "(bench/results: compile_sm<arch>.json, campaign_*.jsonl, kernel_times.json)")
    parser.add_argument("--gate", action="store_true",
                        help="exit 1 on a regression: a target that is met no longer is, or an unmet one got "
                             "worse than its measured ceiling (SHORTFALLS); what CI runs")
    return parser


def calibrate() -> int:
    """Print the calibration table of the committed records (``targets.calibration``)."""
    times = measured_times(runner.RESULTS_DIR)
    records, references = [], []
    for arch in sorted({t["arch"] for t in times}):
        path = runner.RESULTS_DIR / RECORD.format(arch=arch)
        written = json.loads(path.read_text())
        records += written["records"]
        references += written["references"]
    print(calibration_markdown(calibration(records, references, times)))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate:
        return calibrate()
    if args.record_all:
        return max(main([*run, "--jobs", str(args.jobs)]) for run in RECORD_ALL)
    # the kernels must be decorated in compiled mode: before xlnet_fast.kernels is first imported
    os.environ["TRITON_INTERPRET"] = "0"
    problems = {arch: aot.toolchain_problem(arch) for arch in args.arch}
    if any(problems.values()):
        for arch, problem in problems.items():
            if problem:
                print(f"cannot compile for sm_{arch} here: {problem}", file=sys.stderr)
        return 2
    scenarios = all_cases(args.D, args.streams, [d == "on" for d in args.dropout],
                          [d == "on" for d in args.deterministic], args.dtype)
    configs, first = set(args.configs or []), args.candidates == "first"
    started = time.perf_counter()
    op, operand_tasks = [], []
    for arch in args.arch:
        attention_tasks, operand_tasks_of_arch = op_tasks(arch, scenarios, configs, first)
        op, operand_tasks = op + attention_tasks, operand_tasks + operand_tasks_of_arch
    refs = [] if args.no_reference else reference_tasks(op)
    log(f"captured {len(op)} op and {len(refs)} reference launches for sm_{', sm_'.join(map(str, args.arch))} "
        f"({len(scenarios)} scenarios) in {time.perf_counter() - started:.0f} s")
    compiled = compile_all(op + refs + operand_tasks, args.jobs, use_cache=not args.no_cache)
    records, references = compiled[:len(op)], compiled[len(op):len(op) + len(refs)]
    operand_records = [launchability({**t.info, **r}) for t, r in zip(operand_tasks, compiled[len(op) + len(refs):])]
    attach_ratios(records, references)
    attach_dropout_overhead(records)
    summary = summarise(records, all_candidates=not configs and not first, references=references)
    meta = {"command": "python -m bench.compile_report " + " ".join(argv if argv is not None else sys.argv[1:]),
            "triton": triton.__version__, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "target": "cuda sm_<arch> (sm_90a, sm_100a, ...), no GPU",
            "counts": "static: the key loop's own instructions and its nested loops once each",
            "seconds": round(time.perf_counter() - started)}
    if args.record:
        paths = []
        for arch in args.arch:
            path = runner.RESULTS_DIR / RECORD.format(arch=arch)
            write_report(path, meta, [r for r in records if r["arch"] == arch],
                         [r for r in references if r["arch"] == arch], [s for s in summary if s["arch"] == arch],
                         [r for r in operand_records if r["arch"] == arch])
            paths.append(str(path))
        where = ", ".join(paths)
    else:
        where = runner.output_path(args, REPORT)
        write_report(where, meta, records, references, summary, operand_records)
    if args.table:
        print(table(records + references))
        print()
    for s in summary:
        print(summary_line(s))
    for task, record in zip(op, records):
        if args.lines and task.info["role"] in args.lines and "error" not in record:
            print()
            print(lines_table(record, line_profile(task)))
    operand_problems = []
    for r in operand_records:
        problem = operand_problem(r)
        operand_problems += [problem] if problem else []
        segments = " with segments" if r["flags"].get("SEGMENTS") else ""
        print(problem or f"sm_{r['arch']} D={r['D']} {r['kernel']}{segments}: {r['regs']} registers, no spill, "
              f"{r['smem_bytes']} B shared memory")
    print(f"\nwrote {len(records)} records and {len(references)} reference records to {where} "
          f"({runner.duration(time.perf_counter() - started)})")
    failed = []
    for flag, field, word in ((args.check, "problems", "CHECK"), (args.gate, "regressions", "GATE")):
        if flag:
            failed += [f"{word} FAILED: sm_{s['arch']} D={s['D']} {s['role']}: {p}" for s in summary for p in s[field]]
            failed += [f"{word} FAILED: {p}" for p in operand_problems]
            if not records:
                failed.append(f"{word} FAILED: nothing was compiled")
    for line in failed:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
