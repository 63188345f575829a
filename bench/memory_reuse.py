"""Transformer-XL evaluation with memory against recomputing a sliding context of the same attention
length: the paper's Table 9 ("up to 1,800+ times faster" at attention length 3,800).

    python -m bench.memory_reuse [--size small] [--lengths 128 256 512 1024 2048 3800] [--tgt-len 128]
                                 [--dtype fp32] [--repeats 3] [--threads N]
                                 [--out FILE | --record | --no-record]

At attention length A, on the same model (``TRANSFO_XL_SIZES[size]``, random weights, batch 1):

- memory (Transformer-XL): a segment of ``tgt_len`` tokens (A/2 when A < 2 x tgt_len) with
  ``A - tgt_len`` memory rows per layer scores ``tgt_len`` next tokens (``crit.nll``);
- recompute (the vanilla model evaluated as Al-Rfou et al., the paper's baseline): a forward over the
  A previous tokens, without memory, scores the next token only.

Each is one timed step (steady state: the memory already full) — CUDA-event medians on a GPU, the
median of ``--repeats`` wall-clock calls after a warm-up on a CPU. Tokens/s = tokens scored per
second; ``speedup`` = memory / recompute. One record per length (``op: memory_reuse``), appended to
``--out`` (default: the cache directory, see ``bench.runner``) or with ``--record`` to
bench/results/memory_reuse.json. The eager backend materialises (B, H, M, K) scores: on a CPU the
recompute step at A = 3,800 holds about H x 3,800² x 4 bytes per layer at a time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bench import runner
from bench.generation import DTYPES, build_model

RECORDS = "memory_reuse.json"
LENGTHS = (128, 256, 512, 1024, 2048, 3800)


def segment_split(A: int, tgt_len: int) -> tuple[int, int]:
    """(segment length, memory rows) at attention length ``A``."""
    T = min(tgt_len, A // 2)
    return T, A - T


def _steps(model, A: int, tgt_len: int, device: str) -> dict:
    """``{"memory": step, "recompute": step}`` at attention length ``A`` (inputs drawn once)."""
    c = model.config
    T, M = segment_split(A, tgt_len)
    g = torch.Generator().manual_seed(A)
    ids = torch.randint(0, c.vocab_size, (1, A + 1), generator=g).to(device)
    dtype = next(model.parameters()).dtype
    mems = [torch.randn(M, 1, c.d_model, generator=g).to(device=device, dtype=dtype) for _ in range(c.n_layer)]
    empty = model.init_mems(1, length=0)
    model.reset_memory_length(M)

    @torch.no_grad()
    def memory():
        out = model.transformer(ids[:, A - T:A], mems=mems)
        return model.crit.nll(out.last_hidden_state.reshape(T, -1), ids[0, A - T + 1:A + 1])

    @torch.no_grad()
    def recompute():
        out = model.transformer(ids[:, :A], mems=empty)
        return model.crit.nll(out.last_hidden_state[:, -1], ids[0, A:A + 1])

    return {"memory": memory, "recompute": recompute}


def measure_length(model, size: str, A: int, tgt_len: int, device: str, cpu_repeats: int = runner.CPU_REPEATS) -> dict:
    """One record's fields: both steps' ms and tokens/s at attention length ``A``, and the speedup."""
    steps = _steps(model, A, tgt_len, device)
    T, M = segment_split(A, tgt_len)
    c = model.config
    out = {"size": size, "n_layer": c.n_layer, "d_model": c.d_model, "n_head": c.n_head, "d_head": c.d_head,
           "vocab_size": c.vocab_size, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
           "B": 1, "attention_length": A, "tgt_len": T, "mem_len": M, "backend": c.attn_backend}
    for name, tokens in (("memory", T), ("recompute", 1)):
        ms, peak = runner.measure(lambda: steps[name], device, cpu_repeats)
        out[f"{name}_ms"] = ms
        out[f"{name}_peak_mb"] = peak
        out[f"{name}_tokens_per_s"] = None if ms == runner.OOM else tokens / (ms / 1e3)
    fast, slow = out["memory_tokens_per_s"], out["recompute_tokens_per_s"]
    out["speedup"] = fast / slow if fast and slow else None
    if out["recompute_ms"] == runner.OOM or out["memory_ms"] == runner.OOM:
        out["status"] = "oom"
    return out


def _estimate_s(model, lengths, tgt_len: int, repeats: int) -> float:
    c = model.config
    linear = 2 * c.n_layer * (4 * c.d_model * c.n_head * c.d_head + 2 * c.d_model * c.d_inner)  # per token
    work_linear = work_attn = 0.0
    for A in lengths:
        T, M = segment_split(A, tgt_len)
        work_linear += (repeats + 1) * linear * (A + T + M)
        work_attn += (repeats + 1) * c.n_layer * 6 * c.n_head * c.d_head * (A * A + T * A)
    return (runner.estimate_cpu_seconds([(work_linear, torch.float32)], runner.CPU_EFFICIENCY_MODEL)
            + runner.estimate_cpu_seconds([(work_attn, torch.float32)], runner.CPU_EFFICIENCY_ATTENTION))


def main(argv=None) -> int:
    from xlnet_fast.transfo_xl.config import TRANSFO_XL_SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(TRANSFO_XL_SIZES), default="small", help="model size (default: small)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), metavar="A",
                   help=f"attention lengths (default: {' '.join(map(str, LENGTHS))})")
    p.add_argument("--tgt-len", type=int, default=128, dest="tgt_len", help="segment length (default: 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=runner.CPU_REPEATS, help="timed calls on a CPU (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    runner.add_output_args(p, RECORDS, no_record=True)
    args = p.parse_args(argv)
    if min(args.lengths) < 2 or args.tgt_len < 1 or args.repeats < 1:
        return runner.refuse("bench.memory_reuse: lengths must be >= 2, --tgt-len and --repeats positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = runner.device_name()
    model = build_model("transfo-xl", args.size, device, DTYPES[args.dtype], mem_len=0)
    if device == "cpu":
        runner.announce(f"memory reuse vs recompute, {args.size} Transformer-XL ({model.config.n_layer} layers, "
                        f"d_model {model.config.d_model}) on CPU at attention lengths {args.lengths}: about "
                        f"{runner.duration(_estimate_s(model, args.lengths, args.tgt_len, args.repeats))}")
    records = []
    print(f"{'A':>6} {'tgt':>5} {'mem':>5} {'memory tok/s':>13} {'recompute tok/s':>16} {'speedup':>9}")
    for A in args.lengths:
        rec = {**runner.environment(), "op": "memory_reuse", **measure_length(model, args.size, A, args.tgt_len,
                                                                               device, args.repeats)}
        if device == "cpu":
            rec.update(threads=torch.get_num_threads(), load_average=os.getloadavg())
        records.append(rec)
        fmt = lambda x: "OOM" if x is None else f"{x:,.1f}"  # noqa: E731
        print(f"{A:6} {rec['tgt_len']:5} {rec['mem_len']:5} {fmt(rec['memory_tokens_per_s']):>13} "
              f"{fmt(rec['recompute_tokens_per_s']):>16} {fmt(rec['speedup']):>9}", flush=True)
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
