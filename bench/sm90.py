"""Compile report for NVIDIA Hopper (sm_90) on a machine without a GPU.

    python -m bench.sm90 [--json PATH | --record] [--D 64 128] [--streams content two-stream]
                         [--dropout off on] [--deterministic off on] [--configs 128x64w8s3 ...]
                         [--trips interpreted|static] [--trip-samples 1] [--no-reference] [--check]

Runs the op's own launch code (``xlnet_fast.kernels.forward`` / ``backward``) on tensors that never
touch a GPU, records every kernel launch at every config its autotuner may pick (``bench.aot``),
compiles each for sm_90 with the flags of the launch, and reads registers, spills, shared memory,
the MMA kind and, per iteration of the key loop and per score element, the SASS instructions by
class (``bench.sass``), next to a plain FlashAttention-2 (``bench.fa2_reference``) compiled the same
way at the same tiles. Writes the report to ``--json PATH`` (default: the cache directory, see
``bench.runner``), or with ``--record`` to ``bench/results/sm90.json`` (overwritten: one snapshot of
the kernels), and prints a table and one summary line per kernel; it first says how many binaries
it will compile and about how long that takes. ``--check`` exits 1 if an op kernel spills or has no
wgmma.

Per iteration: the key loop's own instructions plus each nested loop (k_r chunks) times its
iterations per key-loop iteration, measured by replaying the launch in triton's CPU interpreter
(``bench.loop_trips``) on the scenario's real index data (``--trips interpreted``, the default:
programs of grid axis 0 spread over it until the loops made 2000 iterations, the first of the other
axes), or once (``--trips static``). One replay serves the launches of a kernel with the same tile
sizes and integer tensors (so D, dropout and the flags are assumed not to change loop trip counts;
``--exact-trips`` replays every binary). Per score element: per-iteration count x threads /
(BLOCK_M x BLOCK_N).
Ratio: against the reference kernel of the same role (forward; backward over query tiles = dQ;
backward over key tiles or other rows = dK/dV, see ``launch_role``) at the same D, tiles, warps and
stages, else against the reference's lowest inst/score config without spills.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The op's launch code picks its kernels at import time from TRITON_INTERPRET: compile mode here.
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from bench import aot, cases, runner, sass  # noqa: E402

RECORDS = "sm90.json"
TRIPS_CACHE = runner.cache_dir() / "sm90_trips.json"
# The constexprs that size the score tile (query rows x keys) in the op's and the reference's kernels.
TILE_ARGS = ("BLOCK_M", "BLOCK_N")
HOPPER_SMEM_PER_BLOCK = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
# Wall seconds one compile + ptxas + nvdisasm takes (measured: 12 binaries in 84 s, 2 shared cores).
SECONDS_PER_COMPILE = 7
COUNTED = ("inst", "mma", "shfl", "lds", "sts", "ldl", "stl", "ldg", "stg", "bar", "mufu")


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
    batch: int = 16
    qlen: int = 512
    mlen: int = 384
    targets: int = 85

    @property
    def heads(self) -> int:
        return 1024 // self.D

    @property
    def label(self) -> str:
        return "+".join([self.stream] + (["dropout"] * self.dropout) + (["det"] * self.deterministic))


def attention_case(case: Case) -> cases.AttentionCase:
    """The op's inputs for the scenario: pretraining ranks (the targets last in the order)."""
    return cases.AttentionCase(B=case.batch, H=case.heads, qlen=case.qlen, mlen=case.mlen, D=case.D,
                               dtype=torch.bfloat16, targets=case.targets, two_stream=case.stream == "two-stream",
                               ranks="pretraining")


def op_calls(case: Case, device: str) -> list:
    """THE SCENARIO BUILDER. ``[(phase, call)]``: calls of the op's launch code (forward, then
    backward) on the inputs ``bench.cases`` builds for the scenario, on ``device`` ("meta" to
    compile only, "cpu" when the interpreter replays the launches). Adapt this function, and only
    it, when the launch code's arguments change."""
    from xlnet_fast import kernels
    from xlnet_fast.attention import AttnArgs

    inputs = cases.attention_inputs(attention_case(case), device)
    floats, index = inputs.floats, inputs.index
    B, L = case.batch, case.qlen
    q_seg, q_rank, q_pos = index["q_seg"], index["q_rank"], None
    if case.stream == "two-stream":  # as ops.rel_attention_two_stream concatenates
        target_pos = index["target_pos"]
        q = torch.cat([floats["q_h"], floats["q_g"]], 1)
        q_pos = torch.cat([torch.arange(L, device=device).expand(B, L), target_pos], 1)
        q_seg = torch.cat([q_seg, q_seg.gather(1, target_pos)], 1)
        q_rank = torch.cat([q_rank, q_rank.gather(1, target_pos)], 1)
    else:
        q = floats["q"]
    dropout_p, seed = 0.0, None
    if case.dropout:
        dropout_p = 0.1
        seed = torch.randint(0, 2**62, (), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    args = AttnArgs(r_s_bias=floats["r_s_bias"], seg_embed=floats["seg_embed"], q_seg=q_seg, k_seg=index["k_seg"],
                    attn_mask=None, q_rank=q_rank, k_rank=index["k_rank"], q_pos=q_pos, qlen=L, self_rows=L,
                    scale=1.0 / math.sqrt(case.D), dropout_p=dropout_p, seed=seed,
                    rows_cover_qlen=case.stream == "two-stream")  # as ops.rel_attention_two_stream says
    saved = {}
    k, v, k_r, r_w_bias, r_r_bias = (floats[n] for n in ("k", "v", "k_r", "r_w_bias", "r_r_bias"))

    def forward():
        saved["out"], saved["lse"] = kernels.forward(q, k, v, k_r, r_w_bias, r_r_bias, args)

    def backward():
        kernels.backward(cases.random_like(q, seed=1), q, k, v, k_r, r_w_bias, r_r_bias, args, saved["out"],
                         saved["lse"], deterministic=case.deterministic)

    return [("forward", forward), ("backward", backward)]


def reference_calls(case: Case, tiles: dict) -> list:
    """``[(phase, call)]`` of the FlashAttention-2 reference at the case's B, H, D and lengths
    (qlen queries, mlen + qlen keys), bf16, meta tensors."""
    from bench import fa2_reference

    B, H, D, M, N = case.batch, case.heads, case.D, case.qlen, case.qlen + case.mlen

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, k, v = t(B, M, H, D), t(B, N, H, D), t(B, N, H, D)
    scale = 1.0 / math.sqrt(D)
    return [("forward", lambda: fa2_reference.forward(q, k, v, scale, **tiles)),
            ("backward", lambda: fa2_reference.backward(t(B, M, H, D), q, k, v, t(B, M, H, D),
                                                        t(B, H, M, dtype=torch.float32), scale, **tiles))]


# --------------------------------------------------------------------------------------------------
# Capture, compile, count
# --------------------------------------------------------------------------------------------------


def capture(calls) -> list:
    """The launches the calls make, each tagged with its phase."""
    from xlnet_fast.kernels import rel_attention

    target = contextlib.nullcontext() if rel_attention.compile_target() else rel_attention.compiling_for(90)
    with aot.capture_launches() as recorder, target:
        for phase, call in calls:
            recorder.phase = phase
            call()
    if not recorder.launches:
        raise RuntimeError("no Triton launch was recorded: were the kernels imported with TRITON_INTERPRET=1?")
    return recorder.launches


def tile_config(launch: aot.Launch) -> tuple:
    k = launch.kwargs
    return (k.get(TILE_ARGS[0]), k.get(TILE_ARGS[1]), k.get("num_warps", 4), k.get("num_stages", 3))


def config_name(config: tuple) -> str:
    return "{}x{}w{}s{}".format(*config)


def launch_role(launch: aot.Launch) -> str:
    """fwd, dq or dkdv: what the launch's programs own, read off its grid. A forward launch is
    ``fwd``; in backward, programs whose count follows BLOCK_M own query tiles (``dq``), any other
    (key tiles, k_r rows, a fixed grid) accumulate over query tiles like dK/dV (``dkdv``)."""
    if launch.phase == "forward":
        return "fwd"
    block_m = launch.kwargs.get(TILE_ARGS[0])
    grid = launch.grid_for()
    if block_m and grid is not None and launch.grid_for(**{TILE_ARGS[0]: 2 * block_m}) != grid:
        return "dq"
    return "dkdv"


def _flags(launch: aot.Launch) -> dict:
    def plain(value):
        return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)

    return {k: plain(v) for k, v in sorted(launch.constexprs().items()) if k not in TILE_ARGS}


def _index_data_hash(launch: aot.Launch) -> str:
    """Hash of the launch's integer tensors (positions, ranks, segment ids, ...)."""
    digest = hashlib.sha256()
    for arg in launch.args:
        if isinstance(arg, torch.Tensor) and not arg.is_floating_point() and arg.device.type == "cpu":
            digest.update(str((arg.dtype, tuple(arg.shape))).encode())
            digest.update(arg.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def source_loops(launch: aot.Launch, key_loop: sass.Loop) -> dict | None:
    """{id(SASS loop): (SASS loop, SourceLoop)} for the key loop and its nested loops, innermost
    first: each SASS loop is the source loop most of its own instructions come from by line info
    (the innermost loop statement of the kernel's files around the line), among those not taken by
    the loops nested in it (a peeled or pipelined first iteration leaves inner-loop lines in the
    outer loop's own code); None if a loop has no candidate."""
    from bench import loop_trips

    candidates = [loop for path in loop_trips.kernel_files(launch.fn) for loop in loop_trips.loops_in(path)]
    mapping = {}
    for loop in sorted([key_loop, *key_loop.descendants()], key=lambda loop: -loop.depth()):
        taken = {mapping[id(inner)][1] for inner in loop.descendants()}
        votes = {}
        for (file, line), n in loop.source_lines().items():
            found = loop_trips.innermost_loop([c for c in candidates if c not in taken], file, line)
            if found is not None:
                votes[found] = votes.get(found, 0) + n
        if not votes:
            return None
        mapping[id(loop)] = (loop, max(votes, key=votes.get))
    return mapping


@dataclass
class TripCounter:
    """Iterations of the kernels' source loops, by interpreter replay of recorded launches: one
    replay serves every launch with the same kernel, tile sizes and integer tensors (positions,
    ranks, segment ids) whose loops it saw run (``exact``: the same flags too); replays are cached
    on disk by everything the interpreter sees but float data."""

    budget: int = 2000
    samples: int = 1
    exact: bool = False
    cache_path: Path | None = TRIPS_CACHE
    replays: int = 0
    _groups: dict = field(default_factory=dict)
    _disk: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.cache_path is not None and self.cache_path.exists():
            try:
                self._disk = json.loads(self.cache_path.read_text())
            except (OSError, ValueError):
                self._disk = {}

    def _replay(self, launch: aot.Launch):
        from bench import loop_trips

        key = hashlib.sha256(repr((launch.fn.cache_key, _flags(launch), tile_config(launch)[:2],
                                   [a for a in launch.args if not isinstance(a, torch.Tensor)],
                                   _index_data_hash(launch), self.budget, self.samples)).encode()).hexdigest()
        if key not in self._disk:
            self.replays += 1
            started = time.perf_counter()
            replay = loop_trips.count_iterations(launch, self.budget, self.samples)
            log(f"  replayed {launch.name} {config_name(tile_config(launch))} in the interpreter: "
                f"{replay.programs}/{replay.of} programs, {time.perf_counter() - started:.0f} s")
            self._disk[key] = {"programs": [replay.programs, replay.of],
                               "loops": [[loop.file, loop.line, loop.end, loop.body, n]
                                         for loop, n in replay.iterations.items()]}
            if self.cache_path is not None:
                runner.write_json(self.cache_path, self._disk)
        entry = self._disk[key]
        return loop_trips.Replay({loop_trips.SourceLoop(*loop[:4]): loop[4] for loop in entry["loops"]},
                                 *entry["programs"])

    def replay(self, launch: aot.Launch, needed: set):
        """A ``loop_trips.Replay`` of this launch's kernel, tiles and index data that reached every
        source loop in ``needed``."""
        group = (launch.name, tile_config(launch)[:2], _index_data_hash(launch))
        if self.exact:
            group += (repr(_flags(launch)),)
        candidates = self._groups.setdefault(group, [])
        for replay in candidates:
            if needed <= replay.iterations.keys():
                return replay
        replay = self._replay(launch)
        candidates.append(replay)
        return replay


def nested_trips(mapping: dict, iterations: dict | None) -> tuple:
    """(trips(SASS loop) per iteration of its parent, note): source-loop iterations over those of the
    parent's source loop; a source loop compiled into several SASS loops splits its iterations
    evenly among them. Without counts (or a parent that never ran) a nested loop counts once."""
    shares = {}
    for _, source in mapping.values():
        shares[source] = shares.get(source, 0) + 1

    def trips(loop: sass.Loop) -> float:
        source, parent = mapping[id(loop)][1], mapping[id(loop.parent)][1]
        if iterations is None or source == parent or not iterations.get(parent):
            return 1.0
        return iterations.get(source, 0) / iterations[parent] / shares[source]

    notes = [f"{source.where} x{trips(loop):.2f}" for loop, source in mapping.values()
             if loop.parent is not None and id(loop.parent) in mapping]
    return trips, "; ".join(notes)


def analyse(launch: aot.Launch, trip_counter: TripCounter | None, **extra) -> dict:
    """The record of one launch: compile it for sm_90 and read its code (``error`` if it fails)."""
    bm, bn, warps, stages = tile_config(launch)
    record = {"kernel": launch.name, "phase": launch.phase, "role": launch_role(launch), **extra,
              "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "flags": _flags(launch)}
    try:
        compiled = aot.compile_launch(launch)
    except Exception as exc:  # noqa: BLE001 - one failed compile is a row of the report
        record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        return record
    code = sass.parse(compiled.sass)
    record.update({
        "regs": compiled.regs, "spill_bytes": compiled.spill_store_bytes + compiled.spill_load_bytes,
        "spill_store_bytes": compiled.spill_store_bytes, "spill_load_bytes": compiled.spill_load_bytes,
        "stack_bytes": compiled.stack_bytes, "smem_bytes": compiled.smem_bytes,
        "smem_fits": compiled.smem_bytes <= HOPPER_SMEM_PER_BLOCK, "mma": code.mma_kind(),
        "threads": warps * 32,
    })
    key_loop = code.key_loop()
    if key_loop is None:
        record.update(key_loop=None, per_iteration=None, per_score=None, inst_per_score=None)
        return record
    nested = list(key_loop.descendants())
    mapping = source_loops(launch, key_loop)
    trips, notes = (lambda loop: 1.0), ("nested loops counted once" if nested else "")
    if mapping is not None and nested:
        replay = None
        if trip_counter is not None:
            replay = trip_counter.replay(launch, {source for _, source in mapping.values()})
        trips, notes = nested_trips(mapping, replay.iterations if replay else None)
        notes = (f"interpreted ({replay.programs}/{replay.of} programs): " if replay else "static: ") + notes
    elif nested:
        notes = "nested loops not matched to source lines: counted once"
    counts = sass.per_iteration(key_loop, trips)
    per_iter = {name: round(counts.get(name, 0), 1) for name in COUNTED}
    scale = record["threads"] / (bm * bn)
    per_score = {name: round(counts.get(name, 0) * scale, 2) for name in COUNTED}
    record.update(
        key_loop={"address": hex(key_loop.head), "nested_loops": len(nested), "trips": notes,
                  "source": mapping[id(key_loop)][1].where if mapping else None},
        per_iteration=per_iter, per_score=per_score, inst_per_score=per_score["inst"])
    return record


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def all_cases(dims: list, streams: list, dropouts: list, deterministic: list) -> list:
    return [Case(D, stream, drop, det) for D in dims for stream in streams for drop in dropouts
            for det in deterministic]


def _matches(launch: aot.Launch, configs: set | None) -> bool:
    return not configs or not launch.autotuned or config_name(tile_config(launch)) in configs


def log(message: str) -> None:
    """Progress (stderr: stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def compile_cases(cases: list, configs: set | None, trip_counter: TripCounter | None) -> list:
    """Records of every distinct compiled launch of the op over ``cases``."""
    by_key: dict = {}
    device = "cpu" if trip_counter is not None else "meta"
    for case in cases:
        launches = [ln for ln in capture(op_calls(case, device)) if _matches(ln, configs)]
        log(f"{case.label} D={case.D}: {len(launches)} launches")
        for launch in launches:
            key = aot.compile_key(launch)
            if key in by_key:
                by_key[key]["scenarios"].append(case.label)
                continue
            by_key[key] = analyse(launch, trip_counter, D=case.D, scenarios=[case.label])
            log(_row(by_key[key]))
    return list(by_key.values())


def reference_launches(D: int, config: tuple) -> list:
    """The FlashAttention-2 reference's launches at head dim ``D`` and tile ``config``."""
    tiles = dict(zip(TILE_ARGS + ("num_warps", "num_stages"), config))
    return capture(reference_calls(Case(D, "content", False, False), tiles))


def compile_references(records: list) -> list:
    """The FlashAttention-2 reference at every (D, tiles) the op's records use."""
    wanted = sorted({(r["D"], (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"]))
                     for r in records if r.get("BLOCK_M")})
    out = []
    for D, config in wanted:
        for launch in reference_launches(D, config):
            out.append(analyse(launch, None, D=D, scenarios=["reference"], reference=True))
            log(_row(out[-1]))
    return out


def planned_compiles(scenarios: list, configs: set | None, reference: bool) -> int:
    """How many binaries a run compiles: the distinct launches of the scenarios (captured on meta
    tensors, which compile nothing), plus the reference's at each (D, tiles) they use."""
    keys, tiles = set(), set()
    for case in scenarios:
        for launch in capture(op_calls(case, "meta")):
            if _matches(launch, configs):
                keys.add(aot.compile_key(launch))
                tiles.add((case.D, tile_config(launch)))
    references = sum(len(reference_launches(D, config)) for D, config in tiles if config[0]) if reference else 0
    return len(keys) + references


def tile_config_of(record: dict) -> tuple:
    return (record["BLOCK_M"], record["BLOCK_N"], record["num_warps"], record["num_stages"])


def attach_ratios(records: list, references: list) -> None:
    """``ratio_to_reference``: inst/score over the reference's of the same role at the same D and
    config, else over the reference's lowest inst/score config without spills (same role and D)."""
    usable = [r for r in references if r.get("inst_per_score")]
    for record in records:
        if not record.get("inst_per_score"):
            record.update(ratio_to_reference=None, reference_config=None)
            continue
        same_role = [r for r in usable if r["role"] == record["role"] and r["D"] == record["D"]]
        config = tile_config_of(record)
        match = [r for r in same_role if tile_config_of(r) == config]
        if not match:
            match = sorted((r for r in same_role if not r["spill_bytes"]), key=lambda r: r["inst_per_score"])
        if not match:
            record.update(ratio_to_reference=None, reference_config=None)
            continue
        ref = match[0]
        record.update(ratio_to_reference=round(record["inst_per_score"] / ref["inst_per_score"], 2),
                      reference_kernel=ref["kernel"], reference_config=config_name(tile_config_of(ref)),
                      reference_same_config=tile_config_of(ref) == config)


_HEADER = ("kernel", "scenarios", "D", "config", "regs", "spill B", "smem B", "mma", "inst/it",
           "MMA/it", "SHFL/it", "LDS/STS it", "LDL/STL it", "inst/score", "x ref")


def _row(r: dict) -> str:
    if r.get("error"):
        return " | ".join([r["kernel"], ",".join(r.get("scenarios", [])), str(r.get("D")),
                           config_name(tile_config_of(r)), "ERROR " + r["error"]])
    it = r.get("per_iteration") or {}

    def n(key):
        value = it.get(key)
        return "-" if value is None else f"{value:g}"

    smem = f"{r['smem_bytes']}" + ("" if r["smem_fits"] else " (>227K)")
    ratio = r.get("ratio_to_reference")
    ratio = "-" if ratio is None else f"{ratio:.2f}" + ("" if r.get("reference_same_config", True) else "*")
    return " | ".join([r["kernel"], ",".join(r.get("scenarios", [])), str(r["D"]), config_name(tile_config_of(r)),
                       str(r["regs"]), str(r["spill_bytes"]), smem, r["mma"], n("inst"), n("mma"), n("shfl"),
                       f"{n('lds')}/{n('sts')}", f"{n('ldl')}/{n('stl')}",
                       "-" if r.get("inst_per_score") is None else f"{r['inst_per_score']:.1f}", ratio])


def table(records: list) -> str:
    ordered = sorted(records, key=lambda r: (r.get("reference", False), r.get("phase", ""), r["kernel"], r["D"],
                                             r.get("scenarios", [""])[0], tile_config_of(r)))
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + _row(r) + " |" for r in ordered]
    return "\n".join(lines)


def summary(records: list) -> str:
    """One line per kernel: worst ratio, max registers, total spills, MMA kinds."""
    lines = []
    for kernel in sorted({r["kernel"] for r in records}):
        rs = [r for r in records if r["kernel"] == kernel and not r.get("error")]
        errors = sum(1 for r in records if r["kernel"] == kernel and r.get("error"))
        ratios = [r["ratio_to_reference"] for r in rs if r.get("ratio_to_reference")]
        spilling = [r for r in rs if r["spill_bytes"]]
        lines.append(
            f"{kernel}: {len(rs)} binaries, worst ratio {max(ratios) if ratios else '-'}, "
            f"max regs {max((r['regs'] for r in rs), default='-')}, "
            f"spills {sum(r['spill_bytes'] for r in rs)} B in {len(spilling)}, "
            f"mma {'/'.join(sorted({r['mma'] for r in rs}))}" + (f", {errors} failed" if errors else ""))
    return "\n".join(lines)


def check(records: list) -> list:
    """Problems that fail ``--check``: an op kernel that spills, lacks wgmma, or failed to compile."""
    problems = []
    for r in records:
        if r.get("reference"):
            continue
        where = f"{r['kernel']} D={r['D']} {config_name(tile_config_of(r))} ({','.join(r['scenarios'])})"
        if r.get("error"):
            problems.append(f"{where}: compile failed: {r['error']}")
        elif r["spill_bytes"]:
            problems.append(f"{where}: spills {r['spill_store_bytes']} B stored, {r['spill_load_bytes']} B loaded")
        elif r["mma"] != "wgmma":
            problems.append(f"{where}: MMA is {r['mma']}, not wgmma")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_output_args(parser, RECORDS, flag="--json")  # the report file (overwritten)
    parser.add_argument("--D", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--streams", nargs="+", default=["content", "two-stream"],
                        choices=["content", "two-stream"])
    parser.add_argument("--dropout", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--deterministic", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--configs", nargs="+", help="only these autotuner configs, e.g. 128x64w8s3")
    parser.add_argument("--trips", choices=["interpreted", "static"], default="interpreted",
                        help="nested-loop iterations: replayed in the interpreter, or counted once")
    parser.add_argument("--trip-budget", type=int, default=2000,
                        help="replay programs of grid axis 0 until the kernel's loops made this many "
                             "iterations (0: all programs)")
    parser.add_argument("--trip-samples", type=int, default=1,
                        help="program ids sampled on each further grid axis in the replay")
    parser.add_argument("--exact-trips", action="store_true",
                        help="replay every distinct launch (default: reuse counts across launches "
                             "with equal kernel, tiles and index data)")
    parser.add_argument("--no-reference", action="store_true", help="skip the FlashAttention-2 reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if an op kernel spills or lacks wgmma")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = aot.toolchain_problem()
    if problem:
        print(f"cannot compile for sm_90 here: {problem}", file=sys.stderr)
        return 2
    scenarios = all_cases(args.D, args.streams, [d == "on" for d in args.dropout],
                          [d == "on" for d in args.deterministic])
    trip_counter = None
    if args.trips == "interpreted":
        trip_counter = TripCounter(args.trip_budget, args.trip_samples, args.exact_trips)
    n = planned_compiles(scenarios, set(args.configs or []), not args.no_reference)
    log(f"compiling {n} kernel binaries for sm_90 ({len(scenarios)} scenarios"
        + ("" if args.no_reference else ", with the FlashAttention-2 reference")
        + f"): about {runner.duration(n * SECONDS_PER_COMPILE)} at ~{SECONDS_PER_COMPILE} s a binary"
        + ("" if trip_counter is None else f"; a kernel with nested loops is also replayed in the interpreter "
           f"once per tile size (cached in {trip_counter.cache_path})"))
    records = compile_cases(scenarios, set(args.configs or []), trip_counter)
    references = [] if args.no_reference else compile_references(records)
    attach_ratios(records, references)
    stamp = {"triton": triton.__version__, "torch": torch.__version__, "target": "cuda sm_90a (no GPU)",
             "date": datetime.date.today().isoformat(),
             "trips": "static" if trip_counter is None else
             f"interpreted: grid axis 0 up to {args.trip_budget or 'all'} loop iterations, "
             f"{args.trip_samples} program(s) on the others"}
    everything = [{**r, **stamp} for r in records + references]
    path = runner.output_path(args, RECORDS)
    runner.write_json(path, everything)
    print()
    print(table(everything))
    print()
    print(summary(everything))
    print(f"\nwrote {len(everything)} records to {path}"
          + (f"; {trip_counter.replays} interpreter replays" if trip_counter else ""))
    if args.check:
        problems = check(records)
        for p in problems:
            print("CHECK FAILED:", p)
        if not records:
            print("CHECK FAILED: nothing was compiled")
            return 1
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
