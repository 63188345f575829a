"""The compile report's launches: the op's scenarios, the Triton launches they make for an arch,
each distinct binary compiled and analysed (``aot``, ``sass``), and cached.

Per iteration: the key loop's own instructions, each once, plus its nested loops once each (static
counts; ``key_loop.nested_loops`` lists their sizes). With the scenarios here (content and
two-stream rows, every tile banded) the kernels' only nested source loop, the deterministic dk_r
kernel's k_r window loop, runs exactly once per key tile (a banded tile's rows span < BLOCK_M <=
BLOCK_N positions, which one window of 2*BLOCK_N rows covers; replaying the launches in triton's
interpreter counted 1.00 too); on sm_100 the other nested loops are 2-instruction mbarrier waits.
Per score element: per-iteration count x threads / (BLOCK_M x BLOCK_N).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from bench import attention, cases, runner
from bench.compiler import aot, sass
from bench.compiler.targets import REFERENCE_CONFIG, REFERENCE_ROLE, launchability, number

ROLES = ("fwd", "dkdv", "dq", "dkr", "fixup", "dq_recompute", "dkr_recompute")
# The reference's own tiles: what bench.attention's fa2_ref provider times on a GPU, so the model's
# ratio to the reference can be compared with a GPU's.
REFERENCE_TRITON_CONFIG = triton.Config({k: attention.FA2_REF_TILES[k] for k in ("BLOCK_M", "BLOCK_N")},
                                        num_warps=attention.FA2_REF_TILES["num_warps"],
                                        num_stages=attention.FA2_REF_TILES["num_stages"])
CACHE = "compile_report_cache"  # analysed binaries, in the cache directory
# Seconds one worker takes per binary, compile + ptxas + nvdisasm (measured with triton 3.6: 1,154
# binaries in 19 minutes on 2 workers; the full matrix is 1,040 since dK/dV's content and two-stream
# launches share their binaries).
SECONDS_PER_COMPILE = 2
COUNTED = ("inst", "mma", "shfl", "lds", "sts", "ldl", "stl", "ldg", "stg", "bar", "mufu")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp32-tf32": torch.float32}  # --dtype

# --------------------------------------------------------------------------------------------------
# Scenarios: the only code that knows the op's arguments
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One realistic call of the op: XLNet-large width (H*D = 1024), bf16, ranks + segments, memory."""

    D: int
    stream: str  # "content" or "two-stream" (content rows + target rows in one launch)
    dropout: bool
    deterministic: bool
    dtype: str = "bf16"  # "bf16", "fp32" (torch's default: TF32 off, the kernels' tf32x3) or "fp32-tf32"
    batch: int = 16
    qlen: int = 512
    mlen: int = 384
    targets: int = 85

    @property
    def heads(self) -> int:
        return 1024 // self.D

    @property
    def label(self) -> str:
        return "+".join([self.stream] + (["dropout"] * self.dropout) + (["det"] * self.deterministic)
                        + ([self.dtype] if self.dtype != "bf16" else []))


def attention_case(case: Case) -> cases.AttentionCase:
    """The op's inputs for the scenario: pretraining ranks (the targets last in the order)."""
    return cases.AttentionCase(B=case.batch, H=case.heads, qlen=case.qlen, mlen=case.mlen, D=case.D,
                               dtype=DTYPES[case.dtype], targets=case.targets, two_stream=case.stream == "two-stream",
                               ranks="pretraining")


def op_calls(case: Case, device: str = "meta") -> list:
    """THE SCENARIO BUILDER. ``[(phase, call)]``: calls of the op's launch code (its mask tables, forward, then
    backward) on the inputs ``bench.cases`` builds for the scenario, on ``device`` ("meta": compile
    only). Adapt this function, and only it, when the launch code's arguments change."""
    from xlnet_fast import kernels
    from xlnet_fast.attention import prepare_masks, prepare_two_stream_masks
    from xlnet_fast.attention.args import validate

    inputs = cases.attention_inputs(attention_case(case), device)
    floats, index = inputs.floats, inputs.index
    B, L = case.batch, case.qlen
    K = L + case.mlen
    masks = dict(q_seg=index["q_seg"], k_seg=index["k_seg"], q_rank=index["q_rank"], k_rank=index["k_rank"])
    if case.stream == "two-stream":  # as the model's layers call rel_attention_two_stream
        q, q_g = floats["q_h"], floats["q_g"]
        prepared = prepare_two_stream_masks(B, L, K, device=device, target_pos=index["target_pos"], backend="eager",
                                            **masks)
    else:
        q, q_g = floats["q"], None
        prepared = prepare_masks(B, L, K, device=device, backend="eager", **masks)
    if device == "cpu":  # values the recorded launches read: the skew's lanes follow the row tables
        prepared.rows_table, prepared.keys_table = interpreted_tables(prepared)
    k, v, k_r, r_w_bias, r_r_bias = (floats[n] for n in ("k", "v", "k_r", "r_w_bias", "r_r_bias"))
    args = validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=floats["r_s_bias"], seg_embed=floats["seg_embed"],
                    q_g=q_g, masks=prepared, scale=1.0 / math.sqrt(case.D), dropout_p=0.1 if case.dropout else 0.0)
    if case.dropout:  # the op draws it per call on the device
        args.seed = torch.randint(0, 2**48, (), dtype=torch.int64, generator=torch.Generator().manual_seed(0)).to(device)
    saved = {}

    def forward():
        with _tf32(case.dtype == "fp32-tf32"):
            saved["out"], saved["lse"] = kernels.forward(q, k, v, k_r, r_w_bias, r_r_bias, args)

    def backward():
        with _tf32(case.dtype == "fp32-tf32"):
            kernels.backward(cases.random_like(q, seed=1), q, k, v, k_r, r_w_bias, r_r_bias, args, saved["out"],
                             saved["lse"], dout_g=None if q_g is None else cases.random_like(q_g, seed=2),
                             deterministic=case.deterministic)

    def backward_recomputing_ds():  # as calls too large to keep dS (kernels.STORED_DS_BYTES) run it
        with _stored_ds_bytes(0):
            backward()

    def tables():  # the kernels (on the CPU the values above, interpreted, are what the others read)
        kernels.mask_tables(prepared, prepared.batch, prepared.rows, prepared.keys, device)

    return [("mask tables", tables), ("forward", forward), ("backward", backward),
            ("backward recomputing dS", backward_recomputing_ds)]


def interpreted_tables(masks) -> tuple:
    """The mask tables of ``masks`` (``PreparedMasks`` on the CPU) as the launcher builds them on a
    GPU, by its kernels (``kernels/tables.py``) run in triton's interpreter in this compiling process,
    a program per batch row's rows and one per its keys (what the report compiles is the GPU's);
    ~4 s a set of masks, kept per set (the scenarios share theirs across dropout, determinism, D and
    arch)."""
    fields = [masks.batch, masks.rows, masks.keys, masks.qlen, masks.self_rows, masks.attn_mask is None]
    for t in (masks.q_seg, masks.k_seg, masks.q_rank, masks.k_rank, masks.q_pos):
        fields.append(None if t is None else (t.dtype, tuple(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest()))
    key = tuple(fields)
    if key not in _INTERPRETED_TABLES:
        _INTERPRETED_TABLES[key] = _interpret_tables(masks)
    return tuple(t.clone() for t in _INTERPRETED_TABLES[key])


_INTERPRETED_TABLES: dict = {}


def _interpret_tables(masks) -> tuple:
    """``interpreted_tables``' work: the launcher's tables with a batch row's rows (keys) per program."""
    from xlnet_fast import kernels
    from xlnet_fast.kernels import tables

    blocks = tables.BLOCK_ROWS, tables.BLOCK_KEYS
    tables.BLOCK_ROWS = triton.next_power_of_2(masks.rows)
    tables.BLOCK_KEYS = max(triton.next_power_of_2(masks.keys), blocks[1])
    try:
        with aot.interpreting():
            return kernels.mask_tables(masks, masks.batch, masks.rows, masks.keys, masks.device)
    finally:
        tables.BLOCK_ROWS, tables.BLOCK_KEYS = blocks


@contextlib.contextmanager
def _stored_ds_bytes(limit: int):
    """The launcher's limit on the dS it keeps for the dQ and dk_r kernels set to ``limit``, its
    call plans made afresh under it and after."""
    from xlnet_fast import kernels

    saved = kernels.STORED_DS_BYTES
    kernels.STORED_DS_BYTES = limit
    kernels.clear_launches()
    try:
        yield
    finally:
        kernels.STORED_DS_BYTES = saved
        kernels.clear_launches()


@contextlib.contextmanager
def _tf32(allowed: bool):
    """torch's switch for TF32 matmuls, which the launcher follows for fp32 inputs
    (``kernels.fp32_precision``)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def reference_calls(case: Case, tiles: dict) -> list:
    """``[(phase, call)]`` of the FlashAttention-2 reference at the case's B, H, D and lengths
    (qlen queries, mlen + qlen keys), bf16, meta tensors; ``tiles``: BLOCK_M, BLOCK_N and launch
    options (num_warps, num_stages, maxnreg)."""
    from bench.compiler import fa2_reference

    B, H, D, M, N = case.batch, case.heads, case.D, case.qlen, case.qlen + case.mlen

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, k, v = t(B, M, H, D), t(B, N, H, D), t(B, N, H, D)
    scale = 1.0 / math.sqrt(D)
    return [("forward", lambda: fa2_reference.forward(q, k, v, scale, **tiles)),
            ("backward", lambda: fa2_reference.backward(t(B, M, H, D), q, k, v, t(B, M, H, D),
                                                        t(B, H, M, dtype=torch.float32), scale, **tiles))]


# --------------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _roles_from_pruning(recorder: aot.Recorder):
    """Label each launch with the role (and candidate list) the launch code asked
    ``rel_attention.configs_for`` for just before it (``kernels._run`` under ``compiling_for``, or an
    autotuner's pruning)."""
    from xlnet_fast.kernels import rel_attention

    configs_for = rel_attention.configs_for

    def spy(arch, head_dim, role):
        configs = configs_for(arch, head_dim, role)
        recorder.labels.update(role=role, candidates=[rel_attention.config_name(c) for c in configs])
        return configs

    rel_attention.configs_for = spy
    try:
        yield
    finally:
        rel_attention.configs_for = configs_for


def capture(calls, arch: int) -> list:
    """The launches the calls (``[(phase, call)]``; the phase names them for readers) make for a GPU
    of ``arch``."""
    from xlnet_fast.kernels import rel_attention

    with aot.capture_launches() as recorder, rel_attention.compiling_for(arch), _roles_from_pruning(recorder):
        for _phase, call in calls:
            call()
    if not recorder.launches:
        raise RuntimeError("no Triton launch was recorded: were the kernels imported with TRITON_INTERPRET=1?")
    return recorder.launches


def launch_config(launch: aot.Launch) -> triton.Config:
    """The launch's tiles and options as a ``triton.Config`` (the autotuner's, when autotuned)."""
    if launch.config is not None:
        return launch.config
    k = launch.kwargs
    return triton.Config({"BLOCK_M": k.get("BLOCK_M"), "BLOCK_N": k.get("BLOCK_N")}, num_warps=k.get("num_warps", 4),
                         num_stages=k.get("num_stages", 3), maxnreg=k.get("maxnreg"))


def config_name(launch: aot.Launch) -> str:
    from xlnet_fast.kernels import rel_attention

    return rel_attention.config_name(launch_config(launch))


def _flags(launch: aot.Launch) -> dict:
    def plain(value):
        return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)

    return {k: plain(v) for k, v in sorted(launch.constexprs().items()) if k not in ("BLOCK_M", "BLOCK_N")}


@dataclass
class Task:
    """One binary to compile: a launch for an arch, and what the report says about it."""

    arch: int
    launch: aot.Launch
    key: str  # aot.compile_key
    info: dict  # the record's fields known before compiling


def op_tasks(arch: int, scenarios: list, configs: set, first_only: bool) -> tuple[list, list]:
    """One task per distinct binary the scenarios' launches make on ``arch``: the attention kernels'
    (at ``configs``, or the first candidate only), and apart the operand kernels' (``operands.py``:
    one pass over their inputs each, no config to choose and nothing to compare with) and the mask
    tables' (``tables.py``, role "tables": once per set of masks)."""
    from xlnet_fast.kernels import operands, tables

    tasks: dict = {}
    operand_tasks: dict = {}
    for case in scenarios:
        # on the CPU: the launcher's row tables hold values (they place the skew's gather, which
        # smem_traffic follows); the float tensors are kept as meta tensors (aot.capture_launches)
        for launch in capture(op_calls(case, "cpu"), arch):
            name, labels = config_name(launch), launch.labels
            if launch.fn in operands.KERNELS or launch.fn in tables.KERNELS:
                key = aot.compile_key(launch, arch)
                role = "operands" if launch.fn in operands.KERNELS else "tables"
                operand_tasks.setdefault(key, Task(arch, launch, key, {
                    "arch": arch, "kernel": launch.name, "role": role, "candidate": None, "D": case.D,
                    "dtype": case.dtype, "scenarios": [], "flags": _flags(launch), "config": name}))
                operand_tasks[key].info["scenarios"].append(case.label)
                continue
            if "role" not in labels:
                raise RuntimeError(f"{launch.name} was launched without asking rel_attention.configs_for for "
                                   "its candidates: no role to report it under")
            candidate = labels["candidates"].index(name) if name in labels["candidates"] else None
            if (configs and name not in configs) or (first_only and candidate != 0):
                continue
            key = aot.compile_key(launch, arch)
            if key in tasks:
                tasks[key].info["scenarios"].append(case.label)
                continue
            tasks[key] = Task(arch, launch, key, {
                "arch": arch, "kernel": launch.name, "role": labels["role"], "candidate": candidate, "D": case.D,
                "dtype": case.dtype, "scenarios": [case.label], "flags": _flags(launch), "config": name})
    return list(tasks.values()), list(operand_tasks.values())


def reference_tasks(op: list) -> list:
    """The FlashAttention-2 reference of each op task's reference role at its arch, D and config,
    and at the reference's own config (``REFERENCE_CONFIG``, what the GPU runs time it at)."""
    from bench.compiler import fa2_reference

    wanted = {(t.arch, t.info["D"], t.info["config"], REFERENCE_ROLE[t.info["role"]]): launch_config(t.launch)
              for t in op if t.info["dtype"] == "bf16"}  # the reference is bf16 only
    for arch, D, _name, role in list(wanted):
        wanted[(arch, D, REFERENCE_CONFIG, role)] = REFERENCE_TRITON_CONFIG
    tasks, launches = [], {}
    for (arch, D, name, role), config in sorted(wanted.items(), key=lambda item: item[0]):
        tiles = {k: v for k, v in config.all_kwargs().items()
                 if k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg")}
        if (arch, D, name) not in launches:
            launches[(arch, D, name)] = capture(reference_calls(Case(D, "content", False, False), tiles), arch)
        for launch in launches[(arch, D, name)]:
            if fa2_reference.ROLES[launch.name] == role:
                tasks.append(Task(arch, launch, aot.compile_key(launch, arch), {
                    "arch": arch, "kernel": launch.name, "role": role, "D": D, "scenarios": ["reference"],
                    "flags": _flags(launch), "config": name}))
    return tasks


# --------------------------------------------------------------------------------------------------
# Compile and count
# --------------------------------------------------------------------------------------------------


def analyse(task: Task) -> dict:
    """What compiling the task's launch gives (``error`` if it fails): registers, spills, memory,
    MMA kind, key-loop counts."""
    launch, arch = task.launch, task.arch
    config = launch_config(launch)
    bm, bn, warps = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps
    try:
        compiled = aot.compile_launch(launch, arch)
    except Exception as exc:  # noqa: BLE001 - one failed compile is a row of the report
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    code = sass.parse(compiled.sass)
    out = {
        "regs": compiled.regs, "spill_bytes": compiled.spill_store_bytes + compiled.spill_load_bytes,
        "spill_store_bytes": compiled.spill_store_bytes, "spill_load_bytes": compiled.spill_load_bytes,
        "stack_bytes": compiled.stack_bytes, "smem_bytes": compiled.smem_bytes, "tmem_columns": compiled.tmem_columns,
        "mma": code.mma_kind(), "threads": warps * 32,
    }
    key_loop = code.key_loop()
    if key_loop is None:
        return {**out, "key_loop": None, "per_iteration": None, "inst_per_score": None, "smem_traffic": None,
                "smem_bytes_per_score": None, "smem_beq_per_score": None, "local_bytes_per_score": None}
    per_score = warps * 32 / (bm * bn)
    counts = sass.per_iteration(key_loop, lambda loop: 1)  # static: nested loops once
    nested = [len(loop.own) for loop in key_loop.descendants()]  # instructions of each nested loop
    traffic = smem_traffic(launch, arch, compiled.ptx, warps * 32, bm * bn)

    def local_bytes(loop):  # spills: one lane's bytes, coalesced
        return sum(sass.access_bytes(i) for each in [loop, *loop.descendants()] for i in each.own
                   if i.base in ("LDL", "STL")) * per_score

    # the forward's key tiles every row sees run in a loop of their own (FREE_TILES): its figures
    # apart, as the time model's columns are the general loop's (a tile that is tested)
    free = [{"address": hex(loop.head),
             "inst_per_score": round(sass.per_iteration(loop, lambda _: 1)["inst"] * per_score, 2),
             "local_bytes_per_score": round(local_bytes(loop), 2)} for loop in code.lighter_twins(key_loop)]
    return {**out, "key_loop": {"address": hex(key_loop.head), "nested_loops": nested},
            "per_iteration": {name: counts.get(name, 0) for name in COUNTED},
            "inst_per_score": round(counts["inst"] * per_score, 2), "smem_traffic": traffic,
            "smem_bytes_per_score": traffic and traffic["bytes_per_score"],
            "smem_beq_per_score": traffic and traffic["beq_per_score"],
            "local_bytes_per_score": round(local_bytes(key_loop), 2), "free_loops": free}


def sampled_programs(grid: tuple) -> list:
    """The CTAs whose key loop ``smem_traffic`` follows: the first, middle and last along the grid's
    first axis (query or key tiles), of the first (batch row, head)."""
    return [((x, 0, 0), grid) for x in sorted({0, grid[0] // 2, grid[0] - 1})]


def smem_traffic(launch: aot.Launch, arch: int, ptx: str, threads: int, scores: int) -> dict | None:
    """Shared-memory bytes and 128-byte wavefronts (bank conflicts included) of one key-loop
    iteration per score (``sass.smem_traffic``: the PTX's lane addresses; the skew's gather placed
    by the launch's own row tables), averaged over ``sampled_programs``; by kind of access (lds/sts,
    ldsm/stsm, ldgsts, the MMA's operand reads: [B/score, B-eq/score]); ``unresolved``: accesses
    whose addresses were not all known (counted conflict-free). When no sampled CTA enters the key
    loop (a FIX_UP launch whose captured masks give it nothing to do) there is no iteration to
    measure: the figures are None and ``not_reached`` says why."""
    try:
        values, memory = aot.lane_inputs(launch, arch)
        found = sass.smem_traffic(ptx, values, memory, threads, sampled_programs(aot.grid_size(launch)))
    except Exception as exc:  # noqa: BLE001 - the report's other figures stand without this one
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "bytes_per_score": None, "beq_per_score": None}
    if found is None:
        return None
    if not found["reached"]:
        return {"bytes_per_score": None, "beq_per_score": None, "by_kind": {}, "unresolved": 0,
                "not_reached": f"none of the {len(sampled_programs(aot.grid_size(launch)))} sampled CTAs enters "
                               "the key loop at the captured launch"}
    return {"bytes_per_score": round(found["bytes"] / scores, 2),
            "beq_per_score": round(128 * found["wavefronts"] / scores, 2),
            "by_kind": {k: [round(b / scores, 2), round(128 * w / scores, 2)]
                        for k, (b, w) in found["by_kind"].items()},
            "unresolved": found["unresolved"]}


def line_profile(task: Task) -> list:
    """Where the task's key loop spends, per source line (the innermost inlined one: a helper's line,
    not its call site), per score: SASS instructions (nested loops once, as ``analyse``) and the
    shared-memory traffic of ``smem_traffic`` (bytes and B-eq, by kind). Rows
    ``{"file", "line", "source", "inst_per_score", "smem_bytes_per_score", "smem_beq_per_score",
    "by_kind"}``, the costliest first; their sums are the record's figures. Lines of no source
    (triton's own) are ``line`` None. Empty without a key loop. The traffic is placed by the PTX's
    ``.loc`` lines, the instructions by nvdisasm's: with triton 3.6 (the GPU machines') a helper's
    own lines; triton 3.9's debug info gives many inlined instructions their call site's line."""
    launch, arch = task.launch, task.arch
    config = launch_config(launch)
    threads, scores = config.num_warps * 32, config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"]
    compiled = aot.compile_launch(launch, arch)
    key_loop = sass.parse(compiled.sass).key_loop()
    if key_loop is None:
        return []
    rows: dict = {}

    def row_of(file, line):
        where = (Path(file).name if file and line is not None else None, line)
        return rows.setdefault(where, {"file": where[0], "line": line, "path": file, "inst_per_score": 0.0,
                                       "smem_bytes_per_score": 0.0, "smem_beq_per_score": 0.0, "by_kind": {}})

    for (file, line), n in key_loop.lines_per_iteration().items():
        row_of(file, line)["inst_per_score"] += n * threads / scores
    unplaced = sum(1 for loop in [key_loop, *key_loop.descendants()] for i in loop.own if i.line is None)
    if unplaced:
        row_of(None, None)["inst_per_score"] += unplaced * threads / scores
    values, memory = aot.lane_inputs(launch, arch)
    found = sass.smem_traffic(compiled.ptx, values, memory, threads, sampled_programs(aot.grid_size(launch)))
    for (file, line), kinds in (found or {}).get("by_line", {}).items():
        row = row_of(file, line)
        for kind, (moved, wavefronts) in kinds.items():
            entry = row["by_kind"].setdefault(kind, [0.0, 0.0])
            entry[0] += moved / scores
            entry[1] += 128 * wavefronts / scores
            row["smem_bytes_per_score"] += moved / scores
            row["smem_beq_per_score"] += 128 * wavefronts / scores
    out = []
    for row in rows.values():
        out.append({**{k: v for k, v in row.items() if k != "path"}, "source": _source_line(row["path"], row["line"]),
                    "inst_per_score": round(row["inst_per_score"], 4),
                    "smem_bytes_per_score": round(row["smem_bytes_per_score"], 4),
                    "smem_beq_per_score": round(row["smem_beq_per_score"], 4),
                    "by_kind": {k: [round(b, 4), round(w, 4)] for k, (b, w) in sorted(row["by_kind"].items())}})
    return sorted(out, key=lambda r: (-r["smem_beq_per_score"], -r["inst_per_score"], r["line"] or 0))


def _source_line(path: str | None, line: int | None) -> str:
    """Line ``line`` of the source file a binary names, stripped (""  if unknown). A binary from
    triton's cache names the checkout it was first compiled in (same source, same lines: triton's key
    holds every function's text and first line); if that is gone, the file of that name beside the
    kernels or the reference here."""
    if not path or line is None:
        return ""
    from xlnet_fast.kernels import rel_attention

    from bench.compiler import fa2_reference

    candidates = [Path(path)] + [Path(m.__file__).parent / Path(path).name for m in (rel_attention, fa2_reference)]
    for candidate in candidates:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            lines = candidate.read_text().splitlines()
            return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return ""


def _analysis_version() -> str:
    """Changes when the code that reads binaries does, or the launcher or kernels that build the tables
    the shared-memory count places its lanes by (the cache's validity: a key names a binary, not the
    values it runs on)."""
    from xlnet_fast import kernels

    source = (inspect.getsource(analyse) + inspect.getsource(smem_traffic) + inspect.getsource(sampled_programs)
              + inspect.getsource(aot) + inspect.getsource(sass) + inspect.getsource(kernels)
              + inspect.getsource(kernels.tables) + inspect.getsource(kernels.contract))
    return hashlib.sha256(f"{triton.__version__}\n{source}".encode()).hexdigest()[:16]


def _cache_path(task: Task, version: str) -> Path:
    return runner.cache_dir() / CACHE / (hashlib.sha256(f"{version}\n{task.key}".encode()).hexdigest() + ".json")


_TASKS: list = []  # what forked workers read (a Launch holds a JITFunction: not picklable)


def _analyse_index(i: int) -> tuple:
    return i, analyse(_TASKS[i])


def compile_all(tasks: list, jobs: int, use_cache: bool = True) -> list:
    """Records of the tasks (cached ones read back), compiled by ``jobs`` forked workers."""
    version = _analysis_version()
    results: dict = {}
    for i, task in enumerate(tasks):
        path = _cache_path(task, version)
        if use_cache and path.exists():
            with contextlib.suppress(OSError, ValueError):
                results[i] = json.loads(path.read_text())
    todo = [i for i in range(len(tasks)) if i not in results]
    log(f"{len(tasks)} binaries, {len(tasks) - len(todo)} in the cache ({runner.cache_dir() / CACHE}): compiling "
        f"{len(todo)} with {jobs} worker(s), about {runner.duration(len(todo) * SECONDS_PER_COMPILE / jobs)} "
        f"at ~{SECONDS_PER_COMPILE} s a binary")
    started = time.perf_counter()

    def done(i, result):
        results[i] = result
        if "error" not in result:
            runner.write_json(_cache_path(tasks[i], version), result)
        log(f"[{len(results) - (len(tasks) - len(todo))}/{len(todo)} {time.perf_counter() - started:.0f} s] "
            + row(launchability({**tasks[i].info, **result})))

    global _TASKS
    _TASKS = tasks
    try:
        if jobs <= 1 or len(todo) <= 1:
            for i in todo:
                done(*_analyse_index(i))
        else:  # fork: the workers inherit the captured launches; the parent compiles nothing
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for i, result in pool.imap_unordered(_analyse_index, todo):
                    done(i, result)
    finally:
        _TASKS = []
    return [launchability({**task.info, **results[i]}) for i, task in enumerate(tasks)]


def log(message: str) -> None:
    """Progress (stderr: stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def row(r: dict) -> str:
    """One binary's row of the table (``ROW_HEADER``)."""
    head = [f"sm_{r['arch']}", r["kernel"], ",".join(r.get("scenarios", [])), str(r["D"]), r["config"]]
    if r.get("error"):
        return " | ".join(head + ["ERROR " + r["error"]])
    it, n = r.get("per_iteration") or {}, number
    smem = f"{r['smem_bytes']}" + ("" if r["launchable"] else " (no launch)")
    return " | ".join(head + [
        str(r["regs"]), f"{r['spill_store_bytes']}+{r['spill_load_bytes']}", smem, n(r.get("tmem_columns")),
        r["mma"], n(it.get("inst")), n(it.get("mma")), n(it.get("shfl")), f"{n(it.get('lds'))}/{n(it.get('sts'))}",
        f"{n(it.get('ldl'))}/{n(it.get('stl'))}", n(r.get("inst_per_score"), "{:.1f}"),
        n(r.get("ratio_to_reference"), "{:.2f}"), n(r.get("dropout_overhead"), "{:.2f}"),
        n(r.get("smem_bytes_per_score"), "{:.1f}"), n(r.get("smem_beq_per_score"), "{:.1f}"),
        n(r.get("resident_warps")),
        n(r.get("predicted"), "{:.2f}"), n((r.get("reference") or {}).get("smem_beq_per_score"), "{:.1f}"),
        n((r.get("reference") or {}).get("resident_warps"))])


ROW_HEADER = ("arch", "kernel", "scenarios", "D", "config", "regs", "spill B (st+ld)", "smem B", "TMEM", "mma",
              "inst/it", "MMA/it", "SHFL/it", "LDS/STS it", "LDL/STL it", "inst/score", "x ref", "x no-dropout",
              "smem B/score", "smem B-eq/score", "warps/SM", "predicted", "ref B-eq/score", "ref warps/SM")
