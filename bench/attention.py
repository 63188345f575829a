"""XLNet attention benchmark: fused Triton vs eager vs transformers' core vs SDPA-flash.

    python -m bench.attention [--qlens 512 1024 2048 4096 8192 16384] [--mlens 0 384] [--B 8]
                              [--H 16] [--D 64 128] [--dtypes bf16 fp16] [--modes fwd fwd_bwd]
                              [--providers xlnet_fast eager hf sdpa_flash] [--out FILE | --record]

Providers, on the same random tensors: ``xlnet_fast`` (the op, Triton backend, permutation rank
mask and segment term), ``eager`` (the op, eager backend), ``hf`` (transformers'
``XLNetRelativeAttention.rel_attn_core`` with the equivalent dense float mask, as HF builds it) and
``sdpa_flash`` (``scaled_dot_product_attention`` with the flash backend on plain attention of the same
B, H, L, D — the physical reference). Median time by CUDA events (``triton.testing.do_bench``) after
warm-up; TFLOP/s counted as 4·B·H·M·K·D forward (FlashAttention's convention, ×2.5 for fwd+bwd);
peak memory above the inputs; an out-of-memory is recorded as ``"OOM"``. Records are appended to
``--out`` (default: the cache directory, see ``bench.runner``), or with ``--record`` to
``bench/results/attention.json``. On a machine without CUDA it runs the eager and hf providers with
wall-clock medians, for a smoke test: it says how long the sweep will take and refuses one estimated
above 10 minutes (pass smaller shapes).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import cases, runner

RECORDS = "attention.json"
CPU_PROVIDERS = ("eager", "hf")
FLOPS_CONVENTION = "4*B*H*M*K*D fwd, x2.5 fwd+bwd"


def _hf_call(leaves: dict, index: dict):
    """transformers' ``rel_attn_core`` on the same tensors, with the equivalent dense masks."""
    from transformers import XLNetConfig
    from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

    B, M, H, D = leaves["q"].shape
    K, device = leaves["k"].shape[1], leaves["q"].device
    att = XLNetRelativeAttention(XLNetConfig(d_model=H * D, n_head=H, dropout=0.0)).eval()
    att.to(device=device, dtype=leaves["q"].dtype)
    with torch.no_grad():
        for n in ("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed"):
            getattr(att, n).copy_(leaves[n])
    # HF's layout (len, B, H, D) and its dense masks: (M, K, B, 1) float, one-hot seg_mat
    seq = {k: leaves[k].transpose(0, 1) for k in ("q", "k", "v", "k_r")}
    k_r = seq["k_r"].expand(-1, B, -1, -1)
    blocked = ~((index["k_rank"][:, None, :] < index["q_rank"][:, :, None])
                | (torch.arange(K, device=device)[None, None, :]
                   == (K - M + torch.arange(M, device=device))[None, :, None]))
    mask = blocked.permute(1, 2, 0)[..., None].to(leaves["q"].dtype)
    diff = (index["q_seg"][:, :, None] != index["k_seg"][:, None, :]).long().permute(1, 2, 0)
    seg_mat = torch.nn.functional.one_hot(diff, 2).to(leaves["q"].dtype)
    return lambda: att.rel_attn_core(seq["q"], seq["k"], seq["v"], k_r, seg_mat=seg_mat, attn_mask=mask)


def _sdpa_flash_call(leaves: dict):
    """Plain attention of the same B, H, L, D by ``scaled_dot_product_attention``'s flash backend."""
    q = leaves["q"].transpose(1, 2)
    k = leaves["k"][:, -q.shape[2]:].transpose(1, 2)
    v = leaves["v"][:, -q.shape[2]:].transpose(1, 2)

    def run():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return run


def provider_call(name: str, inputs: cases.AttentionInputs, leaves: dict):
    """A zero-argument callable returning ``name``'s attention output on ``leaves`` (the case's
    float arguments, possibly requiring grad)."""
    if name in ("xlnet_fast", "eager"):
        backend = "triton" if name == "xlnet_fast" else "eager"
        return lambda: inputs.call(leaves, backend=backend)
    if name == "hf":
        return _hf_call(leaves, inputs.index)
    if name == "sdpa_flash":
        return _sdpa_flash_call(leaves)
    raise ValueError(f"unknown provider {name!r}")


def provider_fn(name: str, inputs: cases.AttentionInputs, mode: str):
    """A zero-argument callable running one forward (and backward) of ``name``."""
    leaves = {k: v.detach().requires_grad_(mode == "fwd_bwd") for k, v in inputs.floats.items()}
    run = provider_call(name, inputs, leaves)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                run()
        return step
    params = list(leaves.values())

    def step():
        out = run()
        return torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)
    return step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--mlens", type=int, nargs="+", default=[0, 384])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(cases.DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--providers", nargs="+", default=["xlnet_fast", "eager", "hf", "sdpa_flash"],
                   choices=["xlnet_fast", "eager", "hf", "sdpa_flash"])
    p.add_argument("--tokens", type=int, default=None, help="keep B*qlen at this many tokens")
    runner.add_output_args(p, RECORDS, no_record=True)
    return p


def sweep_cases(args) -> list[tuple[str, cases.AttentionCase]]:
    """``(dtype name, case)`` for every point of the sweep, in the order they run."""
    out = []
    for point in runner.sweep(dtype=args.dtypes, D=args.D, mlen=args.mlens, qlen=args.qlens):
        B = max(1, args.tokens // point["qlen"]) if args.tokens else args.B
        out.append((point["dtype"], cases.AttentionCase(B, args.H, point["qlen"], point["mlen"], point["D"],
                                                        cases.DTYPES[point["dtype"]])))
    return out


def _measurements(sweep: list, modes: list, providers: list) -> list:
    """``(dtype name, case, mode, provider)`` in order; plain attention only at mlen 0 (no memory)."""
    return [(name, case, mode, prov) for name, case in sweep for mode in modes for prov in providers
            if not (prov == "sdpa_flash" and case.mlen)]


def _cpu_plan(plan: list) -> int | None:
    """On CPU: say what runs and how long it takes; exit status 2 when over the limit."""
    work = [(case.flops(mode) * (runner.CPU_REPEATS + 1), case.dtype) for _, case, mode, _ in plan]
    seconds = runner.estimate_cpu_seconds(work, runner.CPU_EFFICIENCY_ATTENTION)
    runner.announce(f"no CUDA device: timing the {'/'.join(CPU_PROVIDERS)} providers on CPU (wall-clock "
                    f"median of {runner.CPU_REPEATS} after a warm-up, a smoke test): {len(plan)} measurements, "
                    f"about {runner.duration(seconds)}")
    if seconds > runner.CPU_LIMIT_S:
        return runner.refuse(f"bench.attention: the sweep would take about {runner.duration(seconds)} on this "
                             f"CPU; pass smaller shapes, e.g. --qlens 256 512 --B 1 --H 4 --D 64 --dtypes fp32")
    return None


def record(env: dict, dtype_name: str, case: cases.AttentionCase, mode: str, prov: str, ms, peak) -> dict:
    """One ``xlnet_attn`` record; TFLOP/s by ``FLOPS_CONVENTION``."""
    flops = 4 * case.B * case.H * case.qlen * case.klen * case.D * (2.5 if mode == "fwd_bwd" else 1)
    tflops = flops / (ms * 1e-3) / 1e12 if ms != runner.OOM else None
    return {**env, "op": "xlnet_attn", "provider": prov, "mode": mode, "dtype": dtype_name, "B": case.B,
            "H": case.H, "L": case.qlen, "mlen": case.mlen, "D": case.D, "ms": ms, "tflops": tflops,
            "peak_mem_mb": peak, "tokens_per_s": None, "flops_convention": FLOPS_CONVENTION}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = runner.device_name()
    providers = args.providers if device == "cuda" else [x for x in args.providers if x in CPU_PROVIDERS]
    plan = _measurements(sweep_cases(args), args.modes, providers)
    if device == "cpu":
        refused = _cpu_plan(plan)
        if refused is not None:
            return refused
    env, records, inputs = runner.environment(), [], None
    for dtype_name, case, mode, prov in plan:
        if inputs is None or inputs.case != case:
            inputs = None  # free the previous case's tensors first
            inputs = cases.attention_inputs(case, device)
        ms, peak = runner.measure(lambda: provider_fn(prov, inputs, mode), device)
        records.append(record(env, dtype_name, case, mode, prov, ms, peak))
        ms_s = ms if ms == runner.OOM else f"{ms:9.3f} ms"
        tf_s = f"{records[-1]['tflops']:7.1f} TFLOP/s" if records[-1]["tflops"] else ""
        print(f"{dtype_name} D={case.D} mlen={case.mlen:4} L={case.qlen:6} B={case.B:3} {mode:8} {prov:11} "
              f"{ms_s} {tf_s}")
    path = runner.output_path(args, RECORDS)
    if path is not None:
        runner.append_records(path, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
