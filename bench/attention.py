"""XLNet attention benchmark: the fused op against transformers, FlexAttention and plain attention.

    python -m bench.attention [--qlens 512 1024 2048 4096 8192 16384] [--mlens 0 384] [--B 8]
                              [--H 16] [--D 64 128] [--dtypes bf16 fp16] [--modes fwd fwd_bwd]
                              [--providers xlnet_fast eager hf sdpa_flash ...] [--out FILE | --record]

Providers (``PROVIDERS``), on the same random tensors (content stream, permutation rank mask,
segments, memory): ``xlnet_fast`` (the op, Triton backend, autotuned), ``xlnet_fast_det`` (the same
with ``torch.use_deterministic_algorithms(True)``: dk_r by a kernel that owns each k_r tile instead of
atomics; forward+backward only), ``xlnet_fast_prepared`` (the same op with its masks prepared
once outside the timed call, ``masks=``, as a model's layers call it: ``xlnet_fast`` prepares them
in every call), ``xlnet_fast_pointers`` (``xlnet_fast_prepared`` with every tile read through
pointers, as on GPUs other than Hopper: against it, what the tensor descriptors bring),
``xlnet_fast_addresses`` (``xlnet_fast_prepared`` with its bound launches passing tensor arguments as
addresses, ``kernels.launch.addresses``: against it, the launcher's per-argument checks), ``eager`` (the
op, eager backend), ``hf`` (transformers'
``XLNetRelativeAttention.rel_attn_core`` with the equivalent dense float mask, as HF builds it),
``flex`` (PyTorch FlexAttention as a user writes XLNet attention with it: ``bd = (q + r_r_bias) @ k_rᵀ``
precomputed and gathered at ``qlen + j - i`` in a ``score_mod`` with the segment term, the rank mask
as a ``mask_mod`` block mask built once per batch, outside the timed call like HF's dense mask;
``torch.compile``d on CUDA, eager forward only on CPU), ``sdpa_flash`` (``scaled_dot_product_attention``
with the flash backend on plain attention of the same B, H, M, K, D — the physical reference) and
``fa2_ref`` (``bench.compiler.fa2_reference``, the plain FlashAttention-2 Triton kernel the compile report
counts against, at its 128x64 w8 s2 tile). Median time by CUDA events (``triton.testing.do_bench``)
after warm-up; TFLOP/s counted as 4·B·H·M·K·D forward (FlashAttention's convention, ×2.5 for
fwd+bwd; the relative term's work is not counted); peak memory above the inputs; an out-of-memory
is recorded as ``"OOM"``. Records are appended to ``--out`` (default: the cache directory, see
``bench.runner``), or with ``--record`` to ``bench/results/attention.json``. On a machine without
CUDA it runs the eager and hf providers with wall-clock medians, for a smoke test: it says how long
the sweep will take and refuses one estimated above 10 minutes (pass smaller shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings

import torch

from bench import cases, runner
from xlnet_fast.kernel_contract import contract

RECORDS = "attention.json"
PROVIDERS = ("xlnet_fast", "xlnet_fast_prepared", "xlnet_fast_pointers", "xlnet_fast_addresses", "xlnet_fast_det",
             "eager", "hf", "flex", "sdpa_flash", "fa2_ref")
CPU_PROVIDERS = ("eager", "hf")
# providers that compute XLNet attention (the others: plain attention of the same shapes)
XLNET_PROVIDERS = ("xlnet_fast", "xlnet_fast_prepared", "xlnet_fast_pointers", "xlnet_fast_addresses",
                   "xlnet_fast_det", "eager", "hf", "flex")
FLOPS_CONVENTION = "4*B*H*M*K*D fwd, x2.5 fwd+bwd"
# the tile of bench.compiler.fa2_reference on a GPU: the compile report's reference row (bench/NOTES.md)
FA2_REF_TILES = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
FA2_REF_INTERPRETER_TILES = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
# torch.compile's recompile limit for the flex provider: one graph per shape, mode and dtype
FLEX_RECOMPILE_LIMIT = 64


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
    """Plain attention of the same B, H, M, K, D (all keys, memory included, no mask) by
    ``scaled_dot_product_attention``'s flash backend."""
    q, k, v = (leaves[n].transpose(1, 2) for n in ("q", "k", "v"))

    def run():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return run


_FLEX: dict = {}


def flex_attention_fn(compiled: bool):
    """``flex_attention``, wrapped in ``torch.compile`` when ``compiled`` (once per process, with
    the recompile limit raised to ``FLEX_RECOMPILE_LIMIT``: a sweep compiles one graph per shape)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if "compiled" not in _FLEX:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch 2.x
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), FLEX_RECOMPILE_LIMIT))
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["compiled"]


def _flex_call(leaves: dict, index: dict):
    """XLNet attention with FlexAttention, content stream (row i at position i): ``bd = (q + r_r_bias)
    @ k_rᵀ`` (B, H, M, R) precomputed and read at ``qlen + j - i`` in the ``score_mod``, with the
    segment term ``(q + r_s_bias) . seg_embed[same or different]``; the rank mask (plus each row's
    own key) as a ``mask_mod`` block mask, built here once per batch. Compiled on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, k_r = (leaves[n] for n in ("q", "k", "v", "k_r"))
    B, M, H, D = q.shape
    K = k.shape[1]
    mlen, qlen, scale = K - M, M, 1.0 / math.sqrt(D)
    q_rank, k_rank = index["q_rank"], index["k_rank"]

    def mask_mod(b, h, i, j):
        return (k_rank[b, j] < q_rank[b, i]) | (j == mlen + i)

    block_mask = create_block_mask(mask_mod, B, None, M, K, device=q.device)
    flex = flex_attention_fn(compiled=q.is_cuda)
    if not q.is_cuda:  # torch warns that the uncompiled path materialises the scores: known, small shapes only
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    segments = "seg_embed" in leaves

    def run():
        k_r_b = k_r.expand(B, -1, -1, -1)
        bd = torch.einsum("bmhd,brhd->bhmr", q + leaves["r_r_bias"], k_r_b)
        if segments:
            q_seg, k_seg = index["q_seg"], index["k_seg"]
            # one tensor per segment relation: FlexAttention's backward refuses a tensor that
            # requires grad indexed twice in a score_mod
            ef_same, ef_diff = (torch.einsum("bmhd,hd->bhm", q + leaves["r_s_bias"], leaves["seg_embed"][s])
                                for s in (0, 1))

        def score_mod(score, b, h, i, j):
            extra = bd[b, h, i, qlen + j - i]
            if segments:
                extra = extra + torch.where(q_seg[b, i] == k_seg[b, j], ef_same[b, h, i], ef_diff[b, h, i])
            return score + extra * scale

        out = flex((q + leaves["r_w_bias"]).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   score_mod=score_mod, block_mask=block_mask, scale=scale)
        return out.transpose(1, 2)
    return run


def _fa2_ref_call(leaves: dict, backward: bool = False):
    """``bench.compiler.fa2_reference`` on the same B, H, M, K, D (plain attention): its forward, or
    with ``backward`` the forward and its own backward kernels (no autograd) for a fixed upstream
    gradient."""
    from bench.compiler import fa2_reference

    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    tiles = FA2_REF_TILES if q.is_cuda else FA2_REF_INTERPRETER_TILES
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout = cases.random_like(q, seed=1) if backward else None

    def run():
        out, lse = fa2_reference.forward(q, k, v, scale, **tiles)
        return fa2_reference.backward(dout, q, k, v, out, lse, scale, **tiles) if backward else out
    return run


def provider_call(name: str, inputs: cases.OpCall, leaves: dict):
    """A zero-argument callable returning ``name``'s attention output on ``leaves`` (the case's
    float arguments, possibly requiring grad): ``(B, M, H, D)``, ``(M, B, H, D)`` for ``hf``, ``(B, H,
    M, D)`` for ``sdpa_flash``."""
    if name in ("xlnet_fast", "xlnet_fast_det", "eager"):
        backend = "eager" if name == "eager" else "triton"
        return lambda: inputs.with_floats(leaves).call(backend=backend)
    if name in ("xlnet_fast_prepared", "xlnet_fast_pointers", "xlnet_fast_addresses"):
        call = inputs.prepared().with_floats(leaves)
        return lambda: call.call(backend="triton")
    if name == "hf":
        return _hf_call(leaves, inputs.index)
    if name == "flex":
        return _flex_call(leaves, inputs.index)
    if name == "sdpa_flash":
        return _sdpa_flash_call(leaves)
    if name == "fa2_ref":
        return _fa2_ref_call(leaves)
    raise ValueError(f"unknown provider {name!r}")


def provider_output(name: str, inputs: cases.OpCall, leaves: dict | None = None) -> torch.Tensor:
    """``name``'s forward output on the case's floats (or ``leaves``) as ``(B, M, H, D)``."""
    with torch.no_grad():
        run = provider_call(name, inputs, dict(inputs.floats if leaves is None else leaves))
        out = _variant(name, run)()
    if name == "hf":
        return out.transpose(0, 1)
    return out.transpose(1, 2) if name == "sdpa_flash" else out


def _deterministic(run):
    """``run`` under ``torch.use_deterministic_algorithms(True)`` (warn only), restored after."""
    def step():
        with runner.deterministic_algorithms():
            return run()
    return step


def _variant(name: str, run):
    """``run`` as provider ``name`` runs it (its backward included): ``xlnet_fast_pointers`` with the
    kernels reading their tiles through pointers, ``xlnet_fast_addresses`` with the bound launches
    passing addresses; the others as they are."""
    if name not in ("xlnet_fast_pointers", "xlnet_fast_addresses"):
        return run
    from xlnet_fast import kernels  # (imported only for these: the others may run without triton)

    context = kernels.pointer_loads if name == "xlnet_fast_pointers" else kernels.launch.addresses

    def step():
        with context():
            return run()
    return step


def provider_fn(name: str, inputs: cases.OpCall, mode: str):
    """A zero-argument callable running one forward (and backward) of ``name``."""
    if name == "fa2_ref" and mode == "fwd_bwd":  # no autograd: its own backward kernels
        return _fa2_ref_call(inputs.floats, backward=True)
    leaves = {k: v.detach().requires_grad_(mode == "fwd_bwd") for k, v in inputs.floats.items()}
    run = _variant(name, provider_call(name, inputs, leaves))
    if mode == "fwd":
        def step():
            with torch.no_grad():
                run()
        return step
    params = list(leaves.values())

    def fwd_bwd():
        out = run()
        return torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)
    return _deterministic(fwd_bwd) if name == "xlnet_fast_det" else fwd_bwd


KERNEL_ROWS = 12  # kernels listed per profile (the rest summed into "other kernels")


def profile_once(step, device: str) -> None:
    """``step()`` to warm up, then once inside the CUDA profiler's range (what ``ncu
    --profile-from-start off`` profiles); without CUDA both calls run unprofiled."""
    step()
    if device != "cuda":
        step()
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def kernel_times(inputs: cases.OpCall, provider: str, mode: str, calls: int = 3) -> dict:
    """Where ``provider``'s time goes on CUDA: the GPU time per call of each kernel it launches
    (``runner.gpu_profile`` over ``calls`` calls after a warm-up), the largest first, and in all."""
    found = runner.gpu_profile(provider_fn(provider, inputs, mode), calls)
    shown, rest = found["kernels"][:KERNEL_ROWS], found["kernels"][KERNEL_ROWS:]
    if rest:
        shown.append({"kernel": f"other kernels ({len(rest)})", "ms_per_call": sum(k["ms_per_call"] for k in rest),
                      "launches_per_call": sum(k["launches_per_call"] for k in rest)})
    return {"kernels": shown, "gpu_ms_per_call": found["gpu_ms_per_call"],
            "launches_per_call": found["launches_per_call"], "host_ms_per_call": found["host_ms_per_call"]}


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
                   choices=list(PROVIDERS))
    p.add_argument("--tokens", type=int, default=None, help="keep B*qlen at this many tokens")
    p.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                   help="pin the autotuned kernels to these configs (e.g. 64x64w4s1: no tuning; for ncu)")
    p.add_argument("--kernels", action="store_true",
                   help="also record each kernel's GPU time per call (torch.profiler; CUDA only)")
    p.add_argument("--ncu", action="store_true",
                   help="no timing: each measurement once to warm up (compiles, autotuning), then once between "
                        "cudaProfilerStart/Stop, for `ncu --profile-from-start off` (without CUDA: once, unprofiled)")
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


def runs_in_mode(provider: str, mode: str) -> bool:
    """Whether ``provider`` is measured in ``mode``: ``xlnet_fast_det`` differs from ``xlnet_fast``
    only in its backward."""
    return not (provider == "xlnet_fast_det" and mode == "fwd")


def _measurements(sweep: list, modes: list, providers: list) -> list:
    """``(dtype name, case, mode, provider)`` in order."""
    return [(name, case, mode, prov) for name, case in sweep for mode in modes for prov in providers
            if runs_in_mode(prov, mode)]


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


# FlexAttention's largest (B, H, M, R) position-score table measured, per mode: at L=4096, B=4 (2.3e9
# elements) its forward ran; at L=16384, B=1 (8.7e9) its forward hit an illegal memory access that
# lost the CUDA context (H200, torch 2.11, 2026-11-26). Its backward at L=4096, B=4 did the same in
# one of inductor's own pointwise kernels over the 2.25e9-element table (past int32 indexing; H200,
# 2026-11-27), losing the rest of that sweep: larger tables are skipped.
FLEX_MAX_POSITION_SCORES = {"fwd": 2**32, "fwd_bwd": 2**31}


def unavailable(provider: str, mode: str, device: str, case: cases.AttentionCase | None = None) -> str | None:
    """Why ``provider`` cannot run in ``mode`` on ``case`` here, or None (on CPU the Triton providers
    need Triton's interpreter)."""
    if provider == "flex" and case is not None:
        scores, limit = case.B * case.H * case.qlen * case.rlen, FLEX_MAX_POSITION_SCORES[mode]
        if scores > limit:
            return (f"its (B, H, M, R) position scores ({scores:.2g} elements) exceed the {limit:.2g} measured "
                    f"to run in {mode} (more crashed the CUDA context)")
    if device == "cuda":
        return None
    if provider == "sdpa_flash":
        return "needs CUDA (the flash backend)"
    if provider == "flex" and mode == "fwd_bwd":
        return "needs CUDA (FlexAttention has no backward on CPU)"
    if (provider.startswith("xlnet_fast") or provider == "fa2_ref") and not contract.interpreting():
        return "needs CUDA (or Triton's interpreter)"
    return None


def agreement(inputs: cases.OpCall, providers: list) -> dict:
    """Relative error of each provider's forward output against the eager backend in float32 on the
    same (upcast) tensors: the XLNet providers compute the same attention."""
    ref = provider_output("eager", inputs.to(dtype=torch.float32)).float()
    errs = {name: float((provider_output(name, inputs).float() - ref).norm() / ref.norm()) for name in providers}
    return {"rel_err_vs_eager_fp32": errs}


def measure(inputs: cases.OpCall, case: cases.AttentionCase, dtype_name: str, mode: str, provider: str,
            device: str, cpu_repeats: int = runner.CPU_REPEATS) -> dict:
    """One ``xlnet_attn`` record of ``provider`` on ``inputs`` (``case``'s call), also printed: the
    median ms, TFLOP/s by ``FLOPS_CONVENTION``, the peak memory above the inputs; ``status``
    ``oom`` when it ran out of memory."""
    ms, peak = runner.measure(lambda: provider_fn(provider, inputs, mode), device, cpu_repeats)
    flops = 4 * case.B * case.H * case.qlen * case.klen * case.D * (2.5 if mode == "fwd_bwd" else 1)
    tflops = flops / (ms * 1e-3) / 1e12 if ms != runner.OOM else None
    print(f"{dtype_name} D={case.D} mlen={case.mlen:4} L={case.qlen:6} B={case.B:3} {mode:8} {provider:14} "
          + ("OOM" if tflops is None else f"{ms:9.3f} ms {tflops:7.1f} TFLOP/s")
          + (f" peak {peak:,.0f} MiB" if peak is not None else ""), flush=True)
    return {"op": "xlnet_attn", "status": "ok" if tflops is not None else "oom", "provider": provider, "mode": mode,
            "dtype": dtype_name, "B": case.B, "H": case.H, "L": case.qlen, "mlen": case.mlen, "D": case.D, "ms": ms,
            "tflops": tflops, "peak_mem_mb": peak, "tokens_per_s": None, "flops_convention": FLOPS_CONVENTION}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = runner.device_name()
    if args.kernels and device != "cuda":
        return runner.refuse("bench.attention: --kernels needs CUDA (the profiler's GPU activity)")
    with contextlib.ExitStack() as stack:
        if args.configs:
            from bench.compiler import pinned_configs

            try:
                stack.enter_context(pinned_configs.pinned(args.configs))
            except ValueError as exc:
                return runner.refuse(f"bench.attention: --configs: {exc}")
        return _run_sweep(args, device)


def _run_sweep(args, device: str) -> int:
    # without CUDA: the CPU providers, and with --ncu the Triton ones in Triton's interpreter (a rehearsal)
    providers = args.providers if device == "cuda" or (args.ncu and contract.interpreting()) else [
        x for x in args.providers if x in CPU_PROVIDERS]
    plan = _measurements(sweep_cases(args), args.modes, providers)
    if device == "cpu" and not args.ncu:
        refused = _cpu_plan(plan)
        if refused is not None:
            return refused
    env, records, drawn, inputs = runner.environment(), [], None, None
    for dtype_name, case, mode, prov in plan:
        if drawn != case:
            inputs = None  # free the previous case's tensors first
            inputs, drawn = cases.attention_inputs(case, device), case
        why = unavailable(prov, mode, device, case)
        if why:
            print(f"{dtype_name} D={case.D} mlen={case.mlen:4} L={case.qlen:6} B={case.B:3} {mode:8} {prov:14} "
                  f"skipped: {why}", flush=True)
            continue
        if args.ncu:
            profile_once(provider_fn(prov, inputs, mode), device)
            print(f"{dtype_name} D={case.D} mlen={case.mlen:4} L={case.qlen:6} B={case.B:3} {mode:8} {prov:14} "
                  f"profiled once", flush=True)
            continue
        record = {**env, **measure(inputs, case, dtype_name, mode, prov, device)}
        if args.kernels and record["status"] == "ok":
            record.update(kernel_times(inputs, prov, mode))
            print("    " + ", ".join(f"{k['kernel'][:40]} {k['ms_per_call']:.3f} ms" for k in record["kernels"][:4]))
        records.append(record)
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
