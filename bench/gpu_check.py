"""GPU correctness check of the fused kernels at realistic shapes, against float64.

    python -m bench.gpu_check [--long] [--out bench/results/gpu_check.json]

For bf16 and fp16: the Triton backend (forward and backward) against the eager backend run in
float64 on the same inputs, relative-norm errors of the output and of all eight gradients (the largest
is recorded). Cases: content stream with memory, rank mask and segments (B=8, H=16, qlen=512,
mlen=384, D=64); the query stream's 85 target rows in one launch with the content rows; with
``--long`` also qlen=4096 (B=1). Appends ``{"op": "xlnet_attn_check", ...}`` records.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import xlnet_fast
from bench.records import append_records, environment
from xlnet_fast import INT32_MIN

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def make_inputs(B, H, qlen, mlen, D, n_targets, device, seed=0):
    """float64 inputs for one call of rel_attention_two_stream (n_targets=0: content only)."""
    g = torch.Generator(device=device).manual_seed(seed)
    K, R = qlen + mlen, 2 * qlen + mlen

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float64) * s

    tensors = dict(q_h=rnd(B, qlen, H, D), q_g=rnd(B, max(n_targets, 1), H, D), k=rnd(B, K, H, D),
                   v=rnd(B, K, H, D), k_r=rnd(1, R, H, D), r_w_bias=rnd(H, D, s=0.1),
                   r_r_bias=rnd(H, D, s=0.1), r_s_bias=rnd(H, D, s=0.1), seg_embed=rnd(2, H, D, s=0.1))
    perm = torch.argsort(torch.rand(B, qlen, generator=g, device=device), dim=1).to(torch.int32)
    targets = torch.sort(perm[:, :max(n_targets, 1)].long(), dim=1).values  # last in the order
    k_rank = torch.cat([torch.full((B, mlen), INT32_MIN, dtype=torch.int32, device=device), perm], 1)
    seg = (torch.arange(qlen, device=device) >= qlen // 2).long().expand(B, qlen)
    consts = dict(q_rank=perm + 1, k_rank=k_rank, q_seg=seg,
                  k_seg=torch.cat([torch.zeros(B, mlen, dtype=torch.long, device=device), seg], 1),
                  target_pos=targets)
    return tensors, consts


def run(tensors, consts, dtype, backend, two_stream):
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in tensors.items()}
    if two_stream:
        h, gq = xlnet_fast.rel_attention_two_stream(**leaves, **consts, backend=backend)
        out = torch.cat([h, gq], 1)
    else:
        kw = {k: v for k, v in consts.items() if k != "target_pos"}
        args = {k: v for k, v in leaves.items() if k != "q_g"}
        out = xlnet_fast.rel_attention(args.pop("q_h"), **args, **kw, backend=backend)
    dout = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(1),
                       device=out.device, dtype=torch.float64).to(dtype)
    names = [k for k in leaves if two_stream or k != "q_g"]
    grads = torch.autograd.grad(out, [leaves[k] for k in names], dout)
    return out.detach(), dict(zip(names, grads))


def rel_err(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", action="store_true", help="also qlen=4096")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    device = "cuda"
    env = environment()
    cases = [("content_mem384_rank_seg", dict(B=8, H=16, qlen=512, mlen=384, D=64, n_targets=0), False),
             ("two_stream_85_targets", dict(B=8, H=16, qlen=512, mlen=384, D=64, n_targets=85), True)]
    if args.long:
        cases.append(("content_qlen4096", dict(B=1, H=16, qlen=4096, mlen=0, D=64, n_targets=0), False))
    records = []
    for name, shape, two_stream in cases:
        tensors, consts = make_inputs(**shape, device=device)
        ref_out, ref_grads = run(tensors, consts, torch.float64, "eager", two_stream)
        for dtype in (torch.bfloat16, torch.float16):
            out, grads = run(tensors, consts, dtype, "triton", two_stream)
            errs = {k: rel_err(grads[k], ref_grads[k]) for k in grads}
            rec = {"op": "xlnet_attn_check", **env, "dtype": str(dtype).split(".")[-1],
                   "case": name, **{k: v for k, v in shape.items()},
                   "rel_err_out": rel_err(out, ref_out), "rel_err_grad": max(errs.values()),
                   "rel_err_grads": errs}
            records.append(rec)
            print(f"{name:28} {rec['dtype']:9} out {rec['rel_err_out']:.2e}  worst grad "
                  f"{rec['rel_err_grad']:.2e} ({max(errs, key=errs.get)})")
        del ref_out, ref_grads
        torch.cuda.empty_cache()
    append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
