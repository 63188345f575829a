"""Read NVIDIA SASS (``nvdisasm -c -gi``): loops, the key loop, and instruction counts per iteration.

Loops are the natural loops of the control-flow graph: the listing is cut into basic blocks at
branch targets and after branches/exits; an edge to a block that dominates its source is a back
edge, and the loop is the header plus every block that reaches the back edge without passing the
header (back edges to one header form one loop). Loops nest by block containment, whatever the code
layout (ptxas may place part of an inner loop after its outer loop's back edge). The *key loop* is
the loop whose own blocks (nested loops excluded) issue the most MMA instructions (HMMA: mma.sync,
sm_80+; HGMMA: Hopper's wgmma; UTC*MMA: Blackwell's tcgen05), the outermost one on a tie, then the
one of more instructions: the loop over the other side's tiles that does the tile's GEMMs, while
inner loops (k_r windows) do one GEMM each and outer loops none; where a kernel runs its tiles in two
such loops (the forward's tiles every row sees, without the rank test), the general one.

Counts are static: every instruction of the loop's blocks, each once, blocks skipped at run time by
a branch included; ``NOP`` padding is not counted. A nested loop counts ``trips`` times per iteration
of its parent (1 if unknown).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

# opcode (before the first '.') -> counted class; an opcode may belong to several classes
CLASSES = {
    "mma": ("HGMMA", "HMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA"),
    "shfl": ("SHFL",),
    "lds": ("LDS", "LDSM"),
    "sts": ("STS", "STSM"),
    "ldl": ("LDL",),
    "stl": ("STL",),
    "ldg": ("LDG", "LDGSTS", "UTMALDG"),
    "stg": ("STG", "RED", "ATOM", "ATOMG", "UTMASTG"),
    "bar": ("BAR",),
    "mufu": ("MUFU",),
}
MMA_KINDS = (("tcgen05", CLASSES["mma"][2:]), ("wgmma", ("HGMMA",)), ("mma.sync", ("HMMA",)))
_OPCODE_CLASS = {}
for _cls, _ops in CLASSES.items():
    for _op in _ops:
        _OPCODE_CLASS.setdefault(_op, []).append(_cls)

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_PREDICATE_OPERAND = re.compile(r"\s*(!?U?P[T0-9]+)\s*,")
_ENDS_BLOCK = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "KILL", "BPT"}
_NO_FALLTHROUGH = {"BRX", "JMX", "RET", "KILL", "BPT"}  # when unpredicated, also BRA/JMP/EXIT
# a call to a label of the kernel's own code is a jump: ptxas leaves some loops by one (``@!P1
# CALL.REL.NOINC `(.L_x_1)``, sm_86's forward with dropout); a call to a subroutine
# (``$__internal_0_$__cuda_sm70_shflsync_bfly``, which returns by RET.REL.NODEC) is not
_JUMP_CALL = "CALL.REL.NOINC"


@dataclass
class Instruction:
    address: int
    opcode: str  # with modifiers, e.g. HGMMA.64x64x16.F32.BF16
    operands: str
    file: str | None
    line: int | None
    predicated: bool = False
    target: str | None = None  # branch target label

    @property
    def base(self) -> str:
        """The opcode without modifiers; a call to a label (``_JUMP_CALL``) reads as BRA."""
        return "BRA" if self.target and self.opcode.startswith(_JUMP_CALL) else self.opcode.split(".")[0]


@dataclass
class Loop:
    head: int  # address of the header block
    blocks: frozenset  # indices of its basic blocks
    children: list = field(default_factory=list)
    parent: "Loop | None" = None
    own: list = field(default_factory=list)  # instructions not inside a nested loop

    def depth(self) -> int:
        return 0 if self.parent is None else 1 + self.parent.depth()

    def own_mma(self) -> int:
        return sum(1 for i in self.own if "mma" in _OPCODE_CLASS.get(i.base, ()))

    def source_lines(self) -> Counter:
        """(file, line) of the loop's own instructions, with multiplicities."""
        return Counter((i.file, i.line) for i in self.own if i.line is not None)

    def lines_per_iteration(self) -> Counter:
        """``source_lines`` of one iteration, each nested loop's once (as ``per_iteration`` counts
        with one trip)."""
        total = self.source_lines()
        for child in self.children:
            total += child.lines_per_iteration()
        return total

    def descendants(self):
        for child in self.children:
            yield child
            yield from child.descendants()


@dataclass
class Sass:
    instructions: list
    loops: list  # all loops, outer before inner

    def mma_kind(self) -> str:
        """The tensor-core path: ``tcgen05`` (Blackwell UTC*MMA), ``wgmma`` (Hopper HGMMA),
        ``mma.sync`` (HMMA), else ``none (FMA)``; the newest present wins."""
        ops = {i.base for i in self.instructions}
        for kind, opcodes in MMA_KINDS:
            if ops & set(opcodes):
                return kind
        return "none (FMA)"

    def key_loop(self) -> Loop | None:
        candidates = [loop for loop in self.loops if loop.own_mma() > 0]
        if not candidates:
            return None
        # a kernel may run its key tiles in two loops of the same products, one of which leaves out
        # work (the forward's tiles every row sees skip the visibility test): the one with more
        # instructions is the general one
        return max(candidates, key=lambda loop: (loop.own_mma(), -loop.depth(), len(loop.own)))

    def lighter_twins(self, key: Loop) -> list:
        """The other loops of the key loop's products (as many MMAs, as deep): the forward's loop over
        the key tiles every row sees, which leaves out the visibility test (``FREE_TILES``)."""
        return [loop for loop in self.loops
                if loop is not key and loop.own_mma() == key.own_mma() and loop.depth() == key.depth()]


def _instructions(text: str) -> tuple:
    """Instructions (NOPs dropped) and {label: address} of an ``nvdisasm -c -gi`` listing."""
    instructions, labels = [], {}
    pending, file, line = [], None, None
    for raw in text.splitlines():
        found = _LINE.search(raw)
        if found:
            file, line = found.group(1), int(found.group(2))
            continue
        found = _LABEL.match(raw)
        if found:
            pending.append(found.group(1))
            continue
        found = _INSTRUCTION.match(raw)
        if not found:
            continue
        address, predicate, opcode, operands = int(found.group(1), 16), found.group(2), found.group(3), found.group(4)
        if opcode == "NOP":  # dropped: a label on it names the next instruction kept
            continue
        for label in pending:
            labels[label] = address
        pending = []
        target = _TARGET.search(operands)
        # a guard (@P0 BRA ...), or a branch's own predicate operand (BRA.U !UP3, `(.L_x_24))
        guard = (predicate or "").strip().lstrip("@")
        operand = _PREDICATE_OPERAND.match(operands) if target else None
        guard = guard or (operand.group(1) if operand else "")
        instructions.append(Instruction(address, opcode, operands, file, line,
                                        predicated=guard not in ("", "PT", "UPT"),
                                        target=target.group(1) if target else None))
    return instructions, labels


def _blocks(instructions: list, labels: dict) -> tuple:
    """Basic blocks (lists of instructions) and their successor lists."""
    targets = set(labels.values())
    blocks, current = [], []
    for instruction in instructions:
        if current and instruction.address in targets:
            blocks.append(current)
            current = []
        current.append(instruction)
        if instruction.base in _ENDS_BLOCK:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    start = {block[0].address: i for i, block in enumerate(blocks)}
    successors = []
    for i, block in enumerate(blocks):
        last, succ = block[-1], []
        if last.base in ("BRA", "JMP") and last.target in labels and labels[last.target] in start:
            succ.append(start[labels[last.target]])
        falls_through = last.base not in _ENDS_BLOCK or (
            last.predicated and last.base not in _NO_FALLTHROUGH - {"BRA", "JMP", "EXIT"})
        if falls_through and i + 1 < len(blocks):
            succ.append(i + 1)
        successors.append(succ)
    return blocks, successors


def _dominators(successors: list) -> list:
    """Immediate dominator of each block reachable from block 0 (None if unreachable)."""
    order, seen, stack = [], {0}, [(0, iter(successors[0]))]
    while stack:  # reverse post-order by iterative DFS
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(successors[child])))
    order.reverse()
    rank = {node: i for i, node in enumerate(order)}
    predecessors = {node: [] for node in order}
    for node in order:
        for child in successors[node]:
            predecessors[child].append(node)
    idom = {0: 0}

    def intersect(a, b):
        while a != b:
            while rank[a] > rank[b]:
                a = idom[a]
            while rank[b] > rank[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for node in order[1:]:
            done = [p for p in predecessors[node] if p in idom]
            new = done[0]
            for p in done[1:]:
                new = intersect(p, new)
            if idom.get(node) != new:
                idom[node], changed = new, True
    return [idom.get(i) for i in range(len(successors))]


def _dominates(idom: list, a: int, b: int) -> bool:
    while b is not None:
        if a == b:
            return True
        if b == 0:
            return False
        b = idom[b]
    return False


def _loop_bodies(successors: list, idom: list) -> dict:
    """{header block: blocks of its natural loop}: for every back edge (an edge to a block that
    dominates its source), the header plus the blocks that reach the source without the header."""
    predecessors = [[] for _ in successors]
    for node, succ in enumerate(successors):
        for child in succ:
            predecessors[child].append(node)
    bodies = {}
    for node, succ in enumerate(successors):
        if idom[node] is None:
            continue
        for header in succ:
            if _dominates(idom, header, node):  # back edge node -> header
                body, work = bodies.setdefault(header, {header}), [node]
                while work:
                    block = work.pop()
                    if block not in body:
                        body.add(block)
                        work.extend(predecessors[block])
    return bodies


def _loop_forest(blocks: list, bodies: dict) -> list:
    """Loops nested by block containment, each with its own instructions; outer before inner."""
    loops = sorted((Loop(blocks[h][0].address, frozenset(body)) for h, body in bodies.items()),
                   key=lambda loop: -len(loop.blocks))
    for i, loop in enumerate(loops):  # parent: the smallest strictly larger loop containing it
        for outer in reversed(loops[:i]):
            if loop.blocks < outer.blocks:
                loop.parent = outer
                outer.children.append(loop)
                break
    for index, block in enumerate(blocks):
        inside = [loop for loop in loops if index in loop.blocks]
        if inside:
            max(inside, key=Loop.depth).own.extend(block)
    for loop in loops:
        loop.children.sort(key=lambda child: child.head)
    loops.sort(key=lambda loop: (loop.depth(), loop.head))
    return loops


def parse(text: str) -> Sass:
    """Instructions and the loop forest of one kernel's ``nvdisasm -c -gi`` listing."""
    instructions, labels = _instructions(text)
    if not instructions:
        return Sass([], [])
    blocks, successors = _blocks(instructions, labels)
    bodies = _loop_bodies(successors, _dominators(successors))
    return Sass(instructions, _loop_forest(blocks, bodies))


def count(instructions) -> Counter:
    """Instruction counts by class, plus ``inst`` (all) and ``opcodes`` is left to the caller."""
    counts = Counter(inst=0)
    for instruction in instructions:
        counts["inst"] += 1
        for cls in _OPCODE_CLASS.get(instruction.base, ()):
            counts[cls] += 1
    return counts


def access_bytes(instruction: Instruction) -> int:
    """Bytes one lane moves in a load/store (``.64``, ``.128``, ``.U16``... in the opcode; 4 else)."""
    for part in instruction.opcode.split(".")[1:]:
        if part in ("8", "U8", "S8"):
            return 1
        if part in ("16", "U16", "S16"):
            return 2
        if part in ("64", "128"):
            return int(part) // 8
    return 4


def per_iteration(loop: Loop, trips) -> Counter:
    """Counts for one iteration of ``loop``: its own instructions plus each nested loop times
    ``trips(nested)`` (iterations of the nested loop per iteration of its parent)."""
    total = count(loop.own)
    for child in loop.children:
        times = trips(child)
        for cls, n in per_iteration(child, trips).items():
            total[cls] += n * times
    return total


# --------------------------------------------------------------------------------------------------
# Shared-memory traffic: the PTX's shared-memory accesses, their lane addresses, bank conflicts
# --------------------------------------------------------------------------------------------------
#
# SASS does not say which lanes touch which bytes; the PTX does, in integer arithmetic on %tid,
# %ctaid, the kernel's parameters and what it loads from global memory (the row tables that place
# the skew's gather). ``smem_traffic`` runs that arithmetic for every thread of the sampled CTAs at
# once, side by side (integers and predicates; floats and shared-memory loads are unknown values;
# each CTA its own shared memory), along the CFG in topological
# order with per-thread active masks (a loop body once: its first iteration), and records each
# shared-memory access's lanes. Per warp access, the 128-byte wavefronts it needs: accesses of
# 8 and 16 bytes a lane go in phases of 16 and 8 lanes (ldmatrix/stmatrix: one phase per 8x8
# matrix), each phase needing as many wavefronts as the most distinct 4-byte words any of the 32
# banks holds among its lanes (one word read by several lanes is one access). wgmma and tcgen05
# read their shared-memory operands through swizzled descriptors: counted conflict-free,
# bytes / 128. Bytes are what the lanes move (no broadcast merged).

PTX_MMA = ("wgmma.mma_async", "mma.sync", "tcgen05.mma", "mma.sp")
_PTX_LABEL = re.compile(r"^([$\w.]+):")
_PTX_GUARD = re.compile(r"^@(!?)(%?\w+)\s+")
_PTX_PARAM = re.compile(r"^\.param\s+\.(\w+)\b.*?(\w+)\s*,?$")
_PTX_LOC = re.compile(r"^\.loc\s+(\d+)\s+(\d+)")
_PTX_FILE = re.compile(r'^\.file\s+(\d+)\s+"([^"]+)"')
_PTX_TYPE_BITS = {"b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16, "bf16": 16,
                  "b32": 32, "u32": 32, "s32": 32, "f32": 32, "b64": 64, "u64": 64, "s64": 64, "f64": 64}
SHARED_WINDOW = 1 << 18  # bytes of shared memory followed (every arch's per-block limit is below)
_INTEGER_OPS = {"mov", "add", "sub", "mul", "mad", "min", "max", "and", "or", "xor", "not", "neg", "abs", "shl",
                "shr", "bfe", "bfi", "selp", "setp", "cvt", "div", "rem", "prmt"}
_NO_DEST = ("st.", "bar.", "barrier.", "fence.", "cp.", "red.", "wgmma.fence", "wgmma.commit", "wgmma.wait",
            "tcgen05.mma", "tcgen05.commit", "tcgen05.wait", "tcgen05.st", "tcgen05.cp", "mbarrier.init",
            "mbarrier.inval", "mbarrier.expect", "bra", "ret", "exit", "trap", "stmatrix", "griddepcontrol",
            "prefetch", "membar", "nanosleep", "setmaxnreg")


@dataclass
class PtxOp:
    index: int
    guard: tuple | None  # (predicate register, negated)
    opcode: str
    args: list
    line: int | None
    file: str | None = None  # the source file of ``line`` (PTX's ``.file`` table, read after the kernel)

    def __post_init__(self):
        self.parts = self.opcode.split(".")
        self.name = self.parts[0]
        self.bits = _bits(self.opcode)
        self.signed = any(p.startswith("s") and p[1:].isdigit() for p in self.parts[1:])
        self.floating = any(p in ("f16", "bf16", "f32", "f64", "bf16x2", "f16x2", "f32x2") for p in self.parts[1:]) or (
            self.name == "cvt" and any(p.startswith("r") and len(p) == 2 for p in self.parts[1:]))
        self.has_dest = bool(self.args) and not any(self.opcode.startswith(p) for p in _NO_DEST)
        # an op whose result is never an integer: its destination only becomes unknown
        self.opaque = self.has_dest and (self.floating or self.name not in _INTEGER_OPS) and not (
            self.name in ("ld", "elect") or (self.name in ("shfl", "redux") and not self.floating))


def _split_args(text: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def parse_ptx(text: str) -> tuple:
    """(ops, {label: op index}, [(param name, PTX type)]) of the first kernel in ``text``; labels
    inside an inline-asm scope ({ ... } below the kernel's own) are renamed apart."""
    ops, labels, params, scopes, file, line, serial = [], {}, [], [{}], None, None, 0
    files, file_of = {}, {}  # .file index -> path; op index -> .file index
    for raw in text.splitlines():
        code = raw.split("//", 1)[0].strip()
        if not code:
            continue
        found = _PTX_LOC.match(code)
        if found:
            file, line = found.group(1), int(found.group(2))
            continue
        found = _PTX_FILE.match(code)
        if found:
            files[found.group(1)] = found.group(2)
            continue
        found = _PTX_PARAM.match(code)
        if found:
            params.append((found.group(2), found.group(1)))
            continue
        for stmt in filter(None, (s.strip() for s in code.split(";"))):
            while stmt.startswith("{") or stmt.startswith("}"):
                if stmt[0] == "{":
                    serial += 1
                    scopes.append({"#": serial})
                elif len(scopes) > 1:
                    scopes.pop()
                stmt = stmt[1:].strip()
            found = _PTX_LABEL.match(stmt)
            if found:
                name = found.group(1)
                if len(scopes) > 2:  # inside inline asm: a name reused by every copy of the snippet
                    scopes[-1][name] = f"{name}#{scopes[-1]['#']}"
                    name = scopes[-1][name]
                labels[name] = len(ops)
                stmt = stmt[found.end():].strip()
            if not stmt or stmt.startswith("."):
                continue
            guard = _PTX_GUARD.match(stmt)
            if guard:
                stmt = stmt[guard.end():]
            opcode, _, rest = stmt.partition(" ")
            args = _split_args(rest.strip())
            if opcode.split(".")[0] == "bra" and args:
                args[-1] = next((s[args[-1]] for s in reversed(scopes) if args[-1] in s), args[-1])
            if line is not None:
                file_of[len(ops)] = file
            ops.append(PtxOp(len(ops), (guard.group(2), guard.group(1) == "!") if guard else None, opcode, args,
                             line))
    for op in ops:
        op.file = files.get(file_of.get(op.index))
    return ops, labels, params


def _ptx_instructions(ops: list) -> list:
    """The ops as ``Instruction``s for the CFG code above (control flow in SASS's words)."""
    out = []
    for op in ops:
        base = op.opcode.split(".")[0]
        opcode = {"bra": "BRA", "ret": "RET", "exit": "EXIT", "trap": "KILL"}.get(base, op.opcode)
        out.append(Instruction(op.index, opcode, ",".join(op.args), None, op.line, predicated=op.guard is not None,
                               target=op.args[-1] if base == "bra" else None))
    return out


def _bits(opcode: str, default: int = 32) -> int:
    for part in reversed(opcode.split(".")):
        if part in _PTX_TYPE_BITS:
            return _PTX_TYPE_BITS[part]
    return default


def _signed(v, bits: int):
    if bits >= 64:
        return v - (1 << 64) if isinstance(v, int) and v >= 1 << 63 else v
    half = 1 << (bits - 1)
    return ((v + half) & ((1 << bits) - 1)) - half


class _Threads:
    """Integer/predicate state of the threads of some CTAs side by side (numpy int64 values, a known
    mask each): ``threads`` a CTA, lane ``t`` being thread ``t % threads`` of CTA ``ctaids[t //
    threads]``. Warps never span two CTAs (``threads`` is a multiple of 32); each CTA has its own
    shared memory."""

    def __init__(self, threads: int, ctaids: list, nctaid: tuple, params: dict, memory):
        import numpy as np

        self.np, self.threads, self.ctas = np, threads, len(ctaids)
        self.T = threads * self.ctas
        self.tid = np.arange(self.T, dtype=np.int64)  # a lane's index among all (shuffles stay in its warp)
        self.cta = self.tid // threads
        own = self.tid % threads
        ids = np.array(ctaids, dtype=np.int64).reshape(self.ctas, 3)[self.cta]  # (T, 3)
        self.regs: dict = {}
        self.special = {"%tid.x": own, "%tid.y": 0, "%tid.z": 0, "%ntid.x": threads, "%ntid.y": 1,
                        "%ntid.z": 1, "%laneid": own % 32, "%warpid": own // 32,
                        "%ctaid.x": ids[:, 0], "%ctaid.y": ids[:, 1], "%ctaid.z": ids[:, 2],
                        "%nctaid.x": nctaid[0], "%nctaid.y": nctaid[1], "%nctaid.z": nctaid[2],
                        "%cluster_ctarank": 0, "%cluster_nctarank": 1, "%clusterid.x": ids[:, 0]}
        self.params, self.memory = params, memory
        self.doubtful = np.zeros(self.T, bool)  # threads whose guard predicate is unknown: results unknown
        # shared memory's bytes as stored, SHARED_WINDOW a CTA (values that go through it, such as a
        # cross-warp reduction of the tile's positions, stay known)
        self.shared = np.zeros(SHARED_WINDOW * self.ctas, np.int64)
        self.shared_known = np.zeros(SHARED_WINDOW * self.ctas, bool)
        self.shared_base = self.cta * SHARED_WINDOW

    def shared_read(self, addresses, known, width):
        """(values, known) of a ``width``-byte little-endian load from shared memory per thread."""
        np = self.np
        ok = known & (addresses >= 0) & (addresses + width <= SHARED_WINDOW)
        where = np.where(ok, addresses, 0) + self.shared_base
        out = np.zeros(self.T, np.int64)
        for byte in range(width):
            out |= self.shared[where + byte] << (8 * byte)
            ok &= self.shared_known[where + byte]
        return out, ok

    def shared_write(self, addresses, known, values, values_known, width, active) -> None:
        write = active & known & (addresses >= 0) & (addresses + width <= SHARED_WINDOW)
        where = addresses[write] + self.shared_base[write]
        for byte in range(width):
            self.shared[where + byte] = (values[write] >> (8 * byte)) & 0xFF
            self.shared_known[where + byte] = values_known[write] & ~self.doubtful[write]

    def full(self, value, known=True):
        np = self.np
        return np.full(self.T, value, dtype=np.int64), np.full(self.T, known)

    def get(self, token: str):
        np = self.np
        token = token.strip()
        if token in self.regs:
            return self.regs[token]
        if token in self.special:
            value = self.special[token]
            return (value.copy(), np.ones(self.T, bool)) if isinstance(value, np.ndarray) else self.full(value)
        if token == "global_smem":
            return self.full(0)
        try:
            if token.startswith(("0f", "0F", "0d", "0D")):
                return self.full(0, False)
            token = token.rstrip("uU")  # 0x7701U
            value = int(token, 0) if not token.startswith("-0x") else -int(token[1:], 16)
            return self.full(_signed(value, 64) if abs(value) < 1 << 64 else 0, abs(value) < 1 << 64)
        except ValueError:
            return self.full(0, False)

    def set(self, name: str, value, known, active) -> None:
        np = self.np
        name = name.strip()
        if name.startswith("{"):  # a vector destination: unknown
            for reg in _split_args(name.strip("{} ")):
                self.set(reg, 0, False, active)
            return
        if "|" in name:
            for reg in name.split("|"):
                self.set(reg, 0, False, active)
            return
        if not name.startswith("%") or name in self.special:
            return
        value = np.broadcast_to(np.asarray(value, dtype=np.int64), (self.T,))
        known = np.broadcast_to(np.asarray(known, dtype=bool), (self.T,)) & ~self.doubtful
        old, old_known = self.regs.get(name, (np.zeros(self.T, np.int64), np.zeros(self.T, bool)))
        self.regs[name] = (np.where(active, value, old), np.where(active, known, old_known))

    def address(self, operand: str):
        """A ``[base+offset]`` operand's value per thread (``None`` base: a symbol, value 0)."""
        inner = operand.strip().strip("[]").replace(" ", "")
        base, offset = inner, 0
        for sign in ("+", "-"):
            if sign in inner[1:]:
                base, off = inner.rsplit(sign, 1)
                offset = int(off, 0) * (1 if sign == "+" else -1)
                break
        if base in self.params:
            return base, offset
        value, known = self.get(base)
        return value + offset, known


def _execute(state: _Threads, op: PtxOp, active) -> None:
    """One op's effect on the integer and predicate registers of the ``active`` threads."""
    np = state.np
    if op.name == "st" and "shared" in op.opcode:
        _store_shared(state, op, active)
        return
    if not op.has_dest:
        return
    args, parts, name, bits, signed, floating = op.args, op.parts, op.name, op.bits, op.signed, op.floating
    dest = args[0]
    if op.opaque:
        if dest in state.regs or not dest.startswith("%"):  # (registers never written are unknown)
            state.set(dest, 0, False, active)
        return

    def val(i, as_bits=bits, sign=signed):
        v, k = state.get(args[i])
        v = _signed(v, as_bits) if sign else (v & ((1 << as_bits) - 1) if as_bits < 64 else v)
        return v, k

    def out(value, known, width=bits, target=dest):
        state.set(target, _signed(np.asarray(value, dtype=np.int64), width) if width < 64 else value, known, active)

    try:
        if name == "ld" and "param" in parts:
            where, offset = state.address(args[1])
            v, k = state.params.get(where, (0, False))
            out(np.full(state.T, v, np.int64) >> (8 * offset), np.full(state.T, k))
        elif name == "ld" and "global" in parts:
            _load(state, op, active, bits, state.memory)
        elif name == "ld" and "shared" in op.opcode and not floating:
            _load(state, op, active, bits, state.shared_read)
        elif name == "shfl" and not floating:
            _shuffle(state, op, active)
        elif name == "elect":
            _elect(state, dest, active)
        elif name == "redux" and not floating:
            _reduce_warp(state, op, active)
        elif floating or name not in _INTEGER_OPS:
            state.set(dest, 0, False, active)
        elif name == "mov" and dest.startswith("{"):  # unpack: the source's low bits to the first part
            parts_ = _split_args(dest.strip("{} "))
            v, k = val(1, sign=False)
            width = bits // len(parts_)
            for i, part in enumerate(parts_):
                out((v >> (i * width)) & ((1 << width) - 1), k, width, part)
        elif name == "mov" and args[1].startswith("{"):  # pack: the first part to the low bits
            parts_ = _split_args(args[1].strip("{} "))
            width, packed, known = bits // len(parts_), 0, True
            for i, part in enumerate(parts_):
                v, k = state.get(part)
                packed, known = packed | ((v & ((1 << width) - 1)) << (i * width)), known & k
            out(packed, known)
        elif name == "mov":
            v, k = state.get(args[1])
            out(v, k)
        elif name in ("add", "sub", "mul", "mad", "min", "max"):
            if name == "mul" and "wide" in parts:
                (a, ka), (b, kb) = val(1), val(2)
                out(a * b, ka & kb, 64)
            elif name == "mad" and "wide" in parts:
                (a, ka), (b, kb), (c, kc) = val(1), val(2), state.get(args[3])
                out(a * b + c, ka & kb & kc, 64)
            else:
                (a, ka), (b, kb) = val(1), val(2)
                if name == "add":
                    r = a + b
                elif name == "sub":
                    r = a - b
                elif name == "min":
                    r = np.minimum(a, b)
                elif name == "max":
                    r = np.maximum(a, b)
                elif "hi" in parts:
                    r = (a * b) >> bits
                else:
                    r = a * b
                if name == "mad":
                    c, kc = val(3)
                    r, kb = r + c, kb & kc
                out(r, ka & kb)
        elif name in ("and", "or", "xor") and "pred" in parts:
            (a, ka), (b, kb) = state.get(args[1]), state.get(args[2])
            r = {"and": a & b, "or": a | b, "xor": a ^ b}[name]
            out(r, ka & kb, 64)
        elif name in ("and", "or", "xor"):
            (a, ka), (b, kb) = val(1, sign=False), val(2, sign=False)
            out({"and": a & b, "or": a | b, "xor": a ^ b}[name], ka & kb)
        elif name == "not":
            a, k = state.get(args[1])
            out((1 - a) if "pred" in parts else ~a, k, 64 if "pred" in parts else bits)
        elif name in ("neg", "abs"):
            a, k = val(1, sign=True)
            out(-a if name == "neg" else np.abs(a), k)
        elif name == "shl":
            (a, ka), (b, kb) = val(1, sign=False), state.get(args[2])
            out(np.where(b >= bits, 0, a << np.clip(b, 0, 63)), ka & kb)
        elif name == "shr":
            (a, ka), (b, kb) = val(1), state.get(args[2])
            fill = np.where(a < 0, -1, 0) if signed else 0
            out(np.where(b >= bits, fill, a >> np.clip(b, 0, 63)), ka & kb)
        elif name == "bfe":
            (a, ka), (pos, kp), (length, kl) = val(1), state.get(args[2]), state.get(args[3])
            field = (a >> pos) & ((1 << length) - 1)
            if signed:
                field = np.where((field >> np.maximum(length - 1, 0)) & 1 == 1, field - (1 << length), field)
            out(field, ka & kp & kl)
        elif name == "bfi":
            (a, ka), (b, kb), (pos, kp), (length, kl) = val(1, sign=False), val(2, sign=False), state.get(
                args[3]), state.get(args[4])
            mask = ((1 << length) - 1) << pos
            out((b & ~mask) | ((a << pos) & mask), ka & kb & kp & kl)
        elif name == "prmt" and len(parts) == 2:  # prmt.b32 d, a, b, selector: bytes of {b, a} by nibble
            (a, ka), (b, kb), (c, kc) = val(1, 32, False), val(2, 32, False), val(3, 32, False)
            source, r = (b << 32) | a, np.zeros(state.T, np.int64)
            for i in range(4):
                select = (c >> (4 * i)) & 0xF
                byte = (source >> (8 * (select & 7))) & 0xFF
                byte = np.where(select & 8, np.where(byte & 0x80, 0xFF, 0), byte)
                r |= byte << (8 * i)
            out(r, ka & kb & kc)
        elif name == "selp":
            (a, ka), (b, kb), (p, kp) = val(1), val(2), state.get(args[3])
            out(np.where(p != 0, a, b), kp & np.where(p != 0, ka, kb))
        elif name == "setp":
            cmp = parts[1]
            (a, ka), (b, kb) = val(1, sign=signed or parts[-1].startswith("s")), val(2, sign=signed or
                                                                                       parts[-1].startswith("s"))
            r = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "lo": a < b,
                 "ls": a <= b, "hi": a > b, "hs": a >= b}.get(cmp)
            known = ka & kb
            if r is None:
                r, known = np.zeros(state.T, bool), np.zeros(state.T, bool)
            if len(args) > 3:  # setp.CMP.BOOLOP p, a, b, c
                c, kc = state.get(args[3].lstrip("!"))
                c = (c == 0) if args[3].startswith("!") else (c != 0)
                r = {"and": r & c, "or": r | c, "xor": r ^ c}.get(parts[2], r)
                known = known & kc
            for i, target in enumerate(dest.split("|")):
                state.set(target, (~r if i else r).astype(np.int64), known, active)
        elif name == "cvt":
            src_bits = _bits(".".join(parts[:-1]) + "." + parts[-1])
            v, k = state.get(args[1])
            v = _signed(v, src_bits) if parts[-1].startswith("s") else (
                v & ((1 << src_bits) - 1) if src_bits < 64 else v)
            out(v, k, _bits(".".join(parts[:-1])))
        elif name == "div" or name == "rem":
            (a, ka), (b, kb) = val(1), val(2)
            safe = np.where(b == 0, 1, b)
            q = np.where((a < 0) ^ (safe < 0), -(np.abs(a) // np.abs(safe)), np.abs(a) // np.abs(safe))
            out(q if name == "div" else a - q * safe, ka & kb & (b != 0))
        else:
            state.set(dest, 0, False, active)
    except (IndexError, ValueError, TypeError):
        state.set(dest, 0, False, active)


def _elect(state: _Threads, dest: str, active) -> None:
    """elect.sync: the lowest active lane of each warp."""
    np = state.np
    elected, leader = np.zeros(state.T, np.int64), np.zeros(state.T, np.int64)
    for w in range(0, state.T, 32):
        lanes = np.flatnonzero(active[w:w + 32])
        if len(lanes):
            elected[w + lanes[0]], leader[w:w + 32] = 1, lanes[0]
    targets = dest.split("|")
    state.set(targets[0], leader, True, active)
    if len(targets) > 1:
        state.set(targets[1], elected, True, active)


def _load(state: _Threads, op: PtxOp, active, bits: int, read) -> None:
    """A (vector) load: each element from ``read(addresses, known, width)``."""
    dests = _split_args(op.args[0].strip("{} ")) if op.args[0].startswith("{") else [op.args[0]]
    address, known = state.address(op.args[1])
    width = bits // 8
    for i, dest in enumerate(dests):
        value, ok = read(address + i * width, known, width)
        state.set(dest, _signed(value, bits) if bits < 64 else value, ok, active)


def _store_shared(state: _Threads, op: PtxOp, active) -> None:
    """A (vector) store to shared memory: what it writes, for the loads that read it back."""
    np = state.np
    if op.args[0].startswith("[") is False or len(op.args) < 2:
        return
    sources = _split_args(op.args[1].strip("{} ")) if op.args[1].startswith("{") else [op.args[1]]
    address, known = state.address(op.args[0])
    width = op.bits // 8
    for i, source in enumerate(sources):
        value, ok = state.get(source)
        state.shared_write(address + i * width, known, value & ((1 << op.bits) - 1) if op.bits < 64 else value,
                           np.broadcast_to(ok, (state.T,)), width, active)


def _reduce_warp(state: _Threads, op: PtxOp, active) -> None:
    """redux.sync.{min,max,add,and,or,xor}: every active lane of a warp gets the warp's result."""
    np = state.np
    kind, bits = op.parts[2], op.bits
    value, known = state.get(op.args[1])
    value = _signed(value, bits) if op.signed else value & ((1 << bits) - 1)
    reduce = {"min": np.min, "max": np.max, "add": np.sum, "and": np.bitwise_and.reduce,
              "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}.get(kind)
    out, ok = np.zeros(state.T, np.int64), np.zeros(state.T, bool)
    for w in range(0, state.T, 32):
        lanes = active[w:w + 32]
        if reduce is not None and lanes.any():
            out[w:w + 32] = reduce(value[w:w + 32][lanes])
            ok[w:w + 32] = known[w:w + 32][lanes].all()
    state.set(op.args[0], _signed(out, bits), ok, active)


def _shuffle(state: _Threads, op: PtxOp, active) -> None:
    np = state.np
    mode = op.opcode.split(".")[2]
    dest = op.args[0].split("|")[0]
    (a, ka), (b, kb) = state.get(op.args[1]), state.get(op.args[2])
    lane = state.tid % 32
    source = {"idx": b & 31, "bfly": lane ^ (b & 31), "up": lane - b, "down": lane + b}.get(mode)
    if source is None:
        state.set(dest, 0, False, active)
        return
    source = np.where((source < 0) | (source > 31), lane, source)
    index = state.tid - lane + source
    state.set(dest, a[index], ka[index] & kb, active)


def _wavefronts(np, addresses, width: int, lanes_per_phase: int) -> int:
    """128-byte wavefronts of one warp's access: per phase, the most distinct 4-byte words a bank holds."""
    total = 0
    for start in range(0, 32, lanes_per_phase):
        phase = addresses[(addresses[:, 0] >= start) & (addresses[:, 0] < start + lanes_per_phase), 1]
        if not len(phase):
            continue
        words = np.unique((phase[:, None] // 4 + np.arange(max(1, width // 4))[None, :]).ravel())
        total += int(np.bincount(words % 32, minlength=32).max())
    return total


def _smem_access(state: _Threads, op: PtxOp, active) -> dict | None:
    """``{"kind", "bytes", "wavefronts", "unresolved"}`` of one shared-memory op over the CTA, or None."""
    np = state.np
    opcode, parts = op.opcode, op.opcode.split(".")
    name = parts[0]
    threads = np.flatnonzero(active)
    if not len(threads):
        return None
    if name == "wgmma" and parts[1] == "mma_async":
        m, n, k = (int(x) for x in re.search(r"\.m(\d+)n(\d+)k(\d+)", opcode).groups())
        element = _bits(opcode, 16) // 8
        a_desc = not op.args[1].startswith("{")
        groups = len(set(zip(state.cta[threads], (threads % state.threads) // 128)))
        size = groups * ((m * k * element if a_desc else 0) + n * k * element)
        return {"kind": "mma", "bytes": size, "wavefronts": size // 128, "unresolved": False}
    if name == "tcgen05" and parts[1] == "mma":
        idesc, known = state.get(op.args[3])
        if not known[threads[0]]:
            return {"kind": "mma", "bytes": 0, "wavefronts": 0, "unresolved": len(set(state.cta[threads]))}
        word = int(idesc[threads[0]])
        n, m = ((word >> 17) & 0x3F) * 8, ((word >> 24) & 0x1F) * 16
        a_desc = op.args[1].startswith("%rd")
        size = len(threads) * ((m * 32 if a_desc else 0) + n * 32)
        return {"kind": "mma", "bytes": size, "wavefronts": size // 128, "unresolved": False}
    if name == "mbarrier" and "expect_tx" in parts:
        # A TMA copy (cp.async.bulk.tensor) fills shared memory without a lane address to follow, but
        # the thread that issues it first tells the barrier how many bytes will land: the fill's
        # size. Its writes take the shared-memory pipe like any store, counted conflict-free (the
        # swizzled layouts TMA writes are built for that); the H200 showed them costing (bench/NOTES.md,
        # "H200 after kernel v4 step 4").
        size = len(threads) * int(op.args[-1], 0)
        return {"kind": "tma", "bytes": size, "wavefronts": -(-size // 128), "unresolved": False}
    if name in ("ldmatrix", "stmatrix"):
        count = int(next(p for p in parts if p.startswith("x"))[1:])
        where = op.args[1] if name == "ldmatrix" else op.args[0]
        width, per_phase, kind, lanes = 16, 8, "ldsm" if name == "ldmatrix" else "stsm", 8 * count
    elif name in ("ld", "st", "atom", "red") and "shared" in opcode.replace("::cta", ""):
        vector = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        width = vector * _bits(opcode) // 8
        per_phase = 32 if width <= 4 else max(1, 128 // width)
        where = op.args[0] if name in ("st", "red") else op.args[1]
        kind, lanes = {"ld": "lds", "st": "sts"}.get(name, "atomic"), 32
    elif name == "cp" and parts[1] == "async" and "shared" in opcode and "bulk" not in opcode:
        width = int(op.args[2], 0)
        per_phase, where, kind, lanes = 32 if width <= 4 else 128 // width, op.args[0], "ldgsts", 32
    else:
        return None
    address, known = state.address(where)
    size, fronts, unresolved = 0, 0, set()
    for w in sorted(set(threads // 32)):
        lane_ids = threads[(threads // 32) == w] - 32 * w
        lane_ids = lane_ids[lane_ids < lanes]
        if not len(lane_ids):
            continue
        thread_ids = lane_ids + 32 * w
        size += width * len(lane_ids)
        if not known[thread_ids].all():
            unresolved.add(int(state.cta[thread_ids[0]]))
            fronts += -(-width * len(lane_ids) // 128)
            continue
        fronts += _wavefronts(np, np.stack([lane_ids, address[thread_ids]], 1), width, per_phase)
    return {"kind": kind, "bytes": size, "wavefronts": fronts, "unresolved": len(unresolved)}


def _topological(successors: list, idom: list) -> tuple:
    """Blocks in reverse post-order over forward edges (back edges: to a dominator) and the back edges."""
    back = {(node, child) for node, succ in enumerate(successors) if idom[node] is not None
            for child in succ if _dominates(idom, child, node)}
    order, seen, stack = [], {0}, [(0, iter(successors[0]))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in seen and (node, child) not in back:
            seen.add(child)
            stack.append((child, iter(successors[child])))
    return order[::-1], back


def smem_traffic(text: str, param_values: dict, memory, threads: int, programs: list) -> dict | None:
    """The key loop's shared-memory accesses, one iteration, averaged over ``programs`` (CTA ids):
    ``{"bytes", "wavefronts", "unresolved", "by_kind": {kind: [bytes, wavefronts]}, "by_line":
    {(file, line): {kind: [bytes, wavefronts]}}}`` per CTA (``by_line``: the PTX's source lines).
    ``param_values``: {PTX parameter index: (value, known)}; ``memory(address, known, width)``:
    (values, known) of a global load; ``reached``: how many of ``programs`` enter the key loop (a
    program that returns first, e.g. a FIX_UP launch's without work, adds nothing). None without a
    key loop."""
    import numpy as np

    ops, labels, params = parse_ptx(text)
    instructions = _ptx_instructions(ops)
    blocks, successors = _blocks(instructions, labels)
    idom = _dominators(successors)
    loops = _loop_forest(blocks, _loop_bodies(successors, idom))
    counted = [loop for loop in loops if any(i.opcode.startswith(PTX_MMA) for i in loop.own)]
    if not counted or not programs:
        return None
    key = max(counted, key=lambda loop: (sum(i.opcode.startswith(PTX_MMA) for i in loop.own), -loop.depth(),
                                         len(loop.own)))  # as Sass.key_loop
    order, back = _topological(successors, idom)
    last_needed = max(order.index(b) for b in key.blocks)
    named = {name: param_values.get(i, (0, False)) for i, (name, _) in enumerate(params)}
    found = {"bytes": 0, "wavefronts": 0, "unresolved": 0, "by_kind": {}, "by_line": {}, "reached": 0}
    # every sampled CTA at once, side by side (one numpy op an instruction for all of them)
    state = _Threads(threads, [ctaid for ctaid, _ in programs], programs[0][1], named, memory)
    lanes = state.T
    entered = np.zeros(lanes, bool)  # the lanes that ran an instruction of the key loop
    masks = {0: np.ones(lanes, bool)}
    for node in order[:last_needed + 1]:
        active = masks.get(node, np.zeros(lanes, bool))
        block = blocks[node]
        for instruction in block:
            op = ops[instruction.address]
            run, state.doubtful = active, np.zeros(lanes, bool)
            if op.guard is not None:
                p, known = state.get(op.guard[0])
                p = (p == 0) if op.guard[1] else (p != 0)
                run, state.doubtful = active & (p | ~known), active & ~known
            if instruction.base in _ENDS_BLOCK:
                continue
            if node in key.blocks:
                entered |= run
                access = _smem_access(state, op, run)
                if access:
                    found["bytes"] += access["bytes"]
                    found["wavefronts"] += access["wavefronts"]
                    found["unresolved"] += access["unresolved"]
                    for entry in (found["by_kind"].setdefault(access["kind"], [0, 0]),
                                  found["by_line"].setdefault((op.file, op.line), {}).setdefault(
                                      access["kind"], [0, 0])):
                        entry[0] += access["bytes"]
                        entry[1] += access["wavefronts"]
            _execute(state, op, run)
            state.doubtful = np.zeros(lanes, bool)
        last = block[-1]
        taken = fall = active
        if last.base in _ENDS_BLOCK:
            op = ops[last.address]
            if op.guard is None:
                fall = np.zeros(lanes, bool)
            else:
                p, known = state.get(op.guard[0])
                p = (p == 0) if op.guard[1] else (p != 0)
                taken, fall = active & (p | ~known), active & (~p | ~known)
        # a loop's latch: its one simulated iteration may branch back, but every thread that
        # reaches it leaves the loop in the end (a loop before the key loop, e.g. the forward's
        # tiles every row sees, must pass its threads on)
        latch = any((node, child) in back for child in successors[node])
        for child in successors[node]:
            if (node, child) in back:
                continue
            if latch:
                masks[child] = masks.get(child, np.zeros(lanes, bool)) | active
                continue
            is_target = last.base in ("BRA", "JMP") and labels.get(last.target) == blocks[child][0].address
            is_next = child == node + 1 and last.base not in _NO_FALLTHROUGH and (
                last.base not in _ENDS_BLOCK or last.predicated)
            none = np.zeros(lanes, bool)
            edge = (taken if is_target else none) | (fall if is_next else none) if (is_target or is_next) else active
            masks[child] = masks.get(child, np.zeros(lanes, bool)) | edge
    found["reached"] = int(entered.reshape(state.ctas, threads).any(1).sum())
    n = len(programs)
    return {"bytes": found["bytes"] / n, "wavefronts": found["wavefronts"] / n, "unresolved": found["unresolved"],
            "by_kind": {k: [b / n, w / n] for k, (b, w) in sorted(found["by_kind"].items())},
            "by_line": {where: {k: [b / n, w / n] for k, (b, w) in sorted(kinds.items())}
                        for where, kinds in found["by_line"].items()},
            "reached": found["reached"]}
