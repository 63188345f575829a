"""The launcher's bound launches (``kernels/launch.py``): past its first launch at a call shape, a
kernel gets its tensors straight to the compiled binary, skipping triton's binding, specialisation
and autotuner key (most of a call's host time). They must reach the driver exactly as triton's JIT
would send them: the same binary, grid and arguments, for calls that differ from each other only in
what triton specialises on. Checked on a fake GPU (``bench.compiler.fake_gpu``: the real JIT and
compiler, sm_80, the driver stubbed) in a process of its own, with the kernels compiled
(``tests/helpers/launch_check.py``); skipped where triton has no NVIDIA backend or ptxas.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parent / "helpers" / "launch_check.py"


def test_bound_launches_send_what_the_jit_sends():
    from bench.compiler import aot

    problem = aot.toolchain_problem(80)
    if problem:
        pytest.skip(problem)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(HELPER), "80"], env=env, capture_output=True, text=True, timeout=1500)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert not result["mismatches"], "\n".join(result["mismatches"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert result["bound"] >= result["launches"] // 2  # every second run of a call shape went bound


def test_bound_launches_pass_addresses_where_asked():
    """``launch.addresses()``: a bound launch passes each tensor argument as its address (what
    triton's launcher would read from it), every other argument as it is, and the tensors
    themselves outside the context (``xlnet_fast_addresses`` times one against the other)."""
    import torch

    from xlnet_fast.kernels import launch

    sent = []

    class Compiled:  # a compiled kernel's runner per grid, as triton's CompiledKernel
        def __getitem__(self, grid):
            return lambda *args: sent.append(args)

    class Param:
        def __init__(self, name, default=None):
            self.name, self.default = name, default

    class Fn:
        params = [Param("X"), Param("n"), Param("Y"), Param("BLOCK", 16)]

    x, y = torch.arange(4.0), torch.zeros(3, dtype=torch.int32)
    bound = launch.bind(Fn(), Compiled(), (2,), {"X": x, "n": 7, "Y": y}, {"X": x, "n": 7, "Y": y}, None)
    with launch.addresses():
        bound({"X": y, "n": 9, "Y": x})
    bound({"X": x, "n": 5, "Y": y})
    assert sent[0] == (y.data_ptr(), 9, x.data_ptr(), 16)
    assert sent[1][0] is x and sent[1][1] == 5 and sent[1][2] is y and sent[1][3] == 16
    assert not launch.ADDRESSES
