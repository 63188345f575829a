"""XLNet attention benchmark: fused Triton vs eager vs transformers' core vs SDPA-flash.

    python -m bench.attention [--qlens 512 1024 2048 4096 8192 16384] [--mlens 0 384] [--B 8]
                              [--H 16] [--D 64 128] [--dtypes bf16 fp16] [--modes fwd fwd_bwd]
                              [--providers xlnet_fast eager hf sdpa_flash] [--out FILE]

Providers, on the same random tensors: ``xlnet_fast`` (the op, Triton backend, permutation rank
mask and segment term), ``eager`` (the op, eager backend), ``hf`` (transformers'
``XLNetRelativeAttention.rel_attn_core`` with the equivalent dense float mask, as HF builds it) and
``sdpa_flash`` (``scaled_dot_product_attention`` with the flash backend on plain attention of the same
B, H, L, D — the physical reference). Median time by CUDA events (``triton.testing.do_bench``) after
warm-up; TFLOP/s counted as 4·B·H·M·K·D forward (FlashAttention's convention, ×2.5 for fwd+bwd);
peak memory above the inputs; an out-of-memory is recorded as ``"OOM"``. Records are appended to
``bench/results/attention.json``. On a machine without CUDA it runs the eager and hf providers with
wall-clock medians, for a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import xlnet_fast
from bench.records import append_records, environment
from xlnet_fast import INT32_MIN

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_case(B, H, qlen, mlen, D, dtype, device, seed=0):
    """Inputs for one XLNet content-stream attention with a permutation mask and segments."""
    g = torch.Generator(device=device).manual_seed(seed)
    K, R = qlen + mlen, 2 * qlen + mlen

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).to(dtype)

    t = dict(q=rnd(B, qlen, H, D), k=rnd(B, K, H, D), v=rnd(B, K, H, D), k_r=rnd(1, R, H, D),
             r_w_bias=rnd(H, D, s=0.1), r_r_bias=rnd(H, D, s=0.1), r_s_bias=rnd(H, D, s=0.1),
             seg_embed=rnd(2, H, D, s=0.1))
    perm = torch.argsort(torch.rand(B, qlen, generator=g, device=device), dim=1).to(torch.int32)
    seg = (torch.arange(qlen, device=device) >= qlen // 2).long().expand(B, qlen)
    c = dict(q_rank=perm + 1, k_rank=torch.cat([torch.full((B, mlen), INT32_MIN, dtype=torch.int32,
                                                           device=device), perm], 1),
             q_seg=seg, k_seg=torch.cat([torch.zeros(B, mlen, dtype=torch.long, device=device), seg], 1))
    return t, c


def runner(name, leaves, c):
    """A zero-argument callable returning ``name``'s attention output on ``leaves``."""
    if name in ("xlnet_fast", "eager"):
        backend = "triton" if name == "xlnet_fast" else "eager"

        def run():
            return xlnet_fast.rel_attention(**leaves, **c, backend=backend)
    elif name == "hf":
        from transformers import XLNetConfig
        from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

        t = leaves
        B, M, H, D = t["q"].shape
        K = t["k"].shape[1]
        att = XLNetRelativeAttention(XLNetConfig(d_model=H * D, n_head=H, dropout=0.0)).eval()
        att.to(device=t["q"].device, dtype=t["q"].dtype)
        with torch.no_grad():
            for n in ("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed"):
                getattr(att, n).copy_(leaves[n])
        # HF's layout (len, B, H, D) and its dense masks: (M, K, B, 1) float, one-hot seg_mat
        seq = {k: leaves[k].transpose(0, 1) for k in ("q", "k", "v", "k_r")}
        k_r = seq["k_r"].expand(-1, B, -1, -1)
        blocked = ~((c["k_rank"][:, None, :] < c["q_rank"][:, :, None])
                    | (torch.arange(K, device=t["q"].device)[None, None, :]
                       == (K - M + torch.arange(M, device=t["q"].device))[None, :, None]))
        mask = blocked.permute(1, 2, 0)[..., None].to(t["q"].dtype)
        diff = (c["q_seg"][:, :, None] != c["k_seg"][:, None, :]).long().permute(1, 2, 0)
        seg_mat = torch.nn.functional.one_hot(diff, 2).to(t["q"].dtype)

        def run():
            return att.rel_attn_core(seq["q"], seq["k"], seq["v"], k_r, seg_mat=seg_mat, attn_mask=mask)
    elif name == "sdpa_flash":
        q = leaves["q"].transpose(1, 2)
        k = leaves["k"][:, -q.shape[2]:].transpose(1, 2)
        v = leaves["v"][:, -q.shape[2]:].transpose(1, 2)

        def run():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        raise ValueError(f"unknown provider {name!r}")
    return run


def provider_fn(name, t, c, mode):
    """A zero-argument callable running one forward (and backward) of ``name``."""
    leaves = {k: v.detach().requires_grad_(mode == "fwd_bwd") for k, v in t.items()}
    run = runner(name, leaves, c)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                run()
        return step
    params = list(leaves.values())

    def step():
        out = run()
        grads = torch.autograd.grad(out, [p for p in params if p.requires_grad], torch.ones_like(out),
                                    allow_unused=True)
        return grads
    return step


def time_ms(step, device) -> float:
    if device == "cuda":
        import triton

        return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
    step()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure(name, t, c, mode, device):
    """(ms, peak MB above the inputs) or ("OOM", None)."""
    try:
        step = provider_fn(name, t, c, mode)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            peak = None
        return time_ms(step, device), peak
    except torch.OutOfMemoryError:
        return "OOM", None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--mlens", type=int, nargs="+", default=[0, 384])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--providers", nargs="+", default=["xlnet_fast", "eager", "hf", "sdpa_flash"])
    p.add_argument("--tokens", type=int, default=None, help="keep B*qlen at this many tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    providers = args.providers if device == "cuda" else [x for x in args.providers if x in ("eager", "hf")]
    env = environment()
    records = []
    for dtype_name in args.dtypes:
        for D in args.D:
            for mlen in args.mlens:
                for qlen in args.qlens:
                    B = max(1, args.tokens // qlen) if args.tokens else args.B
                    t, c = make_case(B, args.H, qlen, mlen, D, DTYPES[dtype_name], device)
                    for mode in args.modes:
                        for prov in providers:
                            if prov == "sdpa_flash" and mlen:
                                continue  # plain attention has no memory: measured at mlen 0
                            ms, peak = measure(prov, t, c, mode, device)
                            flops = 4 * B * args.H * qlen * (qlen + mlen) * D * (2.5 if mode == "fwd_bwd" else 1)
                            tflops = flops / (ms * 1e-3) / 1e12 if ms != "OOM" else None
                            rec = {**env, "op": "xlnet_attn",
                                   "provider": prov, "mode": mode, "dtype": dtype_name, "B": B, "H": args.H,
                                   "L": qlen, "mlen": mlen, "D": D, "ms": ms, "tflops": tflops,
                                   "peak_mem_mb": peak, "tokens_per_s": None,
                                   "flops_convention": "4*B*H*M*K*D fwd, x2.5 fwd+bwd"}
                            records.append(rec)
                            ms_s = ms if ms == "OOM" else f"{ms:9.3f} ms"
                            tf_s = f"{tflops:7.1f} TFLOP/s" if tflops else ""
                            print(f"{dtype_name} D={D} mlen={mlen:4} L={qlen:6} B={B:3} {mode:8} {prov:11} {ms_s} {tf_s}")
                    del t, c
    if not args.no_record:
        append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
