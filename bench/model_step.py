"""XLNet's training step and inference forward: transformers against xlnet_fast, same weights and batch.

    python -m bench.model_step [--config base|large|tiny] [--modes train infer]
                               [--providers hf patched native native-graphed native-compiled] [--B 8]
                               [--seq 512]
                               [--mem 384] [--predict 85] [--infer-B 32] [--vocab 32000] [--repeats 10]
                               [--out FILE | --record | --no-record]

Providers, all on transformers' ``XLNetLMHeadModel``'s weights: ``hf`` (transformers itself, with the
dense ``perm_mask`` and one-hot ``target_mapping``), ``patched`` (a copy of it after
``patch_transformers``, the same dense inputs: a drop-in user), ``native`` (``from_hf``, with compact
ranks and target positions: what ``xlnet-fast pretrain`` runs), ``native-graphed`` (the same step
captured in one CUDA graph and replayed: no host work per launch; CUDA only, run by default there)
and ``native-compiled`` (the same under ``torch.compile``: inductor on CUDA, ``aot_eager`` on CPU;
``patched-compiled`` likewise, on request).

``train``: forward + backward + AdamW with mems, ``--predict`` targets per row, dropout 0.1, bf16
autocast on CUDA (fp32 on CPU, a smoke test). ``infer``: the backbone's forward (``XLNetModel``)
without grad on ``--infer-B`` rows of ``--seq`` tokens, each left-padded to a random length in
[seq/2, seq] (``attention_mask``), no memory, no targets. Per provider: median ms, tokens/s, peak
memory, MFU (against the device's dense bf16 peak, ``xlnet_fast.pretrain.flops``; none on CPU) and the
speedup over ``hf``; appends ``{"op": "model_step", ...}`` records to ``--out`` (default: the cache
directory, see ``bench.runner``), with ``--record`` to ``bench/results/model_step.json``. Model sizes
are ``xlnet_fast.config.MODEL_SIZES``. On CPU it says how long the run will take and refuses one
estimated above 10 minutes (``--config tiny`` is quick). The GPU campaign runs it (``model_step``).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import xlnet_fast
from bench import cases, runner
from xlnet_fast.config import MODEL_SIZES
from xlnet_fast.pretrain import flops

RECORDS = "model_step.json"
SIZE_ALIASES = {"mini": "tiny"}  # the name bench.pretrain_step, this script's predecessor, used
PROVIDERS = ("hf", "patched", "native", "native-graphed", "native-compiled", "patched-compiled")
DEFAULT_PROVIDERS = ("hf", "patched", "native", "native-compiled")
# on CUDA also the captured step: the H100's eager steps waited on the host (~40 us a launch), the GPU
# busy a third of the native step (bench/NOTES.md, "H100 after the packed key fields")
GPU_PROVIDERS = ("hf", "patched", "native", "native-graphed", "native-compiled")
MODES = ("train", "infer")
WARMUP_STEPS = 3  # compiles (torch.compile, triton), autotunes and binds the launches


def source_model(case: cases.ModelCase, device: str = "cpu"):
    """transformers' ``XLNetLMHeadModel`` for ``case`` on the CPU (seed 0, dropout 0.1): every
    provider's weights; on ``"meta"``, the same model without weights (``bench.campaign``'s compile step)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.XLNetConfig(**case.config(dropout=0.1, reuse_len=case.seq // 2))
    with torch.device(device):
        model = transformers.XLNetLMHeadModel(config)
    return model.to(device).train()  # transformers makes some of XLNet's weights on the CPU regardless


def provider_model(provider: str, source, device: str):
    """``provider``'s model on ``device`` with ``source``'s weights (uncompiled), in training mode."""
    if provider == "hf":
        return copy.deepcopy(source).to(device)
    if provider.startswith("patched"):
        return xlnet_fast.patch_transformers(copy.deepcopy(source).to(device))
    return xlnet_fast.from_hf(source, backend="auto").to(device).train()


def _compiled(provider: str, module, device: str):
    """``module`` under torch.compile for the ``-compiled`` providers (inductor on CUDA)."""
    if not provider.endswith("-compiled"):
        return module
    return torch.compile(module, backend="inductor" if device == "cuda" else "aot_eager")


def _graphed(work, warmup: int = WARMUP_STEPS):
    """``work`` (a step that leaves its results in the same tensors each time: the batch is fixed)
    captured in one CUDA graph at the first call, after ``warmup`` eager runs on a side stream
    (compiles, autotuning, launch binding: none of it may happen while capturing), then replayed."""
    graph = None

    def step():
        nonlocal graph
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    work(capturing=False)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                work(capturing=True)
        graph.replay()
    return step


def _autocast(device: str, autocast: bool | None, graphed: bool):
    """bf16 autocast, by default on any device but the CPU (whose steps are smoke tests in fp32)."""
    # autocast's weight cache must be off under capture (its casts would not be replayed)
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device != "cpu" if autocast is None else autocast,
                          cache_enabled=not graphed)


def train_step(provider: str, model, batch: dict, device: str, autocast: bool | None = None):
    """One forward + backward + AdamW step of ``model`` (``native``: compact ranks and target
    positions; the others transformers' dense ``perm_mask`` and ``target_mapping``) under bf16
    ``autocast`` (default: off the CPU); ``-graphed``: the whole step in one CUDA graph (AdamW
    ``capturable``; the gradients the graph's own, written by each replay's backward)."""
    graphed = provider.endswith("-graphed")
    if graphed and device != "cuda":
        raise ValueError(f"provider {provider!r} captures CUDA graphs: it needs a CUDA device")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda", capturable=graphed)
    run = _compiled(provider, model.train(), device)
    if provider.startswith("native"):
        masks = dict(q_rank=batch["q_rank"], k_rank=batch["k_rank"], target_pos=batch["target_pos"])
    else:
        masks = dict(perm_mask=batch["perm_mask"], target_mapping=batch["target_mapping"])

    def work(capturing: bool = False):
        with _autocast(device, autocast, graphed):
            out = run(batch["ids"], mems=batch["mems"], labels=batch["labels"], use_mems=True, **masks)
        out.loss.backward()
        opt.step()
        if not capturing:  # the graph keeps the gradients it allocated: replays write them anew
            opt.zero_grad(set_to_none=True)
    return _graphed(work) if graphed else work


def infer_batch(case: cases.ModelCase, B: int, device: str) -> dict:
    """``B`` rows of ``case.seq`` token ids, each left-padded (XLNet's side) to a random length in
    [seq/2, seq], with their ``attention_mask`` (1 = token)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.randint(cases.FIRST_ORDINARY_ID, case.vocab, (B, case.seq), generator=g)
    lengths = torch.randint(case.seq // 2, case.seq + 1, (B,), generator=g)
    mask = (torch.arange(case.seq)[None, :] >= case.seq - lengths[:, None]).long()
    return {"ids": ids.to(device), "attention_mask": mask.to(device)}


def infer_step(provider: str, model, batch: dict, device: str, autocast: bool | None = None):
    """The backbone's forward (``XLNetModel``, in eval mode) without grad under bf16 ``autocast``
    (default: off the CPU; ``-graphed``: in one CUDA graph)."""
    graphed = provider.endswith("-graphed")
    if graphed and device != "cuda":
        raise ValueError(f"provider {provider!r} captures CUDA graphs: it needs a CUDA device")
    run = _compiled(provider, model.transformer.eval(), device)

    def work(capturing: bool = False):
        with torch.no_grad(), _autocast(device, autocast, graphed):
            run(batch["ids"], attention_mask=batch["attention_mask"], use_mems=False)
    return _graphed(work) if graphed else work


def time_step(step, device: str, repeats: int) -> tuple:
    """``(median ms, peak MiB)`` of ``step`` after ``WARMUP_STEPS``, or ``("OOM", None)``."""
    try:
        for _ in range(WARMUP_STEPS):
            step()
        with runner.PeakMemory(device) as peak:
            ms = runner.wall_median_ms(step, device, warmup=0, repeats=repeats)
        return ms, peak.mb
    except torch.OutOfMemoryError:
        return runner.OOM, None


def step_flops(case: cases.ModelCase, mode: str, B: int) -> int:
    """Model FLOPs of one step (``xlnet_fast.pretrain.flops``): a training step, or the backbone's
    forward over B rows without memory or targets."""
    d = case.dims
    shape = flops.StepShape(d_model=d["d_model"], n_layer=d["n_layer"], n_head=d["n_head"],
                            d_head=d["d_model"] // d["n_head"], d_inner=d["d_inner"], vocab_size=case.vocab,
                            seq_len=case.seq, mem_len=case.mlen if mode == "train" else 0,
                            num_predict=case.predict if mode == "train" else 0, rows=B)
    return flops.training_flops_per_step(shape) if mode == "train" else flops.forward_flops_per_batch(shape)


def measure(mode: str, provider: str, case: cases.ModelCase, model, batch: dict, device: str, repeats: int,
            B: int) -> dict:
    """One ``model_step`` record (without the environment) of ``provider``'s ``model``, also printed;
    ``status`` ``oom`` when it ran out of memory."""
    step = train_step(provider, model, batch, device) if mode == "train" else infer_step(provider, model, batch, device)
    ms, peak = time_step(step, device, repeats)
    ok = ms != runner.OOM
    # on CUDA, one more step under the profiler: the GPU's busy time and the host's waits beside the
    # wall time say whether the step waits on the GPU or on the host
    profiled = runner.gpu_profile(step) if ok and device == "cuda" else {}
    tps = B * case.seq / (ms / 1e3) if ok else None
    peak_tflops, _ = flops.device_peak_tflops(torch.device(device))
    mfu = step_flops(case, mode, B) / (ms / 1e3) / (peak_tflops * 1e12) if ok and peak_tflops else None
    dims, mlen = case.dims, case.mlen if mode == "train" else 0
    print(f"{mode:5} {case.size} ({dims['n_layer']} layers) B={B} seq={case.seq} mem={mlen} {provider:16} "
          + ("OOM" if not ok else f"{ms:9.1f} ms {tps:10,.0f} tokens/s")
          + (f" peak {peak:,.0f} MiB" if peak is not None else "") + (f" MFU {mfu:.1%}" if mfu else "")
          + (f" GPU {profiled['gpu_ms_per_call']:.1f} ms in {profiled['launches_per_call']:,.0f} launches, "
             f"{profiled['host_waits_per_call']} host waits, host {profiled['host_ms_per_call']:.1f} ms"
             if profiled else ""), flush=True)
    return {"op": "model_step", "status": "ok" if ok else "oom", "mode": mode, "provider": provider,
            "dtype": "bf16" if device == "cuda" else "fp32", "config": case.size, "n_layer": dims["n_layer"], "B": B,
            "H": dims["n_head"], "L": case.seq, "mlen": mlen, "num_predict": case.predict if mode == "train" else 0,
            "ms": ms, "tokens_per_s": tps, "peak_mem_mb": peak, "mfu": mfu,
            "gpu_ms": profiled.get("gpu_ms_per_call"), "launches": profiled.get("launches_per_call"),
            "host_waits": profiled.get("host_waits_per_call"), "host_ms": profiled.get("host_ms_per_call")}


def measure_provider(provider: str, case: cases.ModelCase, source, batches: dict, device: str, repeats: int,
                     infer_B: int) -> list[dict]:
    """The records of ``provider`` in each mode of ``batches`` ({mode: batch}); its model alone on
    the device (built from ``source``, freed after)."""
    model = provider_model(provider, source, device)
    try:
        return [measure(mode, provider, case, model, batch, device, repeats, case.B if mode == "train" else infer_B)
                for mode, batch in batches.items()]
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def with_speedups(records: list[dict]) -> list[dict]:
    """Each record with ``speedup_vs_hf`` and ``memory_vs_hf`` against the ``hf`` record of its mode."""
    hf = {r["mode"]: r for r in records if r["provider"] == "hf" and r["status"] == "ok"}
    for r in records:
        base = hf.get(r["mode"])
        ok = base is not None and r["status"] == "ok"
        r["speedup_vs_hf"] = base["ms"] / r["ms"] if ok else None
        r["memory_vs_hf"] = r["peak_mem_mb"] / base["peak_mem_mb"] if ok and r["peak_mem_mb"] and base["peak_mem_mb"] \
            else None
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(MODEL_SIZES) + sorted(SIZE_ALIASES), default="base",
                   help="model size (mini: old name of tiny)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS,
                   help=f"default: {' '.join(GPU_PROVIDERS)} on CUDA, {' '.join(DEFAULT_PROVIDERS)} on CPU")
    p.add_argument("--B", type=int, default=8, help="training rows")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mem", type=int, default=384)
    p.add_argument("--predict", type=int, default=85)
    p.add_argument("--infer-B", type=int, default=32, help="inference rows")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (XLNet's: 32000)")
    p.add_argument("--repeats", type=int, default=10)
    runner.add_output_args(p, RECORDS, no_record=True)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    size = SIZE_ALIASES.get(args.config, args.config)
    case = cases.ModelCase(size, args.B, args.seq, mlen=args.mem, predict=args.predict, vocab=args.vocab)
    device = runner.device_name()
    args.providers = args.providers or list(GPU_PROVIDERS if device == "cuda" else DEFAULT_PROVIDERS)
    graphed = [p for p in args.providers if p.endswith("-graphed")]
    if graphed and device != "cuda":
        return runner.refuse(f"bench.model_step: {', '.join(graphed)} captures CUDA graphs and needs a CUDA device")
    if device == "cpu":
        steps = (WARMUP_STEPS + args.repeats) * len(args.providers)
        work = [(case.flops("fwd_bwd", lm_head=True) * steps, torch.float32)] if "train" in args.modes else []
        if "infer" in args.modes:
            infer_case = cases.ModelCase(size, args.infer_B, args.seq, vocab=args.vocab)
            work.append((infer_case.flops("fwd") * steps, torch.float32))
        seconds = runner.estimate_cpu_seconds(work, runner.CPU_EFFICIENCY_MODEL)
        runner.announce(f"no CUDA device: {len(args.providers)} providers x {WARMUP_STEPS + args.repeats} fp32 steps "
                        f"of XLNet-{size} on CPU, a smoke test: about {runner.duration(seconds)}")
        if seconds > runner.CPU_LIMIT_S:
            return runner.refuse(f"bench.model_step: this would take about {runner.duration(seconds)} on this CPU; "
                                 "try --config tiny --B 2 --seq 128 --mem 64 --predict 20 --infer-B 2")
    source = source_model(case)
    batches = {mode: cases.pretraining_batch(case, device) if mode == "train" else infer_batch(case, args.infer_B, device)
               for mode in args.modes}
    records = [r for provider in args.providers
               for r in measure_provider(provider, case, source, batches, device, args.repeats, args.infer_B)]
    records = [{**runner.environment(), **r} for r in with_speedups(records)]
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
