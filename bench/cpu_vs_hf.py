"""CPU: our eager XLNet against transformers' at the same shape, side by side in one process.

    python -m bench.cpu_vs_hf [--seq 512] [--layers 12] [--repeats 5] [--head model|lm] [--size base]
                              [--out FILE | --record | --no-record]

Base width (d_model 768, 12 heads, d_inner 3072; ``--size`` from ``xlnet_fast.config.MODEL_SIZES``),
batch 1, fp32, same weights. ``--head model``
(default) times the backbone ``XLNetModel``; ``--head lm`` adds the 32k-vocab LM head, whose
logits (identical work in both) then dominate the peak memory. Times forward and
forward+backward (median of interleaved repeats) and the peak resident-memory growth of one step
(VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS before the step). glibc is told to
return large blocks to the OS at once (MALLOC_MMAP_THRESHOLD_), so freed memory does not hide a peak;
the script re-executes itself with that setting. It says at the start how long it will take
(estimated from the work and this CPU's matmul rate). Appends a record to ``--out`` (default: the
cache directory, see ``bench.runner``), or with ``--record`` to bench/results/cpu_vs_hf.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from xlnet_fast.config import MODEL_SIZES

_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
RECORDS = "cpu_vs_hf.json"
MODES = ("fwd", "fwd_bwd")


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


def build_parser() -> argparse.ArgumentParser:
    from bench import runner

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--head", choices=["model", "lm"], default="model")
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="base", help="model width")
    runner.add_output_args(p, RECORDS, no_record=True)
    return p


def _steps(model, ids) -> dict:
    """``{mode: step}``: a forward without grad, and a forward + backward of a scalar loss."""
    import torch

    def fwd():
        with torch.no_grad():
            model(ids, use_mems=False)

    def fwd_bwd():
        out = model(ids, use_mems=False)[0]
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def compare(models: dict, ids, repeats: int) -> dict:
    """``{(name, mode): (median s, median peak growth MiB)}``; each mode warmed up once, then the
    models' steps interleaved ``repeats`` times so drift hits both."""
    results = {}
    for mode in MODES:
        steps = {name: _steps(model, ids)[mode] for name, model in models.items()}
        for s in steps.values():  # warm-up
            s()
        samples = {k: [] for k in steps}
        for _ in range(repeats):
            for k, s in steps.items():
                samples[k].append(measure(s))
        for k, v in samples.items():
            results[(k, mode)] = (statistics.median(t for t, _ in v), statistics.median(m for _, m in v))
    return results


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if any(os.environ.get(k) != v for k, v in _ENV.items()):
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", "bench.cpu_vs_hf", *argv], {**os.environ, **_ENV})

    import torch
    import transformers

    import xlnet_fast
    from bench import cases, runner

    if args.threads:
        torch.set_num_threads(args.threads)
    case = cases.ModelCase(args.size, B=1, seq=args.seq, n_layer=args.layers)
    lm = args.head == "lm"
    work = 2 * (case.flops("fwd", lm_head=lm) + (1 + args.repeats) * sum(case.flops(m, lm_head=lm) for m in MODES))
    seconds = runner.estimate_cpu_seconds([(work, torch.float32)], runner.CPU_EFFICIENCY_MODEL)
    runner.announce(f"timing transformers' and our XLNet ({args.size} width, {args.layers} layers, seq {args.seq}) on "
                    f"CPU, forward and forward+backward, {args.repeats} interleaved repeats after a warm-up: "
                    f"about {runner.duration(seconds)}")
    cfg = case.config(dropout=0.0)
    torch.manual_seed(0)
    cls = "XLNetLMHeadModel" if lm else "XLNetModel"
    hf = getattr(transformers, cls)(transformers.XLNetConfig(**cfg)).eval()
    ours = getattr(xlnet_fast, cls)(xlnet_fast.XLNetConfig(**cfg, attn_backend="eager")).eval()
    ours.load_hf_state_dict(hf.state_dict())
    ids = cases.token_ids(case)
    with torch.no_grad():
        err = float((ours(ids)[0] - hf(ids)[0]).abs().max())
    results = compare({"hf": hf, "xlnet_fast": ours}, ids, args.repeats)

    d_model = case.dims["d_model"]
    print(f"{cls}, d_model {d_model}, {args.layers} layers, batch 1, seq {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads; max |output diff| = {err:.2e}")
    print(f"{'mode':8} {'hf ms':>10} {'ours ms':>10} {'time ratio':>10} {'hf MiB':>9} {'ours MiB':>9} {'mem ratio':>9}")
    record = {
        **runner.environment(), "op": "cpu_model_vs_hf", "model": cls,
        "device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "d_model": d_model, "n_layer": args.layers, "B": 1, "L": args.seq, "dtype": "float32",
        "repeats": args.repeats, "max_abs_output_diff": err, "modes": {},
    }
    for mode in MODES:
        (th, mh), (to, mo) = results[("hf", mode)], results[("xlnet_fast", mode)]
        mem_ratio = mo / mh if mh > 0 else None  # a step too small to grow the process has no ratio
        print(f"{mode:8} {th * 1e3:10.1f} {to * 1e3:10.1f} {to / th:10.3f} {mh:9.1f} {mo:9.1f} "
              + ("        -" if mem_ratio is None else f"{mem_ratio:9.3f}"))
        record["modes"][mode] = {"hf_ms": th * 1e3, "xlnet_fast_ms": to * 1e3, "time_ratio": to / th,
                                 "hf_peak_growth_mb": mh, "xlnet_fast_peak_growth_mb": mo, "mem_ratio": mem_ratio}
    runner.write_records(args, RECORDS, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
