"""Read NVIDIA SASS (``nvdisasm -c -gi``): loops, the key loop, and instruction counts per iteration.

Loops are the natural loops of the control-flow graph: the listing is cut into basic blocks at
branch targets and after branches/exits; an edge to a block that dominates its source is a back
edge, and the loop is the header plus every block that reaches the back edge without passing the
header (back edges to one header form one loop). Loops nest by block containment, whatever the code
layout (ptxas may place part of an inner loop after its outer loop's back edge). The *key loop* is
the loop whose own blocks (nested loops excluded) issue the most MMA instructions (HMMA: mma.sync,
sm_80+; HGMMA: Hopper's wgmma; UTC*MMA: Blackwell's tcgen05), the outermost one on a tie: the loop
over the other side's tiles that does the tile's GEMMs, while inner loops (k_r windows) do one GEMM
each and outer loops none.

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
        return self.opcode.split(".")[0]


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
        return max(candidates, key=lambda loop: (loop.own_mma(), -loop.depth()))


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
        for label in pending:
            labels[label] = address
        pending = []
        if opcode == "NOP":
            continue
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


def per_iteration(loop: Loop, trips) -> Counter:
    """Counts for one iteration of ``loop``: its own instructions plus each nested loop times
    ``trips(nested)`` (iterations of the nested loop per iteration of its parent)."""
    total = count(loop.own)
    for child in loop.children:
        times = trips(child)
        for cls, n in per_iteration(child, trips).items():
            total[cls] += n * times
    return total
