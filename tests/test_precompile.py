"""Triton's on-disk cache, where the kernels' binaries are looked up by key. Compiling ahead
(``bench.compiler.precompile``, the campaign's ``compile`` step): the binaries it puts there are the
ones triton's JIT then looks up, so the JIT compiles none of them (checked on a fake GPU,
``bench.compiler.fake_gpu``: the real JIT, cache and compiler, the driver stubbed, in a process of
its own, ``tests/helpers/precompile_check.py``; skipped where triton has no NVIDIA backend or
ptxas). And the launcher makes the keys independent of what a process launches first.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parent / "helpers" / "precompile_check.py"
# its n_m_used is how many of the dQ launch's query tiles it sums: a count of the config the autotuner
# picks, which compiling ahead cannot know (it sizes for the smallest tile); 1 here, which triton
# specialises on. One small binary the JIT compiles itself.
PICK_DEPENDENT = {"_grad_finish_kernel"}


def test_the_jit_finds_every_binary_compiled_ahead(tmp_path):
    from bench.compiler import aot

    problem = aot.toolchain_problem(90)
    if problem:
        pytest.skip(problem)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    run = subprocess.run([sys.executable, str(HELPER), "90"], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines and run.returncode == 0, f"no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["failed"] == [] and result["compiled"] == result["binaries"] == result["cache_folders"] > 0
    launched = result["launched"]  # {cache folder: kernel}
    assert {"_fwd_kernel", "_bwd_kv_kernel", "_bwd_q_kernel"} <= set(launched.values())
    missed = {launched[folder] for folder in result["launched_not_compiled_ahead"]}
    assert missed <= PICK_DEPENDENT, f"the JIT compiled these itself: {missed - PICK_DEPENDENT}"
    assert set(result["added_by_the_jit"]) <= set(result["launched_not_compiled_ahead"])


ORDERS = """
import json, random
from triton.runtime import JITFunction, jit
from xlnet_fast import kernels
from xlnet_fast.kernels import operands, rel_attention


def update_hash_as_triton_3_6(self, func):  # the helper's globals merged before it is hashed (3.9: after)
    self.used_global_vals.update(func.used_global_vals)
    self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))


jit.DependenciesFinder._update_hash = update_hash_as_triton_3_6

functions = [f for m in (rel_attention, operands) for f in vars(m).values() if isinstance(f, JITFunction)]
raw, canonical = [], []
for seed in range(3):
    for f in functions:  # as in a new process
        f.hash, f.used_global_vals = None, {}
    order = functions[:]
    random.Random(seed).shuffle(order)
    for f in order:  # hashed in the order a process first launches them
        f.cache_key
    raw.append([f.cache_key for f in functions])
    kernels._canonical_cache_keys.__wrapped__()
    canonical.append([f.cache_key for f in functions])
print(json.dumps({"functions": len(functions), "raw_orders_agree": raw[0] == raw[1] == raw[2],
                  "canonical_orders_agree": canonical[0] == canonical[1] == canonical[2]}))
"""


def test_the_kernels_cache_keys_do_not_depend_on_what_a_process_launches_first():
    """Triton hashes a kernel with its helpers' global constants only where those helpers were hashed
    before it, so the key of its binary in triton's on-disk cache followed the order of a process's
    first launches (triton 3.6, the GPU machines'; 3.9 hashes the helper first, and the subprocess
    hashes as 3.6 does): the launcher hashes every kernel and helper to a fixpoint before its first
    launch (``kernels._canonical_cache_keys``), and three orders of first launches give the same keys."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", ORDERS], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines and run.returncode == 0, f"no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["functions"] > 20 and not result["raw_orders_agree"] and result["canonical_orders_agree"], result


AUTOCAST = """
import contextlib, dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from bench.source_tree import ensure_kernels_importable
ensure_kernels_importable()
from bench import campaign, cases, model_step
from bench.compiler import aot, fake_gpu, precompile

plan = dataclasses.replace(campaign.PLANS["dry"], steps=("model_step",), infer_B=2, model_providers=("hf", "patched", "native"),
                           models=(("tiny", cases.ModelCase("tiny", B=2, seq=32, mlen=16, predict=8, vocab=100, n_layer=1)),))


def keys(device):
    found = precompile.distinct_launches(campaign.model_step_calls(plan, device), 90, device=device)
    return sorted(repr(aot.compile_key(launch, 90)) for launch in found)


on_meta, on_cpu = keys("meta"), keys("cpu")
# the same steps on meta without autocast (what a compile step that did not reproduce it would record)
fake_gpu.autocast_on_meta = lambda dtype=None: contextlib.nullcontext()
model_step._autocast = lambda device, autocast, graphed: contextlib.nullcontext()
print(json.dumps({"binaries": len(on_meta), "meta_is_cpu": on_meta == on_cpu, "plain_meta_is_cpu": keys("meta") == on_cpu}))
"""


def test_a_model_step_on_meta_tensors_makes_the_launches_it_makes_under_autocast():
    """The compile step records the model step's launches on meta tensors, where torch.autocast does
    not exist (``fake_gpu.autocast_on_meta`` stands in for CUDA's): a training step and an inference
    forward of the patched and the native model (tiny, one layer) make the same binaries on meta
    tensors as on CPU tensors under the CPU's own bf16 autocast, and other ones without autocast."""
    from bench.compiler import aot

    problem = aot.toolchain_problem(90)
    if problem:
        pytest.skip(problem)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    run = subprocess.run([sys.executable, "-c", AUTOCAST, root], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines and run.returncode == 0, f"no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["binaries"] > 10 and result["meta_is_cpu"] and not result["plain_meta_is_cpu"], result


def test_the_autocast_stand_in_on_meta_casts_as_cuda_autocast_nests_and_restores_torch():
    """``fake_gpu.autocast_on_meta``: off until a ``torch.autocast("meta")`` (positional or keyword
    device type) turns it on; then products in bf16, layer norm in float32; an inner disabled
    autocast turns it off; torch's own functions answer for other devices and come back after."""
    import torch

    from bench.compiler.fake_gpu import autocast_on_meta

    x, w = torch.empty(2, 3, device="meta"), torch.empty(4, 3, device="meta")
    real = (torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype)
    with autocast_on_meta(torch.bfloat16):
        assert not torch.is_autocast_enabled("meta") and (x @ w.t()).dtype == torch.float32
        with torch.autocast(device_type="meta", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("meta") and torch.get_autocast_dtype("meta") == torch.bfloat16
            assert torch.matmul(x, w.t()).dtype == torch.bfloat16
            assert torch.nn.functional.layer_norm(x.bfloat16(), (3,)).dtype == torch.float32
            with torch.autocast("meta", enabled=False):
                assert not torch.is_autocast_enabled("meta") and (x @ w.t()).dtype == torch.float32
            assert torch.is_autocast_enabled("meta")
        with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own, for the CPU
            assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("meta")
    assert (torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype) == real
