"""Pin the op's autotuned Triton kernels to some of their configs (named like ``128x64w8s2``:
BLOCK_M x BLOCK_N, warps, stages; the configs are ``kernels/rel_attention.CANDIDATES``).

``pinned(names)`` is a context manager: inside it the autotuners only know those configs (one
config: no tuning at all), their tuning caches are emptied, and both are restored after. The
campaign checks each config's numbers with it. As a pytest plugin (``-p bench.compiler.pinned_configs``
with ``$BENCH_PINNED_CONFIGS=64x64w4s1``) it pins the kernels for a whole test run on a GPU, so that
the suite compiles one binary per kernel variant instead of tuning every config at every test shape
(nothing happens without the variable, nor without CUDA). ``TuningLog`` lists what the autotuners
chose as they tune (the campaign records it).
"""

from __future__ import annotations

import contextlib
import os

ENV = "BENCH_PINNED_CONFIGS"
TIMEOUT_ENV = "BENCH_TEST_TIMEOUT_S"
TIMEOUT_MARK = "per-test timeout"
TUNED_KERNELS = ("fwd_kernel_tuned", "bwd_kv_kernel_tuned", "bwd_q_kernel_tuned")


def config_name(config) -> str:
    """``128x64w8s2`` (``...r255`` with a register cap) for a ``triton.Config``."""
    from bench.source_tree import ensure_kernels_importable

    ensure_kernels_importable()
    from xlnet_fast.kernels import rel_attention

    return rel_attention.config_name(config)


def tuned_kernels() -> dict:
    """The op's autotuned kernels by name (``triton.runtime.Autotuner`` objects)."""
    from bench.source_tree import ensure_kernels_importable

    ensure_kernels_importable()
    from xlnet_fast.kernels import rel_attention

    return {name: getattr(rel_attention, name) for name in TUNED_KERNELS}


def all_config_names() -> list:
    """Every candidate config (any kernel) of this machine's GPU; without one, of the H100 the GPU
    campaign runs on (its CPU dry run rehearses that)."""
    import torch

    from xlnet_fast.kernels import rel_attention

    tuned_kernels()  # makes the kernels importable
    arch = 90
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    family = rel_attention.CANDIDATES[rel_attention.arch_family(arch)]
    return list(dict.fromkeys(name for names in family.values() for name in names))


def _pin(names) -> dict:
    """Restrict every tuned kernel to ``names``; returns what to restore."""
    names, kernels = list(names), tuned_kernels()
    chosen = {name: [c for c in tuner.configs if config_name(c) in names] for name, tuner in kernels.items()}
    for name, tuner in kernels.items():
        if not names or len(chosen[name]) != len(set(names)):
            raise ValueError(f"configs must be among {[config_name(c) for c in tuner.configs]}, got {names}")
    saved = {}
    for name, tuner in kernels.items():
        saved[name] = (tuner.configs, dict(tuner.cache))
        tuner.configs = chosen[name]
        tuner.cache.clear()
    return saved


@contextlib.contextmanager
def pinned(names):
    """The tuned kernels restricted to the configs ``names`` inside, restored after."""
    saved = _pin(names)
    try:
        yield
    finally:
        for name, tuner in tuned_kernels().items():
            tuner.configs, cache = saved[name]
            tuner.cache.clear()
            tuner.cache.update(cache)


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    names = os.environ.get(ENV)
    if not names:
        return
    import torch

    from xlnet_fast.kernel_contract import contract

    if torch.cuda.is_available() and not contract.interpreting():
        _pin(names.split(","))


def _timeout_s() -> float | None:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else None


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        """Fail the test if its body runs past ``$BENCH_TEST_TIMEOUT_S`` seconds."""
        import signal

        seconds = _timeout_s()
        if not seconds or not hasattr(signal, "SIGALRM"):
            yield
            return

        def expire(signum, frame):  # noqa: ARG001 - signal handler signature
            pytest.fail(f"{TIMEOUT_MARK}: {item.nodeid} ran past {seconds:g} s", pytrace=False)

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
except ImportError:  # imported outside a test run (the campaign itself)
    pass


class TuningLog:
    """The autotuners' choices as they are made. ``new(context)`` lists one record per key tuned
    since the last call: the kernel, the key's fields, the winning config and, when exactly one key
    was tuned since the last call (the timings then are that key's), every config's median ms."""

    def __init__(self, kernels: dict | None = None):
        self.kernels = tuned_kernels() if kernels is None else kernels
        self.seen: dict = {name: set() for name in self.kernels}
        self.timings_seen: dict = {}

    def new(self, context: str) -> list[dict]:
        out = []
        for name, tuner in self.kernels.items():
            keys = [key for key in tuner.cache if key not in self.seen[name]]
            timings = getattr(tuner, "configs_timings", None)
            fresh = timings is not None and timings is not self.timings_seen.get(name)
            per_config = ({config_name(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
                          if fresh and len(keys) == 1 else None)
            for key in keys:
                self.seen[name].add(key)
                fields = {n: (v if isinstance(v, (int, float, bool, str)) else str(v)) for n, v in zip(tuner.keys, key)}
                fields["dtypes"] = sorted(set(map(str, key[len(tuner.keys):])))
                out.append({"kernel": name, "context": context, "key": fields, "best": config_name(tuner.cache[key]),
                            "timings_ms": per_config})
            if fresh:
                self.timings_seen[name] = timings
        return out
