"""CPU: our eager XLNet against transformers' at the same shape, side by side in one process.

    python -m bench.cpu_vs_hf [--seq 512] [--layers 12] [--repeats 5] [--head model|lm]

Base width (d_model 768, 12 heads, d_inner 3072), batch 1, fp32, same weights. ``--head model``
(default) times the backbone ``XLNetModel``; ``--head lm`` adds the 32k-vocab LM head, whose
logits (identical work in both) then dominate the peak memory. Times forward and
forward+backward (median of interleaved repeats) and the peak resident-memory growth of one step
(VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS before the step). glibc is told to
return large blocks to the OS at once (MALLOC_MMAP_THRESHOLD_), so freed memory does not hide a peak;
the script re-executes itself with that setting. Appends a record to bench/results/cpu_vs_hf.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
RESULTS = Path(__file__).resolve().parent / "results" / "cpu_vs_hf.json"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(step):
    """(seconds, peak growth MiB) of one call of ``step``."""
    import gc

    gc.collect()
    _reset_peak()
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    step()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return dt, (peak - base) / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--head", choices=["model", "lm"], default="model")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    args = p.parse_args(argv)

    if any(os.environ.get(k) != v for k, v in _ENV.items()):
        os.execve(sys.executable, [sys.executable, "-m", "bench.cpu_vs_hf", *sys.argv[1:]],
                  {**os.environ, **_ENV})

    import torch
    import transformers

    import xlnet_fast

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(vocab_size=32000, d_model=768, n_layer=args.layers, n_head=12, d_inner=3072,
               dropout=0.0, mem_len=0)
    torch.manual_seed(0)
    cls = "XLNetLMHeadModel" if args.head == "lm" else "XLNetModel"
    hf = getattr(transformers, cls)(transformers.XLNetConfig(**cfg)).eval()
    ours = getattr(xlnet_fast, cls)(xlnet_fast.XLNetConfig(**cfg, attn_backend="eager")).eval()
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(9, 32000, (1, args.seq))
    with torch.no_grad():
        err = float((ours(ids)[0] - hf(ids)[0]).abs().max())

    def fwd(model):
        def step():
            with torch.no_grad():
                model(ids, use_mems=False)
        return step

    def fwd_bwd(model):
        def step():
            out = model(ids, use_mems=False)[0]
            out.float().pow(2).mean().backward()
            model.zero_grad(set_to_none=True)
        return step

    results = {}
    for mode, make in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        steps = {"hf": make(hf), "xlnet_fast": make(ours)}
        for s in steps.values():  # warm-up
            s()
        samples = {k: [] for k in steps}
        for _ in range(args.repeats):
            for k, s in steps.items():  # interleaved, so drift hits both
                samples[k].append(measure(s))
        for k, v in samples.items():
            results[(k, mode)] = (statistics.median(t for t, _ in v), statistics.median(m for _, m in v))

    print(f"{cls}, d_model 768, {args.layers} layers, batch 1, seq {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads; max |output diff| = {err:.2e}")
    print(f"{'mode':8} {'hf ms':>10} {'ours ms':>10} {'time ratio':>10} {'hf MiB':>9} {'ours MiB':>9} {'mem ratio':>9}")
    record = {
        "op": "cpu_model_vs_hf", "model": cls, "device": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
        "d_model": 768, "n_layer": args.layers, "B": 1, "L": args.seq, "dtype": "float32",
        "repeats": args.repeats, "max_abs_output_diff": err, "modes": {},
    }
    for mode in ("fwd", "fwd_bwd"):
        (th, mh), (to, mo) = results[("hf", mode)], results[("xlnet_fast", mode)]
        print(f"{mode:8} {th * 1e3:10.1f} {to * 1e3:10.1f} {to / th:10.3f} {mh:9.1f} {mo:9.1f} {mo / mh:9.3f}")
        record["modes"][mode] = {"hf_ms": th * 1e3, "xlnet_fast_ms": to * 1e3, "time_ratio": to / th,
                                 "hf_peak_growth_mb": mh, "xlnet_fast_peak_growth_mb": mo,
                                 "mem_ratio": mo / mh}
    if not args.no_record:
        from bench.records import append_records

        append_records(RESULTS, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
