"""Compile ahead, one worker per core, the binaries that calls of the op will make triton's JIT
compile on a GPU of ``arch``, into triton's own cache, where the JIT then finds them.

On a GPU the autotuner compiles each candidate config of each kernel, one at a time, at the first
call of every new specialisation (dtypes, head dim, which integer arguments are 1 or multiples of
16): the campaign's sweep makes 217 distinct binaries on sm_90 at ~2 s each, most of a GPU call's
minutes. Here the calls run with every launch recorded instead (``launches.capture``: every
candidate, on meta tensors, ``fake_gpu.triton_backend_on``), each launch is specialised as the JIT
specialises it (``aot.specialise``, the JIT's own binder), the distinct ones are compiled by
``triton.compile`` as the JIT calls it (same source, target, options and, with the launcher's
order-free hashes, ``kernels._canonical_cache_keys``, the same cache key), first seen first compiled. The workers touch no GPU (forked after the capture).
"""

from __future__ import annotations

import multiprocessing
import time

import triton
from triton.compiler import ASTSource

from bench.compiler import aot, launches
from bench.compiler.fake_gpu import triton_backend_on


def distinct_launches(calls, arch: int, device_index: int | None = None, device: str = "meta") -> list:
    """The launches ``calls`` (``[(label, call)]``, each building its inputs inside, on ``device``: a
    prepared mask launches kernels too) make on a GPU of ``arch``, one per binary, in first-launch
    order. ``device_index``: the GPU whose memory sets how much dS the backward keeps
    (``kernels._stored_ds_limit``), so that the recorded backward takes the path the GPU's will."""
    from xlnet_fast import kernels

    stored_ds_limit = kernels._stored_ds_limit
    kernels._stored_ds_limit = lambda _index: stored_ds_limit(device_index)
    try:
        with triton_backend_on(device):
            found = launches.capture(calls, arch)
    finally:
        kernels._stored_ds_limit = stored_ds_limit
        kernels.clear_launches()
    distinct: dict = {}
    for launch in found:
        distinct.setdefault(aot.compile_key(launch, arch), launch)
    return list(distinct.values())


_WORK: tuple = ()  # (arch, launches): what forked workers read (a launch holds a JITFunction)


def _compile(index: int) -> tuple:
    arch, found = _WORK
    launch = found[index]
    started = time.perf_counter()
    try:
        signature, constexprs, attrs, options = aot.specialise(launch, arch)
        triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=aot.target(arch),
                       options=options.__dict__)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported by name: the JIT will meet it again on the GPU
        error = f"{launch.name}: {type(exc).__name__}: {exc}"[:500]
    return index, time.perf_counter() - started, error


def compile_ahead(calls, arch: int, jobs: int, budget_s: float | None = None,
                  device_index: int | None = None) -> dict:
    """Compile the distinct binaries of ``calls`` for ``arch`` into triton's cache with ``jobs``
    forked workers, stopping after ``budget_s`` seconds (the binaries done by then stay cached).
    Returns ``binaries`` (distinct; ``kernels``: how many of each kernel), ``compiled`` (done, from
    triton's cache or not), ``failed`` (their errors), ``capture_s``, ``compile_s`` and ``worker_s``
    (the workers' seconds summed: what the JIT would have spent in turn)."""
    global _WORK
    started = time.perf_counter()
    deadline = None if budget_s is None else time.monotonic() + budget_s
    found = distinct_launches(calls, arch, device_index)
    captured = time.perf_counter()
    done, failed, worker_s = 0, [], 0.0
    _WORK = (arch, found)
    try:
        with multiprocessing.get_context("fork").Pool(max(1, jobs)) as pool:
            results = pool.imap_unordered(_compile, range(len(found)))
            for _ in found:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                try:
                    _index, seconds, error = results.next(timeout=left)
                except multiprocessing.TimeoutError:
                    break
                done, worker_s = done + 1, worker_s + seconds
                failed += [error] if error else []
            pool.terminate()
    finally:
        _WORK = ()
    kernels: dict = {}
    for launch in found:
        kernels[launch.name] = kernels.get(launch.name, 0) + 1
    return {"arch": arch, "binaries": len(found), "kernels": kernels, "compiled": done, "failed": failed,
            "capture_s": round(captured - started, 2), "compile_s": round(time.perf_counter() - captured, 2),
            "worker_s": round(worker_s, 2), "jobs": jobs}
