"""The compile report's targets and bookkeeping: like-for-like ratios, dropout's cost, the summary
per (arch, D, kernel role) with its best launchable config, and what ``--check`` and ``--gate`` find.

A record is one compiled binary (``bench.compiler.launches``): ``arch``, ``kernel``, ``role``,
``config``, ``D``, ``scenarios``, ``regs``, ``spill_bytes``, ``smem_bytes``, ``tmem_columns``,
``mma``, ``inst_per_score``; ``launchability``, ``attach_ratios`` and ``attach_dropout_overhead``
add what compares it with the arch's limits, the reference and the same build without dropout.
"""

from __future__ import annotations

import math
import re

import triton

from bench import attention

# The reference's own tiles: what bench.attention's fa2_ref provider times on a GPU (the time model's
# ratio to the reference is taken there, comparable with a GPU's).
REFERENCE_CONFIG = "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}".format(**attention.FA2_REF_TILES)
# The FlashAttention-2 kernel an op kernel is compared with.
REFERENCE_ROLE = {"fwd": "fwd", "dkdv": "dkdv", "dq": "dq", "dkr": "dkdv", "fixup": "dkdv", "dq_recompute": "dq",
                  "dkr_recompute": "dkdv"}
# Roles held to launchability, spills and register cliffs only (no MMA kind, ratio or dropout
# target): the dK/dV kernel's FIX_UP launch, whose programs return at once unless their key tile
# holds segment codes past its one-hot's columns (a batch row with more than 15 segment ids).
CHECKS_ONLY = ("fixup",)

# --------------------------------------------------------------------------------------------------
# Issue 20's targets: shared by --check, --gate and tests/test_compile_report.py
# --------------------------------------------------------------------------------------------------

# inst/score over the reference's at the same arch, D and config, at the best launchable spill-free
# config, worst scenario (both streams, with and without dropout); (arch, D) -> role -> cap
RATIO_CAPS = {(90, 64): {"fwd": 2.0, "dkdv": 3.0, "dq": 3.0, "dq_recompute": 3.0},
              (80, 64): {"fwd": 3.5, "dkdv": 3.5, "dq": 3.5, "dq_recompute": 3.5}}
DROPOUT_OVERHEAD_CAP = 1.35  # inst/score with dropout over without, same kernel, config and stream
REGISTER_CLIFF = 128  # a launchable binary below this many registers must not spill
MIN_LAUNCHABLE = 2  # launchable configs per (arch, D <= 128, role), when every candidate is compiled
# the tensor-core path per arch family (rel_attention.arch_family)
EXPECTED_MMA = {80: "mma.sync", 86: "mma.sync", 90: "wgmma", 100: "tcgen05", 120: "mma.sync"}
# Hopper's warpgroup MMA takes 64 rows per warpgroup: a 32-row tile can only use mma.sync
WGMMA_MIN_ROWS = 64

# Regression ceilings where a target above is NOT met yet, per triton minor version (3.6: the GPU
# machines and the committed records; 3.9: CI): the level measured at the report's best config
# (``best``, else ``least_spill``) with a small margin. ``--check`` still lists the unmet target as a
# problem; the regression gate (``--gate``, the CI test) fails only beyond these, and on every
# target that is met. (arch, D, role) -> {"ratio", "dropout", "spill", "mma"}: a ratio cap, a
# dropout-overhead cap, spill bytes (stores + loads), the MMA kind accepted at the best config.
SHORTFALLS: dict = {
    "3.6": {  # the committed records (bench/results/compile_sm*.json): every arch, both D and streams
        # (2026-11-29: the entries of targets met again went, so the gate holds them: the recomputing
        # dQ's dropout on sm_80/86/89 and at D=128 on sm_100/120, sm_86/89's D=128 forward, sm_80's
        # D=128 dK/dV, sm_90's forward)
        # dropout target <= 1.35x: 32-row mma.sync tiles of 4 warps (warps side by side along the
        # keys: each Philox call's bytes cross warps, bench/NOTES.md change 8): the forward's 32x64
        # tiles (1.37-1.44x) and dQ's 32x32 ones (1.37-1.43x, its build without dropout gained more)
        (80, 64, "fwd"): {"dropout": 1.5},  # measured 3.7
        (80, 128, "fwd"): {"dropout": 1.45},
        # sm_90: 32-row tiles cannot use wgmma (64 rows a warpgroup); dQ's spill-free config is
        # 32x32w4s1 (mma.sync, 2.83x)
        (90, 64, "dkr_recompute"): {"mma": "mma.sync"},
        (90, 64, "dq_recompute"): {"mma": "mma.sync", "dropout": 1.45},  # measured 17.81
        (90, 128, "dkr_recompute"): {"mma": "mma.sync"},
        (90, 128, "dq_recompute"): {"mma": "mma.sync", "dropout": 1.45},
        # Two steps led to the entries below. First, the dropout seed read from device memory into
        # the Philox counter (graph-safe dropout, issue 33): sm_86/89's 64x64 forward 1.35 -> 1.36x,
        # sm_90 dK/dV's 64x64w4s2 16 B of spill with dropout (best spill-free: 32x64w4s1, 3.03x).
        # Then kernel v4's bank-spread skew windows (bench/NOTES.md, 2026-11-27): shared-memory wavefronts
        # per score fall 25-55% and every predicted time with them, but a few registers more cost
        # some builds their last spill-free byte or a few instructions, so issue 20's "best spill-free"
        # moves to a build the time model ranks slower: sm_86/89's 64x64w4s2r255 forward spills 40 B
        # with dropout (best: 32x64w4s1r255, dropout 1.43x); sm_90's dK/dV 32x64w4s1 48.2 -> 52.8
        # inst/score (3.33x); sm_90 D=128's wgmma forward 64x64w4s1 spills 40 B with dropout (best:
        # 32x64w4s1, mma.sync, dropout 1.44x) and its dK/dV's wgmma builds spill past 512 B (best:
        # 32x32w2s2, mma.sync); sm_100 D=128's dQ tcgen05 builds spill more (best: 32x32w4s1, mma.sync)
        (86, 64, "fwd"): {"dropout": 1.45},
        (89, 64, "fwd"): {"dropout": 1.45},
        # Kernel v4 step 2, the dK/dV kernel storing dS for the dQ kernel (bench/NOTES.md): a few
        # registers more again: sm_80 D=128's 32x32w4s1r255 dropout 1.34 -> 1.36x; sm_90's 32x64w4s1
        # 3.33 -> 3.41x; sm_90 D=128's least-spilling dK/dV is now 32x64w4s1 (wgmma, 540 -> 556 B;
        # 32x32w2s2, mma.sync, 428 -> 1,880 B). The dQ kernel reading dS is spill-free on wgmma at
        # D=64; at D=128 on sm_90 only its 32x32w4s1 is (mma.sync: 64x64w4s2 spills 1,180 B)
        # the position products in bf16 (bench/NOTES.md, 2026-11-28 (4)): 32x64w4s1 54.2 -> 56.3
        # inst/score (3.41 -> 3.56x) for 4 B-eq/score fewer; sm_90 D=128's dK/dV is within the
        # 512 B spill cap again (32x64w4s1, 508 B): its entry here went
        (90, 64, "dkdv"): {"ratio": 3.6},  # measured 3.56
        # the ROWS table's fifth field (the forward's free key tiles, bench/NOTES.md 2026-11-28 (6)):
        # every kernel's row addressing changed; sm_90 D=128's least-spilling dK/dV 508 -> 516 B
        (90, 128, "dkdv"): {"spill": 520},
        (120, 64, "dq_recompute"): {"dropout": 1.45},
        (120, 128, "fwd"): {"dropout": 1.45},
        # Kernel v4 step 4, tiles through tensor descriptors (bench/NOTES.md): the forward without
        # dropout got cheaper (sm_90 64x64w4s1 21.7 -> 19.9 inst/score) and dropout's own instructions
        # did not (+7.4), so its ratio rose 1.34 -> 1.37x. sm_90 D=128's wgmma forward is the best again
        # (64x64w4s1, 16 B of spill with dropout): its mma.sync entry fell away
        # (sm_90 D=128's dQ reading dS: wgmma met since 2026-11-28, its column numbers loaded: 64x64w4s1
        # went 236 -> 0 B of spill, its best spill-free build, wgmma for every product; it was
        # 32x64w4s1, mma.sync for dQ's 32-row product)
        # The own key compared as a column of the tile (bench/NOTES.md, "Conflict-free skew reads"):
        # forwards without dropout got cheaper and dropout's instructions did not, so sm_120's best
        # spill-free forward (32x64w4s1r255) goes 1.43-1.44 -> 1.47x; sm_100 D=128's recomputing dQ
        # now has a tcgen05 build at its best (64x64w8s2): its mma.sync entry fell away
        (120, 64, "fwd"): {"dropout": 1.5},
        # The forward's key tiles every row sees in a loop of their own (bench/NOTES.md, 2026-11-28
        # (6); these records re-made 2026-11-28 (7)): the second loop's registers cost sm_100 D=128
        # its spill-free tcgen05 forward (64x128w8s1: 0 -> 68 B); the best spill-free one is now
        # 32x64w4s1 on mma.sync, dropout 1.38x. Kept: the launcher keeps the free loop there
        # (kernels._runs_free_key_tiles), which the time model, its spills priced in, predicts 1.4%
        # faster at the pretraining shape (bench/NOTES.md, 2026-11-29)
        (100, 128, "fwd"): {"mma": "mma.sync", "dropout": 1.4},
    },
    "3.9": {  # CI's scope: sm_80 and sm_90, D=64, two-stream, dropout off and on
        # 32x32w4s1r255: 136 B with dropout (16 B before kernel v4's bank-spread windows), dropout
        # 1.41x; targets 0 B, 1.35x
        (80, 64, "dq_recompute"): {"spill": 144, "dropout": 1.45},
        (80, 64, "fwd"): {"dropout": 1.55},  # 1.48x at 32x64; target 1.35x
        # 32x32w4s1 (mma.sync), 2.94x: 72 B of spill with dropout (56 B before kernel v4), where the
        # product carried through the key loop costs triton 3.9 registers (3.6: spill-free); targets
        # wgmma, 0 B
        (90, 64, "dq_recompute"): {"mma": "mma.sync", "spill": 80},
        # kernel v4: 32x64w4s1 48 -> 52 inst/score (3.24x), as with 3.6 above; the position products
        # in bf16 (bench/NOTES.md, 2026-11-28 (4)): 52 -> 56.0 (3.49x), its window's conversions,
        # for 4 B-eq/score fewer (the time model's pick 64x64w4s1 -1.9%)
        (90, 64, "dkdv"): {"ratio": 3.55},
        # the forward's key tiles every row sees in a loop of their own (bench/NOTES.md, 2026-11-28
        # (6)): the two loops cost the single-stage 64x64w4s1, the best spill-free build, registers
        # (3.6: 164 -> 198) and with triton 3.9 instructions in its general loop: past 2.0x to 2.05x; the
        # time model's pick, 64x64w4s2, keeps its general loop (22.2 inst/score) and occupancy
        (90, 64, "fwd"): {"ratio": 2.1},
    },
}


# The time model's ratio to the reference (``predicted_ratio``: the fastest predicted config's time over
# the FA2 reference's at its own tiles, both by MODEL), what the regression gate holds per triton
# version: the level measured when the model was calibrated, 5% over. ``dq_recompute``: the dQ
# kernel recomputing dS (calls whose dS the backward does not keep, kernels.STORED_DS_BYTES), held
# where the dQ kernel was before it could read a stored dS; so are its SHORTFALLS. Issue 34's targets are GPU
# times (forward <= 2x, dQ <= 3x, dK/dV <= 2x the reference on sm_90): ``--calibrate`` predicts
# those; the model's raw ratio over-predicts the measured ones by ~2x (the reference runs further
# from its bound than ours), so these ceilings hold the kernels where they are, not at the targets.
PREDICTED_CEILINGS: dict = {
    "3.6": {  # the committed records (2026-11-27 evening: kernel v4 steps 2-4, then rows interleaved for
        # conflict-free skew reads and the own key compared as a tile column; night: a key's rank and
        # segment code in one field; MODEL R6, TMA's fills counted; 2026-11-28 evening: the position
        # products in bf16); measured (before the bf16 products; before this evening's step; R4's,
        # before R6). sm_90's records made again under R7 (2026-11-29, bench/NOTES.md "2026-11-29
        # (7)"): forward 2.87 at 64x64w4s2, dK/dV 1.82 at 64x64w4s1, dQ 3.06, dQ recomputing 7.15; the
        # other archs' records keep R6's predictions:
        (80, 64, "fwd"): 2.31,  # 2.20 (2.33; 2.41 before the packed keys; 2.6; the same)
        (80, 64, "dkdv"): 1.86,  # 1.77 (1.81; 1.87; 1.88)
        (80, 64, "dq"): 2.54,  # 2.42 (the same)
        (80, 64, "dq_recompute"): 5.37,  # 5.11 (5.43; 5.56; the same)
        (90, 64, "fwd"): 3.01,  # 2.87 at 64x64w4s2 (3.10; 3.25 before the packed keys; 3.64; 3.27 before TMA's
        # fills counted; 3.89 before step 4; 5.73 at 64x64w4s1r168 before R6)
        (90, 64, "dkdv"): 2.71,  # 2.58 (2.59; 2.67)
        (90, 64, "dq"): 3.19,  # 3.04 (2026-11-28: column numbers loaded; 3.39 before; 3.05 before TMA's
        # fills counted; 3.37 before step 4; 4.24)
        (90, 64, "dq_recompute"): 7.27,  # 6.92 (7.11; 7.54; 12.68)
    },
    "3.9": {  # CI's compile of sm_80 and sm_90 (2026-11-27 evening, R6; TMA's fills counted; 2026-11-28
        # evening: the position products in bf16); measured (before the bf16 products; before this
        # evening's step; R4's, before R6):
        (80, 64, "fwd"): 2.43,  # 2.31 (2.18 before the loop of tiles every row sees, whose registers cost
        # 64x64w4s2r255's general loop with triton 3.9; 2.31; 2.37 before the packed keys; 2.44; the same)
        (80, 64, "dkdv"): 1.89,  # 1.80 (1.84; 1.89; the same)
        (80, 64, "dq"): 2.63,  # 2.5 (the same)
        (80, 64, "dq_recompute"): 5.43,  # 5.17 (5.37; 5.49; the same)
        (90, 64, "fwd"): 3.0,  # 2.86 at 64x64w4s2 (3.09; 3.21 before the packed keys; 3.34; 2.98 before TMA's
        # fills counted; 3.51 before step 4; 5.31 at 64x64w4s1r168 before R6)
        (90, 64, "dkdv"): 2.24,  # 2.13 (2.47; 2.56)
        (90, 64, "dq"): 3.43,  # 3.27 (2.94 before TMA's fills counted; 3.25 before step 4; 4.04)
        (90, 64, "dq_recompute"): 6.88,  # 6.55 (6.76; 7.24; 12.18)
    },
}


def shortfalls(version: str | None = None) -> dict:
    """The ceilings of ``version`` (default: the running triton's); for a version not measured, the
    loosest of each known entry (a new triton gets the widest ceiling measured, not none)."""
    version = ".".join((version or triton.__version__).split(".")[:2])
    if version in SHORTFALLS:
        return SHORTFALLS[version]
    merged: dict = {}
    for table in SHORTFALLS.values():
        for key, entry in table.items():
            into = merged.setdefault(key, {})
            for name, value in entry.items():
                if name == "mma":
                    into[name] = value if name not in into or into[name] == value else into[name]
                else:
                    into[name] = max(value, into.get(name, value))
    return merged


def limits(arch: int, D: int, role: str, version: str | None = None) -> dict:
    """What the regression gate allows at (arch, D, role)'s chosen config: issue 20's targets, or the
    measured ceiling where ``SHORTFALLS`` has one. ``ratio``/``spill`` None: no target."""
    from xlnet_fast.kernels import rel_attention

    out = {"ratio": RATIO_CAPS.get((arch, D), {}).get(role), "dropout": DROPOUT_OVERHEAD_CAP,
           "spill": spill_cap(arch, D), "mma": EXPECTED_MMA.get(rel_attention.arch_family(arch)),
           "predicted_ratio": predicted_ceilings(version).get((arch, D, role))}
    out.update(shortfalls(version).get((arch, D, role), {}))
    if role in CHECKS_ONLY:
        out.update(ratio=None, dropout=math.inf, mma=None, predicted_ratio=None)
    return out


def predicted_ceilings(version: str | None = None) -> dict:
    """``PREDICTED_CEILINGS`` of ``version`` (default: the running triton's); for a version not
    measured, the loosest of each entry."""
    version = ".".join((version or triton.__version__).split(".")[:2])
    if version in PREDICTED_CEILINGS:
        return PREDICTED_CEILINGS[version]
    merged: dict = {}
    for table in PREDICTED_CEILINGS.values():
        for key, value in table.items():
            merged[key] = max(value, merged.get(key, value))
    return merged


def spill_cap(arch: int, D: int) -> int | None:
    """Spill bytes (stores + loads) the best launchable config may have: none at D <= 64, 512 B at
    D <= 128 on the sm_80, sm_90 and sm_100 families; None: no target."""
    from xlnet_fast.kernels import rel_attention

    if D <= 64:
        return 0
    if D <= 128 and rel_attention.arch_family(arch) in (80, 90, 100):
        return 512
    return None




def launchability(record: dict) -> dict:
    """``smem_limit`` and ``launchable`` (``rel_attention.launchable``: shared memory within the
    arch's per-block opt-in limit, tensor memory within its columns) of a compiled record, its
    ``resident_warps`` per SM and its ``predicted`` cycles per score (``predicted_cycles``)."""
    from xlnet_fast.kernels import rel_attention

    if "error" not in record:
        record["smem_limit"] = rel_attention.shared_memory_limit(record["arch"])
        record["launchable"] = rel_attention.launchable(record["arch"], record["smem_bytes"], record["tmem_columns"])
        if record.get("threads"):
            record["resident_warps"] = resident_warps(record["arch"], record["regs"], record["smem_bytes"],
                                                      record["threads"])
        record["predicted"] = predicted_cycles(record)
    return record


# --------------------------------------------------------------------------------------------------
# Occupancy and the time model: what ranks real speed (bench/NOTES.md, issue 34)
# --------------------------------------------------------------------------------------------------

# What one SM holds, per arch (CUDA's occupancy rules): resident warps and blocks, and shared memory
# for blocks (each block also takes RESERVED_SMEM_PER_BLOCK); 64K registers, allocated per warp in
# units of 256 (a thread's count rounded up to a multiple of 8).
SM_LIMITS = {80: {"warps": 64, "blocks": 32, "smem": 167_936}, 86: {"warps": 48, "blocks": 16, "smem": 102_400},
             87: {"warps": 48, "blocks": 16, "smem": 167_936}, 89: {"warps": 48, "blocks": 24, "smem": 102_400},
             90: {"warps": 64, "blocks": 32, "smem": 233_472}, 100: {"warps": 64, "blocks": 32, "smem": 233_472},
             103: {"warps": 64, "blocks": 32, "smem": 233_472}, 120: {"warps": 48, "blocks": 32, "smem": 102_400},
             121: {"warps": 48, "blocks": 32, "smem": 102_400}}
REGISTERS_PER_SM, REGISTER_UNIT, RESERVED_SMEM_PER_BLOCK = 65_536, 256, 1_024


def resident_warps(arch: int, regs: int, smem_bytes: int, threads: int) -> int:
    """Warps of one kernel resident on an SM at once: whole blocks, as registers, shared memory and
    the arch's warp and block limits allow (the numbers Nsight Compute's occupancy section shows)."""
    from xlnet_fast.kernels import rel_attention

    limit = SM_LIMITS.get(arch) or SM_LIMITS[rel_attention.arch_family(arch)]
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    blocks = min(REGISTERS_PER_SM // per_warp // warps, limit["smem"] // (smem_bytes + RESERVED_SMEM_PER_BLOCK),
                 limit["warps"] // warps, limit["blocks"])
    return blocks * warps


ISSUE_PER_CYCLE = 4  # warp instructions an SM issues per cycle (4 schedulers)
WAVEFRONT_BYTES = 128  # the L1/shared-memory data pipe: one 128-byte wavefront per SM per cycle
LATENCY_WARPS = 16  # resident warps per SM that hide a block's dependent chain (4 per scheduler)
EXPOSED_LOAD_CYCLES = 800  # what a single-stage key loop waits for its tiles' global loads, per iteration
# How much resident warps hide in a kernel bound by the shared-memory pipe: time goes as
# (LATENCY_WARPS / warps) ** WARPS_EXPONENT (R6). R4's exponent 1 ordered the H200's configs (42 of
# 44) but credited the H100's register-capped builds (12 warps) with a 1.5x gain they did not show
# (1.1-1.15x), and R5's 0 (pre-registered against R4) ignores the 4-warp dK/dV build's loss; fitted
# on both runs, 0.2-0.25 order the most pairs, 0.15 and 0.3 fewer (bench/NOTES.md, "H100 after
# kernel v4 steps 1-3": the next run tests it out of sample).
WARPS_EXPONENT = 0.25
# R7, fitted on the H200's D=64 and first D=128 configs (bench/NOTES.md "2026-11-29 (7)"): a kernel
# with one block resident per SM waits at each of its barriers (the skew's shared-memory round
# trip) with no other block to issue, SINGLE_BLOCK_PENALTY slower
# (0.3-0.5 order the same pairs); a spilled byte costs SPILL_WEIGHT shared-memory bytes (its store
# and load go through L1, and a miss there to L2). R6 ordered 688 of 797 pairs, R7 729.
SINGLE_BLOCK_PENALTY = 0.4
SPILL_WEIGHT = 2


def model_terms(record: dict) -> dict | None:
    """Per score and SM: ``issue`` (warp instructions / 4), ``l1`` (shared-memory wavefronts, bank
    conflicts included, plus the key loop's spill bytes / 128), ``spill`` (those spill bytes / 128
    alone), ``load`` (EXPOSED_LOAD_CYCLES per iteration of a single-stage loop), ``warps`` and
    ``blocks`` (resident per SM); None without the figures."""
    if not record.get("inst_per_score") or record.get("smem_beq_per_score") is None or not record.get(
            "resident_warps"):
        return None
    tiles, rest = record["config"].split("w", 1)
    block_m, block_n = (int(x) for x in tiles.split("x"))
    warps_per_block, stages = int(rest.split("s")[0]), int(rest.split("s")[1].split("r")[0])
    spill = (record.get("local_bytes_per_score") or 0) / WAVEFRONT_BYTES
    return {"issue": record["inst_per_score"] / 32 / ISSUE_PER_CYCLE,
            "l1": record["smem_beq_per_score"] / WAVEFRONT_BYTES + spill, "spill": spill,
            "load": EXPOSED_LOAD_CYCLES / (block_m * block_n) if stages == 1 else 0.0,
            "warps": record["resident_warps"], "blocks": record["resident_warps"] // warps_per_block}


# The candidate rules of bench/NOTES.md ("What ranks real speed"), cycles per score up to a constant;
# MODEL is the one the report predicts with (the one that ordered the most measured pairs).
RULES = {
    "R0": lambda t: t["issue"],
    "R1": lambda t: max(t["issue"], t["l1"]),
    "R2": lambda t: t["issue"] + t["l1"],
    "R3": lambda t: (t["issue"] + t["l1"]) * LATENCY_WARPS / min(t["warps"], LATENCY_WARPS),
    "R4": lambda t: (t["issue"] + t["l1"] + t["load"]) * LATENCY_WARPS / min(t["warps"], LATENCY_WARPS),
    "R5": lambda t: t["issue"] + t["l1"] + t["load"],
    "R6": lambda t: (t["issue"] + t["l1"] + t["load"]) * (LATENCY_WARPS / min(t["warps"], LATENCY_WARPS))
    ** WARPS_EXPONENT,
    "R7": lambda t: (t["issue"] + t["l1"] + (SPILL_WEIGHT - 1) * t["spill"] + t["load"])
    * (LATENCY_WARPS / min(t["warps"], LATENCY_WARPS)) ** WARPS_EXPONENT
    * (1 + SINGLE_BLOCK_PENALTY * (t["blocks"] == 1)),
}
MODEL = "R7"


def predicted_cycles(record: dict, rule: str = MODEL) -> float | None:
    """The time model's cycles per score per SM of a binary (``RULES[rule]``), None without figures."""
    terms = model_terms(record)
    return None if terms is None else round(RULES[rule](terms), 4)




# --------------------------------------------------------------------------------------------------
# Like-for-like comparisons and the summary
# --------------------------------------------------------------------------------------------------


def attach_ratios(records: list, references: list) -> None:
    """``ratio_to_reference``: inst/score over the reference's of ``REFERENCE_ROLE`` at the same
    arch, D and config (tiles, warps, stages, maxnreg), nothing else; ``reference``: that binary's
    figures, or ``error`` when it has none."""
    by_config = {(r["arch"], r["D"], r["config"], r["role"]): r for r in references}
    for record in records:
        if record.get("dtype", "bf16") != "bf16":
            record.update(ratio_to_reference=None, reference={"error": "the reference is compiled in bf16 only"})
            continue
        ref = by_config.get((record["arch"], record["D"], record["config"], REFERENCE_ROLE[record["role"]]))
        if ref is None:
            record.update(ratio_to_reference=None, reference={"error": "not compiled"})
            continue
        if ref.get("error") or not ref.get("inst_per_score"):
            record.update(ratio_to_reference=None,
                          reference={"kernel": ref["kernel"], "error": ref.get("error") or "no key loop"})
            continue
        record["reference"] = {k: ref.get(k) for k in ("kernel", "inst_per_score", "regs", "spill_bytes", "smem_bytes",
                                                       "launchable", "smem_bytes_per_score", "smem_beq_per_score",
                                                       "resident_warps", "predicted")}
        record["ratio_to_reference"] = (round(record["inst_per_score"] / ref["inst_per_score"], 2)
                                        if record.get("inst_per_score") else None)


def _without_dropout(label: str) -> str:
    return "+".join(part for part in label.split("+") if part != "dropout")


def attach_dropout_overhead(records: list) -> None:
    """``dropout_overhead`` of a dropout binary: its inst/score over the binary of the same arch,
    kernel, role (one kernel serves dK/dV and its fix-up), D and config in the same scenario without
    dropout (null when that was not compiled)."""
    by_scenario = {(r["arch"], r["kernel"], r.get("role"), r["D"], r["config"], label): r
                   for r in records for label in r["scenarios"]}
    for record in records:
        dropped = [label for label in record["scenarios"] if "dropout" in label.split("+")]
        if not dropped:
            continue
        base = by_scenario.get((record["arch"], record["kernel"], record.get("role"), record["D"], record["config"],
                                _without_dropout(dropped[0])))
        ok = base is not None and base.get("inst_per_score") and record.get("inst_per_score")
        record["dropout_overhead"] = round(record["inst_per_score"] / base["inst_per_score"], 2) if ok else None


def _worst(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def config_figures(binaries: list) -> dict:
    """One config of one (arch, D, role) over its binaries (one per scenario group): launchable if
    all are, its worst figures, and the ratio and inst/score of the binaries without dropout."""
    plain = [b for b in binaries if "dropout_overhead" not in b] or binaries
    return {
        "config": binaries[0]["config"], "candidate": binaries[0].get("candidate"),
        "launchable": all(b.get("launchable") for b in binaries), "errors": sum(1 for b in binaries if b.get("error")),
        "regs": _worst(b.get("regs") for b in binaries), "spill_bytes": _worst(b.get("spill_bytes") for b in binaries),
        "smem_bytes": _worst(b.get("smem_bytes") for b in binaries),
        "mma": sorted({b["mma"] for b in binaries if b.get("mma")}),
        "inst_per_score": _worst(b.get("inst_per_score") for b in plain),
        "ratio_to_reference": _worst(b.get("ratio_to_reference") for b in plain),
        "dropout_overhead": _worst(b.get("dropout_overhead") for b in binaries),
        "smem_bytes_per_score": _worst(b.get("smem_bytes_per_score") for b in plain),
        "smem_beq_per_score": _worst(b.get("smem_beq_per_score") for b in plain),
        "resident_warps": min((b["resident_warps"] for b in binaries if b.get("resident_warps")), default=None),
        "predicted": _worst(b.get("predicted") for b in plain),
        "cliff": any(b.get("launchable") and b.get("regs", REGISTER_CLIFF) < REGISTER_CLIFF and b.get("spill_bytes")
                     for b in binaries),
    }


def summarise(records: list, all_candidates: bool = True, references: list | None = None) -> list:
    """Per (arch, D, role, dtype): the configs' figures (``config_figures``), ``best`` (the
    launchable spill-free config with the lowest inst/score, those on the arch's own tensor-core path
    first, else likewise within the spill cap), ``fastest`` (the launchable config the time model
    predicts fastest, what an autotuner would pick) with ``predicted_ratio`` (its predicted time
    over the reference's at ``REFERENCE_CONFIG``, from ``references``),
    ``problems`` against issue 20's targets and ``regressions`` (the gate: ``regressions``);
    ``all_candidates``: whether every candidate config was compiled, which the count of launchable
    ones needs. The ratio caps are bf16's (the reference is bf16)."""
    from xlnet_fast.kernels import rel_attention

    own = {(r["arch"], r["D"], r["role"]): r for r in references or [] if r.get("config") == REFERENCE_CONFIG}

    groups: dict = {}
    for r in records:
        key = (r["arch"], r["D"], r["role"], r.get("dtype", "bf16"))
        groups.setdefault(key, {}).setdefault(r["config"], []).append(r)
    out = []
    for (arch, D, role, dtype), by_config in sorted(groups.items(), key=lambda item: (item[0][3] != "bf16", item[0])):
        configs = sorted((config_figures(b) for b in by_config.values()),
                         key=lambda c: (c["candidate"] is None, c["candidate"] or 0, c["config"]))
        launchable = [c for c in configs if c["launchable"] and not c["errors"]]
        cap = spill_cap(arch, D)
        within = [c for c in launchable if c["spill_bytes"] <= (cap or 0) and c["inst_per_score"] is not None]
        expected = None if role in CHECKS_ONLY else EXPECTED_MMA.get(rel_attention.arch_family(arch))
        # the arch's own tensor-core path first: its MMA issues far more work per instruction
        best = min(within, key=lambda c: (c["spill_bytes"] > 0, bool(expected) and c["mma"] != [expected],
                                          c["inst_per_score"]), default=None)
        least_spill = min(launchable, key=lambda c: (c["spill_bytes"], c["inst_per_score"] or 0), default=None)
        problems = [f"{c['config']}: {c['errors']} binaries failed to compile" for c in configs if c["errors"]]
        problems += [f"{c['config']}: register cliff ({c['regs']} registers, {c['spill_bytes']} B of spill)"
                     for c in configs if c["cliff"]]
        if all_candidates and D <= 128 and len(launchable) < MIN_LAUNCHABLE:
            problems.append(f"{len(launchable)} launchable configs (target: at least {MIN_LAUNCHABLE})")
        if not launchable:
            problems.append("no launchable config")
        elif best is None and cap is not None:
            problems.append(f"no launchable config within {cap} B of spill (least: {least_spill['config']}, "
                            f"{least_spill['spill_bytes']} B)")
        if best is not None:
            if expected and best["mma"] != [expected]:
                problems.append(f"{best['config']}: MMA {'/'.join(best['mma'])}, not {expected}")
            ratio_cap = RATIO_CAPS.get((arch, D), {}).get(role) if dtype == "bf16" else None
            if ratio_cap is not None and best["ratio_to_reference"] is None:
                problems.append(f"{best['config']}: no ratio to the reference at this config (cap {ratio_cap}x)")
            elif ratio_cap is not None and best["ratio_to_reference"] > ratio_cap:
                problems.append(f"{best['config']}: {best['ratio_to_reference']}x the reference (cap {ratio_cap}x)")
            if (role not in CHECKS_ONLY and best["dropout_overhead"] is not None
                    and best["dropout_overhead"] > DROPOUT_OVERHEAD_CAP):
                problems.append(f"{best['config']}: dropout {best['dropout_overhead']}x (cap {DROPOUT_OVERHEAD_CAP}x)")
        timed = [c for c in launchable if c["predicted"] is not None]
        fastest = min(timed, key=lambda c: c["predicted"], default=None)
        reference = own.get((arch, D, REFERENCE_ROLE.get(role)))
        predicted_ratio = (round(fastest["predicted"] / reference["predicted"], 2) if fastest and dtype == "bf16"
                           and role not in CHECKS_ONLY and reference and reference.get("predicted") else None)
        entry = {"arch": arch, "D": D, "role": role, "dtype": dtype, "compiled": len(configs),
                 "launchable": len(launchable), "spill_cap": cap, "best": best,
                 "least_spill": None if best else least_spill, "fastest": fastest,
                 "predicted_ratio": predicted_ratio, "problems": problems, "configs": configs}
        entry["regressions"] = regressions(entry, all_candidates)
        out.append(entry)
    return out


def _wgmma_fits(config: str, role: str) -> bool:
    """Whether a config named like ``64x64w4s1`` gives Hopper's warpgroup MMA what it needs: a
    warpgroup (4 warps) and 64 rows of the tile the kernel owns (query rows in fwd and dQ, key or
    k_r rows in dK/dV and dk_r)."""
    try:
        tiles, rest = config.split("w", 1)
        block_m, block_n = (int(x) for x in tiles.split("x"))
        warps = int(rest.split("s")[0])
    except ValueError:
        return False
    return warps >= 4 and (block_n if role in ("dkdv", "dkr") else block_m) >= WGMMA_MIN_ROWS


def regressions(s: dict, all_candidates: bool = True, version: str | None = None) -> list:
    """What the regression gate (``--gate``, the CI test) finds in one summary entry: ``limits``
    (issue 20's targets, or the measured ceiling of ``SHORTFALLS`` where a target is not met) at the
    chosen config (``best``, else ``least_spill``); at every config, a failed compile, a register
    cliff, or a missing tensor-core path (no MMA at all; on sm_90 a build of 64-row or taller
    tiles without wgmma)."""
    from xlnet_fast.kernels import rel_attention

    arch, D, role = s["arch"], s["D"], s["role"]
    limit = limits(arch, D, role, version)
    if s.get("dtype", "bf16") != "bf16":  # the targets are for bf16: fp32 builds get the per-config checks
        limit.update(ratio=None, spill=None, dropout=math.inf, launchable=0, mma=None, predicted_ratio=None)
    found = [f"{c['config']}: {c['errors']} binaries failed to compile" for c in s["configs"] if c["errors"]]
    found += [f"{c['config']}: register cliff ({c['regs']} registers, {c['spill_bytes']} B of spill)"
              for c in s["configs"] if c["cliff"]]
    runs = [c for c in s["configs"] if c["launchable"] and not c["errors"]]  # (a build over its limits may trap)
    found += [f"{c['config']}: no tensor-core MMA ({'/'.join(c['mma']) or 'no key loop'})"
              for c in runs if not [m for m in c["mma"] if m != "none (FMA)"]]
    if rel_attention.arch_family(arch) == 90 and role not in CHECKS_ONLY:
        found += [f"{c['config']}: {'/'.join(c['mma'])} where wgmma fits" for c in runs
                  if c["mma"] and _wgmma_fits(c["config"], role) and c["mma"] != ["wgmma"]]
    wanted = limit.get("launchable", MIN_LAUNCHABLE)
    if all_candidates and D <= 128 and s["launchable"] < wanted:
        found.append(f"{s['launchable']} launchable configs (gate: at least {wanted})")
    chosen = s["best"] or s["least_spill"]
    if chosen is None:
        return found + ["no launchable config"]
    name = chosen["config"]
    if limit["spill"] is not None and chosen["spill_bytes"] > limit["spill"]:
        found.append(f"{name}: {chosen['spill_bytes']} B of spill (gate: {limit['spill']} B)")
    if limit["mma"] and "/".join(chosen["mma"]) != limit["mma"]:  # a build can mix, e.g. "mma.sync/wgmma"
        found.append(f"{name}: MMA {'/'.join(chosen['mma'])} (gate: {limit['mma']})")
    if limit["ratio"] is not None and (chosen["ratio_to_reference"] is None
                                       or chosen["ratio_to_reference"] > limit["ratio"]):
        found.append(f"{name}: {number(chosen['ratio_to_reference'])}x the reference (gate: {limit['ratio']}x)")
    if chosen["dropout_overhead"] is not None and chosen["dropout_overhead"] > limit["dropout"]:
        found.append(f"{name}: dropout {chosen['dropout_overhead']}x (gate: {limit['dropout']}x)")
    ceiling = limit.get("predicted_ratio")
    if ceiling is not None and s.get("fastest") is not None:
        if s.get("predicted_ratio") is None:
            found.append(f"{s['fastest']['config']}: no predicted time for it or the reference (gate: "
                         f"{ceiling}x predicted)")
        elif s["predicted_ratio"] > ceiling:
            found.append(f"{s['fastest']['config']}: predicted {s['predicted_ratio']}x the reference's time "
                         f"(gate: {ceiling}x)")
    return found


def number(value, fmt="{:g}") -> str:
    """``value`` formatted, ``-`` for None."""
    return "-" if value is None else fmt.format(value)


# --------------------------------------------------------------------------------------------------
# Calibration: the rules against the GPU runs' kernel times
# --------------------------------------------------------------------------------------------------

TIMED_KERNELS = {"fwd_kernel_tuned": "fwd", "bwd_kv_kernel_tuned": "dkdv", "bwd_q_kernel_tuned": "dq"}
KERNEL_TIMES = "kernel_times.json"  # the times not in a campaign's autotune records
ORDER_TIE = 0.03  # two measured times closer than this are a tie: their order is not scored


def measured_times(results_dir) -> list:
    """Every measured kernel time the calibration uses: each config's time from the autotune records
    of ``campaign_*.jsonl`` (the content launch: bf16, segments and ranks, no dropout; the GPU's arch
    from the run's environment record) and the entries of ``kernel_times.json``. Rows: ``gpu``,
    ``arch``, ``role``, ``kernel`` (xlnet_fast or fa2_ref), ``config``, ``qlen``, ``ms``, ``run`` (the
    file), ``source``."""
    import json
    from pathlib import Path

    rows, results_dir = [], Path(results_dir)
    kept = json.loads((results_dir / KERNEL_TIMES).read_text())
    for path in sorted(results_dir.glob("campaign_*.jsonl")):
        archs = {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("op") == "environment" and r.get("capability"):
                major, minor = r["capability"].split(".")
                archs[r["run"]] = 10 * int(major) + int(minor)
            key = r.get("key") or {}
            if (r.get("op") != "autotune" or not r.get("timings_ms") or r.get("kernel") not in TIMED_KERNELS
                    or key.get("DOT_DTYPE") != "bf16" or key.get("DROPOUT") or not key.get("SEGMENTS")
                    or r["run"] not in archs or key.get("TMA") is False):
                # TMA False: the pointer path timed beside the descriptors' (kernels.pointer_loads());
                # the records hold the descriptor builds it would be scored against
                continue
            gpu = r["device"].replace("NVIDIA ", "").split()[0]
            batch = int(re.search(r"\bB=(\d+)", r["context"]).group(1))
            # the dQ kernel timed before it could read a stored dS (FROM_DS) recomputed it
            role = TIMED_KERNELS[r["kernel"]]
            role = "dq_recompute" if role == "dq" and not key.get("FROM_DS") else role
            rows += [{"gpu": gpu, "arch": archs[r["run"]], "role": role, "kernel": "xlnet_fast",
                      "config": config, "D": key["HEAD_DIM"], "qlen": key["M"], "ms": ms,
                      "scores": batch * kept["campaign_heads"] * key["M"] * key["N_KEYS"],
                      "run": path.name, "source": f"{path.name}: {r['context']}"}
                     for config, ms in r["timings_ms"].items()]
    shape = kept["shape_fields"]
    return rows + [{"D": shape["D"], "qlen": shape["qlen"], "run": KERNEL_TIMES,
                    "scores": shape["B"] * shape["H"] * shape["qlen"] * (shape["qlen"] + shape["mlen"]), **row}
                   for row in kept["times"]]


def _binary(records: list, references: list, row: dict) -> dict | None:
    """The compiled binary a measured time belongs to: the content launch's, without dropout, bf16."""
    if row["kernel"] == "fa2_ref":
        found = [r for r in references if (r["arch"], r["D"], r["role"], r["config"]) ==
                 (row["arch"], row["D"], row["role"], row["config"])]
    else:
        found = [r for r in records if (r["arch"], r["D"], r["role"], r["config"]) ==
                 (row["arch"], row["D"], row["role"], row["config"]) and r.get("dtype", "bf16") == "bf16"
                 and any(label == "content" for label in r["scenarios"])]
    return found[0] if found else None


def calibration(records: list, references: list, times: list) -> dict:
    """Each rule of ``RULES`` against the measured times: ``rows`` (a measured time with its binary's
    figures and each rule's prediction), ``orders`` (rule -> [right, scored]: pairs of one kernel's
    configs timed in one run on one GPU at one shape, measured ORDER_TIE or more apart), ``ratios`` (per GPU and
    kernel: our kernel's time over the reference's, measured and by each rule) and ``scale`` (per
    rule, milliseconds per predicted cycle per score: the geometric mean over our measured kernels)."""
    rows = []
    for row in times:
        binary = _binary(records, references, row)
        if binary is None or model_terms(binary) is None:
            rows.append({**row, "binary": None})
            continue
        rows.append({**row, "binary": {k: binary.get(k) for k in (
            "inst_per_score", "smem_bytes_per_score", "smem_beq_per_score", "local_bytes_per_score", "regs",
            "smem_bytes", "resident_warps", "spill_bytes")},
            "predicted": {rule: RULES[rule](model_terms(binary)) for rule in RULES}})
    known = [r for r in rows if r["binary"]]
    orders = {rule: [0, 0] for rule in RULES}
    groups: dict = {}
    for r in known:
        if r["kernel"] == "xlnet_fast":
            # one run (a later run times other kernels) and one shape (the same length can come at
            # two (B, mlen), as 2048/0 and 2048/384 did, and at two head dims)
            groups.setdefault((r["run"], r["gpu"], r["role"], r["D"], r["qlen"], r["scores"]), []).append(r)
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if abs(a["ms"] / b["ms"] - 1) < ORDER_TIE:
                    continue
                for rule in RULES:
                    orders[rule][1] += 1
                    orders[rule][0] += (a["ms"] < b["ms"]) == (a["predicted"][rule] < b["predicted"][rule])
    ratios = []
    for ref in (r for r in known if r["kernel"] == "fa2_ref"):
        ours = [r for r in known if r["kernel"] == "xlnet_fast" and (r["gpu"], REFERENCE_ROLE[r["role"]], r["qlen"]) ==
                (ref["gpu"], ref["role"], ref["qlen"])]
        if ours:
            fastest = min(ours, key=lambda r: r["ms"])
            ratios.append({"gpu": ref["gpu"], "role": fastest["role"], "config": fastest["config"], "ours": fastest,
                           "reference": ref, "measured": fastest["ms"] / ref["ms"],
                           "predicted": {rule: fastest["predicted"][rule] / ref["predicted"][rule] for rule in RULES}})
    scale = {}
    for rule in RULES:
        logs = [math.log(r["ms"] / (r["predicted"][rule] * r["scores"])) for r in known if r["kernel"] == "xlnet_fast"]
        scale[rule] = math.exp(sum(logs) / len(logs)) if logs else None
    for r in known:
        r["predicted_ms"] = {rule: scale[rule] * r["predicted"][rule] * r["scores"] for rule in RULES}
    for x in ratios:  # our predicted time over the reference's measured one
        x["calibrated"] = {rule: x["ours"]["predicted_ms"][rule] / x["reference"]["ms"] for rule in RULES}
    return {"rows": rows, "orders": orders, "ratios": ratios, "scale": scale}


def calibration_markdown(found: dict) -> str:
    """The calibration as NOTES' tables: the measured kernels with their static figures and each
    rule's predicted time (ms: the rule's cycles per score times its scale), the pairs each rule
    orders right, and the ratios to the reference."""
    rules = list(RULES)
    head = ("| GPU | kernel | config | qlen | measured ms | inst/score | smem B/score | smem B-eq/score "
            "| spill B/score | warps/SM | " + " | ".join(f"{rule} ms" for rule in rules) + " |")
    lines = [head, "|" + "---|" * (10 + len(rules))]
    order = {"fwd": 0, "dkdv": 1, "dq": 2, "dq_recompute": 3}
    for r in sorted(found["rows"], key=lambda r: (r["gpu"], order.get(r["role"], 9), r["kernel"] != "xlnet_fast",
                                                  r["qlen"], r["ms"])):
        name = {"fwd": "forward", "dkdv": "dK/dV", "dq": "dQ", "dq_recompute": "dQ recomputing dS"}.get(r["role"], r["role"])
        name += "" if r["kernel"] == "xlnet_fast" else " (FA2 ref)"
        b = r["binary"]
        if b is None:
            lines.append(f"| {r['gpu']} | {name} | {r['config']} | {r['qlen']} | {r['ms']:.3f} | "
                         "no binary in the records |" + " |" * (5 + len(rules)))
            continue
        cells = [f"{r['predicted_ms'][rule]:.3f}" for rule in rules]
        lines.append(f"| {r['gpu']} | {name} | {r['config']} | {r['qlen']} | {r['ms']:.3f} | "
                     f"{b['inst_per_score']:.1f} | "
                     f"{b['smem_bytes_per_score']:.1f} | {b['smem_beq_per_score']:.1f} | "
                     f"{b['local_bytes_per_score'] or 0:.1f} | {b['resident_warps']} | " + " | ".join(cells) + " |")
    lines += ["", "Per rule: the pairs of one kernel's configs (one GPU, one length, measured "
              f"{ORDER_TIE:.0%} or more apart) it orders right; each kernel's time over the FA2 reference's, "
              "the rule's own ratio, then (calibrated) the rule's predicted time of ours (its scale fitted on our "
              "measured kernels) over the reference's measured time.", "",
              "| rule | pairs ordered right | " + " | ".join(
                  f"{x['gpu']} {x['role']} x FA2 (measured {x['measured']:.2f})" for x in found["ratios"]) + " |",
              "|---|---|" + "---|" * len(found["ratios"])]
    for rule in rules:
        right, scored = found["orders"][rule]
        lines.append(f"| {rule}{' (MODEL)' if rule == MODEL else ''} | {right}/{scored} | "
                     + " | ".join(f"{x['predicted'][rule]:.2f} (calibrated {x['calibrated'][rule]:.2f})"
                                  for x in found["ratios"]) + " |")
    return "\n".join(lines)
