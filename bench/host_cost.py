"""What one attention call costs the host: µs, GPU launches and host syncs, with the GPU stubbed.

    python -m bench.host_cost [--B 8] [--H 12] [--qlen 512] [--mlen 384] [--targets 85] [--D 64]
                              [--arch 90] [--device cpu|meta] [--layers 12] [--repeats 50]
                              [--out FILE | --record]

The call a layer of the XLNet model makes in pretraining: both streams in one launch
(``rel_attention_two_stream``), rank masks, segments, dropout, bf16, on the Triton backend, with the
masks as the model gives them (prepared once per forward for every layer: ``prepared``) and raw
(prepared by the call itself: ``raw``). Triton runs its whole launch path against a fake
``sm_<arch>`` (``bench.compiler.fake_gpu``: binding, specialisation, cache lookup, the autotuner, the
launcher's bound launches; only the driver's C launcher is stubbed), so no kernel runs: the time is
the host's share of a call. Per call, forward alone (no grad) and forward + backward: median µs over
``--repeats`` steps of ``--layers`` calls (a model's layers: their outputs go through one backward, as
in a training step, whose engine's set-up a lone call would carry alone) of the calling thread's CPU
time per call (``host_us``: what the host spends, whatever else the machine runs; the wall time
beside it); GPU launches (triton kernels, and the PyTorch ops that run a kernel on a GPU:
not views or allocations); tensor reads on the host (``item``, ``bool``, ``int``, ``float``,
``tolist``: each a sync on a GPU). Writes ``host_cost.json``.

The tensors are CPU tensors at the shape given (``--device cpu``): with the kernels stubbed, the
prepared call runs no PyTorch op with a CPU kernel worth timing but the dropout seed's draw; large
allocations come from the heap as from CUDA's caching allocator (glibc's ``mallopt``: no ``mmap`` per
allocation). The raw call's figure includes its masks' checks and join (a dozen small ops, each an
asynchronous launch on a GPU) and its tables' three launches (stubbed, as the kernels'). ``--device meta`` runs on
meta tensors instead, whose Python shape functions make many ops slower than a GPU's host path.

Runs in a process of its own without ``TRITON_INTERPRET`` (the kernels must be compiled); the first
call compiles each kernel for the arch once (cached by triton afterwards, ~1 minute).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import runner

RECORDS = "host_cost.json"
# aten ops that run no kernel on a GPU: allocations and metadata (views are known by their schema)
_NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "_unsafe_view",
              "lift_fresh", "set_", "resize_", "_local_scalar_dense")
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class _CountOps(TorchDispatchMode):
    """Counts, by name, the aten ops that would run a kernel on a GPU, inside the op's own
    implementation too (its custom ops are run with this mode on)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from xlnet_fast.attention import op

        name = func.overloadpacket.__name__
        if func.namespace == "xlnet_fast":
            with self:
                return op.REAL_IMPLEMENTATIONS[name](*args, **(kwargs or {}))
        if name not in _NO_KERNEL and not func.is_view:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _host_reads():
    """Counts reads of a tensor's value on the host (a meta tensor answers 0, or False)."""
    counts: dict[str, int] = {}
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def spy(name):
        def read(self, *args):
            counts[name] = counts.get(name, 0) + 1
            if self.device.type != "meta":
                return saved[name](self, *args)
            return False if name == "__bool__" else [0] * self.numel() if name == "tolist" else 0
        return read

    for name in _HOST_READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def layer_call(args, device: str):
    """``(forward, forward_backward)`` closures of the calls the model's layers make, each layer its
    own inputs and the masks shared, as ``prepared`` and ``raw`` masks: {mode: (fwd, fwd_bwd)}."""
    import xlnet_fast

    B, H, L, M, P, D = args.B, args.H, args.qlen, args.mlen, args.targets, args.D
    K = L + M
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=device).requires_grad_()

    def index(high, *shape, dtype=torch.long):
        return torch.randint(0, high, shape, generator=g, dtype=dtype).to(device)

    layers = [dict(dense=[leaf(B, L, H, D), leaf(B, P, H, D), leaf(B, K, H, D), leaf(B, K, H, D),
                          leaf(1, K + L, H, D), leaf(H, D), leaf(H, D)],
                   weights=dict(r_s_bias=leaf(H, D), seg_embed=leaf(2, H, D))) for _ in range(args.layers)]
    inputs = [t for layer in layers for t in layer["dense"] + list(layer["weights"].values())]
    raw = dict(target_pos=index(L, B, P), q_seg=index(2, B, L), k_seg=index(2, B, K),
               q_rank=index(L, B, L, dtype=torch.int32), k_rank=index(L, B, K, dtype=torch.int32))
    prepared = xlnet_fast.prepare_two_stream_masks(B, L, K, device=device, backend="triton", **raw)
    grads = [torch.empty(B, L, H, D, dtype=torch.bfloat16, device=device),
             torch.empty(B, P, H, D, dtype=torch.bfloat16, device=device)] * args.layers

    def calls(masks: dict):
        def forward():
            return [xlnet_fast.rel_attention_two_stream(*layer["dense"], **layer["weights"], **masks, dropout_p=0.1,
                                                        backend="triton") for layer in layers]

        def forward_backward():  # one backward over the layers' calls, as a model's step makes it
            outputs = forward()
            torch.autograd.grad([t for pair in outputs for t in pair], inputs, grads)

        return forward, forward_backward

    return {"prepared": calls(dict(masks=prepared)), "raw": calls(raw)}


def measure(fn, grad: bool, repeats: int, gpu, layers: int) -> dict:
    """One step of ``layers`` calls counted (launches, PyTorch ops, host reads), then ``repeats``
    steps timed; every figure per call."""
    with torch.set_grad_enabled(grad):
        for _ in range(3):  # compile, tune, bind
            fn()
        start = gpu.count()
        with _host_reads() as reads, _CountOps() as counted:
            fn()
        triton_launches: dict[str, int] = {}
        for launch in gpu.launches[start:]:
            triton_launches[launch.kernel] = triton_launches.get(launch.kernel, 0) + 1
        times, walls = [], []
        for _ in range(repeats):
            begin, wall = time.thread_time_ns(), time.perf_counter_ns()
            fn()
            times.append((time.thread_time_ns() - begin) / layers)
            walls.append((time.perf_counter_ns() - wall) / layers)
    return {"host_us": round(statistics.median(times) / 1e3, 1), "host_us_p10": round(sorted(times)[len(times) // 10] / 1e3, 1),
            "wall_us": round(statistics.median(walls) / 1e3, 1),
            "launches": (sum(triton_launches.values()) + sum(counted.ops.values())) / layers,
            # per call, by kernel (a step's launches: every layer's forward, then every backward)
            "triton_launches": {name: n / layers for name, n in triton_launches.items()},
            "torch_ops": {name: n / layers for name, n in counted.ops.items()},
            "host_reads": {name: n / layers for name, n in reads.items()}}


def _heap_allocations() -> None:
    """Large CPU allocations from the heap, reused, as CUDA's caching allocator reuses device memory
    (glibc would map and unmap each one: tens of µs a call that a GPU's host path does not pay)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: allocations as they come
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 2**30)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def _cpu_name() -> str:
    """The host CPU's model (``/proc/cpuinfo``) and core count: the machine class the figures hold for."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        model = "unknown"
    return f"{model}, {os.cpu_count()} cores"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--qlen", type=int, default=512)
    p.add_argument("--mlen", type=int, default=384)
    p.add_argument("--targets", type=int, default=85)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--arch", type=int, default=90, help="the fake GPU's arch (compiles for it)")
    p.add_argument("--device", choices=("cpu", "meta"), default="cpu")
    p.add_argument("--layers", type=int, default=12, help="calls per measured step (a model's layers): "
                   "the figures are per call; one backward runs over all of them")
    p.add_argument("--repeats", type=int, default=50)
    runner.add_output_args(p, RECORDS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return runner.refuse("bench.host_cost measures the compiled kernels' launch path: run it without "
                             "TRITON_INTERPRET=1")
    from bench.compiler import aot
    from bench.compiler.fake_gpu import fake_gpu, triton_backend_on

    problem = aot.toolchain_problem(args.arch)
    if problem:
        return runner.refuse(f"bench.host_cost compiles for sm_{args.arch}: {problem}")
    _heap_allocations()
    records = []
    with fake_gpu(args.arch, keep_args=False) as gpu, triton_backend_on(args.device):
        for masks, (forward, forward_backward) in layer_call(args, args.device).items():
            for name, fn, grad in (("fwd", forward, False), ("fwd_bwd", forward_backward, True)):
                result = measure(fn, grad, args.repeats, gpu, args.layers)
                records.append({"op": "host_cost", "masks": masks, "pass": name, "layers": args.layers, "B": args.B,
                                "H": args.H,
                                "qlen": args.qlen, "mlen": args.mlen, "targets": args.targets, "D": args.D,
                                "arch": args.arch, "tensors": args.device, "dropout_p": 0.1, "segments": True,
                                **result, **runner.environment(), "cpu": _cpu_name()})
                print(f"{masks:>8} {name:>7}: {result['host_us']:8.1f} µs host (median; 10th percentile "
                      f"{result['host_us_p10']:.1f}), {result['launches']} launches "
                      f"({sum(result['triton_launches'].values()):g} triton), host reads {result['host_reads'] or 'none'}", flush=True)
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
