"""The GPU campaign in one command, time-boxed: environment and ceilings, correctness of the compiled
kernels, the attention sweep, the model's training step and inference forward, memory reuse and generation, the autotuner's
choices, plots and a summary table last, every failure recorded.

    python -m bench.campaign --out DIR [--budget-min 20] [--quick] [--steps env compile correctness sweep model_step memory plots]
                             [--sweep-D 64 128]
    python -m bench.campaign --out DIR --cpu-dry-run [--budget-min 3]   # the orchestration on CPU, tiny shapes
    python -m bench.campaign --report RECORDS.jsonl [MORE.jsonl ...] [--out DIR]

Steps (each runs benchmark modules; what they measure in each mode is ``PLANS``):

- ``env``: device, SM count, versions; the bf16 matmul (TFLOP/s) and device-to-device copy (GB/s)
  ceilings measured on random data;
- ``compile``: the binaries the calls of our kernels in the correctness step's checks (not its test
  suite's), the sweep and the model step (those of the steps run) will make triton's JIT compile
  (every autotuner candidate at every specialisation; the model step's recorded on meta tensors
  under a stand-in for CUDA's autocast), compiled ahead into triton's cache by one worker per core
  (``bench.compiler.precompile``), where the autotuner then finds them instead of compiling each in
  turn; on CPU only counted;
- ``correctness``: the suite's GPU tests in a subprocess without ``TRITON_INTERPRET`` (the kernels
  pinned to ``PYTEST_CONFIGS``, pytest-xdist workers where installed), then ``bench.gpu_check``'s
  comparison with float64 (``gpu_check.CASES`` and ``LONG_CASES``), then one case at each autotuner
  config in turn;
- ``sweep``: the providers of ``bench.attention`` on the same tensors per shape, forward and
  forward+backward, D=64 first; the providers' forward outputs compared once per D, and the first
  xlnet_fast forward+backward timed twice (the spread);
- ``model_step``: ``bench.model_step``, XLNet's training step and inference forward, transformers against
  the patched model and the native one (eager and compiled), base then large;
- ``memory``: ``bench.memory_reuse`` (Transformer-XL evaluation with memory against a recomputed
  sliding context, 128…3,800) and ``bench.generation`` (Transformer-XL and XLNet, with memory
  against recomputing the context);
- ``ncu``: Nsight Compute (``--clock-control none``) on the attention kernels, ours and the FA2
  reference's, at the sweep's first shape: shared-memory bank conflicts and wavefronts, warp-stall
  reasons, occupancy, throughputs (one ``ncu_kernel`` record each); on CPU the profiled program
  runs alone (a rehearsal);
- ``plots``: ``attention.png`` and ``model_step.png`` (``bench.plot``).

Every step but ``plots`` records the autotuner's winning config (and every config's time) for each
shape it tuned. Each step runs in its own process, gets a share of ``--budget-min`` (what an earlier
step left is shared among the later ones), starts no item once its share is used up (a ``cut``
record names what did not run) and is killed if it still runs a little after that; a crash, a lost
CUDA context or an exception is recorded (traceback in the log) and the next step runs. DIR, which
must not hold a campaign's files already, gets ``campaign.jsonl`` (one record per line: ``run``,
``step``, ``op``, ``status`` — ok, error, skipped, cut or oom —, ``t`` in seconds, then the op's
fields), ``campaign.log`` (progress, tracebacks, the test output), ``summary.md`` (the table printed
last) and the two plots.

``--quick``: the smallest shapes, a couple of minutes on a GPU (a smoke test on arrival). Without
CUDA the campaign refuses unless ``--cpu-dry-run``: tiny shapes on CPU, the Triton kernels in
Triton's interpreter, and what needs CUDA recorded as skipped. ``--report`` prints the summary and
the README's tables from records (several files: e.g. the two calls of a session), and with ``--out
DIR`` writes ``summary.md`` and the plots there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import (attention, campaign_report, cases, generation, gpu_check, memory_reuse, model_step, plot,
                   runner, source_tree)
from bench.compiler import pinned_configs
from bench.compiler.pinned_configs import TIMEOUT_MARK
from xlnet_fast.kernel_contract import contract

ROOT = Path(__file__).resolve().parents[1]
RECORDS_FILE, LOG_FILE, SUMMARY_FILE = "campaign.jsonl", "campaign.log", "summary.md"
ATTENTION_PLOT, MODEL_PLOT = "attention.png", "model_step.png"
OUTPUT_FILES = (RECORDS_FILE, LOG_FILE, SUMMARY_FILE, ATTENTION_PLOT, MODEL_PLOT)
STEPS = ("env", "compile", "correctness", "sweep", "model_step", "memory", "ncu", "plots")
# Shares of the budget; "plots" runs at the end in the time kept back (RESERVE_*).
WEIGHTS = {"env": 0.04, "compile": 0.1, "correctness": 0.34, "sweep": 0.44, "model_step": 0.18, "memory": 0.12, "ncu": 0.3}
RESERVE_FRACTION, RESERVE_MAX_S = 0.04, 20.0
MIN_STEP_S = 2.0  # a step whose share is below this is not started (a cut record says so)
# A step still running this long after its share is killed: max(GRACE_MIN_S, GRACE_FRACTION x share).
GRACE_MIN_S, GRACE_FRACTION, GRACE_MAX_S = 5.0, 0.1, 30.0
MIN_ITEM_S = 1.0  # an item starts only with at least this many seconds of its step left
# A step's process talks to the campaign in lines on stdout: a record (JSON), a line for the log only,
# a process group it started (the test suite's: killed with the step). Other lines: log and console.
RECORD_PREFIX, LOG_PREFIX, GROUP_PREFIX = "@record ", "@log ", "@group "
NEEDS_CUDA = "needs CUDA"

# The test files that run the compiled kernels on a GPU, and the bf16 tests of the transformers patch
# (skipped without a GPU).
GPU_TESTS = ("tests/test_triton_kernels.py", "tests/test_fa2_reference.py",
             "tests/test_hf_patch.py::test_convergence_bf16_on_gpu_is_close",
             "tests/test_hf_patch.py::test_patched_with_triton_backend")
# The suite runs on the GPU with the kernels pinned to these configs (bench.compiler.pinned_configs):
# a compile or two per kernel variant instead of tuning every config at every test shape. 64x64w4s1
# where the device lists it and it fits; 32x32w4s1 where it does not (the first GPU run: fp32 at
# D=96 needs 278,528 B of shared memory for dK/dV at 64x64 on an H200, 232,448 allowed) or where
# the device lists both and the autotuner times them. The correctness step checks every config at
# a realistic shape after the suite.
PYTEST_CONFIGS = ("64x64w4s1", "32x32w4s1")
PYTEST_SHARE = 0.5  # of the correctness step's time, the suite's (the float64 checks get the rest)
# One test past this (its compiles included) fails as a timeout and the suite goes on
# (pinned_configs.TIMEOUT_ENV); at most half the suite's share, so that one hang cannot take all of it.
PER_TEST_TIMEOUT_S = 120.0
# The suite's failed tests re-run alone for their failure text: at most this share of what the
# correctness step has left, and RERUN_MAX_S; the text kept, its last FAILURE_TEXT_CHARS.
RERUN_SHARE, RERUN_MAX_S, FAILURE_TEXT_CHARS = 0.3, 120.0, 6000
SWEEP_MODES = ("fwd", "fwd_bwd")
# In the order they are measured at each shape: the headline comparison first, FlexAttention (the
# slowest to compile: one graph per shape and mode) last, so a cut at the step's end costs it first.
GPU_PROVIDERS = ("xlnet_fast", "sdpa_flash", "xlnet_fast_prepared", "xlnet_fast_pointers", "hf", "xlnet_fast_det",
                 "fa2_ref", "flex")
# Profiled per kernel at each D's first point (the first GPU run's most telling measurement).
PROFILED = ("xlnet_fast", "xlnet_fast_pointers", "xlnet_fast_det", "fa2_ref")
# what the H100's op table compared them with (our eager path: "unfused eager"), whatever the plan's providers
ANOMALY_PROVIDERS = ("xlnet_fast", "sdpa_flash", "xlnet_fast_prepared", "eager",
                     # where the host bounds a call: the launcher's per-argument checks, timed ("2026-11-29 (8)")
                     "xlnet_fast_addresses")
# The ncu step: Nsight Compute (clocks left alone) on the attention kernels, ours and the FA2
# reference's, one forward+backward each after a warm-up (bench.attention --ncu), with the sections
# the H100's runbook read, the shared-memory bank conflicts and wavefronts (what the compile report's
# smem B-eq/score models) and the warp-stall reasons (WarpStateStats), printed as CSV and recorded.
NCU_KERNELS = "regex:_(fwd|bwd_q|bwd_kv)_kernel|_fa2_"
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
NCU_METRICS = ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
               "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
               "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
               "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "smsp__inst_executed.sum")
# recorded from ncu's raw page besides NCU_METRICS and every warp-stall ratio
NCU_RECORDED = ("gpu__time_duration.sum", "launch__registers_per_thread", "launch__block_size", "launch__grid_size",
                "launch__shared_mem_per_block_dynamic", "launch__occupancy_limit_registers",
                "launch__occupancy_limit_shared_mem", "sm__warps_active.avg.pct_of_peak_sustained_active",
                "l1tex__throughput.avg.pct_of_peak_sustained_active",
                "smsp__issue_active.avg.pct_of_peak_sustained_active",
                "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "smsp__warps_eligible.avg.per_cycle_active", "smsp__average_warp_latency_per_inst_issued.ratio")


# --------------------------------------------------------------------------------------------------
# What runs in each mode
# --------------------------------------------------------------------------------------------------


def _check_case(**fields) -> cases.AttentionCase:
    """A case of the correctness step: drawn in float64, cast to each checked dtype."""
    return cases.AttentionCase(**fields, dtype=torch.float64)


@dataclass(frozen=True)
class Plan:
    """The shapes and selections of one mode; the defaults are the full GPU campaign's."""

    mode: str = "full"
    steps: tuple = STEPS  # the campaign's (the compile step compiles for those of them in COMPILED_AHEAD)
    matmul_n: int = 8192  # the bf16 matmul ceiling: an n x n x n product
    copy_mib: int = 2048  # the device-to-device copy ceiling: this many MiB copied
    pytest_targets: tuple = GPU_TESTS
    pytest_k: str | None = None
    # pytest-xdist workers; None: one per core. On a GPU the suite's time is triton's compiles, one core
    # each (the H100's 8 workers ran 88 tests in 89 s on 16 cores)
    pytest_workers: int | None = None
    checks: tuple = tuple(gpu_check.CASES + gpu_check.LONG_CASES)  # (name, case, dtypes, deterministic)
    config_check: tuple = gpu_check.CASES[1][:2]  # (name, case): checked in bf16 at each autotuner config
    sweep_D: tuple = (64, 128)
    sweep_points: tuple = ((512, 384), (2048, 384), (4096, 384), (16384, 384))  # (qlen, mlen), in order
    sweep_H: int = 16
    sweep_tokens: int = 16384  # B = max(1, sweep_tokens // qlen)
    sweep_dtype: str = "bf16"
    # shapes off the sweep's grid, (B, H, qlen, mlen, D), timed (ours, SDPA-flash, eager) and ours
    # profiled right after the first point of the same D: issue 33's op target (fwd+bwd at 8x12,
    # 512/384 within 4x SDPA-flash) and issue 34's long one (1x16 at 8192/0 within 3x, off the
    # sweep's grid), then the H100's two anomalies (issue 34, item 4) as it measured them
    op_target_shapes: tuple = ((8, 12, 512, 384, 64), (1, 16, 8192, 0, 64))
    anomaly_shapes: tuple = ((2, 16, 2048, 0, 64), (4, 8, 1024, 0, 128))
    providers: tuple = GPU_PROVIDERS
    models: tuple = (("base", cases.ModelCase("base", B=8, seq=512, mlen=384, predict=85)),
                     ("large", cases.ModelCase("large", B=8, seq=512, mlen=384, predict=85)))
    model_repeats: int = 10
    model_providers: tuple = model_step.GPU_PROVIDERS
    infer_B: int = 32  # the inference forward's rows
    cpu_repeats: int = 1
    # memory: Transformer-XL evaluation with memory at these attention lengths, generation at these
    # total lengths; the size is a TRANSFO_XL_SIZES name (and the XLNet of that width)
    memory_size: str = "wt103_base"
    memory_dtype: str = "bf16"
    memory_lengths: tuple = (128, 256, 512, 1024, 2048, 3800)
    memory_tgt_len: int = 128
    generation_lengths: tuple = (512, 1024, 2048, 3800)
    generation_new_tokens: int = 64
    # ncu: the shape (B, H, qlen, mlen, D, dtype) and the runs: (name, configs the kernels are pinned
    # to or None for the autotuner's picks, providers); 64x64w4s1 is what the suite pins and what
    # the H100's Nsight Compute file holds
    ncu_case: tuple = (32, 16, 512, 384, 64, "bf16")
    ncu_runs: tuple = (("pinned_64x64w4s1", ("64x64w4s1",), ("xlnet_fast", "fa2_ref")),
                       ("autotuned", None, ("xlnet_fast",)))

    def extra_cases(self, D: int) -> list:
        """``op_target_shapes`` then ``anomaly_shapes`` of head dim ``D`` as cases of the sweep's dtype."""
        dtype = cases.DTYPES[self.sweep_dtype]
        return [cases.AttentionCase(B, H, qlen, mlen, d, dtype)
                for B, H, qlen, mlen, d in self.op_target_shapes + self.anomaly_shapes if d == D]

    def sweep_cases(self) -> list:
        """The sweep's cases, D slowest (D=64 first: XLNet's), then the points in order."""
        dtype = cases.DTYPES[self.sweep_dtype]
        return [cases.AttentionCase(max(1, self.sweep_tokens // qlen), self.sweep_H, qlen, mlen, D, dtype)
                for D in self.sweep_D for qlen, mlen in self.sweep_points]


_QUICK_CHECK = ("two_stream_85_targets_B2",
                _check_case(B=2, H=16, qlen=512, mlen=384, D=64, targets=85, two_stream=True))
_DRY_CHECK = ("two_stream_tiny", _check_case(B=1, H=2, qlen=24, mlen=8, D=16, targets=5, two_stream=True))
PLANS = {
    "full": Plan(),
    "quick": Plan(
        "quick", matmul_n=4096, copy_mib=256,
        pytest_targets=(GPU_TESTS[0], GPU_TESTS[2]),
        pytest_k="forward_backward_match_eager_and_reference or convergence_bf16",
        checks=((*_QUICK_CHECK, gpu_check.CHECKED_DTYPES, False),), config_check=_QUICK_CHECK,
        sweep_D=(64,), sweep_points=((512, 384),), sweep_tokens=4096, op_target_shapes=(), anomaly_shapes=(),
        models=(("base_2_layers", cases.ModelCase("base", B=2, seq=512, mlen=384, predict=85, n_layer=2)),),
        model_repeats=3, infer_B=4, memory_lengths=(512, 3800), generation_lengths=(2048,), generation_new_tokens=32),
    "dry": Plan(
        "dry", matmul_n=0, copy_mib=0, pytest_targets=("tests/test_triton_kernels.py",),
        pytest_k="head_dims_past_the_kernels_limit", pytest_workers=1,  # one fast test
        checks=((*_DRY_CHECK, (torch.bfloat16,), True),), config_check=_DRY_CHECK,
        sweep_D=(16,), sweep_points=((16, 8),), sweep_H=2, sweep_tokens=16, sweep_dtype="fp32",
        providers=("xlnet_fast", "sdpa_flash", "xlnet_fast_prepared", "xlnet_fast_pointers", "xlnet_fast_addresses",
                   "hf", "eager", "xlnet_fast_det", "fa2_ref", "flex"),
        models=(("tiny_1_layer", cases.ModelCase("tiny", B=1, seq=16, mlen=8, predict=4, vocab=100, n_layer=1)),),
        model_repeats=1, infer_B=1, model_providers=("hf", "patched", "native"), memory_size="tiny",
        memory_dtype="fp32", memory_lengths=(16, 32), memory_tgt_len=8, generation_lengths=(24,),
        generation_new_tokens=4, ncu_case=(1, 2, 16, 8, 16, "fp32")),
}


# --------------------------------------------------------------------------------------------------
# A step's process: what it reports
# --------------------------------------------------------------------------------------------------


class Reporter:
    """What a step writes (protocol lines on stdout, read by the campaign) and its deadline
    (``time.time()`` by which the step should be done)."""

    def __init__(self, deadline: float, device: str, env: dict | None = None):
        self.deadline, self.device, self.env = deadline, device, env or {}
        self.cuda_lost: str | None = None

    def left(self) -> float:
        return self.deadline - time.time()

    def line(self, text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def log(self, text: str, console: bool = True) -> None:
        for line in str(text).splitlines() or [""]:
            self.line(line if console else LOG_PREFIX + line)

    def emit(self, op: str, status: str = "ok", **fields) -> dict:
        rec = {"op": op, "status": status, **self.env, **fields}
        self.line(RECORD_PREFIX + json.dumps(rec, default=str))
        return rec

    def skipped(self, op: str, reason: str, **fields) -> dict:
        self.log(f"skipped {op} {_describe(fields)}: {reason}")
        return self.emit(op, "skipped", reason=reason, **fields)

    def failed(self, op: str, exc: BaseException, **fields) -> dict:
        self.log(f"ERROR in {op} {_describe(fields)}:")
        self.log("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        if self.device == "cuda" and self.cuda_lost is None:
            self.cuda_lost = _cuda_failure()
        return self.emit(op, "error", error=f"{type(exc).__name__}: {exc}"[:2000], **fields)

    def each(self, items: list, label, op: str):
        """Yield ``items`` while the step has at least ``MIN_ITEM_S`` left and CUDA works; then one
        ``cut`` (or ``skipped``) record naming the items not run."""
        for n, item in enumerate(items):
            not_run = [label(x) for x in items[n:]]
            if self.cuda_lost is not None:
                self.skipped(op, f"CUDA context lost earlier: {self.cuda_lost}", not_run=not_run)
                return
            if self.left() < MIN_ITEM_S:
                self.log(f"cut: {op}: the step's time is up; not run: {', '.join(not_run)}")
                self.emit(op, "cut", reason="the step's share of the budget was used up", not_run=not_run)
                return
            yield item

    def attempt(self, op: str, fn, **fields) -> list:
        """``fn()`` -> a record's fields (or a list of them; ``status`` among them if not ok), emitted
        with ``fields``; out of memory is an ``oom`` record, an exception an ``error`` record."""
        try:
            out = fn()
        except torch.OutOfMemoryError as exc:
            self.log(f"out of memory in {op} {_describe(fields)}: {str(exc).splitlines()[0]}")
            _free(self.device)
            return [self.emit(op, "oom", **fields)]
        except Exception as exc:  # noqa: BLE001 - recorded, the campaign goes on
            return [self.failed(op, exc, **fields)]
        recs = []
        for result in out if isinstance(out, list) else [out]:
            result = {k: v for k, v in {**fields, **result}.items() if k != "op"}
            recs.append(self.emit(op, result.pop("status", "ok"), **result))
        return recs


def _describe(fields: dict) -> str:
    keys = ("case", "provider", "mode", "D", "L", "mlen", "config", "dtype")
    return " ".join(f"{k}={fields[k]}" for k in keys if fields.get(k) is not None)


def _cuda_failure() -> str | None:
    """None if the CUDA context still works after an error, else what synchronising raised."""
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: the process must end
        return f"{type(exc).__name__}: {exc}"[:500]


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _untuned() -> bool:
    """The kernels run in Triton's interpreter at fixed tiles, or not at all (no GPU): nothing is tuned."""
    return contract.interpreting() or not torch.cuda.is_available()


class _Tuning:
    """Emits an ``autotune`` record for each shape the kernels' autotuners tuned (``TuningLog``)."""

    def __init__(self, r: Reporter):
        self.r, self.log = r, None if _untuned() else pinned_configs.TuningLog()

    def look(self, context: str) -> None:
        for rec in self.log.new(context) if self.log else []:
            self.r.emit("autotune", **rec)

    def flush(self, context: str) -> None:
        if self.log is None:
            self.r.skipped("autotune", "the interpreter runs fixed tiles: nothing is tuned", context=context)
        self.look(context)


# --------------------------------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------------------------------


def step_env(r: Reporter, plan: Plan) -> None:
    """The device (the versions are in every record: ``runner.environment()``), and the two ceilings."""
    note = source_tree.ensure_kernels_importable()

    def environment():
        out = {"mode": plan.mode, "triton_interpret": os.environ.get("TRITON_INTERPRET"),
               "kernels_import": note or "xlnet_fast.kernels importable", "cpu_count": os.cpu_count()}
        if r.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            out.update(device=props.name, sm_count=props.multi_processor_count, capability=f"{props.major}."
                       f"{props.minor}", memory_gib=round(props.total_memory / 2**30, 1))
        return out

    r.attempt("environment", environment)
    for op, fn in (("ceiling_matmul", lambda: matmul_ceiling(plan.matmul_n)),
                   ("ceiling_copy", lambda: copy_ceiling(plan.copy_mib))):
        if r.device != "cuda":
            r.skipped(op, NEEDS_CUDA)
            continue
        for _ in r.each([op], str, op):
            r.attempt(op, fn)


def correctness_calls(plan: Plan) -> list:
    """``[(label, call)]``: the correctness step's runs of our kernels after its test suite (whose
    shapes are the tests' own): each float64 check's forward and backward at each checked dtype (the
    eager references launch none), then its case at each pinned config, in order, on meta tensors."""
    def call(case, dtype, deterministic, config=None):
        def run():
            with pinned_configs.pinned([config]) if config else contextlib.nullcontext(), \
                    runner.deterministic_algorithms(deterministic):
                gpu_check.run(cases.attention_inputs(case, "meta"), dtype, "triton")
        return run

    calls = [(f"check {name} {str(dtype).split('.')[-1]}{' deterministic' * det}", call(case, dtype, det))
             for name, case, dtypes, det in plan.checks for dtype in dtypes]
    name, case = plan.config_check
    return calls + [(f"check {name} bfloat16 at {config}", call(case, torch.bfloat16, False, config))
                    for config in pinned_configs.all_config_names()]


def sweep_calls(plan: Plan) -> list:
    """``[(label, call)]``: the forward and forward+backward of each of our providers at each shape the
    sweep times, in the sweep's order (``sweep_items``), each building its inputs on meta tensors."""
    def call(provider, case, mode):
        return lambda: attention.provider_fn(provider, cases.attention_inputs(case, "meta"), mode)()

    ours = [p for p in plan.providers if p.startswith("xlnet_fast")]
    ours_off_grid = [p for p in ANOMALY_PROVIDERS if p.startswith("xlnet_fast")]  # whatever the plan's providers
    calls = []
    for D in plan.sweep_D:
        d_cases = [c for c in plan.sweep_cases() if c.D == D]
        shapes = [(d_cases[0], ours)] + [(c, ours_off_grid) for c in plan.extra_cases(D)]
        for case, providers in shapes + [(c, ours) for c in d_cases[1:]]:
            calls += [(f"{p} {m} D={case.D} {case.B}x{case.H} {case.qlen}/{case.mlen}", call(p, case, m))
                      for m in SWEEP_MODES for p in providers if attention.runs_in_mode(p, m)]
    return calls


def model_step_calls(plan: Plan, device: str = "meta") -> list:
    """``[(label, call)]``: a training step and an inference forward of each model the model step
    times, with each provider of ours (the graphed and compiled native steps launch the native one's
    binaries), under bf16 autocast: on meta tensors as on a GPU (``fake_gpu.autocast_on_meta``), or
    on ``device``'s with its own autocast (``tests/test_precompile.py`` compares the two on the CPU)."""
    from bench.compiler.fake_gpu import autocast_on_meta

    providers = list(dict.fromkeys(p.split("-")[0] for p in plan.model_providers if p != "hf"))
    built: dict = {}

    def call(label, case, provider, mode):
        def run():
            if built.get("label") != label:  # the model and batches once per size, in the calls' order
                built.clear()
                built.update(label=label, source=model_step.source_model(case, device),
                             train=cases.pretraining_batch(case, device),
                             infer=model_step.infer_batch(case, plan.infer_B, device))
            model = model_step.provider_model(provider, built["source"], device)
            step = model_step.train_step if mode == "train" else model_step.infer_step
            with autocast_on_meta(torch.bfloat16) if device == "meta" else contextlib.nullcontext():
                step(provider, model, built[mode], device, autocast=True)()
        return run

    return [(f"model_step {label} {provider} {mode}", call(label, case, provider, mode))
            for label, case in plan.models for provider in providers for mode in model_step.MODES]


# the steps whose calls of our kernels the compile step makes ahead, in the campaign's order
COMPILED_AHEAD = {"correctness": correctness_calls, "sweep": sweep_calls, "model_step": model_step_calls}


def compile_calls(plan: Plan) -> list:
    """The calls whose binaries the compile step compiles ahead: the correctness step's checks, the
    sweep's, then the model step's, for those among the campaign's steps (first needed first)."""
    return [call for step, calls in COMPILED_AHEAD.items() if step in plan.steps for call in calls(plan)]


def step_compile(r: Reporter, plan: Plan) -> None:
    """What the correctness step's checks, the sweep's and the model step's calls will make triton's JIT
    compile on this GPU (those of the campaign's steps), compiled ahead by one worker per core into triton's cache
    (``bench.compiler.precompile``; the step runs without ``TRITON_INTERPRET``, even in the dry run).
    Without CUDA the binaries are only counted."""
    from bench.compiler import precompile

    source_tree.ensure_kernels_importable()
    if not set(COMPILED_AHEAD) & set(plan.steps):
        r.skipped("precompile", f"none of {', '.join(COMPILED_AHEAD)} is among the campaign's steps: nothing to compile")
        return
    if r.device != "cuda":
        from bench.compiler import aot

        problem = aot.toolchain_problem(90)
        if problem:
            r.skipped("precompile", f"{NEEDS_CUDA}; and no sm_90 toolchain to count the binaries with: {problem}")
            return

        def count():
            found = precompile.distinct_launches(compile_calls(plan), 90)
            return {"status": "skipped", "arch": 90, "binaries": len(found),
                    "reason": f"{NEEDS_CUDA}: the binaries for sm_90 counted, not compiled"}
        r.attempt("precompile", count)
        return
    import triton

    arch = triton.runtime.driver.active.get_current_target().arch  # what the JIT compiles for here
    jobs = len(os.sched_getaffinity(0))
    r.attempt("precompile", lambda: precompile.compile_ahead(compile_calls(plan), arch, jobs, r.left() - MIN_ITEM_S,
                                                             torch.cuda.current_device()))


def matmul_ceiling(n: int) -> dict:
    """bf16 ``n x n @ n x n`` on random data: CUDA-event median and TFLOP/s."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    ms = runner.median_ms(lambda: a @ b, "cuda")
    return {"n": n, "dtype": "bf16", "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def copy_ceiling(mib: int) -> dict:
    """Device-to-device copy of ``mib`` MiB of random data: GB/s counting bytes read and written."""
    src = torch.randn(mib * 2**20 // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = runner.median_ms(lambda: dst.copy_(src), "cuda")
    return {"mib": mib, "ms": ms, "gb_per_s": 2 * src.numel() * 4 / (ms * 1e-3) / 1e9,
            "counting": "bytes read + bytes written"}


_CLOSING_LINE = re.compile(r"^=+ (.+?) in [\d.]+s")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")
_OUTCOME = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors", "XFAIL": "xfailed",
            "XPASS": "xpassed"}
_WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
# -v lines: "path::test OUTCOME [ 10%]", or under pytest-xdist "[gw0] [ 10%] OUTCOME path::test"
_VERBOSE = (re.compile(rf"^(\S+::\S+)\s+({_WORDS})\b"),
            re.compile(rf"^\[gw\d+\]\s+\[\s*\d+%\]\s+({_WORDS})\s+(\S+::\S+)"))


def _test_id(nodeid: str) -> str:
    """A test id relative to the repository (pytest prints it relative to its working directory)."""
    return nodeid[nodeid.index("tests/"):] if "tests/" in nodeid else nodeid


def parse_pytest(lines: list) -> dict:
    """Counts (``passed``, ``failed``, ``skipped``, ``errors``...) from pytest's closing line, or
    counted from the ``-v`` lines when it has none (stopped early); every test's outcome by id
    (``tests``, from the ``-v`` lines: also when the run was stopped before its summary), the
    failed ones (``failed_tests``: from ``-rfE``'s summary and the ``-v`` lines) and those that
    failed by the per-test timeout (``timed_out_tests``)."""
    counts, closing, tests, failed, timed_out = {}, None, {}, set(), set()
    for line in lines:
        stripped = line.strip()
        m = _CLOSING_LINE.match(stripped)
        closing = m.group(1) if m else closing
        plain, xdist = (pattern.match(stripped) for pattern in _VERBOSE)
        if plain or xdist:
            nodeid, word = (plain.group(1), plain.group(2)) if plain else (xdist.group(2), xdist.group(1))
            tests[_test_id(nodeid)] = _OUTCOME[word]
        summary = re.match(r"^(FAILED|ERROR) (\S+::\S+)", stripped)
        if summary:
            failed.add(_test_id(summary.group(2)))
            if TIMEOUT_MARK in stripped:
                timed_out.add(_test_id(summary.group(2)))
    for n, what in _COUNT.findall(closing or ""):
        what = {"error": "errors", "warning": "warnings"}.get(what, what)
        counts[what] = counts.get(what, 0) + int(n)
    if closing is None:
        for outcome in tests.values():
            counts[outcome] = counts.get(outcome, 0) + 1
    failed |= {name for name, outcome in tests.items() if outcome in ("failed", "errors")}
    # the tests only a GPU runs (named *_on_gpu, tests/test_campaign.py checks it) with their outcome
    gpu_only = {name: outcome for name, outcome in tests.items() if "_on_gpu" in name}
    return {"counts": counts, "closing_line": closing, "failed_tests": sorted(failed),
            "timed_out_tests": sorted(timed_out), "tests": dict(sorted(tests.items())), "gpu_only_tests": gpu_only}


def _pytest_command(r: Reporter, root: Path = ROOT) -> tuple[list, dict, str | None]:
    """pytest's command (verbose, failures summarised, the campaign's plugins, the project's
    configuration), its environment (no ``TRITON_INTERPRET``; on a GPU the kernels pinned to
    ``PYTEST_CONFIGS``) and the pinned configs."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-p", "bench.source_tree",
           "-p", "bench.compiler.pinned_configs", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(root)]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", pinned_configs.ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    pinned = ",".join(PYTEST_CONFIGS) if r.device == "cuda" else None
    if pinned:
        env[pinned_configs.ENV] = pinned
    return cmd, env, pinned


def run_pytest(r: Reporter, plan: Plan, timeout_s: float) -> dict:
    """The suite's GPU tests in a subprocess without ``TRITON_INTERPRET`` (on a GPU the compiled
    kernels, pinned to ``PYTEST_CONFIGS``; on CPU, where tests/conftest.py turns the interpreter on, a
    quick selection), stopped after ``timeout_s``; its output goes to the log only."""
    import importlib.util

    cmd, env, pinned = _pytest_command(r)
    workers = plan.pytest_workers or len(os.sched_getaffinity(0))
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    cmd += (["-k", plan.pytest_k] if plan.pytest_k else []) + [str(ROOT / t) for t in plan.pytest_targets]
    per_test = round(min(PER_TEST_TIMEOUT_S, max(timeout_s * 0.5, 1.0)), 1)
    env[pinned_configs.TIMEOUT_ENV] = str(per_test)
    r.log(f"pytest (up to {timeout_s:.0f} s, {per_test:g} s a test): {' '.join(cmd[cmd.index('--rootdir') + 2:])}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="campaign_pytest_") as cwd:  # .hypothesis and the like land here
        lines, returncode, stopped = _run_logged(r, cmd, cwd, env, timeout_s)
    result = parse_pytest(lines)
    result.update(returncode=returncode, seconds=round(time.time() - t0, 1), targets=list(plan.pytest_targets),
                  k=plan.pytest_k, command=" ".join(cmd[1:]), pinned_config=pinned, per_test_timeout_s=per_test)
    if stopped:
        result.update(status="cut", reason=f"stopped after {timeout_s:.0f} s (its share of the budget)")
    elif returncode not in (0, 5) or result["counts"].get("failed") or result["counts"].get("errors"):
        result.update(status="error", error=f"pytest exit status {returncode}: {result['closing_line']}")
    r.log(f"pytest: {result['closing_line'] or result['counts']} (exit status {returncode}"
          f"{', stopped' if stopped else ''})")
    return result


def rerun_failed(r: Reporter, test_ids: list, timeout_s: float, root: Path = ROOT) -> dict:
    """``test_ids`` (relative to ``root``) again, alone, one process, with their failure text
    (``--tb=short``): a suite stopped at its share prints no failure summary (the H100's first run
    lost two tests' reasons so), and a test that passes alone points at the suite's load or order.
    Fields: ``tests`` (outcome by id), ``failed_tests``, ``passed_alone``, ``failure_text`` (pytest's
    FAILURES section, its last FAILURE_TEXT_CHARS)."""
    cmd, env, pinned = _pytest_command(r, root)
    cmd += ["--tb=short"] + [str(root / t) for t in test_ids]
    r.log(f"pytest, the failed tests alone (up to {timeout_s:.0f} s): {' '.join(test_ids)}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="campaign_pytest_") as cwd:
        lines, returncode, stopped = _run_logged(r, cmd, cwd, env, timeout_s)
    parsed = parse_pytest(lines)
    start = next((i for i, line in enumerate(lines) if re.match(r"^=+ FAILURES =+$", line.strip())), len(lines))
    result = {"tests": parsed["tests"], "failed_tests": parsed["failed_tests"],
              "passed_alone": sorted(t for t, outcome in parsed["tests"].items() if outcome == "passed"),
              "failure_text": "\n".join(lines[start:])[-FAILURE_TEXT_CHARS:], "returncode": returncode,
              "seconds": round(time.time() - t0, 1), "pinned_config": pinned}
    if stopped:
        result.update(status="cut", reason=f"stopped after {timeout_s:.0f} s")
    elif parsed["failed_tests"]:
        result.update(status="error", error=f"failed again alone: {', '.join(parsed['failed_tests'])}")
    r.log(f"pytest alone: {parsed['closing_line'] or parsed['counts']}")
    return result


def _check(name: str, case, dtypes, deterministic: bool, device: str, **extra) -> list:
    """``bench.gpu_check``'s records of ``case``, errors where outside the suite's tolerance."""
    return [{**rec, **extra, **({} if rec["within_tolerance"] else
                                {"status": "error", "error": "outside the suite's tolerance"})}
            for rec in gpu_check.check_case(name, case, device, dtypes, deterministic)]


def step_correctness(r: Reporter, plan: Plan) -> None:
    """The suite's GPU tests, ``bench.gpu_check``'s float64 comparison, then one case at each config."""
    for _ in r.each(["pytest"], str, "pytest"):
        [suite] = r.attempt("pytest", lambda: run_pytest(r, plan, r.left() * PYTEST_SHARE))
        failed = suite.get("failed_tests") or []
        for _ in r.each(["the failed tests alone"] if failed else [], str, "pytest_rerun"):
            r.attempt("pytest_rerun", lambda: rerun_failed(r, failed, min(RERUN_MAX_S, r.left() * RERUN_SHARE)))
    tuning = _Tuning(r)
    label = lambda c: f"{c[0]}{' deterministic' if c[3] else ''}"  # noqa: E731
    for name, case, dtypes, det in r.each(list(plan.checks), label, "xlnet_attn_check"):
        r.attempt("xlnet_attn_check", lambda: _check(name, case, dtypes, det, r.device), case=name, deterministic=det)
        _free(r.device)
    tuning.flush("correctness")
    name, case = plan.config_check
    if _untuned():
        r.skipped("xlnet_attn_check", "the interpreter runs fixed tiles: no config to pin", case=name, config="each")
        return
    for config in r.each(pinned_configs.all_config_names(), str, "xlnet_attn_check"):
        with pinned_configs.pinned([config]):
            r.attempt("xlnet_attn_check", lambda: _check(name, case, [torch.bfloat16], False, r.device, config=config),
                      case=name, config=config)
        _free(r.device)


def sweep_items(plan: Plan) -> list:
    """``(kind, case, mode, provider)`` in order: per D, an agreement check at its first point, the
    measurements at that point, where the GPU time goes there (``PROFILED``, forward+backward), the
    shapes off the grid (``extra_cases``), the other points, and a repeat of the first ``xlnet_fast``
    forward+backward (the spread)."""
    items = []
    for D in plan.sweep_D:
        d_cases = [c for c in plan.sweep_cases() if c.D == D]
        timed = [[("time", c, m, p) for m in SWEEP_MODES for p in plan.providers if attention.runs_in_mode(p, m)]
                 for c in d_cases]
        items.append(("agree", d_cases[0], "fwd", None))
        items += timed[0] + [("profile", d_cases[0], "fwd_bwd", p) for p in PROFILED if p in plan.providers]
        ours_profiled = [("profile", "xlnet_fast")] if "xlnet_fast" in plan.providers else []
        for case in plan.extra_cases(D):
            items += [("time", case, m, p) for m in SWEEP_MODES for p in ANOMALY_PROVIDERS
                      if attention.runs_in_mode(p, m)]
            items += [(kind, case, "fwd_bwd", p) for kind, p in ours_profiled]
        # ours at every later point too: where its time goes as the length grows (issue 34's
        # anomalies: a long sequence slower than more work at 512, D=128 slower than eager)
        for case, more in zip(d_cases[1:], timed[1:]):
            items += more + [(kind, case, "fwd_bwd", p) for kind, p in ours_profiled]
        if "xlnet_fast" in plan.providers:
            items.append(("repeat", d_cases[0], "fwd_bwd", "xlnet_fast"))
    return items


def step_sweep(r: Reporter, plan: Plan) -> None:
    """``bench.attention``'s providers on the same tensors per shape, forward and forward+backward."""
    tuning, drawn, inputs = _Tuning(r), None, None
    label = lambda x: f"{x[0]} D={x[1].D} L={x[1].qlen} mlen={x[1].mlen} {x[2]} {x[3] or ''}".rstrip()  # noqa: E731
    for kind, case, mode, prov in r.each(sweep_items(plan), label, "xlnet_attn"):
        if drawn != case:
            inputs = None
            _free(r.device)
            inputs, drawn = cases.attention_inputs(case, r.device), case
        fields = {"dtype": plan.sweep_dtype, "B": case.B, "H": case.H, "L": case.qlen, "mlen": case.mlen, "D": case.D,
                  "mode": mode}
        if kind == "agree":
            provs = [p for p in plan.providers if p in attention.XLNET_PROVIDERS and p not in ("xlnet_fast_det", "eager")
                     and attention.unavailable(p, "fwd", r.device, case) is None]
            r.attempt("provider_agreement", lambda: attention.agreement(inputs, provs), **fields)
            continue
        if kind == "profile":
            if r.device != "cuda":
                r.skipped("kernel_profile", "needs CUDA (the profiler's GPU activity)", provider=prov, **fields)
            else:
                r.attempt("kernel_profile", lambda: attention.kernel_times(inputs, prov, mode), provider=prov, **fields)
            continue
        why = attention.unavailable(prov, mode, r.device, case)
        if why:
            r.skipped("xlnet_attn", why, provider=prov, **fields)
            continue
        r.attempt("xlnet_attn", lambda: attention.measure(inputs, case, plan.sweep_dtype, mode, prov, r.device,
                                                          plan.cpu_repeats),
                  provider=prov, **fields, **({"repeat": True} if kind == "repeat" else {}))
        if prov.startswith("xlnet_fast"):
            tuning.look(f"{prov} {mode} D={case.D} L={case.qlen} mlen={case.mlen} B={case.B}")
    tuning.flush("sweep")


def step_model_step(r: Reporter, plan: Plan) -> None:
    """``bench.model_step``: XLNet's training step (forward, backward, AdamW; bf16 autocast on CUDA)
    and inference forward, transformers against the patched and the native model (eager and
    compiled), on the same weights and batches, per model size."""
    tuning, built = _Tuning(r), {}
    items = [(label, case, prov) for label, case in plan.models for prov in plan.model_providers]
    for label, case, prov in r.each(items, lambda x: f"{x[0]} {x[2]}", "model_step"):
        if built.get("label") != label:
            built.clear()
            _free(r.device)

            def build():
                built["source"] = model_step.source_model(case)
                built["batches"] = {"train": cases.pretraining_batch(case, r.device),
                                    "infer": model_step.infer_batch(case, plan.infer_B, r.device)}
                return {"parameters": sum(p.numel() for p in built["source"].parameters())}

            [rec] = r.attempt("model_source", build, case=label)
            built.update(label=label, failed=None if rec["status"] == "ok" else rec["status"])
        if built["failed"]:
            r.skipped("model_step", f"the model and batches could not be built ({built['failed']})", case=label,
                      provider=prov)
            continue
        r.attempt("model_step", lambda: model_step.measure_provider(prov, case, built["source"], built["batches"],
                                                                    r.device, plan.model_repeats, plan.infer_B),
                  case=label, provider=prov)
        tuning.look(f"model_step {label} {prov}")
    tuning.flush("model_step")


def step_memory(r: Reporter, plan: Plan) -> None:
    """``bench.memory_reuse`` (tokens/s of Transformer-XL's evaluation with memory and of a recomputed
    sliding context per attention length) and ``bench.generation`` (Transformer-XL and XLNet: tokens/s
    of generation with memory and of recomputing the context)."""
    dtype, models = generation.DTYPES[plan.memory_dtype], {}

    def model(kind: str):
        if kind not in models:
            models.clear()
            _free(r.device)
            models[kind] = generation.build_model(kind, plan.memory_size, r.device, dtype, mem_len=0)
        return models[kind]

    for A in r.each(list(plan.memory_lengths), lambda a: f"attention length {a}", "memory_reuse"):
        r.attempt("memory_reuse", lambda: memory_reuse.measure_length(model("transfo-xl"), plan.memory_size, A,
                                                                      plan.memory_tgt_len, r.device, plan.cpu_repeats),
                  L=A)
    items = [(kind, L) for kind in generation.MODELS for L in plan.generation_lengths]
    for kind, L in r.each(items, lambda x: f"{x[0]} length {x[1]}", "generation"):
        def measure():
            m = model(kind)
            m.config.mem_len = L  # the memory holds the whole context
            return generation.measure_length(m, kind, plan.memory_size, L, plan.generation_new_tokens, r.device)

        r.attempt("generation", measure, case=kind, L=L)
    _free(r.device)


def ncu_command(plan: Plan, configs, providers) -> tuple:
    """(ncu's arguments, the profiled program's arguments) of one ncu run."""
    B, H, qlen, mlen, D, dtype = plan.ncu_case
    target = ["-m", "bench.attention", "--qlens", str(qlen), "--mlens", str(mlen), "--B", str(B), "--H", str(H),
              "--D", str(D), "--dtypes", dtype, "--modes", "fwd_bwd", "--providers", *providers, "--ncu",
              "--no-record"] + (["--configs", *configs] if configs else [])
    ncu = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--kernel-name", NCU_KERNELS, "--csv",
           "--page", "raw", *[x for section in NCU_SECTIONS for x in ("--section", section)], "--metrics",
           ",".join(NCU_METRICS)]
    return ncu, target


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text or None


def parse_ncu_csv(lines: list) -> list:
    """One dict per profiled kernel from ``ncu --csv --page raw``'s output (other lines skipped):
    ``kernel``, ``stalls`` ({reason: warps stalled per issued instruction}, the largest first) and
    the metrics of NCU_METRICS and NCU_RECORDED ({name: [value, unit]})."""
    import csv

    rows = [line for line in lines if line.startswith('"')]
    if not rows:
        return []
    table = list(csv.reader(rows))
    header, units = table[0], table[1] if len(table) > 1 and not table[1][0] else [""] * len(table[0])
    out = []
    for row in table[1:]:
        if not row or not row[0] or not row[0].isdigit():
            continue
        values = dict(zip(header, row))
        unit = dict(zip(header, units))
        stalls = {}  # WarpStateStats: smsp__average_warp{s,_latency}_issue_stalled_<reason>[_per_issue_active]
        for name, value in values.items():
            found = re.match(r"smsp__average_warps?(?:_latency)?_issue_stalled_(\w+?)(?:_per_issue_active)?\.\w+$",
                             name)
            if found and isinstance(_number(value), float):
                stalls[found.group(1)] = _number(value)
        out.append({"kernel": values.get("Kernel Name"), "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
                    "metrics": {name: [_number(values[name]), unit.get(name)] for name in NCU_METRICS + NCU_RECORDED
                                if name in values}})
    return out


def step_ncu(r: Reporter, plan: Plan) -> None:
    """Nsight Compute on the attention kernels, ours and the reference's (``Plan.ncu_runs``): one
    ``ncu_kernel`` record per profiled kernel (bank conflicts, wavefronts, stall reasons, occupancy),
    ncu's whole output in the log. Without CUDA or ncu the profiled program runs alone (a rehearsal)."""
    import shutil

    found = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name, configs, providers in r.each(list(plan.ncu_runs), lambda x: x[0], "ncu_run"):
        ncu, target = ncu_command(plan, configs, providers)
        profiled = r.device == "cuda" and found is not None
        cmd = ([found, *ncu[1:]] if profiled else []) + [sys.executable, *target]
        fields = {"run_name": name, "configs": list(configs) if configs else None, "providers": list(providers),
                  "command": shlex.join(ncu + ["python3", *target])}

        def run():
            lines = _run_group(r, cmd, env, r.left())
            kernels = parse_ncu_csv(lines) if profiled else []
            for kernel in kernels:
                r.emit("ncu_kernel", run_name=name, **kernel)
            if not profiled:
                why = "needs CUDA and Nsight Compute (ncu)" if r.device != "cuda" else "ncu was not found"
                return {"status": "skipped", "reason": f"{why}: the profiled program ran without it",
                        "program_lines": [line for line in lines if "profiled once" in line]}
            return {"kernels": [k["kernel"] for k in kernels]} if kernels else {
                "status": "error", "error": "ncu profiled no kernel (its output is in the log)"}

        r.attempt("ncu_run", run, **fields)


def _run_logged(r: Reporter, cmd: list, cwd, env: dict, timeout_s: float) -> tuple[list, int, bool]:
    """``cmd`` in a process group of its own (which the campaign kills with the step), each output
    line to the log; the group killed after ``timeout_s``: (its lines, exit status, whether stopped)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    r.line(f"{GROUP_PREFIX}{proc.pid}")
    lines: list = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            r.log(lines[-1], console=False)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode, stopped = proc.wait(timeout=max(timeout_s, 0.1)), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group we started: the program and its workers
        returncode, stopped = proc.wait(), True
    reader.join(timeout=10)
    return lines, returncode, stopped


def _run_group(r: Reporter, cmd: list, env: dict, timeout_s: float) -> list:
    """``cmd``'s output lines (``_run_logged``, from the repository's root); stopped after ``timeout_s``
    (TimeoutError), a failure (RuntimeError)."""
    r.log(f"running (up to {timeout_s:.0f} s): {shlex.join(cmd)}")
    lines, returncode, stopped = _run_logged(r, cmd, ROOT, env, timeout_s)
    if stopped:
        raise TimeoutError(f"stopped after {timeout_s:.0f} s (the step's share of the budget)")
    if returncode != 0:
        raise RuntimeError(f"exit status {returncode}: " + " | ".join(lines[-5:]))
    return lines


STEP_FUNCTIONS = {"env": step_env, "compile": step_compile, "correctness": step_correctness, "sweep": step_sweep,
                  "model_step": step_model_step, "memory": step_memory, "ncu": step_ncu}


def child_main(args) -> int:
    """Run one step in this process, reporting on stdout."""
    mode = _mode(args)
    device = "cuda" if mode != "dry" and torch.cuda.is_available() else "cpu"
    r = Reporter(args.deadline, device, {**runner.environment(), **({"device": "cpu"} if device == "cpu" else {})})
    plan = dataclasses.replace(PLANS[mode], steps=tuple(args.steps))
    if args.sweep_D:
        plan = dataclasses.replace(plan, sweep_D=tuple(args.sweep_D))
    try:
        STEP_FUNCTIONS[args.child](r, plan)
    except Exception as exc:  # noqa: BLE001 - recorded; the campaign goes on with the next step
        r.failed(args.child, exc)
        return 1
    return 3 if r.cuda_lost else 0


# --------------------------------------------------------------------------------------------------
# The campaign: shares, the steps' processes, records, log, summary
# --------------------------------------------------------------------------------------------------


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group this campaign started (a step, or the test suite a step started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Campaign:
    """Runs the steps as child processes and owns the output files (their only writer)."""

    def __init__(self, out: Path, budget_s: float, mode: str, steps: list, child_args: list = ()):
        self.out, self.mode, self.steps, self.child_args = out, mode, steps, list(child_args)
        self.t0 = time.time()
        self.end = self.t0 + budget_s
        self.reserve = min(RESERVE_MAX_S, RESERVE_FRACTION * budget_s)
        self.run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.t0)) + f"-{os.getpid()}"
        self.records: list = []
        self.device = None
        self.child = None
        self.child_groups: set = set()  # process groups the running step started (its test suite)
        self._lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)
        self._log = open(out / LOG_FILE, "a", buffering=1)
        self._jsonl = open(out / RECORDS_FILE, "a", buffering=1)

    def log(self, text: str, console: bool = True) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {text}"
        with self._lock:
            self._log.write(line + "\n")
        if console:
            print(line, file=sys.stderr, flush=True)

    def add(self, step: str, rec: dict) -> dict:
        rec = {"run": self.run_id, "step": step, "t": round(time.time() - self.t0, 2), **rec}
        rec.setdefault("device", self.device)
        self.device = rec.get("device") or self.device
        with self._lock:
            self._jsonl.write(json.dumps(rec, default=str) + "\n")
            self.records.append(rec)
        return rec

    def share(self, step: str, remaining: list) -> float:
        """Seconds for ``step``: the time left (less the reserve) split by weight among the steps left."""
        weights = [WEIGHTS[s] for s in remaining if s in WEIGHTS]
        left = self.end - self.reserve - time.time()
        return max(0.0, left * WEIGHTS[step] / sum(weights)) if weights else 0.0

    def run(self) -> int:
        self.log(f"campaign {self.run_id}: mode {self.mode}, budget {(self.end - self.t0) / 60:.1f} min, steps "
                 f"{' '.join(self.steps)}, writing to {self.out}")
        try:
            for i, step in enumerate(self.steps):
                if step in WEIGHTS:
                    self.run_step(step, self.share(step, self.steps[i:]))
        except KeyboardInterrupt:
            self._stop_child()
            self.add("campaign", {"op": "interrupted", "status": "cut", "reason": "interrupted (SIGINT/SIGTERM)"})
            self.log("interrupted: writing what was measured")
        finally:
            self.finish()
        return 1 if any(r.get("status") == "error" for r in self.records) else 0

    def child_command(self, step: str, deadline: float) -> list:
        return [sys.executable, "-m", "bench.campaign", "--child", step, "--deadline", f"{deadline:.3f}",
                *self.child_args]

    def _read_child(self, step: str, stream, counts: dict) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith(GROUP_PREFIX):
                self.child_groups.add(int(line[len(GROUP_PREFIX):]))
            elif line.startswith(RECORD_PREFIX):
                try:
                    rec = self.add(step, json.loads(line[len(RECORD_PREFIX):]))
                except json.JSONDecodeError:
                    self.log(f"{step}: unreadable record line: {line[:200]}")
                    continue
                counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            elif line.startswith(LOG_PREFIX):
                self.log(line[len(LOG_PREFIX):], console=False)
            else:
                self.log(f"{step}: {line}")

    def run_step(self, step: str, share: float) -> None:
        """``step`` in a child process for ``share`` seconds (killed a grace period after), its records
        and a ``step`` record."""
        t_start, counts = time.time(), {}
        if share < MIN_STEP_S:
            self.log(f"cut: step {step} not started: {share:.1f} s of the budget left for it")
            self.add(step, {"op": "step", "status": "cut", "seconds": 0.0, "share_s": round(share, 1), "records": 0,
                            "note": "not started: the budget was used up", "reason": "no time left", "not_run": [step]})
            return
        grace = min(GRACE_MAX_S, max(GRACE_MIN_S, GRACE_FRACTION * share))
        self.log(f"step {step}: {share:.0f} s (killed {grace:.0f} s after that if still running)")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if self.mode == "dry" and step != "compile":
            env["TRITON_INTERPRET"] = "1"  # the kernels in Triton's interpreter on CPU
        else:
            env.pop("TRITON_INTERPRET", None)  # the compiled kernels
        self.child = subprocess.Popen(self.child_command(step, t_start + share), cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        reader = threading.Thread(target=self._read_child, args=(step, self.child.stdout, counts), daemon=True)
        reader.start()
        killed = False
        try:
            returncode = self.child.wait(timeout=share + grace)
        except subprocess.TimeoutExpired:
            self._stop_child()
            returncode, killed = self.child.wait(), True
        if returncode != 0:
            self._stop_groups()  # what a killed or crashed step left running
        reader.join(timeout=10)
        self.child, self.child_groups = None, set()
        seconds = time.time() - t_start
        notes = [f"{n} {s}" for s, n in sorted(counts.items())]
        if killed:
            self.add(step, {"op": "step_killed", "status": "cut", "reason": f"still running {seconds - share:.0f} s "
                            "after its share of the budget: killed", "not_run": ["the rest of the step"]})
            notes.append("killed at its deadline")
        elif returncode != 0:
            self.add(step, {"op": "step_process", "status": "error",
                            "error": f"the step's process exited with status {returncode} (its output is in the log)"})
            notes.append(f"process exit status {returncode}")
        status = ("error" if counts.get("error") or (returncode != 0 and not killed) else
                  "cut" if killed or counts.get("cut") else "ok")
        why = {"error": {"error": ", ".join(notes)}, "cut": {"reason": ", ".join(notes)}}.get(status, {})
        self.add(step, {"op": "step", "status": status, "seconds": round(seconds, 1), "share_s": round(share, 1),
                        "records": sum(counts.values()), "note": ", ".join(notes), **why})
        self.log(f"step {step}: {status} after {seconds:.0f} s ({', '.join(notes) or 'no records'})")

    def _stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            _kill_group(self.child.pid)  # the process group this campaign started
        self._stop_groups()

    def _stop_groups(self) -> None:
        for pgid in self.child_groups:
            _kill_group(pgid)

    def finish(self) -> None:
        """The plots (when ``plots`` is a step), the summary written and printed last."""
        if "plots" in self.steps:
            t = time.time()
            for name, written in _plots(self.records, self.out, self.log):
                self.add("plots", {"op": "plot", "file": name, **written})
            self.add("plots", {"op": "step", "status": "ok", "seconds": round(time.time() - t, 1), "share_s": None,
                               "records": 2, "note": ""})
        used = time.time() - self.t0
        title = f"GPU campaign {self.run_id} ({self.mode}; {used / 60:.1f} of {(self.end - self.t0) / 60:.1f} min)"
        runner.write_text(self.out / SUMMARY_FILE, campaign_report.summary_markdown(self.records, title=title))
        files = sorted(p.name for p in self.out.iterdir())
        self.log(f"wrote {len(files)} files to {self.out}: {', '.join(files)}")
        self._log.close()
        self._jsonl.close()
        print(campaign_report.summary_markdown(self.records, title=title, compact=True), flush=True)


def _plots(records: list, out: Path, log=None) -> list:
    """``(file, status fields)`` of the campaign's two plots written under ``out``."""
    done = []
    for name, fn in ((ATTENTION_PLOT, plot.attention_panels), (MODEL_PLOT, plot.model_bars)):
        try:
            written = fn(records, out / name)
            done.append((name, {"status": "ok"} if written else {"status": "skipped", "reason": "no records to plot"}))
        except Exception as exc:  # noqa: BLE001 - recorded; the summary is still written
            if log:
                log("ERROR in plots:\n" + traceback.format_exc().rstrip())
            done.append((name, {"status": "error", "error": f"{type(exc).__name__}: {exc}"}))
    return done


# --------------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for the campaign's files (required unless --report)")
    p.add_argument("--budget-min", type=float, default=20.0, help="minutes for the whole campaign (default 20)")
    p.add_argument("--quick", action="store_true", help="smallest shapes: a couple of minutes, a smoke test")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the orchestration on CPU with tiny shapes (interpreter and eager providers)")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run, in order")
    p.add_argument("--sweep-D", type=int, nargs="+", metavar="D",
                   help="the sweep's head dims instead of the mode's (e.g. 128 for a follow-up call)")
    p.add_argument("--report", type=Path, nargs="+", metavar="RECORDS",
                   help="print the summary and README tables of these campaign.jsonl files")
    p.add_argument("--child", choices=STEPS[:-1], help=argparse.SUPPRESS)  # run one step (internal)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's deadline, time.time()
    return p


def _mode(args) -> str:
    return "dry" if args.cpu_dry_run else "quick" if args.quick else "full"


def _existing_outputs(out: Path) -> list:
    return [name for name in OUTPUT_FILES if (out / name).exists()] if out.is_dir() else []


def report_main(args) -> int:
    missing = [str(p) for p in args.report if not p.is_file()]
    if missing:
        return runner.refuse(f"bench.campaign --report: no such file: {', '.join(missing)}")
    records, notes = campaign_report.load_records(args.report)
    text = campaign_report.summary_markdown(records, notes, title=f"GPU campaign: {', '.join(map(str, args.report))}")
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            return runner.refuse(f"bench.campaign --report: --out {args.out} is not a folder")
        clash = _existing_outputs(args.out)
        if clash:
            return runner.refuse(f"bench.campaign --report: {args.out} already holds {', '.join(clash)}; "
                                 "choose another folder")
        args.out.mkdir(parents=True, exist_ok=True)
        runner.write_text(args.out / SUMMARY_FILE, text)
        _plots(records, args.out)
    print(text)
    print("## README tables\n")
    print(campaign_report.readme_tables(records))
    return 0


def _usage_problem(args) -> str | None:
    if args.out is None:
        return "bench.campaign: --out DIR is required"
    if not args.budget_min > 0:
        return f"bench.campaign: --budget-min must be positive, got {args.budget_min}"
    if args.quick and args.cpu_dry_run:
        return "bench.campaign: --quick and --cpu-dry-run exclude each other"
    if args.sweep_D and not all(0 < d <= 128 for d in args.sweep_D):
        return f"bench.campaign: --sweep-D takes head dims in 1..128 (the kernels' limit), got {args.sweep_D}"
    if args.out.exists() and not args.out.is_dir():
        return f"bench.campaign: --out {args.out} exists and is not a folder"
    clash = _existing_outputs(args.out)
    if clash:
        return f"bench.campaign: {args.out} already holds {', '.join(clash)} of another run; choose another folder"
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child_main(args)
    if args.report:
        return report_main(args)
    problem = _usage_problem(args)
    if problem:
        return runner.refuse(problem)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        return runner.refuse("bench.campaign: no CUDA device here; --cpu-dry-run runs the campaign's orchestration "
                             "on CPU with tiny shapes")
    mode = _mode(args)
    child_args = {"dry": ["--cpu-dry-run"], "quick": ["--quick"], "full": []}[mode]
    child_args += ["--sweep-D", *map(str, args.sweep_D)] if args.sweep_D else []
    steps = [s for s in STEPS if s in args.steps]
    campaign = Campaign(args.out.resolve(), args.budget_min * 60, mode, steps, child_args + ["--steps", *steps])
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return campaign.run()
    finally:
        signal.signal(signal.SIGTERM, before)


def _interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
