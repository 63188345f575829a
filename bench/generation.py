"""Generation carried by memory against recomputing the whole context for every token, for
Transformer-XL and XLNet.

    python -m bench.generation [--models transfo-xl xlnet] [--size small] [--lengths 128 512 1024 2048]
                               [--new-tokens 16] [--dtype fp32] [--threads N] [--out FILE | --record | --no-record]

At total length L (prompt L - new tokens, then ``--new-tokens`` greedy tokens, batch 1, random
weights of the same width for both models): ``generate(use_cache=True)`` — each token one forward
over itself (Transformer-XL; XLNet: the last two tokens and the dummy, transformers' scheme)
attending to the memory — against ``use_cache=False``, a forward over the whole sequence per token.
``mem_len`` = L, so the memory holds the whole context: Transformer-XL's tokens are then the same
both ways (``same_tokens``); XLNet's differ by design (its cached rows did not see later tokens).
Tokens/s = the decoding rate after the first token (whose time, the prompt's forward, is recorded
apart): (new tokens - 1) / the time between the first token and the last, taken between the tokens
``xlnet_fast.generation.stream_*`` yields (wall clock, CUDA synchronised), the median of
``--repeats`` runs after a warm-up run. One record per model and length (``op: generation``), appended to
``--out`` (default: the cache directory) or with ``--record`` to bench/results/generation.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench import runner

RECORDS = "generation.json"
LENGTHS = (128, 512, 1024, 2048)
MODELS = ("transfo-xl", "xlnet")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# XLNet widths matching TRANSFO_XL_SIZES (the same layers, d_model, heads and d_inner)
XLNET_SIZES = {"tiny": "tiny", "small": dict(d_model=256, n_layer=4, n_head=4, d_inner=1024, vocab_size=10000),
               "wt103_base": "base"}


def build_model(kind: str, size: str, device: str, dtype: torch.dtype, mem_len: int):
    """A generating model of ``kind`` with random weights, eval mode, no dropout, memory ``mem_len``."""
    import xlnet_fast
    from xlnet_fast.config import MODEL_SIZES
    from xlnet_fast.transfo_xl.config import TRANSFO_XL_SIZES

    torch.manual_seed(0)
    if kind == "transfo-xl":
        config = xlnet_fast.TransfoXLConfig(**TRANSFO_XL_SIZES[size], dropout=0.0, dropatt=0.0, mem_len=mem_len,
                                            same_length=False, clamp_len=-1, mem_start="empty")  # the paper's
        model = xlnet_fast.TransfoXLLMHeadModel(config)
    else:
        dims = XLNET_SIZES[size]
        dims = dict(MODEL_SIZES[dims], vocab_size=32000) if isinstance(dims, str) else dims
        model = xlnet_fast.XLNetLMHeadModel(xlnet_fast.XLNetConfig(**dims, dropout=0.0, mem_len=mem_len))
    return model.to(device=device, dtype=dtype).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_stream(stream, device: str) -> tuple[float, float, torch.Tensor]:
    """(seconds to the first token — the prompt's forward —, seconds of the tokens after it, the
    tokens ``(B, n)``) of a ``xlnet_fast.generation.stream_*`` iterator."""
    _sync(device)
    t0 = time.perf_counter()
    tokens, stamps = [], []
    for token in stream:
        _sync(device)
        stamps.append(time.perf_counter())
        tokens.append(token)
    return stamps[0] - t0, stamps[-1] - stamps[0], torch.stack(tokens, 1)


def measure_length(model, kind: str, size: str, L: int, new_tokens: int, device: str, repeats: int = 1) -> dict:
    """One record's fields: cached and recomputed generation of ``new_tokens`` tokens up to length
    ``L``: the decoding rate after the first token (its median over ``repeats`` runs after a warm-up)."""
    from xlnet_fast.generation import stream_transfo_xl, stream_xlnet

    stream = stream_transfo_xl if kind == "transfo-xl" else stream_xlnet
    c = model.config
    P = L - new_tokens
    prompt = torch.randint(0, c.vocab_size, (1, P), generator=torch.Generator().manual_seed(L)).to(device)
    out = {"model": kind, "size": size, "n_layer": c.n_layer, "d_model": c.d_model, "vocab_size": c.vocab_size,
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "B": 1, "length": L, "prompt": P,
           "new_tokens": new_tokens, "mem_len": c.mem_len, "backend": c.attn_backend}
    results = {}
    for name, use_cache in (("cached", True), ("recompute", False)):
        runs = []
        try:
            for _ in range(1 + repeats):  # a warm-up run first
                runs.append(timed_stream(stream(model, prompt, new_tokens, eos_token_id=None, use_cache=use_cache),
                                         device))
        except torch.OutOfMemoryError:
            out[f"{name}_tokens_per_s"], out["status"] = None, "oom"
            continue
        first_s = statistics.median(r[0] for r in runs[1:])
        rest_s = statistics.median(r[1] for r in runs[1:])
        results[name] = runs[-1][2]
        out.update({f"{name}_first_token_s": first_s, f"{name}_s": first_s + rest_s,
                    f"{name}_tokens_per_s": (new_tokens - 1) / rest_s})
    fast, slow = out.get("cached_tokens_per_s"), out.get("recompute_tokens_per_s")
    out["speedup"] = fast / slow if fast and slow else None
    if len(results) == 2:
        out["same_tokens"] = bool(torch.equal(results["cached"], results["recompute"]))
    return out


def main(argv=None) -> int:
    from xlnet_fast.transfo_xl.config import TRANSFO_XL_SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--size", choices=sorted(set(TRANSFO_XL_SIZES) & set(XLNET_SIZES)), default="small",
                   help="model width (default: small)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), metavar="L",
                   help=f"total lengths, prompt + new tokens (default: {' '.join(map(str, LENGTHS))})")
    p.add_argument("--new-tokens", type=int, default=16, dest="new_tokens", help="tokens generated (default: 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=1, help="timed calls after a warm-up (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    runner.add_output_args(p, RECORDS, no_record=True)
    args = p.parse_args(argv)
    if args.new_tokens < 1 or min(args.lengths) <= args.new_tokens or args.repeats < 1:
        return runner.refuse("bench.generation: --new-tokens and --repeats must be positive, every length above "
                             "--new-tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = runner.device_name()
    runner.announce(f"generation with memory vs recomputing the context: {' and '.join(args.models)}, {args.size}, "
                    f"{args.new_tokens} new tokens at total lengths {args.lengths} on {device}")
    records = []
    print(f"{'model':11} {'L':>6} {'cached tok/s':>13} {'recompute tok/s':>16} {'speedup':>8} same")
    for kind in args.models:
        for L in args.lengths:
            model = build_model(kind, args.size, device, DTYPES[args.dtype], mem_len=L)
            rec = {**runner.environment(), "op": "generation",
                   **measure_length(model, kind, args.size, L, args.new_tokens, device, args.repeats)}
            if device == "cpu":
                rec.update(threads=torch.get_num_threads(), load_average=os.getloadavg())
            records.append(rec)
            fmt = lambda x: "OOM" if x is None else f"{x:,.1f}"  # noqa: E731
            print(f"{kind:11} {L:6} {fmt(rec.get('cached_tokens_per_s')):>13} "
                  f"{fmt(rec.get('recompute_tokens_per_s')):>16} {fmt(rec['speedup']):>8} {rec.get('same_tokens')}",
                  flush=True)
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
