"""GPU correctness check of the fused kernels at realistic shapes, against float64.

    python -m bench.gpu_check [--long] [--out FILE | --record]

For bf16 and fp16: the Triton backend (forward and backward) against the eager backend run in
float64 on the same inputs, relative-norm errors of the output and of all eight gradients (the largest
is recorded), and whether they are within the test suite's tolerance (1e-2, or 3x the eager
backend's own error at the same dtype). Cases (``CASES``): content stream with memory, rank mask and
segments (B=8, H=16, qlen=512, mlen=384, D=64); the query stream's 85 target rows in one launch with
the content rows, also with the deterministic backward (bf16); D=128 (bf16); with ``--long`` also
qlen=4096 (B=1), content and two-stream with 683 targets. Appends ``{"op": "xlnet_attn_check", ...}``
records to ``--out`` (default: the cache directory, see ``bench.runner``), or with ``--record`` to
``bench/results/gpu_check.json``. Without CUDA it refuses (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

from bench import cases, runner

RECORDS = "gpu_check.json"
CHECKED_DTYPES = (torch.bfloat16, torch.float16)
# (name, case, dtypes, deterministic backward): the inputs are drawn in float64 and cast to each dtype
_REALISTIC = cases.AttentionCase(B=8, H=16, qlen=512, mlen=384, D=64, dtype=torch.float64)
_TWO_STREAM = dataclasses.replace(_REALISTIC, targets=85, two_stream=True)
_LONG = dataclasses.replace(_REALISTIC, B=1, qlen=4096)
# (the deterministic backward before fp16's two streams: a time box cuts the last first)
CASES = [("content_mem384_rank_seg", _REALISTIC, CHECKED_DTYPES, False),
         ("two_stream_85_targets", _TWO_STREAM, (torch.bfloat16,), False),
         ("two_stream_85_targets", _TWO_STREAM, (torch.bfloat16,), True),
         ("two_stream_85_targets", _TWO_STREAM, (torch.float16,), False),
         ("content_D128", dataclasses.replace(_REALISTIC, H=8, D=128), (torch.bfloat16,), False)]
LONG_CASES = [("content_qlen4096", _LONG, CHECKED_DTYPES, False),
              ("two_stream_qlen4096_683_targets", dataclasses.replace(_LONG, targets=683, two_stream=True),
               (torch.bfloat16,), False)]
# tests/test_triton_kernels.py's half-precision criterion: within 1e-2 of float64, or within 3x the
# eager path's error at the same dtype (sums of dS that cancel show the rounding of O in both)
ABS_TOLERANCE = 1e-2
EAGER_FACTOR = 3


def run(inputs: cases.OpCall, dtype, backend):
    """The output (both streams' rows concatenated) and the gradients of every float argument for
    a fixed random upstream gradient, with the floats cast to ``dtype``."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.floats.items()}
    out = inputs.with_floats(leaves).call(backend=backend)
    if inputs.two_stream:
        out = torch.cat(out, 1)
    dout = cases.random_like(out.detach().double(), seed=1).to(dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return out.detach(), dict(zip(leaves, grads))


def rel_err(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def within_tolerance(errs: dict, eager_errs: dict) -> bool:
    """The suite's criterion for half precision (tests/test_triton_kernels.py): each error within
    ``ABS_TOLERANCE`` of float64, or within ``EAGER_FACTOR`` x the eager path's at the same dtype."""
    return all(math.isfinite(e) and e < max(ABS_TOLERANCE, EAGER_FACTOR * eager_errs[k]) for k, e in errs.items())


def check_case(name: str, case: cases.AttentionCase, device: str, dtypes=CHECKED_DTYPES,
               deterministic: bool = False) -> list[dict]:
    """One ``xlnet_attn_check`` record per dtype: the Triton backend's output and gradients against
    the eager backend in float64 (``case`` is drawn in float64), and against the eager backend at
    the same dtype for the tolerance; ``deterministic`` runs the backward under
    ``torch.use_deterministic_algorithms(True)`` (dk_r without atomics). Each is printed as a line."""
    inputs = cases.attention_inputs(case, device)
    ref_out, ref_grads = run(inputs, torch.float64, "eager")
    records = []
    for dtype in dtypes:
        with runner.deterministic_algorithms(deterministic):
            out, grads = run(inputs, dtype, "triton")
        eager_out, eager_grads = run(inputs, dtype, "eager")
        errs = {"out": rel_err(out, ref_out), **{k: rel_err(grads[k], ref_grads[k]) for k in grads}}
        eager_errs = {"out": rel_err(eager_out, ref_out),
                      **{k: rel_err(eager_grads[k], ref_grads[k]) for k in eager_grads}}
        worst = max((k for k in errs if k != "out"), key=errs.get)
        records.append({"op": "xlnet_attn_check", "dtype": str(dtype).split(".")[-1], "case": name,
                        "deterministic": deterministic, "B": case.B, "H": case.H, "qlen": case.qlen,
                        "mlen": case.mlen, "D": case.D, "n_targets": case.targets,
                        "rel_err_out": errs["out"], "rel_err_grad": errs[worst], "worst_grad": worst,
                        "rel_err_grads": {k: v for k, v in errs.items() if k != "out"},
                        "eager_rel_errs": eager_errs, "within_tolerance": within_tolerance(errs, eager_errs)})
        r = records[-1]
        print(f"{name:32} {r['dtype']:9}{' deterministic' if deterministic else ''} out {r['rel_err_out']:.2e}  "
              f"worst grad {r['rel_err_grad']:.2e} ({worst})  {'ok' if r['within_tolerance'] else 'OUT OF TOLERANCE'}",
              flush=True)
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", action="store_true", help="also qlen=4096")
    runner.add_output_args(p, RECORDS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        return runner.refuse("no CUDA device: this check needs a GPU")
    env = runner.environment()
    records = []
    for name, case, dtypes, deterministic in CASES + (LONG_CASES if args.long else []):
        records += [{**rec, **env} for rec in check_case(name, case, "cuda", dtypes, deterministic)]
        torch.cuda.empty_cache()
    runner.write_records(args, RECORDS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
