"""The launcher's bound launches against triton's JIT, on a fake GPU (``bench.compiler.fake_gpu``).

Run in a process of its own, with the kernels compiled (``TRITON_INTERPRET`` unset):
``python tests/helpers/launch_check.py ARCH`` prints one JSON line ``{"calls", "launches", "bound",
"mismatches"}`` and exits 1 on a mismatch. Each call of the scenarios below runs its forward and
backward twice, once with every launch through triton's JIT and once through the launcher's cache,
where the second run of a call shape launches bound (``kernels/launch.py``): every launch must reach
the driver with the same binary, grid and arguments. The scenarios follow each other so that a call
differing from an earlier one only in what triton specialises on (a pointer's alignment, a size's
divisibility by 16, a flag) would reuse the earlier binary if the launcher's call key missed it.
"""

from __future__ import annotations

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scenarios(torch):
    """(name, inputs) pairs: the kernels' arguments of one forward and backward, small shapes."""
    from xlnet_fast.attention import prepare_masks, prepare_two_stream_masks
    from xlnet_fast.attention.args import validate

    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    def call(B=2, L=32, mlen=16, H=2, D=16, P=0, Br=1, segments=True, ranks=True, dense=False, dropout=0.0,
             dtype=torch.bfloat16, offset=0, q_pos=False):
        K = mlen + L
        rows = L + P
        k_store = rnd(B, K * H * D + offset, dtype=dtype)
        k = k_store[:, offset:].view(B, K, H, D)  # offset: k not 16-byte aligned
        v, k_r = rnd(B, K, H, D, dtype=dtype), rnd(Br, K + L, H, D, dtype=dtype)
        weights = [rnd(H, D, dtype=dtype), rnd(H, D, dtype=dtype)]
        seg = dict(r_s_bias=rnd(H, D, dtype=dtype), seg_embed=rnd(2, H, D, dtype=dtype)) if segments else {}
        mask = {}
        if segments:
            mask.update(q_seg=torch.randint(0, 3, (B, L), generator=g), k_seg=torch.randint(0, 3, (B, K), generator=g))
        if ranks:
            mask.update(q_rank=torch.randint(0, 9, (B, L), generator=g, dtype=torch.int32),
                        k_rank=torch.randint(0, 9, (B, K), generator=g, dtype=torch.int32))
        if dense:
            mask.update(attn_mask=torch.rand(B, rows, K, generator=g) < 0.3)
        q, q_g = rnd(B, L, H, D, dtype=dtype), None
        if P:
            q_g = rnd(B, P, H, D, dtype=dtype)
            prepared = prepare_two_stream_masks(B, L, K, device="cpu", target_pos=torch.randint(-1, L, (B, P), generator=g),
                                                backend="eager", **mask)
        elif q_pos:
            prepared = prepare_masks(B, L, K, device="cpu", q_pos=torch.randint(-1, L, (B, L), generator=g), qlen=L,
                                     self_visible=False, backend="eager", **mask)
        else:
            prepared = prepare_masks(B, L, K, device="cpu", backend="eager", **mask)
        a = validate(q, k, v, k_r, *weights, q_g=q_g, masks=prepared, scale=1 / math.sqrt(D), dropout_p=dropout, **seg)
        if dropout:
            a.seed = torch.tensor(12345, dtype=torch.int64)
        dout = rnd(B, L, H, D, dtype=dtype)
        dout_g = rnd(B, P, H, D, dtype=dtype) if P else None
        return (q, k, v, k_r, *weights, a), dout, dout_g

    return [
        ("content", call()),
        ("content, k not aligned", call(offset=1)),
        ("content, 33 rows", call(L=33)),
        ("two-stream, dropout", call(P=5, dropout=0.1)),
        ("two-stream, no segments", call(P=5, segments=False)),
        ("dense mask, per-row k_r", call(ranks=False, dense=True, Br=2)),
        ("target rows", call(q_pos=True, segments=False)),
        ("float32", call(dtype=torch.float32, segments=False)),
    ]


def _record(launch, torch) -> tuple:
    def arg(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", str(x.dtype), tuple(x.shape), x.data_ptr() % 16 == 0)
        return repr(x)
    return (launch.kernel, launch.binary, launch.grid, tuple(arg(x) for x in launch.args))


def main(arch: int) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, ROOT)
    import torch

    from bench.compiler.fake_gpu import fake_gpu
    from bench.compiler.pinned_configs import pinned
    from bench.source_tree import ensure_kernels_importable

    ensure_kernels_importable()
    from xlnet_fast import kernels
    from xlnet_fast.kernels import launch

    with fake_gpu(arch) as gpu, pinned(["32x32w4s1"]):
        scenarios = _scenarios(torch)
        runs, bound_calls, unbound = {}, [], []
        call_bound = launch._Bound.__call__
        launch._Bound.__call__ = lambda self, tensors: (bound_calls.append(1), call_bound(self, tensors))[1]
        for mode in ("jit", "bound"):
            kernels.clear_launches()
            bind = launch.bind
            if mode == "jit":
                launch.bind = lambda *args: None
            try:
                records = []
                for name, (inputs, dout, dout_g) in scenarios:
                    for deterministic in (False, True):
                        for again in (False, True):  # the second run of a call shape launches bound
                            start, bound_before = gpu.count(), len(bound_calls)
                            out, lse = kernels.forward(*inputs)
                            kernels.backward(dout, *inputs, out, lse, dout_g=dout_g, deterministic=deterministic)
                            made = [_record(x, torch) for x in gpu.launches[start:]]
                            records.append((name, deterministic, made))
                            if mode == "bound" and again and len(bound_calls) - bound_before != len(made):
                                unbound.append(f"{name} (deterministic={deterministic}): "
                                               f"{len(bound_calls) - bound_before} of {len(made)} launches bound")
            finally:
                launch.bind = bind
            runs[mode] = records
        launch._Bound.__call__ = call_bound
    mismatches = [f"{name} (deterministic={det}), launch {i}: {a} != {b}"
                  for (name, det, jit), (_, _, got) in zip(runs["jit"], runs["bound"])
                  for i, (a, b) in enumerate(zip(jit, got)) if a != b]
    mismatches += [f"{name}: {len(jit)} launches through the JIT, {len(got)} bound"
                   for (name, _, jit), (_, _, got) in zip(runs["jit"], runs["bound"]) if len(jit) != len(got)]
    mismatches += unbound  # every launch of a call shape's second run must go bound
    print(json.dumps({"calls": len(runs["jit"]), "launches": sum(len(r) for _, _, r in runs["jit"]),
                      "bound": len(bound_calls), "mismatches": mismatches[:20]}))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 80))
