"""One XLNet two-stream pretraining step, xlnet_fast against transformers, same weights and inputs.

    python -m bench.pretrain_step [--config base|large|tiny] [--B 8] [--seq 512] [--mem 384] [--predict 85]
                                  [--out FILE | --record]

Forward + backward + AdamW step of ``XLNetLMHeadModel`` with mems, a permutation mask and
``num_predict`` targets, bf16 autocast on CUDA (fp32 on CPU, where it is a smoke test). xlnet_fast gets
compact ranks and target positions (query stream on the targets only, both streams in one launch);
transformers gets the equivalent dense ``perm_mask`` and one-hot ``target_mapping``. Reports tokens/s
(B·seq per step, median of timed steps) and peak memory; appends ``{"op": "pretrain_step", ...}``
records to ``--out`` (default: the cache directory, see ``bench.runner``), or with ``--record`` to
``bench/results/pretrain_step.json``. Model sizes are ``xlnet_fast.config.MODEL_SIZES`` (``mini`` is
the old name of ``tiny``). On CPU it says how long the run will take and refuses one estimated above
10 minutes (``--config tiny`` is quick).
"""

from __future__ import annotations

import argparse
import sys

import torch

import xlnet_fast
from bench import cases, runner
from xlnet_fast.config import MODEL_SIZES

RECORDS = "pretrain_step.json"
SIZE_ALIASES = {"mini": "tiny"}  # the name this script used before MODEL_SIZES
WARMUP_STEPS = 2


def step_fn(provider, model, batch, device):
    """One forward + backward + AdamW step of ``provider`` (``xlnet_fast``: compact ranks and
    target positions; ``hf``: dense ``perm_mask`` and ``target_mapping``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = device == "cuda"

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            if provider == "xlnet_fast":
                out = model(batch["ids"], q_rank=batch["q_rank"], k_rank=batch["k_rank"],
                            target_pos=batch["target_pos"], mems=batch["mems"], labels=batch["labels"],
                            use_mems=True)
            else:
                out = model(batch["ids"], perm_mask=batch["perm_mask"], target_mapping=batch["target_mapping"],
                            mems=batch["mems"], labels=batch["labels"], use_mems=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss
    return step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(MODEL_SIZES) + sorted(SIZE_ALIASES), default="base",
                   help="model size (mini: old name of tiny)")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mem", type=int, default=384)
    p.add_argument("--predict", type=int, default=85)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--providers", nargs="+", default=["xlnet_fast", "hf"], choices=["xlnet_fast", "hf"])
    runner.add_output_args(p, RECORDS, no_record=True)
    return p


def time_provider(step, device: str, repeats: int) -> tuple:
    """``(median ms, peak MiB)`` of ``step`` after ``WARMUP_STEPS``, or ``("OOM", None)``."""
    try:
        for _ in range(WARMUP_STEPS):
            step()
        with runner.PeakMemory(device) as peak:
            ms = runner.wall_median_ms(step, device, warmup=0, repeats=repeats)
        return ms, peak.mb
    except torch.OutOfMemoryError:
        return runner.OOM, None


def hf_model_and_batch(case: cases.ModelCase, device: str):
    """transformers' ``XLNetLMHeadModel`` for ``case`` (seed 0, dropout 0.1, training mode) and one
    pretraining batch; both providers start from these weights."""
    import transformers

    torch.manual_seed(0)
    config = transformers.XLNetConfig(**case.config(dropout=0.1, reuse_len=case.seq // 2))
    hf = transformers.XLNetLMHeadModel(config).to(device).train()
    return hf, cases.pretraining_batch(case, device)


def measure_provider(provider: str, case: cases.ModelCase, hf, batch, device: str, repeats: int) -> dict:
    """One ``pretrain_step`` record (without the environment) of ``provider`` on ``hf``'s weights, also
    printed; ``status`` ``oom`` when it ran out of memory."""
    model = xlnet_fast.from_hf(hf, backend="auto").train() if provider == "xlnet_fast" else hf
    try:
        ms, peak = time_provider(step_fn(provider, model, batch, device), device, repeats)
    finally:
        del model
    dims = case.dims
    tps = case.B * case.seq / (ms / 1e3) if ms != runner.OOM else None
    print(f"{case.size} ({dims['n_layer']} layers) B={case.B} seq={case.seq} mem={case.mlen} {provider:11} "
          + ("OOM" if tps is None else f"{ms:9.1f} ms {tps:10,.0f} tokens/s")
          + (f" peak {peak:,.0f} MiB" if peak is not None else ""), flush=True)
    return {"op": "pretrain_step", "status": "ok" if tps is not None else "oom", "provider": provider,
            "mode": "fwd_bwd", "dtype": "bf16" if device == "cuda" else "fp32", "config": case.size,
            "n_layer": dims["n_layer"], "B": case.B, "H": dims["n_head"], "L": case.seq, "mlen": case.mlen,
            "D": dims["d_model"] // dims["n_head"], "num_predict": case.predict, "ms": ms, "tflops": None,
            "peak_mem_mb": peak, "tokens_per_s": tps}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    size = SIZE_ALIASES.get(args.config, args.config)
    case = cases.ModelCase(size, args.B, args.seq, mlen=args.mem, predict=args.predict)
    device = runner.device_name()
    if device == "cpu":
        steps = (WARMUP_STEPS + args.repeats) * len(args.providers)
        seconds = runner.estimate_cpu_seconds([(case.flops("fwd_bwd", lm_head=True) * steps, torch.float32)],
                                              runner.CPU_EFFICIENCY_MODEL)
        runner.announce(f"no CUDA device: {len(args.providers)} providers x {WARMUP_STEPS + args.repeats} fp32 "
                        f"training steps of XLNet-{size} (B={args.B}, seq {args.seq}) on CPU, a smoke test: "
                        f"about {runner.duration(seconds)}")
        if seconds > runner.CPU_LIMIT_S:
            return runner.refuse(f"bench.pretrain_step: this would take about {runner.duration(seconds)} on this "
                                 "CPU; try --config tiny --B 2 --seq 128 --mem 64 --predict 20")
    hf, batch = hf_model_and_batch(case, device)
    records = [{**runner.environment(), **measure_provider(provider, case, hf, batch, device, args.repeats)}
               for provider in args.providers]
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
