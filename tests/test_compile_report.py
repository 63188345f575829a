"""The compile report (``bench.compile_report``): machine code of the fused kernels for NVIDIA GPUs,
produced without a GPU.

``test_what_users_run_compiles_for_sm80_and_sm90`` runs the report in a subprocess (this session has
``TRITON_INTERPRET=1``, compiling needs the kernels in compiled mode) for sm_80 and sm_90 at D=64,
two-stream, dropout off and on, at every candidate config the autotuner may pick there, with the
FlashAttention-2 reference at the same configs, and fails on what its regression gate (``--gate``)
finds at the best config per kernel: a spill, a register cliff, a missing tensor-core path (HMMA on
sm_80, HGMMA on sm_90), a ratio above issue 20's caps or dropout above its cap, or, where a target
is not met yet, a figure past the ceiling measured for this triton (``SHORTFALLS``). Skipped where
triton has no NVIDIA backend or ptxas. ``test_recorded_records...`` checks the committed records
(triton 3.6, every arch) without compiling. The other tests check the SASS reader and the report's
bookkeeping on synthetic input.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import runner
from bench.compiler import sass
from bench.compiler import targets as report

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

# Blackwell style: branches on a uniform predicate given as an operand (BRA.U !UP3, target), which
# fall through when not taken: the loop at .L_x_1 is reached only through the first one's fall-through.
_SASS_TCGEN05 = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BRA.U !UP3, `(.L_x_2) ;
.L_x_1:
        /*0020*/                   UTCHMMA gdesc[UR42], gdesc[UR32], tmem[UR15], tmem[UR18], idesc[UR19], !UPT ;
        /*0030*/                   UTCBAR [UR4], URZ ;
        /*0040*/                   BRA.U !UP2, `(.L_x_1) ;
.L_x_2:
        /*0050*/                   EXIT ;
"""


def test_sass_natural_loops_key_loop_counts_and_mma_kinds():
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
    # branches on a uniform predicate, tcgen05
    code = sass.parse(_SASS_TCGEN05)
    assert code.mma_kind() == "tcgen05"
    assert [loop.head for loop in code.loops] == [0x20]
    counts = sass.per_iteration(code.key_loop(), lambda loop: 1)
    assert (counts["inst"], counts["mma"]) == (3, 1)
    assert sass.parse(_SASS.replace("HGMMA", "HMMA")).mma_kind() == "mma.sync"
    assert sass.parse("        /*0000*/                   FFMA R1, R2, R3, R4 ;\n").mma_kind() == "none (FMA)"


# PTX of a 64-thread kernel whose loop (an MMA in it, so the key loop) stores 4 bytes a lane to
# shared memory at three lane patterns (a 4-byte stride, a 128-byte stride, and a per-thread table
# value times 128 bytes, as the skew's gather is placed by the row tables), a fourth store guarded
# to the first 16 threads, a 16-byte load per lane, and a store placed by a value that went through
# shared memory (thread 0 publishes a parameter), a warp reduction and a byte permute; one
# inline-asm scope with a label.
_PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1
)
.reqntid 64
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<40>;
	.reg .b64 	%rd<8>;
	mov.u32 	%r1, %tid.x;
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b32 	%r20, [k_param_1];
	mul.wide.u32 	%rd2, %r1, 4;
	add.s64 	%rd3, %rd1, %rd2;
	// begin inline asm
	mov.u32 %r2, 0x0;
	@%p3 ld.global.b32 { %r2 }, [ %rd3 + 0 ];
	// end inline asm
	setp.lt.u32 	%p2, %r1, 16;
	shl.b32 	%r3, %r1, 2;
	mov.b32 	%r4, global_smem;
	add.s32 	%r5, %r4, %r3;
	shl.b32 	%r6, %r1, 7;
	add.s32 	%r7, %r4, %r6;
	shl.b32 	%r8, %r2, 7;
	add.s32 	%r9, %r4, %r8;
	shl.b32 	%r12, %r1, 4;
	add.s32 	%r13, %r4, %r12;
	setp.eq.u32 	%p5, %r1, 0;
	@%p5 st.shared.b32 	[%r4+16384], %r20;
	bar.sync 	0;
	ld.shared.b32 	%r21, [%r4+16384];
	redux.sync.max.s32 	%r22, %r1, -1;
	and.b32 	%r23, %r22, 32;
	prmt.b32 	%r25, %r23, 0, 0x7710U;
	add.s32 	%r26, %r25, %r21;
	shl.b32 	%r27, %r26, 2;
	add.s32 	%r28, %r5, %r27;
	mov.u32 	%r10, 0;
$L__BB0_1:
	st.shared.b32 	[%r5], %r1;
	st.shared.b32 	[%r7+4096], %r1;
	st.shared.b32 	[%r9], %r1;
	@%p2 st.shared.b32 	[%r5+8192], %r1;
	ld.shared.v4.b32 	{%r14, %r15, %r16, %r17}, [%r13];
	st.shared.b32 	[%r28+12288], %r1;
	@%p5 mbarrier.arrive.expect_tx.shared.b64 _, [%r4+16392], 8192;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r30, %r31, %r32, %r33}, {%r21, %r22, %r23, %r24}, {%r25, %r26}, {%r30, %r31, %r32, %r33};
	{
	.reg .pred done;
	waitLoop:
	mbarrier.try_wait.parity.shared.b64 done, [%r4], %r10;
	@!done bra.uni waitLoop;
	}
	add.s32 	%r10, %r10, 1;
	setp.lt.s32 	%p1, %r10, %r20;
	@%p1 bra 	$L__BB0_1;
	ret;
}
"""


def test_smem_traffic_follows_lane_addresses_placed_by_tables_and_guards():
    import numpy as np

    def memory(table):
        def read(addresses, known, width):
            index = (addresses - (1 << 36)) // 4
            ok = known & (index >= 0) & (index < len(table))
            return np.where(ok, np.asarray(table)[np.clip(index, 0, len(table) - 1)], 0), ok
        return read

    params = {0: (1 << 36, True), 1: (8, True)}
    program = [((0, 0, 0), (1, 1, 1))]
    # the guard %p3 was never set: its threads' loads are unknown, so the table-placed store is unresolved
    found = sass.smem_traffic(_PTX, params, memory(list(range(64))), 64, program)
    assert found["unresolved"] == 1
    ptx = _PTX.replace("@%p3 ld.global", "ld.global")
    # per warp: 4 B a lane at 4 B apart: 1 wavefront; 128 B apart: all in one bank, 32; the guarded
    # store, 16 lanes of warp 0 only: 1; 16 B a lane: 4 phases of 8 lanes, 1 each
    spread = sass.smem_traffic(ptx, params, memory(list(range(64))), 64, program)
    assert spread["unresolved"] == 0
    # thread 0 announces a TMA fill of 8 KiB: 64 conflict-free wavefronts
    assert spread["by_kind"] == {"sts": [4 * 256 + 64, 2 * (1 + 32 + 32 + 1) + 1], "lds": [1024, 8],
                                 "tma": [8192, 64]}
    # the table places every lane of a warp in the same word: one access per warp (a broadcast)
    same = sass.smem_traffic(ptx, params, memory([5] * 64), 64, program)
    assert same["by_kind"]["sts"] == [4 * 256 + 64, 2 * (1 + 32 + 1 + 1) + 1]
    # averaged over programs
    both = sass.smem_traffic(ptx, params, memory(list(range(64))), 64, program * 2)
    assert both["wavefronts"] == spread["wavefronts"]
    assert sass.smem_traffic(_PTX.replace("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mov.b32"),
                             params, memory([0] * 64), 64, program) is None  # no MMA: no key loop


# Two loops of the same MMAs one after the other, as the forward's (its key tiles every row sees
# first, without the rank test, then the rest): the second has more instructions.
_SASS_TWO_LOOPS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0040*/                   ISETP.GE.AND P2, PT, R3, R4, PT ;
        /*0050*/                   FSEL R5, R5, -INF , P2 ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   EXIT ;
"""


# sm_86's forward with dropout (triton 3.6): ptxas leaves the first loop by a call that pushes no
# return address, to a label on a NOP
_SASS_CALL_EXIT = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0030*/              @!P1 CALL.REL.NOINC `(.L_x_1) ;
        /*0040*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0050*/                   NOP ;
        /*0060*/                   S2R R14, SR_TID.X ;
.L_x_3:
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R10, R4 ;
        /*0080*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm70_shflsync_bfly) ;
        /*0090*/                   FSEL R5, R5, -INF , P2 ;
        /*00a0*/               @P2 BRA `(.L_x_3) ;
        /*00b0*/                   EXIT ;
$__internal_0_$__cuda_sm70_shflsync_bfly:
        /*00c0*/                   SHFL.BFLY PT, R3, R4, R5, R6 ;
        /*00d0*/                   RET.REL.NODEC R20 `(xlnet_kernel) ;
.L_x_4:
        /*00e0*/                   BRA `(.L_x_4);
"""


def test_a_loop_left_by_a_call_without_return_and_a_label_on_a_nop_lose_no_code():
    """Regression: the code after a loop that ptxas leaves by ``CALL.REL.NOINC`` (a jump), to a label
    on a NOP, read as unreachable: the forward's general key loop went unseen and the free-tile loop
    before it was taken for the key loop (sm_86/89 with dropout: 35.31 inst/score recorded, the free
    loop's). A call to a label ends its block with an edge to its target, a call to a subroutine
    (which returns) does not; a label names the next instruction kept."""
    code = sass.parse(_SASS_CALL_EXIT)
    assert [loop.head for loop in code.loops] == [0x20, 0x70]
    assert code.key_loop().head == 0x70
    assert [len(loop.own) for loop in code.loops] == [3, 4]


def test_of_two_loops_of_the_same_products_the_general_one_is_the_key_loop():
    """Regression: where a kernel runs its tiles in two loops of the same MMAs (the forward's tiles
    every row sees, then the rest), the key loop is the one with more instructions, in SASS and in
    PTX; and the shared-memory walk reaches it, though the first loop's one simulated iteration
    branches back (it passed no thread on, and every CTA read as never entering the key loop)."""
    import numpy as np

    code = sass.parse(_SASS_TWO_LOOPS)
    assert code.key_loop().head == 0x30
    assert [loop.head for loop in code.lighter_twins(code.key_loop())] == [0x10]  # reported apart
    nested = sass.parse(_SASS)  # a loop inside the key loop is not a twin
    assert nested.lighter_twins(nested.key_loop()) == []

    def table(addresses, known, width):
        index = (addresses - (1 << 36)) // 4
        ok = known & (index >= 0) & (index < 64)
        return np.where(ok, np.clip(index, 0, 63), 0), ok

    params, program = {0: (1 << 36, True), 1: (8, True)}, [((0, 0, 0), (1, 1, 1))]
    ptx = _PTX.replace("@%p3 ld.global", "ld.global")
    alone = sass.smem_traffic(ptx, params, table, 64, program)
    first_loop = """	mov.u32 	%r11, 0;
$L__BB0_0:
	st.shared.b32 	[%r7+4096], %r1;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r30, %r31, %r32, %r33}, {%r21, %r22, %r23, %r24}, {%r25, %r26}, {%r30, %r31, %r32, %r33};
	add.s32 	%r11, %r11, 1;
	setp.lt.s32 	%p4, %r11, %r20;
	@%p4 bra 	$L__BB0_0;
"""
    both = sass.smem_traffic(ptx.replace("$L__BB0_1:", first_loop + "$L__BB0_1:", 1), params, table, 64, program)
    assert alone["reached"] == both["reached"] == 1
    assert both["by_kind"] == alone["by_kind"]  # the second loop's accesses, not the first's


def test_traffic_and_instructions_are_placed_on_their_source_lines():
    """``--lines`` (``launches.line_profile``): each shared-memory access counts on its PTX ``.loc``
    line, in the file PTX's ``.file`` table (written after the kernel) names, and the lines add up to
    the loop's figures; SASS instructions on their ``//## File`` lines, a nested loop's once."""
    import numpy as np

    key = sass.parse(_SASS).key_loop()
    lines = key.lines_per_iteration()
    assert lines == {("/src/k.py", 10): 4, ("/src/k.py", 12): 5}  # the inner loop's 5, once
    assert sum(lines.values()) == sass.per_iteration(key, lambda loop: 1)["inst"]

    def table(addresses, known, width):
        index = (addresses - (1 << 36)) // 4
        ok = known & (index >= 0) & (index < 64)
        return np.where(ok, np.clip(index, 0, 63), 0), ok

    ptx = (_PTX.replace("@%p3 ld.global", "ld.global")
           .replace("$L__BB0_1:\n", "$L__BB0_1:\n\t.loc\t1 20 7\n")
           .replace("\tld.shared.v4", "\t.loc\t1 21 3\n\tld.shared.v4")
           .replace("\tst.shared.b32 \t[%r28", "\t.loc\t2 5 0\n\tst.shared.b32 \t[%r28")
           .replace("\t@%p5 mbarrier", "\t.loc\t1 30 0\n\t@%p5 mbarrier")
           + '\t.file\t1 "/src/k.py"\n\t.file\t2 "/src/other.py"\n')
    params, program = {0: (1 << 36, True), 1: (8, True)}, [((0, 0, 0), (1, 1, 1))]
    found = sass.smem_traffic(ptx, params, table, 64, program)
    # the stores of line 20: 4 B a lane at 4 B, 128 B and table-placed 128 B apart (1 + 32 + 32 per
    # warp), the guarded one (16 lanes of warp 0: 1); line 21's 16-byte loads; other.py's store
    assert found["by_line"] == {("/src/k.py", 20): {"sts": [3 * 256 + 64, 2 * (1 + 32 + 32) + 1]},
                                ("/src/k.py", 21): {"lds": [1024, 8]},
                                ("/src/other.py", 5): {"sts": [256, 2]},
                                ("/src/k.py", 30): {"tma": [8192, 64]}}
    summed: dict = {}
    for kinds in found["by_line"].values():
        for kind, (moved, wavefronts) in kinds.items():
            entry = summed.setdefault(kind, [0, 0])
            entry[0], entry[1] = entry[0] + moved, entry[1] + wavefronts
    assert summed == found["by_kind"]


# Each CTA's thread 0 stores its %ctaid.x to shared memory; every thread reads it back and stores at
# a stride of ctaid + 1 words in the key loop (1, 2, 4 wavefronts a warp at ctaid 0, 1, 3); CTA 2
# returns before the loop
_PTX_BY_CTA = """
.visible .entry k(
	.param .u32 k_param_0
)
.reqntid 64
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<40>;
	mov.u32 	%r1, %tid.x;
	mov.u32 	%r2, %ctaid.x;
	mov.b32 	%r4, global_smem;
	setp.eq.u32 	%p1, %r1, 0;
	@%p1 st.shared.b32 	[%r4+16384], %r2;
	bar.sync 	0;
	ld.shared.b32 	%r5, [%r4+16384];
	add.s32 	%r6, %r5, 1;
	mul.lo.s32 	%r7, %r1, %r6;
	shl.b32 	%r8, %r7, 2;
	add.s32 	%r9, %r4, %r8;
	setp.eq.u32 	%p2, %r2, 2;
	@%p2 bra 	$L__RET;
	mov.u32 	%r10, 0;
$L__BB0_1:
	st.shared.b32 	[%r9], %r1;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r30, %r31, %r32, %r33}, {%r21, %r22, %r23, %r24}, {%r25, %r26}, {%r30, %r31, %r32, %r33};
	add.s32 	%r10, %r10, 1;
	setp.lt.s32 	%p3, %r10, 4;
	@%p3 bra 	$L__BB0_1;
$L__RET:
	ret;
}
"""


def test_smem_traffic_runs_the_sampled_ctas_side_by_side_each_with_its_own_shared_memory():
    """The sampled CTAs run at once, side by side, and give what each gives alone, averaged: each
    lane sees its own CTA's %ctaid and shared memory (here a value stored by the CTA's thread 0 and
    read back by all), and a CTA that returns before the key loop is not counted as reaching it."""
    grid = (4, 1, 1)
    alone = [sass.smem_traffic(_PTX_BY_CTA, {}, None, 64, [((x, 0, 0), grid)]) for x in (0, 1, 2, 3)]
    assert [a["wavefronts"] for a in alone] == [2 * 1, 2 * 2, 0, 2 * 4] and [a["reached"] for a in alone] == [1, 1, 0, 1]
    together = sass.smem_traffic(_PTX_BY_CTA, {}, None, 64, [((x, 0, 0), grid) for x in (0, 1, 2, 3)])
    assert together["reached"] == 3 and together["unresolved"] == 0
    assert together["wavefronts"] == sum(a["wavefronts"] for a in alone) / 4
    assert together["by_kind"] == {"sts": [sum(a["by_kind"].get("sts", [0])[0] for a in alone) / 4,
                                           sum(a["wavefronts"] for a in alone) / 4]}


def test_smem_traffic_follows_table_values_unpacked_from_wider_loads():
    """Regression: a 16-bit table read as 32-bit words and split by ``mov.b32 {lo, hi}`` (the dQ
    kernel's column numbers) left the lanes' addresses unknown, counted conflict-free. Each lane
    here stores at 128 B times the high half of its word (unpacked) and at 4 B times the two halves
    packed back in the other order, so the counts depend on both moves."""
    import numpy as np

    unpacked = _PTX.replace(
        "\tsetp.lt.u32 \t%p2, %r1, 16;",
        "\tmov.b32 \t{%rs1, %rs2}, %r2;\n\tcvt.u32.u16 \t%r35, %rs2;\n\tshl.b32 \t%r36, %r35, 7;\n"
        "\tmov.b32 \t%r37, {%rs2, %rs1};\n\tshl.b32 \t%r38, %r37, 2;\n\tsetp.lt.u32 \t%p2, %r1, 16;"
    ).replace("ld.global", "ld.global", 1).replace("@%p3 ld.global", "ld.global").replace(
        "\tst.shared.b32 \t[%r5], %r1;",
        "\tst.shared.b32 \t[%r5], %r1;\n\tst.shared.b32 \t[%r36+20480], %r1;\n\tst.shared.b32 \t[%r38+24576], %r1;")
    assert unpacked.count("[%r36+20480]") == 1 and "{%rs2, %rs1}" in unpacked
    unpacked = unpacked.replace(".reg .b64", ".reg .b16 \t%rs<4>;\n\t.reg .b64")

    def read(table):
        def memory(addresses, known, width):
            index = (addresses - (1 << 36)) // 4
            ok = known & (index >= 0) & (index < len(table))
            return np.where(ok, np.asarray(table, np.int64)[np.clip(index, 0, len(table) - 1)], 0), ok
        return memory

    params, program = {0: (1 << 36, True), 1: (8, True)}, [((0, 0, 0), (1, 1, 1))]
    table = read([(t << 16) | 1 for t in range(64)])  # lane t's word: high half t, low half 1
    base = sass.smem_traffic(_PTX.replace("@%p3 ld.global", "ld.global"), params, table, 64, program)
    found = sass.smem_traffic(unpacked, params, table, 64, program)
    assert found["unresolved"] == 0
    # the high half, t: 128 B apart, one bank (32 wavefronts a warp); packed back as (t | 1 << 16) * 4 B:
    # 4 B apart (1 a warp). With the halves' order swapped in both moves: a broadcast and 4 B apart.
    assert found["by_kind"]["sts"][1] == base["by_kind"]["sts"][1] + 2 * 32 + 2 * 1


def test_the_analysis_cache_changes_with_the_launchers_tables(monkeypatch):
    """Regression: a cache entry is named by its binary, but the shared-memory count places the
    skew's lanes by the row tables the launcher builds; a change to how the tables are built (the
    row interleave) returned the old counts from the cache. The version covers the launcher's source."""
    import inspect

    from bench.compiler import launches
    from xlnet_fast import kernels

    before = launches._analysis_version()
    source = inspect.getsource

    def edited(obj):
        text = source(obj)
        return text.replace("def _row_groups_kernel", "def _row_groups_kernel_v2") if obj is kernels.tables else text

    monkeypatch.setattr(inspect, "getsource", edited)
    assert launches._analysis_version() != before


def test_resident_warps_per_sm_as_nsight_compute_counted_them():
    """The H100's Nsight Compute occupancy sections (../shared/perf/H100_ncu_2026-11-26.txt): our
    forward at 228 registers and 107 KB, dK/dV at 255 and 61 KB, the fix-up at 188 and 57 KB, and the
    reference's 8-warp kernels at 125 and 131 registers."""
    assert report.resident_warps(90, 228, 107_008, 128) == 8
    assert report.resident_warps(90, 255, 61_440, 128) == 8
    assert report.resident_warps(90, 188, 57_344, 128) == 8
    assert report.resident_warps(90, 125, 49_152, 256) == 16
    assert report.resident_warps(90, 131, 99_328, 256) == 8  # one block: 136 x 256 x 2 registers > 64K
    assert report.resident_warps(90, 168, 57_344, 128) == 12  # the forward's register cap: a third block
    assert report.resident_warps(86, 64, 60_000, 128) == 4  # 100 KB of shared memory an SM: one block
    assert report.resident_warps(89, 32, 1_000, 64) == 48  # the warp limit


def _binary(config, role="dq", arch=90, D=64, scenario="two-stream", kernel=None, **figures) -> dict:
    record = {"arch": arch, "D": D, "role": role, "kernel": kernel or f"_{role}", "config": config,
              "candidate": 0, "scenarios": [scenario], "regs": 200, "spill_bytes": 0, "smem_bytes": 100_000,
              "tmem_columns": None, "mma": "wgmma", "inst_per_score": 30.0}
    record.update(figures)
    return report.launchability(record)


def test_best_config_is_launchable_and_spill_free_and_problems_are_reported():
    assert _binary("a", arch=90, smem_bytes=200_000)["launchable"]  # launchable: the arch's shared memory
    assert not _binary("a", arch=86, smem_bytes=200_000)["launchable"]  # 101,376 B per block
    assert not _binary("a", arch=100, smem_bytes=100_000, tmem_columns=640)["launchable"]  # 512 TMEM columns
    assert _binary("a", arch=80, smem_bytes=166_912)["launchable"]
    records = [  # the dk_r kernel (no ratio cap) on sm_90
        _binary("fast", role="dkr", inst_per_score=20.0, smem_bytes=240_000),  # over sm_90's 232,448 B
        _binary("spills", role="dkr", inst_per_score=25.0, spill_bytes=8),
        _binary("good", role="dkr", inst_per_score=28.0, candidate=1),
        _binary("slow", role="dkr", inst_per_score=40.0, candidate=2),
        _binary("cliff", role="dkr", regs=32, spill_bytes=30_000, candidate=3),
    ]
    [summary] = report.summarise(records)
    assert (summary["compiled"], summary["launchable"]) == (5, 4)
    assert summary["best"]["config"] == "good"
    assert summary["problems"] == ["cliff: register cliff (32 registers, 30000 B of spill)"]
    # the arch's own tensor-core path wins among spill-free configs, even at more instructions per
    # score (sm_100's dQ: a 32x32 mma.sync build 0.9 inst/score under the tcgen05 one); without one
    # spill-free, the other MMA kind is reported
    [native] = report.summarise([_binary("sync", role="dkr", mma="mma.sync", inst_per_score=20.0),
                                 _binary("wgmma", role="dkr")])
    assert native["best"]["config"] == "wgmma" and not native["problems"]
    [wrong_mma] = report.summarise([_binary("good", role="dkr", mma="mma.sync", inst_per_score=20.0),
                                    _binary("b", role="dkr", spill_bytes=8)])
    assert wrong_mma["problems"] == ["good: MMA mma.sync, not wgmma"]
    [only_spilling] = report.summarise([_binary("spills", spill_bytes=8), _binary("fast", smem_bytes=240_000)])
    assert only_spilling["best"] is None
    assert any("no launchable config within 0 B" in p for p in only_spilling["problems"])
    assert any("1 launchable configs" in p for p in only_spilling["problems"])
    # D=128 on sm_90: up to 512 B of spill is within the target, a spill-free config still wins
    [d128] = report.summarise([_binary("small", D=128, spill_bytes=500, inst_per_score=20.0),
                               _binary("clean", D=128, inst_per_score=30.0)])
    assert d128["best"]["config"] == "clean" and not d128["problems"]


def test_ratio_and_dropout_overhead_compare_the_same_config_only():
    records = [_binary("128x64w8s2", inst_per_score=33.0), _binary("64x64w4s1", inst_per_score=30.0),
               _binary("64x64w8s2", inst_per_score=30.0), _binary("128x64w8s2", role="dkr", inst_per_score=60.0)]
    references = [_binary("128x64w8s2", kernel="_fa2_bwd_q", inst_per_score=10.0),
                  _binary("128x64w8s2", role="dkdv", kernel="_fa2_bwd_kv", inst_per_score=15.0),
                  {"arch": 90, "D": 64, "role": "dq", "kernel": "_fa2_bwd_q", "config": "64x64w8s2",
                   "error": "OutOfResources"}]
    report.attach_ratios(records, references)
    same, other, failed, dkr = records
    assert same["ratio_to_reference"] == 3.3 and same["reference"]["inst_per_score"] == 10.0
    assert other["ratio_to_reference"] is None and other["reference"] == {"error": "not compiled"}
    assert failed["ratio_to_reference"] is None and failed["reference"]["error"] == "OutOfResources"
    assert dkr["ratio_to_reference"] == 4.0  # the dk_r kernel against the reference's dK/dV
    [summary] = report.summarise(records[:3])  # the best (lowest inst/score) has no like-for-like ratio
    assert summary["best"]["config"] == "64x64w4s1"
    assert summary["problems"] == ["64x64w4s1: no ratio to the reference at this config (cap 3.0x)"]
    [summary] = report.summarise(records[:1], all_candidates=False)
    assert summary["problems"] == ["128x64w8s2: 3.3x the reference (cap 3.0x)"]
    # dropout's cost: over the same config and stream without dropout
    records = [_binary("a", scenario="two-stream", inst_per_score=40.0),
               _binary("a", scenario="content", inst_per_score=20.0),
               _binary("b", scenario="two-stream", inst_per_score=10.0, spill_bytes=4),
               _binary("a", scenario="two-stream+dropout", inst_per_score=60.0)]
    report.attach_dropout_overhead(records)
    assert records[3]["dropout_overhead"] == 1.5  # over "a" two-stream, not content, not "b"
    assert "dropout_overhead" not in records[0]
    [summary] = report.summarise(records)
    a = next(c for c in summary["configs"] if c["config"] == "a")
    assert a["inst_per_score"] == 40.0 and a["dropout_overhead"] == 1.5  # worst without dropout
    assert any("dropout 1.5x" in p for p in summary["problems"])
    # one kernel in two roles (dK/dV and its fix-up launch): dropout against its own role's binary,
    # and the fix-up held to launchability, spills and cliffs only (mma.sync on sm_90, no ratio)
    records = [_binary("a", role="dkdv", kernel="_bwd_kv_kernel", inst_per_score=40.0),
               _binary("a", role="fixup", kernel="_bwd_kv_kernel", inst_per_score=20.0, mma="mma.sync"),
               _binary("a", role="dkdv", kernel="_bwd_kv_kernel", scenario="two-stream+dropout", inst_per_score=50.0),
               _binary("a", role="fixup", kernel="_bwd_kv_kernel", scenario="two-stream+dropout", inst_per_score=40.0,
                       mma="mma.sync")]
    report.attach_dropout_overhead(records)
    assert [r.get("dropout_overhead") for r in records] == [None, None, 1.25, 2.0]
    fixup = next(s for s in report.summarise(records, all_candidates=False) if s["role"] == "fixup")
    assert fixup["best"]["config"] == "a" and fixup["problems"] == [] and report.regressions(fixup, False) == []


def test_regression_gate_holds_met_targets_and_measured_ceilings(monkeypatch):
    monkeypatch.setattr(report, "SHORTFALLS", {"3.6": {(90, 64, "dq"): {"ratio": 3.5, "mma": "mma.sync"}},
                                               "3.9": {(90, 64, "dq"): {"ratio": 3.3, "spill": 64}}})
    # a met target: the gate is the target itself
    [fwd] = report.summarise([_binary("64x64w4s1", role="fwd", ratio_to_reference=2.1),
                              _binary("64x64w4s2", role="fwd", ratio_to_reference=2.4, candidate=1)])
    assert report.regressions(fwd, version="3.6") == ["64x64w4s1: 2.1x the reference (gate: 2.0x)"]
    # an unmet target: the measured ceiling of that triton version, and --check still lists the target
    dq = [_binary("32x32w4s1", mma="mma.sync", ratio_to_reference=3.4),
          _binary("64x64w4s1", spill_bytes=500, ratio_to_reference=4.0, candidate=1)]
    [summary] = report.summarise(dq)
    assert "32x32w4s1: 3.4x the reference (cap 3.0x)" in summary["problems"]
    assert report.regressions(summary, version="3.6") == []
    assert report.regressions(summary, version="3.9") == ["32x32w4s1: MMA mma.sync (gate: wgmma)",
                                                          "32x32w4s1: 3.4x the reference (gate: 3.3x)"]
    # the time model's ratio to the reference at the config it predicts fastest
    monkeypatch.setattr(report, "PREDICTED_CEILINGS", {"3.6": {(90, 64, "dq"): 12.0}, "3.9": {(90, 64, "dq"): 8.0}})
    timed = [_binary("32x32w4s1", mma="mma.sync", ratio_to_reference=3.4, inst_per_score=48.0,
                     smem_beq_per_score=222.0, resident_warps=8, threads=128),
             _binary("64x64w4s2", spill_bytes=500, ratio_to_reference=4.0, candidate=1, inst_per_score=37.0,
                     smem_beq_per_score=140.0, resident_warps=8, threads=128)]
    for b in timed:
        b["predicted"] = report.predicted_cycles(b)
    reference = {**_binary(report.REFERENCE_CONFIG, kernel="_fa2_bwd_q", inst_per_score=9.0, smem_beq_per_score=12.0,
                           resident_warps=16), "predicted": None}
    reference["predicted"] = report.predicted_cycles(reference)
    [summary] = report.summarise(timed, references=[reference])
    assert summary["fastest"]["config"] == "64x64w4s2" and summary["best"]["config"] == "32x32w4s1"
    assert summary["predicted_ratio"] == round(timed[1]["predicted"] / reference["predicted"], 2)
    assert 8.0 < summary["predicted_ratio"] < 12.0
    assert report.regressions(summary, version="3.6") == []
    assert report.regressions(summary, version="3.9")[-1] == (
        f"64x64w4s2: predicted {summary['predicted_ratio']}x the reference's time (gate: 8.0x)")
    [unknown] = report.summarise(timed)  # no reference binary: no prediction to hold
    assert report.regressions(unknown, version="3.9")[-1].startswith("64x64w4s2: no predicted time")
    # a version never measured: the loosest ceiling of each entry
    assert report.limits(90, 64, "dq", version="4.0")["predicted_ratio"] == 12.0
    assert report.limits(90, 64, "dq", version="4.0")["ratio"] == 3.5
    assert report.limits(90, 64, "dq", version="4.0")["spill"] == 64
    # a 64-row Hopper build without wgmma, or a build without any tensor-core MMA, fails wherever it is
    [lost] = report.summarise([_binary("32x32w4s1", mma="mma.sync", ratio_to_reference=3.4),
                               _binary("64x64w4s1", mma="mma.sync", spill_bytes=500, candidate=1),
                               _binary("32x64w4s1", mma="none (FMA)", spill_bytes=500, candidate=2)])
    assert report.regressions(lost, version="3.6") == [
        "32x64w4s1: no tensor-core MMA (none (FMA))", "64x64w4s1: mma.sync where wgmma fits"]


def _compile_env(tmp_path) -> dict:
    return {**os.environ, "TRITON_INTERPRET": "0", "XDG_CACHE_HOME": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def test_an_operand_kernel_binary_fails_on_an_error_a_spill_or_no_launch():
    """The one-pass operand kernels are held to no spill and launchable (the gate prints each problem)."""
    from bench import compile_report

    clean = {"arch": 90, "D": 64, "kernel": "_query_operands_kernel", "spill_bytes": 0, "smem_bytes": 128,
             "launchable": True}
    assert compile_report.operand_problem(clean) is None
    assert "8 B of spill" in compile_report.operand_problem({**clean, "spill_bytes": 8})
    assert "300000 B shared memory" in compile_report.operand_problem({**clean, "smem_bytes": 300000,
                                                                       "launchable": False})
    assert "boom" in compile_report.operand_problem({**clean, "error": "CompilationError: boom"})


def test_what_users_run_compiles_for_sm80_and_sm90(tmp_path):
    """Every candidate the autotuner may pick on sm_80 and sm_90 at D=64 (two-stream, dropout off and
    on), with the reference at the same configs, through the report's regression gate: at the best
    config per kernel no spill, the tensor-core path, the ratio and dropout caps of issue 20, or, where
    a target is not met yet, no worse than ``SHORTFALLS`` measured for this triton; at every config no
    failed compile, no register cliff, no build without MMA (nor a 64-row sm_90 build without wgmma)."""
    from bench.compiler import aot

    for arch in (80, 90):
        problem = aot.toolchain_problem(arch)
        if problem:
            pytest.skip(problem)
    out = tmp_path / "report.json"
    recorded = {path: path.read_bytes() for path in runner.RESULTS_DIR.glob("compile_*.json")}
    cmd = [sys.executable, "-m", "bench.compile_report", "--arch", "80", "90", "--D", "64", "--streams", "two-stream",
           "--dropout", "off", "on", "--deterministic", "off", "--gate", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=_compile_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.exists(), f"no report written:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert {p: p.read_bytes() for p in recorded} == recorded, "the repository's records were rewritten"
    written = json.loads(out.read_text())
    records = written["records"]
    from xlnet_fast.kernels import rel_attention

    wanted = {(arch, role, rel_attention.config_name(c)) for arch in (80, 90)
              for role in ("fwd", "dkdv", "dq", "fixup", "dq_recompute")
              for c in rel_attention.configs_for(arch, 64, role)}
    assert {(r["arch"], r["role"], r["config"]) for r in records} == wanted
    assert all(r["ratio_to_reference"] for r in records), "a binary without its like-for-like reference"
    # every binary's shared-memory traffic resolved from its lane addresses, and its occupancy; the
    # FIX_UP launch's programs return unless their key tile holds segment codes past SEG_CODES, which
    # the captured launch has not: its key loop is never entered, and the record says so
    timed = [r for r in records if r["role"] != "fixup"]
    assert all(r["smem_beq_per_score"] >= r["smem_bytes_per_score"] > 0 and not r["smem_traffic"]["unresolved"]
               and r["resident_warps"] and r["predicted"] for r in timed)
    # the forward's key tiles every row sees (16-bit, D=64: FREE_TILES) in a loop of their own, lighter
    forwards = [r for r in records if r["role"] == "fwd"]
    assert all(r["flags"]["FREE_TILES"] and len(r["free_loops"]) == 1
               and r["free_loops"][0]["inst_per_score"] < r["inst_per_score"] for r in forwards)
    idle = [r for r in records if r["role"] == "fixup"]
    assert all(r["smem_traffic"]["not_reached"] and r["smem_beq_per_score"] is None and r["predicted"] is None
               and r["resident_warps"] and r["inst_per_score"] for r in idle)
    assert {(s["arch"], s["role"]) for s in written["summary"]} == {(a, r) for a, r, _ in wanted}
    assert all(s["predicted_ratio"] for s in written["summary"] if s["role"] != "fixup")
    assert run.returncode == 0, "what users run, against issue 20's targets and the ceilings:\n" + run.stdout[-4000:]
    # --lines on one of those binaries (the run above cached its record): where its key loop spends
    # per source line, the lines summing to the record's figures
    cmd = [sys.executable, "-m", "bench.compile_report", "--arch", "90", "--D", "64", "--streams", "two-stream",
           "--dropout", "off", "--deterministic", "off", "--configs", "64x64w4s2", "--no-reference",
           "--lines", "fwd", "--json", str(tmp_path / "lines.json")]
    lines = subprocess.run(cmd, cwd=ROOT, env=_compile_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert lines.returncode == 0, lines.stdout[-3000:] + lines.stderr[-3000:]
    [sums] = re.findall(r"^ *([\d.]+) +([\d.]+) +([\d.]+)  \(sum; the record: ([\d.]+) inst, ([\d.]+) B-eq, "
                        r"([\d.]+) bytes\)$", lines.stdout, re.M)
    line_sums, recorded_figures = [float(x) for x in sums[:3]], [float(x) for x in sums[3:]]
    assert line_sums == pytest.approx(recorded_figures, abs=0.02), lines.stdout[-3000:]
    assert re.search(r"lds [\d.]+, sts [\d.]+ +rel_attention\.py:\d+ +return tl\.reshape\(tl\.gather", lines.stdout), \
        "the skew's gather, named by its source line:\n" + lines.stdout[-3000:]


def test_recorded_records_cover_the_candidates_and_pass_the_gate():
    """The committed records (bench/results/compile_sm*.json and compile_fp32.json, triton 3.6, every
    arch) cover the candidates ``configs_for`` lists now, and, summarised again, pass the regression
    gate with the ceilings measured for triton 3.6 (no compile: CI runs triton 3.9). fp32 included: its
    3xTF32 dQ at sm_90's 32x32w2s2 fell to 32 registers and 53.7 KB of spill without a register cap.
    So do their operand kernels (no spill, launchable): triton 3.6's sm_120 build of the backward's
    finishing kernel at D=128 spilled 12 B when it summed 64 rows a step (3.9's did not)."""
    from bench import compile_report
    from xlnet_fast import kernels
    from xlnet_fast.kernels import rel_attention

    paths = sorted(runner.RESULTS_DIR.glob("compile_*.json"))
    assert "compile_fp32.json" in {p.name for p in paths}
    assert paths, "no compile records: python -m bench.compile_report --record (triton 3.6)"
    problems = []
    for path in paths:
        written = json.loads(path.read_text())
        assert written["triton"].startswith("3.6."), f"{path.name}: made with triton {written['triton']}"
        for s in report.summarise(written["records"], references=written["references"]):
            wanted = [rel_attention.config_name(c) for c in rel_attention.configs_for(s["arch"], s["D"], s["role"])]
            where = f"{path.name} D={s['D']} {s['role']}"
            if sorted(wanted) != sorted(c["config"] for c in s["configs"]):
                problems.append(f"{where}: records {[c['config'] for c in s['configs']]}, candidates now {wanted}")
            problems += [f"{where}: {p}" for p in report.regressions(s, version="3.6")]
        for r in written["records"]:  # the forward's free key tiles: a loop of their own where the launcher says
            if r["role"] == "fwd" and r.get("inst_per_score") is not None:
                itemsize = 4 if r["dtype"].startswith("fp32") else 2
                wanted = kernels._runs_free_key_tiles(r["arch"], r["flags"]["BLOCK_D"], itemsize)
                if r["flags"]["FREE_TILES"] != wanted or len(r["free_loops"]) != wanted:
                    problems.append(f"{path.name} {r['arch']} D={r['D']} fwd {r['config']}: FREE_TILES "
                                    f"{r['flags']['FREE_TILES']}, {len(r['free_loops'])} free loops; launcher {wanted}")
        assert written["operand_kernels"], f"{path.name}: no operand kernel records"
        problems += [f"{path.name}: {p}" for p in map(compile_report.operand_problem, written["operand_kernels"]) if p]
    assert not problems, "re-run python -m bench.compile_report --record, or fix the kernels:\n" + "\n".join(
        problems)


def test_the_time_model_orders_the_measured_configs():
    """The report's time model (``targets.MODEL``) against the GPU runs' kernel times
    (``python -m bench.compile_report --calibrate``, bench/NOTES.md "What ranks real speed"): every
    measured kernel has its binary in the committed records, the model orders at least 90% of the
    GPUs' measured pairs of configs right (each pair timed in one run at one shape), and more than
    instructions per score (R0) do."""
    times = report.measured_times(runner.RESULTS_DIR)
    records, references = [], []
    for arch in sorted({t["arch"] for t in times}):
        written = json.loads((runner.RESULTS_DIR / f"compile_sm{arch}.json").read_text())
        records, references = records + written["records"], references + written["references"]
    found = report.calibration(records, references, times)
    assert [f"{r['gpu']} {r['role']} {r['config']}" for r in found["rows"] if r["binary"] is None] == []
    right, scored = found["orders"][report.MODEL]
    assert scored >= 40 and right >= 0.9 * scored and right > found["orders"]["R0"][0]
    # each GPU's fastest dQ against the reference's: the one reading dS (dq), which the H100's second
    # run and the H200's third timed, faster than the earlier runs' recomputing one (dq_recompute)
    assert {(x["gpu"], x["role"]) for x in found["ratios"]} == {
        ("H100", "fwd"), ("H100", "dkdv"), ("H100", "dq"), ("H200", "fwd"), ("H200", "dkdv"), ("H200", "dq")}
