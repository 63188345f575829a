"""What every benchmark script shares: where its output goes, timing, peak memory, OOM as a
result, sweeps, CPU time estimates, and writing records with the environment they were taken in.

Output: a script writes to ``--out`` (or ``--json``) when given, to ``bench/results/`` (the project's
records, tracked by git) only with ``--record``, and otherwise to the cache directory
``$XDG_CACHE_HOME/xlnet_fast/bench`` (default ``~/.cache/xlnet_fast/bench``): running a documented
command never modifies the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OOM = "OOM"  # a measurement that ran out of device memory is recorded as this string
# A run on CPU whose estimate is above this refuses (bench.attention, bench.model_step).
CPU_LIMIT_S = 600.0
CPU_REPEATS = 3  # timed calls of a step on CPU, after one warm-up call
# Fractions of the CPU's measured matmul rate the workloads reach, measured on 2 cores with torch
# 2.13 (fp32): a base-width model forward 0.5-0.7, the attention op alone (eager or transformers',
# L=512) 0.1-0.15. Estimates take the low end.
CPU_EFFICIENCY_MODEL = 0.5
CPU_EFFICIENCY_ATTENTION = 0.1


# --------------------------------------------------------------------------------------------------
# Where output goes
# --------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/xlnet_fast/bench`` (``~/.cache/...`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlnet_fast" / "bench"


def add_output_args(parser: argparse.ArgumentParser, name: str, flag: str = "--out",
                    no_record: bool = False) -> None:
    """``flag PATH`` and ``--record`` (mutually exclusive); ``--no-record`` (write nothing) where the
    script had it. ``name``: the file (or folder) under ``bench/results`` or the cache directory."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(flag, type=Path, default=None, dest="out",
                       help=f"where to write (default: {cache_dir() / name})")
    group.add_argument("--record", action="store_true",
                       help=f"write to the project's records, bench/results/{name}")
    if no_record:
        group.add_argument("--no-record", action="store_true", help="write nothing, only print")


def output_path(args: argparse.Namespace, name: str) -> Path | None:
    """Where a script run with ``args`` writes ``name``; None with ``--no-record``."""
    if getattr(args, "no_record", False):
        return None
    if args.out is not None:
        return args.out
    return (RESULTS_DIR if args.record else cache_dir()) / name


def _atomic_write(path: Path, write: Callable, binary: bool = False) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG to ``path``, atomically."""
    _atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format="png"), binary=True)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, atomically."""
    _atomic_write(path, lambda f: f.write(text))


def write_json(path: Path, value) -> None:
    """Write ``value`` as indented JSON to ``path``, atomically."""
    write_text(path, json.dumps(value, indent=1) + "\n")


def append_records(path: Path, records: list[dict]) -> None:
    """Append ``records`` to the JSON list in ``path`` (created if missing), atomically."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else []
    if not isinstance(old, list):
        raise ValueError(f"{path} does not hold a JSON list of records")
    write_json(path, old + records)
    print(f"appended {len(records)} records to {path}")


def write_records(args: argparse.Namespace, name: str, records: list[dict]) -> None:
    """Append ``records`` to where a script run with ``args`` writes ``name`` (``output_path``);
    nothing with ``--no-record``."""
    path = output_path(args, name)
    if path is not None:
        append_records(path, records)


def environment() -> dict:
    """``device``, the versions (``python``, ``torch``, ``cuda``, ``triton``, ``transformers``; None
    where not installed) and ``date`` for a result record."""
    versions = {}
    for name in ("triton", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, **versions, "date": datetime.date.today().isoformat()}


def device_name() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def refuse(message: str) -> int:
    """A run the script will not do: one line on stderr, exit status 2."""
    print(message, file=sys.stderr)
    return 2


# --------------------------------------------------------------------------------------------------
# Sweeps and measurements
# --------------------------------------------------------------------------------------------------


def sweep(**axes) -> list[dict]:
    """Every combination of the axes' values, the first axis slowest: ``sweep(a=[1, 2], b="xy")``
    gives ``[{a: 1, b: "x"}, {a: 1, b: "y"}, {a: 2, ...}, ...]``."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_median_ms(step: Callable, device: str, warmup: int = 1, repeats: int = 3) -> float:
    """Median wall-clock milliseconds of ``repeats`` calls after ``warmup`` (synchronised on CUDA)."""
    for _ in range(warmup):
        step()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def median_ms(step: Callable, device: str, cpu_repeats: int = CPU_REPEATS) -> float:
    """Median milliseconds of ``step``: CUDA events (``triton.testing.do_bench``, 25 ms warm-up,
    100 ms of repeats) on CUDA, else the wall clock over ``cpu_repeats`` calls after one warm-up."""
    if device == "cuda":
        import triton

        return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
    return wall_median_ms(step, device, warmup=1, repeats=cpu_repeats)


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.mb`` (the device's peak allocation in
    MiB) and ``peak.above_start_mb`` (the peak above what was allocated at the start). Both None off
    CUDA."""

    def __init__(self, device: str):
        self.device, self.mb, self.above_start_mb, self._start = device, None, None, 0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda" and exc[0] is None:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self.mb, self.above_start_mb = peak / 2**20, (peak - self._start) / 2**20
        return False


# CUDA runtime calls in which the host waits for the GPU (a tensor read such as ``.item()`` is a copy
# and one of these)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


HOST_TIMED_CALLS = 5  # gpu_profile's calls timed on the host alone


def gpu_profile(step: Callable, calls: int = 1) -> dict:
    """Where ``step``'s time goes on CUDA (``torch.profiler`` over ``calls`` calls after one warm-up):
    ``kernels`` ([{kernel, ms_per_call, launches_per_call}], the largest first), ``gpu_ms_per_call``
    (the kernels' GPU time: against the wall time, how much of it the GPU was busy),
    ``launches_per_call``, ``host_waits_per_call`` (``HOST_WAITS`` calls; the profile's own
    closing synchronize not counted; None when the profiler recorded no runtime call, not even that
    one) and ``host_ms_per_call``: the median wall time of ``HOST_TIMED_CALLS`` unprofiled calls, each
    from an idle GPU to its return, before the closing synchronize (what the host spends issuing it;
    a step timed at about this is bound by the host, not by its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels, and the runtime calls (CUPTI)
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels, waits = [], -1  # the closing synchronize above
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            kernels.append({"kernel": event.key[:80], "ms_per_call": us / 1e3 / calls,
                            "launches_per_call": event.count / calls})
        elif event.key in HOST_WAITS:
            waits += event.count
    kernels.sort(key=lambda k: -k["ms_per_call"])
    issue_times = []
    for _ in range(HOST_TIMED_CALLS):
        begin = time.perf_counter()
        step()
        issue_times.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    return {"kernels": kernels, "gpu_ms_per_call": sum(k["ms_per_call"] for k in kernels),
            "launches_per_call": sum(k["launches_per_call"] for k in kernels),
            "host_waits_per_call": waits / calls if waits >= 0 else None,
            "host_ms_per_call": statistics.median(issue_times) * 1e3}


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True):
    """``torch.use_deterministic_algorithms(enabled, warn_only=True)`` inside, the previous setting
    after (the op's Triton backward computes dk_r without atomics under it)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def measure(make_step: Callable[[], Callable], device: str, cpu_repeats: int = CPU_REPEATS) -> tuple:
    """``(median ms, peak MiB above the inputs)`` of the step ``make_step()`` returns (peak None off
    CUDA), or ``("OOM", None)`` if building or running it runs out of memory."""
    try:
        step = make_step()
        peak = PeakMemory(device)
        if device == "cuda":
            step()  # compiling and autotuning (with its own buffers) stay out of the peak
            with peak:
                step()
        return median_ms(step, device, cpu_repeats), peak.above_start_mb
    except torch.OutOfMemoryError:
        return OOM, None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# How long a run will take on this CPU
# --------------------------------------------------------------------------------------------------


def cpu_matmul_flops_per_s(dtype: torch.dtype = torch.float32, max_n: int = 1024) -> float:
    """This CPU's matmul rate at ``dtype`` (FLOP/s): the fastest of 3 square products, at the first
    size (doubling from 256 up to ``max_n``) where the fastest takes 50 ms. The fastest, not the
    median: on a shared machine other processes only ever slow a product down."""
    n = 256
    while True:
        a = torch.randn(n, n).to(dtype)
        a @ a  # the first product also starts the thread pool
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        if n >= max_n or min(times) >= 0.05:
            return 2 * n**3 / max(min(times), 1e-9)
        n *= 2


def estimate_cpu_seconds(work: list[tuple[float, torch.dtype]], efficiency: float) -> float:
    """Seconds ``work`` — ``(FLOPs, dtype)`` pairs — takes on this CPU at ``efficiency`` (one of
    the ``CPU_EFFICIENCY_*``) of the matmul rate measured per dtype."""
    rates = {dtype: cpu_matmul_flops_per_s(dtype) for dtype in {d for _, d in work}}
    return sum(flops / (rates[dtype] * efficiency) for flops, dtype in work)


def duration(seconds: float) -> str:
    """``"under 1 s"``, ``"40 s"``, ``"12 min"``, ``"3.5 h"``."""
    if seconds < 1:
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def announce(message: str) -> None:
    """Progress and plans (stderr: stdout carries the results)."""
    print(message, file=sys.stderr, flush=True)
