"""The steps of ``bench.campaign`` and what each measures in each mode (``PLANS``).

Each step runs in a child process of the campaign (``python -m bench.campaign --child STEP``): a
crash, a lost CUDA context or a hang ends that step only. A step reports through a ``Reporter``,
which writes protocol lines on stdout that the parent turns into records and log lines
(``RECORD_PREFIX`` + JSON: a record; ``LOG_PREFIX`` + text: the log only; anything else: the log
and the console). Steps check ``Reporter.left()`` between items and stop with one ``cut`` record
naming what they did not run.

Steps: ``env``, ``correctness``, ``sweep``, ``pretrain`` (issue 13) and ``memory`` (issue 21:
Transformer-XL evaluation and generation carried by memory).

Modes: ``full`` (the GPU campaign of issue 13), ``quick`` (the smallest shapes, a couple of minutes
on a GPU: a smoke test on arrival), ``dry`` (``--cpu-dry-run``: tiny shapes on CPU, the Triton
kernels in Triton's interpreter, the eager providers; what needs CUDA is recorded as skipped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import attention, cases, generation, gpu_check, memory_reuse, pinned_configs, pretrain_step, runner

ROOT = Path(__file__).resolve().parents[1]
RECORD_PREFIX = "@record "
LOG_PREFIX = "@log "
# a process group the step started (the test suite's): the parent kills it if the step dies or is killed
GROUP_PREFIX = "@group "
NEEDS_CUDA = "needs CUDA"
# An item starts only with at least this many seconds of its step left.
MIN_ITEM_S = 1.0
# Share of the correctness step the test suite gets (the float64 checks get the rest).
PYTEST_SHARE = 0.5
# How many pytest-xdist workers compile the kernels in parallel on the GPU machine (16 cores).
PYTEST_WORKERS = 8
# The test files that run the compiled kernels on a GPU, and the bf16 convergence test of the
# transformers patch (skipped without a GPU).
GPU_TESTS = ("tests/test_triton_kernels.py", "tests/test_fa2_reference.py",
             "tests/test_hf_patch.py::test_convergence_bf16_on_gpu_is_close",
             "tests/test_hf_patch.py::test_patched_with_triton_backend")
# The test suite runs on the GPU with the kernels pinned to this config (bench.pinned_configs): one
# compile per kernel variant instead of tuning every config at every test shape. The smallest tiles
# (most tiles per test shape) and the one config every head dim fits; every config is checked at a
# realistic shape by the correctness step's per-config check.
PYTEST_CONFIG = "64x64w4s1"
# In the order they are measured at each shape: the headline comparison first, FlexAttention (the
# slowest to compile: one graph per shape and mode) last, so a cut at the step's end costs it first.
GPU_PROVIDERS = ("xlnet_fast", "sdpa_flash", "hf", "xlnet_fast_det", "fa2_ref", "flex")


# --------------------------------------------------------------------------------------------------
# What runs in each mode
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The shapes and selections of one mode."""

    mode: str
    matmul_n: int  # the bf16 matmul ceiling: an n x n x n product
    copy_mib: int  # the device-to-device copy ceiling: this many MiB copied
    pytest_targets: tuple
    pytest_k: str | None
    checks: tuple  # (name, AttentionCase drawn in float64, dtypes, deterministic)
    sweep_D: tuple
    sweep_points: tuple  # (qlen, mlen), in order of importance
    sweep_H: int
    sweep_tokens: int  # B = max(1, sweep_tokens // qlen)
    sweep_dtype: str
    sweep_modes: tuple
    providers: tuple
    models: tuple  # (label, ModelCase)
    model_providers: tuple = ("xlnet_fast", "hf")
    model_repeats: int = 10
    cpu_repeats: int = 1
    pytest_workers: int = PYTEST_WORKERS
    pytest_config: str | None = PYTEST_CONFIG  # None: the suite autotunes as in CI
    config_check: tuple | None = None  # (name, case, dtype): checked at each autotuner config
    # g. memory: Transformer-XL evaluation with memory vs a recomputed sliding context at these
    # attention lengths, and generation with memory vs recomputing the context at these total lengths
    memory_size: str = "wt103_base"  # xlnet_fast.transfo_xl.config.TRANSFO_XL_SIZES (and the XLNet of that width)
    memory_dtype: str = "bf16"
    memory_lengths: tuple = (128, 256, 512, 1024, 2048, 3800)
    memory_tgt_len: int = 128
    generation_lengths: tuple = (512, 1024, 2048, 3800)
    generation_new_tokens: int = 64

    def sweep_cases(self) -> list:
        """The sweep's cases, D slowest (D=64 first: XLNet's), then the points in order."""
        return [cases.AttentionCase(max(1, self.sweep_tokens // qlen), self.sweep_H, qlen, mlen, D,
                                    cases.DTYPES[self.sweep_dtype])
                for D in self.sweep_D for qlen, mlen in self.sweep_points]


_CHECK = cases.AttentionCase(B=8, H=16, qlen=512, mlen=384, D=64, dtype=torch.float64)
_CHECK_2S = dataclasses.replace(_CHECK, targets=85, two_stream=True)
_CHECK_LONG = dataclasses.replace(_CHECK, B=1, qlen=4096)
_HALF = (torch.bfloat16, torch.float16)
_TINY = cases.AttentionCase(B=1, H=2, qlen=24, mlen=8, D=16, dtype=torch.float64)

PLANS = {
    "full": Plan(
        "full", matmul_n=8192, copy_mib=2048, pytest_targets=GPU_TESTS, pytest_k=None,
        checks=(("content_mem384_rank_seg", _CHECK, _HALF, False),
                ("two_stream_85_targets", _CHECK_2S, _HALF, False),
                ("two_stream_85_targets", _CHECK_2S, (torch.bfloat16,), True),
                ("content_qlen4096", _CHECK_LONG, _HALF, False),
                ("two_stream_qlen4096_683_targets", dataclasses.replace(_CHECK_LONG, targets=683, two_stream=True),
                 (torch.bfloat16,), False),
                ("content_D128", dataclasses.replace(_CHECK, H=8, D=128), (torch.bfloat16,), False)),
        config_check=("two_stream_85_targets", _CHECK_2S, torch.bfloat16),
        sweep_D=(64, 128), sweep_points=((512, 384), (2048, 384), (4096, 384), (16384, 384)), sweep_H=16,
        sweep_tokens=16384, sweep_dtype="bf16", sweep_modes=("fwd", "fwd_bwd"),
        providers=GPU_PROVIDERS,
        models=(("base", cases.ModelCase("base", B=8, seq=512, mlen=384, predict=85)),
                ("large", cases.ModelCase("large", B=8, seq=512, mlen=384, predict=85)))),
    "quick": Plan(
        "quick", matmul_n=4096, copy_mib=256,
        pytest_targets=("tests/test_triton_kernels.py",
                        "tests/test_hf_patch.py::test_convergence_bf16_on_gpu_is_close"),
        pytest_k="forward_backward_match_eager_and_reference or convergence_bf16",
        checks=(("two_stream_85_targets_B2", dataclasses.replace(_CHECK_2S, B=2), _HALF, False),),
        config_check=("two_stream_85_targets_B2", dataclasses.replace(_CHECK_2S, B=2), torch.bfloat16),
        sweep_D=(64,), sweep_points=((512, 384),), sweep_H=16, sweep_tokens=4096, sweep_dtype="bf16",
        sweep_modes=("fwd", "fwd_bwd"),
        providers=GPU_PROVIDERS,
        models=(("base_2_layers", cases.ModelCase("base", B=2, seq=512, mlen=384, predict=85, n_layer=2)),),
        model_repeats=3, memory_lengths=(512, 3800), generation_lengths=(2048,), generation_new_tokens=32),
    "dry": Plan(
        "dry", matmul_n=0, copy_mib=0,
        pytest_targets=("tests/test_triton_kernels.py",), pytest_k="head_dims_past_the_kernels_limit",  # fast
        checks=(("two_stream_tiny", dataclasses.replace(_TINY, targets=5, two_stream=True), (torch.bfloat16,), True),),
        config_check=("two_stream_tiny", dataclasses.replace(_TINY, targets=5, two_stream=True), torch.bfloat16),
        sweep_D=(16,), sweep_points=((16, 8),), sweep_H=2, sweep_tokens=16, sweep_dtype="fp32",
        sweep_modes=("fwd", "fwd_bwd"),
        providers=("xlnet_fast", "sdpa_flash", "hf", "eager", "xlnet_fast_det", "fa2_ref", "flex"),
        models=(("tiny_1_layer", cases.ModelCase("tiny", B=1, seq=16, mlen=8, predict=4, vocab=100, n_layer=1)),),
        model_repeats=1, pytest_workers=1, memory_size="tiny", memory_dtype="fp32", memory_lengths=(16, 32),
        memory_tgt_len=8, generation_lengths=(24,), generation_new_tokens=4),
}


# --------------------------------------------------------------------------------------------------
# Reporting from a child process
# --------------------------------------------------------------------------------------------------


class Cut(Exception):
    """Raised inside a step to stop it at its deadline."""


@dataclass
class Reporter:
    """What a step writes (protocol lines on stdout, read by the parent) and its deadline."""

    deadline: float  # time.time() by which the step should be done
    device: str
    failures: tuple = ()  # injected failures (--inject-failure), for testing the failure handling
    cuda_lost: str | None = None
    env: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.time()

    def _line(self, text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def started_group(self, pgid: int) -> None:
        """Tell the parent about a process group this step started (to end it if the step is killed)."""
        self._line(f"{GROUP_PREFIX}{pgid}")

    def log(self, text: str, console: bool = True) -> None:
        for line in str(text).splitlines() or [""]:
            self._line(line if console else LOG_PREFIX + line)

    def emit(self, op: str, status: str = "ok", **fields) -> dict:
        rec = {"op": op, "status": status, **self.env, **fields}
        self._line(RECORD_PREFIX + json.dumps(rec, default=str))
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
        ``cut`` (or ``skipped``) record listing the items not run."""
        for n, item in enumerate(items):
            if self.cuda_lost is not None:
                self.skipped(op, f"CUDA context lost earlier: {self.cuda_lost}",
                             not_run=[label(x) for x in items[n:]])
                return
            if self.left() < MIN_ITEM_S:
                not_run = [label(x) for x in items[n:]]
                self.log(f"cut: {op}: the step's time is up; not run: {', '.join(not_run)}")
                self.emit(op, "cut", reason="the step's share of the budget was used up", not_run=not_run)
                return
            yield item

    def attempt(self, op: str, fn, **fields) -> list:
        """``fn()`` -> a record's fields (or a list of them), emitted with ``fields``; an exception is
        an ``error`` record (traceback in the log). Injected failures (``op`` or ``op:provider``)
        raise here."""
        try:
            self._inject(op, fields)
            out = fn()
        except torch.OutOfMemoryError as exc:
            self.log(f"out of memory in {op} {_describe(fields)}: {str(exc).splitlines()[0]}")
            _free(self.device)
            return [self.emit(op, "oom", **fields)]
        except Exception as exc:  # noqa: BLE001 - recorded, the campaign goes on
            return [self.failed(op, exc, **fields)]
        recs = []
        for result in out if isinstance(out, list) else [out]:
            result = {**fields, **result}
            status = result.pop("status", "ok")
            recs.append(self.emit(op, status, **result))
        return recs

    def _inject(self, op: str, fields: dict) -> None:
        tags = {op, f"{op}:{fields.get('provider')}"}
        hit = tags & set(self.failures)
        if hit:
            raise RuntimeError(f"injected failure ({sorted(hit)[0]})")


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


# --------------------------------------------------------------------------------------------------
# Step a: environment and ceilings
# --------------------------------------------------------------------------------------------------


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _device_info() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu", "cpu_count": os.cpu_count()}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1),
            "cpu_count": os.cpu_count()}


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


def step_env(r: Reporter, plan: Plan) -> None:
    """a. Device, versions, and the two ceilings measured here."""
    import bench.source_tree

    note = bench.source_tree.ensure_kernels_importable()
    r.attempt("environment", lambda: {**_versions(), **_device_info(), "mode": plan.mode,
                                      "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                                      "kernels_import": note or "xlnet_fast.kernels importable"})
    if r.device != "cuda":
        for op in ("ceiling_matmul", "ceiling_copy"):
            r.skipped(op, NEEDS_CUDA)
        return
    for op, fn in (("ceiling_matmul", lambda: matmul_ceiling(plan.matmul_n)),
                   ("ceiling_copy", lambda: copy_ceiling(plan.copy_mib))):
        for _ in r.each([op], str, op):
            [rec] = r.attempt(op, fn)
            if rec["status"] == "ok":
                r.log(f"{op}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in rec.items() if k in ("tflops", "gb_per_s", "ms")))


# --------------------------------------------------------------------------------------------------
# Step b: correctness
# --------------------------------------------------------------------------------------------------

_SUMMARY_LINE = re.compile(r"^=+ (.+?) in [\d.]+s")
_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def parse_pytest(lines: list) -> dict:
    """Counts (``passed``, ``failed``, ``skipped``, ``errors``...) from pytest's closing line, or
    counted from ``-v`` lines when it has none (stopped early), and the failed tests' ids."""
    counts, closing = {}, None
    for line in lines:
        m = _SUMMARY_LINE.match(line.strip())
        if m:
            closing = m.group(1)
    if closing:
        for n, what in _COUNT.findall(closing):
            what = {"error": "errors", "warning": "warnings"}.get(what, what)
            counts[what] = counts.get(what, 0) + int(n)
    else:
        for line in lines:
            m = _OUTCOME.search(line) if "::" in line else None
            if m:
                what = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors",
                        "XFAIL": "xfailed", "XPASS": "xpassed"}[m.group(1)]
                counts[what] = counts.get(what, 0) + 1
    failed = sorted({line.split()[1] for line in lines if re.match(r"^(FAILED|ERROR) \S+::", line)})
    return {"counts": counts, "closing_line": closing, "failed_tests": failed}


def _pytest_command(plan: Plan) -> list:
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-p", "bench.source_tree",
           "-p", "bench.pinned_configs", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]
    if plan.pytest_workers > 1 and _has_module("xdist"):
        cmd += ["-n", str(plan.pytest_workers)]
    if plan.pytest_k:
        cmd += ["-k", plan.pytest_k]
    return cmd + [str(ROOT / t) for t in plan.pytest_targets]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run_pytest(r: Reporter, plan: Plan, timeout_s: float) -> dict:
    """The suite's GPU tests in a subprocess without ``TRITON_INTERPRET`` (compiled kernels on a
    GPU, pinned to ``plan.pytest_config``; on CPU, where tests/conftest.py turns the interpreter on,
    a quick selection), stopped after ``timeout_s``; its output goes to the log only."""
    cmd = _pytest_command(plan)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", pinned_configs.ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    pinned = plan.pytest_config if r.device == "cuda" else None
    if pinned:
        env[pinned_configs.ENV] = pinned
    r.log(f"pytest ({'-n ' + str(plan.pytest_workers) if '-n' in cmd else 'one process'}, "
          f"up to {timeout_s:.0f} s): {' '.join(plan.pytest_targets)}"
          + (f" -k '{plan.pytest_k}'" if plan.pytest_k else ""))
    lines: list = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="campaign_pytest_") as cwd:  # .hypothesis and the like land here
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        r.started_group(proc.pid)
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines, r), daemon=True)
        reader.start()
        try:
            returncode, stopped = proc.wait(timeout=max(timeout_s, 0.1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group we started: pytest and its workers
            returncode, stopped = proc.wait(), True
        reader.join(timeout=10)
    result = parse_pytest(lines)
    result.update(returncode=returncode, seconds=round(time.time() - t0, 1), targets=list(plan.pytest_targets),
                  k=plan.pytest_k, command=" ".join(cmd[1:]), pinned_config=pinned)
    counts = result["counts"]
    if stopped:
        result.update(status="cut", reason=f"stopped after {timeout_s:.0f} s (its share of the budget)")
    elif returncode not in (0, 5) or counts.get("failed") or counts.get("errors"):
        result.update(status="error", error=f"pytest exit status {returncode}: {result['closing_line']}")
    r.log(f"pytest: {result['closing_line'] or counts} (exit status {returncode}{', stopped' if stopped else ''})")
    return result


def _read_lines(stream, lines: list, r: Reporter) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        r.log(line.rstrip("\n"), console=False)


def _check(r: Reporter, name: str, case, dtypes, deterministic: bool) -> list:
    recs = gpu_check.check_case(name, case, r.device, dtypes, deterministic)
    out = []
    for rec in recs:
        r.log(f"check {name} {rec['dtype']}{' deterministic' if deterministic else ''}: out {rec['rel_err_out']:.2e}, "
              f"worst grad {rec['rel_err_grad']:.2e} ({rec['worst_grad']}) "
              f"{'ok' if rec['within_tolerance'] else 'OUT OF TOLERANCE'}")
        status = {} if rec["within_tolerance"] else {"status": "error", "error": "outside the suite's tolerance"}
        out.append({**{k: v for k, v in rec.items() if k != "op"}, **status})
    return out


def step_correctness(r: Reporter, plan: Plan) -> None:
    """b. The suite's GPU tests (compiled kernels, the bf16 convergence of the transformers patch),
    then ``bench.gpu_check``'s float64 comparison at realistic shapes."""
    for _ in r.each(["pytest"], str, "pytest"):
        r.attempt("pytest", lambda: run_pytest(r, plan, r.left() * PYTEST_SHARE))
    watch = AutotuneWatch(r)
    label = lambda c: f"{c[0]}{' deterministic' if c[3] else ''}"  # noqa: E731
    for name, case, dtypes, deterministic in r.each(list(plan.checks), label, "xlnet_attn_check"):
        r.attempt("xlnet_attn_check", lambda: _check(r, name, case, dtypes, deterministic), case=name,
                  deterministic=deterministic)
        _free(r.device)
    watch.flush("correctness")
    if plan.config_check:
        _check_each_config(r, *plan.config_check)


def _check_each_config(r: Reporter, name: str, case, dtype) -> None:
    """``gpu_check`` at ``case`` with the kernels pinned to each autotuner config in turn: every
    config the autotuner may pick computes the same function."""
    if _interpreting():
        r.skipped("xlnet_attn_check", "the interpreter runs fixed tiles: no config to pin", case=name, config="each")
        return
    for config in r.each(pinned_configs.all_config_names(), str, "xlnet_attn_check"):
        with pinned_configs.pinned([config]):
            r.attempt("xlnet_attn_check",
                      lambda: [{**x, "config": config} for x in _check(r, name, case, (dtype,), False)],
                      case=name, config=config)
        _free(r.device)


# --------------------------------------------------------------------------------------------------
# Step c: the attention sweep (and e: the autotuner's choices, recorded as they are made)
# --------------------------------------------------------------------------------------------------


class AutotuneWatch:
    """Emits an ``autotune`` record for each key the kernels' autotuners tuned: the winning config
    and, when one key was tuned since the last look, every config's median ms (``configs_timings``)."""

    def __init__(self, r: Reporter):
        self.r, self.seen, self.timings_seen = r, {}, {}
        self.kernels = self._kernels()

    @staticmethod
    def _kernels() -> dict:
        if _interpreting():
            return {}  # the interpreter runs fixed tiles: nothing is tuned
        return pinned_configs.tuned_kernels()

    def look(self, context: str) -> None:
        for name, tuner in self.kernels.items():
            new = [key for key in tuner.cache if key not in self.seen.setdefault(name, set())]
            timings = getattr(tuner, "configs_timings", None)
            fresh = timings is not None and timings is not self.timings_seen.get(name)
            for key in new:
                self.seen[name].add(key)
                per_config = ({pinned_configs.config_name(c): (t[0] if isinstance(t, (list, tuple)) else t)
                               for c, t in timings.items()} if fresh and len(new) == 1 else None)
                self.r.emit("autotune", kernel=name, context=context, key=self._key(tuner, key),
                            best=pinned_configs.config_name(tuner.cache[key]), timings_ms=per_config)
            if fresh:
                self.timings_seen[name] = timings

    @staticmethod
    def _key(tuner, key: tuple) -> dict:
        names = list(tuner.keys)
        out = {n: (v if isinstance(v, (int, float, bool, str)) else str(v)) for n, v in zip(names, key)}
        out["dtypes"] = sorted(set(map(str, key[len(names):])))
        return out

    def flush(self, context: str) -> None:
        if not self.kernels:
            self.r.skipped("autotune", "the interpreter runs fixed tiles: nothing is tuned" if self.r.device != "cuda"
                           else "no tuned kernel", context=context)
            return
        self.look(context)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _unavailable(provider: str, mode: str, device: str) -> str | None:
    """Why ``provider`` cannot run in ``mode`` here, or None."""
    if device == "cuda":
        return None
    if provider == "sdpa_flash":
        return f"{NEEDS_CUDA} (the flash backend)"
    if provider == "flex" and mode == "fwd_bwd":
        return f"{NEEDS_CUDA} (FlexAttention has no backward on CPU)"
    if provider in ("xlnet_fast", "xlnet_fast_det", "fa2_ref") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"{NEEDS_CUDA} (or Triton's interpreter)"
    return None


def _case_fields(plan: Plan, case) -> dict:
    return {"dtype": plan.sweep_dtype, "B": case.B, "H": case.H, "L": case.qlen, "mlen": case.mlen, "D": case.D}


def agreement(inputs, providers: list) -> dict:
    """Relative error of each XLNet provider's forward output against the eager backend in float32 on
    the same (upcast) tensors: the providers compute the same attention."""
    ref_inputs = dataclasses.replace(inputs, floats={k: v.float() for k, v in inputs.floats.items()})
    ref = attention.provider_output("eager", ref_inputs).float()
    errs = {}
    for name in providers:
        out = attention.provider_output(name, inputs).float()
        errs[name] = float((out - ref).norm() / ref.norm())
    return {"rel_err_vs_eager_fp32": errs}


def sweep_items(plan: Plan) -> list:
    """``(kind, case, mode, provider)`` in order: per D, an agreement check at its first point, the
    measurements, and a repeat of the first ``xlnet_fast`` fwd+bwd measurement (the spread)."""
    items = []
    for D in plan.sweep_D:
        d_cases = [c for c in plan.sweep_cases() if c.D == D]
        items.append(("agree", d_cases[0], "fwd", None))
        items += [("time", c, m, p) for c in d_cases for m in plan.sweep_modes for p in plan.providers
                  if attention.runs_in_mode(p, m)]
        if "xlnet_fast" in plan.providers and "fwd_bwd" in plan.sweep_modes:
            items.append(("repeat", d_cases[0], "fwd_bwd", "xlnet_fast"))
    return items


def _item_label(item) -> str:
    kind, case, mode, prov = item
    return f"{kind} D={case.D} L={case.qlen} mlen={case.mlen} {mode} {prov or ''}".rstrip()


def _measure(r: Reporter, plan: Plan, inputs, mode: str, prov: str) -> dict:
    ms, peak = runner.measure(lambda: attention.provider_fn(prov, inputs, mode), r.device, cpu_repeats=plan.cpu_repeats)
    rec = attention.record({}, plan.sweep_dtype, inputs.case, mode, prov, ms, peak)
    rec.pop("op")
    if ms == runner.OOM:
        rec["status"] = "oom"
    c = inputs.case
    r.log(f"{prov:15} {mode:8} D={c.D:3} L={c.qlen:6} mlen={c.mlen:5} B={c.B:3}: "
          + ("OOM" if ms == runner.OOM else f"{ms:9.3f} ms {rec['tflops']:7.1f} TFLOP/s"
             + (f" peak {peak:,.0f} MiB" if peak is not None else "")))
    return rec


def step_sweep(r: Reporter, plan: Plan) -> None:
    """c. Every provider on the same tensors, forward and forward+backward, per shape; e. the
    autotuner's choice for each shape as it is made."""
    watch, inputs = AutotuneWatch(r), None
    items = sweep_items(plan)
    for kind, case, mode, prov in r.each(items, _item_label, "xlnet_attn"):
        if inputs is None or inputs.case != case:
            inputs = None
            _free(r.device)
            inputs = cases.attention_inputs(case, r.device)
        fields = {**_case_fields(plan, case), "mode": mode}
        if kind == "agree":
            provs = [p for p in plan.providers if p in attention.XLNET_PROVIDERS
                     and p not in ("xlnet_fast_det", "eager") and _unavailable(p, "fwd", r.device) is None]
            r.attempt("provider_agreement", lambda: agreement(inputs, provs), **fields)
            continue
        why = _unavailable(prov, mode, r.device)
        if why:
            r.skipped("xlnet_attn", why, provider=prov, **fields)
            continue
        extra = {"repeat": True} if kind == "repeat" else {}
        r.attempt("xlnet_attn", lambda: _measure(r, plan, inputs, mode, prov), provider=prov, **fields, **extra)
        if prov.startswith("xlnet_fast"):
            watch.look(f"{prov} {mode} D={case.D} L={case.qlen} mlen={case.mlen} B={case.B}")
    watch.flush("sweep")


# --------------------------------------------------------------------------------------------------
# Step d: the pretraining step
# --------------------------------------------------------------------------------------------------


def _pretrain(r: Reporter, plan: Plan, model, prov: str, label: str, built: dict) -> dict:
    rec = pretrain_step.measure_provider(prov, model, built["hf"], built["batch"], r.device, plan.model_repeats)
    rec.pop("op")
    if rec["ms"] == runner.OOM:
        rec["status"] = "oom"
    r.log(f"pretrain {label} {prov:11}: " + ("OOM" if rec["ms"] == runner.OOM else
          f"{rec['ms']:8.1f} ms/step {rec['tokens_per_s']:10,.0f} tokens/s"
          + (f" peak {rec['peak_mem_mb']:,.0f} MiB" if rec["peak_mem_mb"] is not None else "")))
    return rec


def step_pretrain(r: Reporter, plan: Plan) -> None:
    """d. One XLNet two-stream pretraining step (forward, backward, AdamW; bf16 autocast on CUDA),
    xlnet_fast against transformers on the same weights and batch, per model size."""
    watch, built = AutotuneWatch(r), {}
    items = [(label, model, prov) for label, model in plan.models for prov in plan.model_providers]
    for label, model, prov in r.each(items, lambda x: f"{x[0]} {x[2]}", "pretrain_step"):
        fields = {"case": label, "provider": prov}
        if built.get("label") != label:
            built.clear()
            _free(r.device)
            built["label"] = label
            [rec] = r.attempt("pretrain_model", lambda: _build(built, model, r.device), **fields)
            if rec["status"] != "ok":
                built["failed"] = rec["status"]
        if built.get("failed") == "oom":
            r.emit("pretrain_step", "oom", ms=runner.OOM, tokens_per_s=None, peak_mem_mb=None, **_model_fields(model),
                   **fields)
            continue
        if built.get("failed"):
            r.skipped("pretrain_step", f"the model and batch could not be built ({built['failed']})", **fields)
            continue
        r.attempt("pretrain_step", lambda: _pretrain(r, plan, model, prov, label, built), **fields)
        watch.look(f"pretrain {label} {prov}")
    watch.flush("pretrain")


def _model_fields(model) -> dict:
    dims = model.dims
    return {"config": model.size, "n_layer": dims["n_layer"], "B": model.B, "H": dims["n_head"], "L": model.seq,
            "mlen": model.mlen, "D": dims["d_model"] // dims["n_head"], "num_predict": model.predict}


def _build(built: dict, model, device: str) -> dict:
    """transformers' model and the batch for ``model`` (a ModelCase) into ``built``; a record's fields."""
    built["hf"], built["batch"] = pretrain_step.hf_model_and_batch(model, device)
    return {"parameters": sum(p.numel() for p in built["hf"].parameters())}


# --------------------------------------------------------------------------------------------------
# Step g: memory (issue 21): evaluation and generation carried by memory
# --------------------------------------------------------------------------------------------------


def step_memory(r: Reporter, plan: Plan) -> None:
    """g. ``bench.memory_reuse`` (Transformer-XL: tokens/s of evaluation with memory and of a
    recomputed sliding context per attention length, the paper's Table 9) and ``bench.generation``
    (Transformer-XL and XLNet: tokens/s of generation with memory and of recomputing the context)."""
    dtype = memory_reuse.DTYPES[plan.memory_dtype]
    models: dict = {}

    def model(kind: str):
        if kind not in models:
            _free(r.device)
            models.clear()
            models[kind] = (memory_reuse.build_model(plan.memory_size, r.device, dtype) if kind == "reuse" else
                            generation.build_model(kind, plan.memory_size, r.device, dtype, mem_len=0))
        return models[kind]

    for A in r.each(list(plan.memory_lengths), lambda a: f"attention length {a}", "memory_reuse"):
        r.attempt("memory_reuse", lambda: memory_reuse.measure_length(model("reuse"), plan.memory_size, A,
                                                                      plan.memory_tgt_len, r.device,
                                                                      plan.cpu_repeats), L=A)
    items = [(kind, L) for kind in generation.MODELS for L in plan.generation_lengths]
    for kind, L in r.each(items, lambda x: f"{x[0]} length {x[1]}", "generation"):
        def measure():
            m = model(kind)
            m.config.mem_len = L  # the memory holds the whole context
            return generation.measure_length(m, kind, plan.memory_size, L, plan.generation_new_tokens, r.device)

        r.attempt("generation", measure, case=kind, L=L)
    _free(r.device)


STEPS = {"env": step_env, "correctness": step_correctness, "sweep": step_sweep, "pretrain": step_pretrain,
         "memory": step_memory}
