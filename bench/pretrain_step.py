"""One XLNet two-stream pretraining step, xlnet_fast against transformers, same weights and inputs.

    python -m bench.pretrain_step [--config base|large] [--B 8] [--seq 512] [--mem 384] [--predict 85]

Forward + backward + AdamW step of ``XLNetLMHeadModel`` with mems, a permutation mask and
``num_predict`` targets, bf16 autocast on CUDA (fp32 on CPU, where it is a smoke test). xlnet_fast gets
compact ranks and target positions (query stream on the targets only, both streams in one launch);
transformers gets the equivalent dense ``perm_mask`` and one-hot ``target_mapping``. Reports tokens/s
(B·seq per step, median of timed steps) and peak memory; appends ``{"op": "pretrain_step", ...}``
records to ``bench/results/pretrain_step.json``.
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
from xlnet_fast.masks import local_perm

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pretrain_step.json"
CONFIGS = {"base": dict(d_model=768, n_layer=12, n_head=12, d_inner=3072),
           "large": dict(d_model=1024, n_layer=24, n_head=16, d_inner=4096),
           "mini": dict(d_model=128, n_layer=2, n_head=4, d_inner=256)}


def make_batch(B, seq, predict, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(9, vocab, (B, seq), generator=g)
    q_ranks, k_ranks, targets = [], [], []
    for b in range(B):
        masked = torch.zeros(seq, dtype=torch.bool)
        masked[torch.randperm(seq, generator=g)[:predict]] = True
        q, k, t = local_perm(ids[b], masked, seq, sep_id=4, cls_id=3, generator=g)
        q_ranks.append(q)
        k_ranks.append(k)
        targets.append(t.nonzero().flatten())
    target_pos = torch.stack(targets)
    q_rank, k_rank = torch.stack(q_ranks), torch.stack(k_ranks)
    perm_mask = (q_rank[:, :, None] <= k_rank[:, None, :]).float()
    target_mapping = torch.zeros(B, predict, seq).scatter_(2, target_pos[..., None], 1.0)
    labels = ids.gather(1, target_pos)
    to = lambda x: x.to(device)  # noqa: E731
    return dict(ids=to(ids), q_rank=to(q_rank), k_rank=to(k_rank), target_pos=to(target_pos),
                perm_mask=to(perm_mask), target_mapping=to(target_mapping), labels=to(labels))


def step_fn(provider, model, batch, mems, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = device == "cuda"

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            if provider == "xlnet_fast":
                out = model(batch["ids"], q_rank=batch["q_rank"], k_rank=batch["k_rank"],
                            target_pos=batch["target_pos"], mems=mems, labels=batch["labels"], use_mems=True)
            else:
                out = model(batch["ids"], perm_mask=batch["perm_mask"], target_mapping=batch["target_mapping"],
                            mems=mems, labels=batch["labels"], use_mems=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="base")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mem", type=int, default=384)
    p.add_argument("--predict", type=int, default=85)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--providers", nargs="+", default=["xlnet_fast", "hf"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(vocab_size=32000, **CONFIGS[args.config], dropout=0.1, mem_len=args.mem, reuse_len=args.seq // 2)
    torch.manual_seed(0)
    hf = transformers.XLNetLMHeadModel(transformers.XLNetConfig(**cfg)).to(device).train()
    batch = make_batch(args.B, args.seq, args.predict, cfg["vocab_size"], device)
    mems = [torch.randn(args.mem, args.B, cfg["d_model"], device=device) for _ in range(cfg["n_layer"])]
    records = []
    for provider in args.providers:
        if provider == "xlnet_fast":
            model = xlnet_fast.from_hf(hf, backend="auto").train()
        else:
            model = hf
        step = step_fn(provider, model, batch, mems, device)
        try:
            for _ in range(2):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
            tps = args.B * args.seq / (ms / 1e3)
        except torch.OutOfMemoryError:
            ms, peak, tps = "OOM", None, None
        if model is not hf:
            del model
        rec = {**environment(), "op": "pretrain_step",
               "provider": provider, "mode": "fwd_bwd", "dtype": "bf16" if device == "cuda" else "fp32",
               "config": args.config, "B": args.B, "H": cfg["n_head"], "L": args.seq, "mlen": args.mem,
               "D": cfg["d_model"] // cfg["n_head"], "num_predict": args.predict, "ms": ms, "tflops": None,
               "peak_mem_mb": peak, "tokens_per_s": tps}
        records.append(rec)
        print(f"{args.config} B={args.B} seq={args.seq} mem={args.mem} {provider:11} "
              f"{ms if ms == 'OOM' else f'{ms:9.1f} ms'}  {tps and f'{tps:,.0f} tokens/s'}  peak {peak} MB")
    if not args.no_record:
        append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
