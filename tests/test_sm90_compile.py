"""Hopper (sm_90) machine code of the fused kernels, produced without a GPU (``bench.sm90``).

The compile check runs in a subprocess: this test session has ``TRITON_INTERPRET=1`` (conftest),
while compiling needs the kernels in compiled mode. It compiles the forward and the backward of one
realistic launch (bf16, D=64, ranks + segments, two-stream pretraining, no dropout) at the autotune
configs below and fails if a kernel's GEMMs are not Hopper wgmma, or if a kernel spills registers at
the config that is its spill-free one (``NO_SPILL_CONFIG``); run without ``--json`` or ``--record``,
the report goes to the cache directory and the repository's record stays as it is. Skipped where
triton has no NVIDIA backend or ptxas.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import sass

ROOT = Path(__file__).resolve().parents[1]

# nvdisasm -c -gi style: an outer loop (header .L_x_1) around an inner one (header .L_x_2) whose
# atomic block ptxas placed after the outer loop's back edge; an unreachable trap loop at the end.
_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "/src/k.py", line 10
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   SHFL.IDX PT, R3, R4, R5, 0x1f ;
.L_x_2:
	//## File "/src/k.py", line 12
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0040*/               @P0 BRA `(.L_x_4) ;
.L_x_3:
        /*0050*/               @P1 BRA `(.L_x_2) ;
	//## File "/src/k.py", line 10
        /*0060*/                   STL [R1], R2 ;
        /*0070*/                   NOP ;
        /*0080*/              @!P2 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
.L_x_4:
	//## File "/src/k.py", line 12
        /*00a0*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU PT, [R6.64], R7 ;
        /*00b0*/                   BRA `(.L_x_3) ;
.L_x_5:
        /*00c0*/                   BRA `(.L_x_5);
"""


def test_sass_natural_loops_key_loop_and_counts():
    code = sass.parse(_SASS)
    assert code.mma_kind() == "wgmma"
    assert [(loop.head, loop.depth()) for loop in code.loops] == [(0x10, 0), (0x30, 1)]
    key = code.key_loop()  # one MMA of its own, like the inner loop: the outer one wins the tie
    [inner] = key.children
    assert key.head == 0x10 and inner.head == 0x30
    assert [i.address for i in inner.own] == [0x30, 0x40, 0x50, 0xA0, 0xB0]  # the atomic block too
    assert key.source_lines() == {("/src/k.py", 10): 4}  # NOP not counted
    once = sass.per_iteration(key, lambda loop: 1)
    assert (once["inst"], once["mma"], once["shfl"], once["stl"], once["stg"]) == (9, 2, 1, 1, 1)
    thrice = sass.per_iteration(key, lambda loop: 3)
    assert (thrice["inst"], thrice["mma"], thrice["stg"]) == (4 + 3 * 5, 1 + 3, 3)


def _problem(record: dict) -> str:
    what = record.get("error") or f"{record['spill_bytes']} B of spill traffic, MMA {record['mma']}"
    return f"{record['kernel']} ({record['phase']}): {what}"


# each kernel's spill-free autotune config at D=64 (kernels/rel_attention.py CONFIGS)
NO_SPILL_CONFIG = {"_fwd_kernel": "128x64w8s2", "_bwd_kv_kernel": "128x64w8s1", "_bwd_q_kernel": "64x64w8s2"}


def test_forward_and_backward_compile_for_sm90_without_spills(tmp_path):
    from bench import aot

    problem = aot.toolchain_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "xlnet_fast" / "bench" / "sm90.json"  # without --json or --record: the cache directory
    record = ROOT / "bench" / "results" / "sm90.json"
    recorded = record.read_bytes() if record.exists() else None
    env = {**os.environ, "TRITON_INTERPRET": "0", "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    cmd = [sys.executable, "-m", "bench.sm90", "--D", "64", "--streams", "two-stream", "--dropout", "off",
           "--deterministic", "off", "--configs", *sorted(set(NO_SPILL_CONFIG.values())), "--trips", "static",
           "--no-reference"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"no report written:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert (record.read_bytes() if record.exists() else None) == recorded, "the repository's record was rewritten"
    records = json.loads(out.read_text())
    assert {r["phase"] for r in records} == {"forward", "backward"}
    assert {r["kernel"] for r in records} == set(NO_SPILL_CONFIG)
    problems = [_problem(r) for r in records if r.get("error") or r["mma"] != "wgmma"]
    problems += [_problem(r) for r in records
                 if r["spill_bytes"] and _config(r) == NO_SPILL_CONFIG[r["kernel"]]]
    assert not problems, "sm_90 code of the realistic launch:\n" + "\n".join(problems)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _config(record: dict) -> str:
    return f"{record['BLOCK_M']}x{record['BLOCK_N']}w{record['num_warps']}s{record['num_stages']}"
