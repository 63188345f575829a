"""The benchmarks' cases as named records, the record of one op call, and the one builder of each
kind of input.

``AttentionCase`` + ``attention_inputs``: the arguments of one call of the attention op as an
``OpCall`` (``rel_attention``, or ``rel_attention_two_stream`` when the case has a query stream),
used by ``bench.attention``, ``bench.gpu_check`` and the compile report; the tests build their
fuzzed ``OpCall``s on top of it (``tests/helpers/attention.py``). ``ModelCase`` + ``token_ids`` /
``pretraining_batch``: the inputs of a whole model, used by ``bench.model_step``,
``bench.cpu_vs_hf`` and ``bench.checkpoint_stall``. Model widths come from
``xlnet_fast.config.MODEL_SIZES``.

Random draws, fixed by the case's ``seed``: the index data (factorisation order, then segment
boundaries) from a CPU generator, then moved to the device; the float tensors from a generator on
the device, in the order of ``GRAD_NAMES``, drawn in float32 (float64 for a float64 case), scaled
(biases and segment embeddings by 0.1) and cast to the case's dtype. On the ``meta`` device the
floats are empty tensors (shapes and dtypes only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from xlnet_fast.config import MODEL_SIZES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
RANKS = ("permutation", "pretraining")
ARG_NAMES = ("q", "k", "v", "k_r", "r_w_bias", "r_r_bias")  # rel_attention's positional arguments
SEGMENT_ARGS = ("r_s_bias", "seg_embed")
# The op's differentiable arguments in the order they are drawn ("q_g" right after "q" for a
# two-stream case; the segment ones only with segments), and the scale of the draws.
GRAD_NAMES = ARG_NAMES + SEGMENT_ARGS
SMALL_ARGS = ("r_w_bias", "r_r_bias") + SEGMENT_ARGS  # drawn x 0.1
# XLNet's first 9 ids are special tokens; token ids are drawn above them.
FIRST_ORDINARY_ID = 9
SEP_ID, CLS_ID = 4, 3


@dataclass(frozen=True)
class AttentionCase:
    """One call of the attention op.

    ``B`` batch, ``H`` heads, ``qlen`` positions, ``mlen`` memory keys, ``D`` head dim, ``dtype``.
    ``targets``: how many positions are predicted (the last ``targets`` of the factorisation order);
    ``two_stream``: the query stream's rows of those targets go in the same launch
    (``rel_attention_two_stream``). ``ranks``: ``"permutation"`` — every position sees the keys up
    to itself in a random factorisation order (``q_rank = rank + 1``, ``k_rank = rank``) — or
    ``"pretraining"`` — as XLNet's pretraining builds them: only the targets are ordered
    (``q_rank = rank`` for targets, 0 else; ``k_rank = rank`` for targets, -1 else). Memory keys are
    always visible. ``segments``: a segment boundary per row, drawn in ``[qlen/4, qlen)``, memory
    in segment 0, with the segment bias and embeddings.
    """

    B: int
    H: int
    qlen: int
    mlen: int
    D: int
    dtype: torch.dtype = torch.bfloat16
    targets: int = 0
    two_stream: bool = False
    ranks: str = "permutation"
    segments: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("B", "H", "qlen", "D"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.mlen < 0 or not 0 <= self.targets <= self.qlen:
            raise ValueError(f"need mlen >= 0 and 0 <= targets <= qlen, got mlen={self.mlen}, "
                             f"targets={self.targets}, qlen={self.qlen}")
        if self.ranks not in RANKS:
            raise ValueError(f"ranks must be one of {RANKS}, got {self.ranks!r}")
        if (self.two_stream or self.ranks == "pretraining") and not self.targets:
            raise ValueError("a two-stream or pretraining case needs targets > 0")

    @property
    def klen(self) -> int:
        """Keys: memory then the positions."""
        return self.mlen + self.qlen

    @property
    def rlen(self) -> int:
        """Rows of ``k_r``: every relative distance from ``klen`` down to ``-qlen``."""
        return self.mlen + 2 * self.qlen

    @property
    def rows(self) -> int:
        """Query rows of the launch: the content stream, plus the targets when two-stream."""
        return self.qlen + (self.targets if self.two_stream else 0)

    def flops(self, mode: str = "fwd") -> float:
        """Work of one call, for time estimates: the content, position and value products
        (``2·B·H·rows·D·(2·klen + rlen)`` forward), x3 for forward+backward."""
        forward = 2 * self.B * self.H * self.rows * self.D * (2 * self.klen + self.rlen)
        return forward * (3 if mode == "fwd_bwd" else 1)


@dataclass(frozen=True, eq=False)
class OpCall:
    """The arguments of one call of the op: ``rel_attention``, or ``rel_attention_two_stream`` when
    ``q_g`` is set (``q`` is then its ``q_h``); a keyword left at None is not passed.

    Shapes: ``q (B, M, H, D)``; ``q_g (B, P, H, D)``; ``k, v (B, K, H, D)``, ``K = mlen + qlen``;
    ``k_r (Br, R, H, D)``; biases ``(H, D)``; ``seg_embed (2, H, D)``; ``q_seg, q_rank, q_pos (B, M)``;
    ``k_seg, k_rank (B, K)``; ``target_pos (B, P)``; ``attn_mask (B, M, K)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    k_r: Tensor
    r_w_bias: Tensor
    r_r_bias: Tensor
    q_g: Tensor | None = None
    r_s_bias: Tensor | None = None
    seg_embed: Tensor | None = None
    q_rank: Tensor | None = None
    k_rank: Tensor | None = None
    q_seg: Tensor | None = None
    k_seg: Tensor | None = None
    target_pos: Tensor | None = None
    q_pos: Tensor | None = None
    attn_mask: Tensor | None = None
    qlen: int | None = None
    self_visible: bool | None = None
    masks: object = None  # xlnet_fast.PreparedMasks, in place of the index arguments: ``prepared()``

    @property
    def two_stream(self) -> bool:
        return self.q_g is not None

    def args(self) -> list[Tensor]:
        """The positional arguments: ``ARG_NAMES``, with ``q_g`` after ``q`` for two streams."""
        names = ("q", "q_g") + ARG_NAMES[1:] if self.two_stream else ARG_NAMES
        return [getattr(self, name) for name in names]

    def kwargs(self) -> dict:
        """The keyword arguments that are set (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ARG_NAMES + ("q_g",) and getattr(self, f.name) is not None}

    @property
    def floats(self) -> dict:
        """The differentiable arguments that are set, by the op's names (``q_h``, ``q_g`` for two
        streams), in ``GRAD_NAMES`` order."""
        names = ("q", "q_g") + GRAD_NAMES[1:]
        return {("q_h" if n == "q" and self.two_stream else n): getattr(self, n) for n in names
                if getattr(self, n) is not None}

    @property
    def index(self) -> dict:
        """The index arguments that are set: ranks, segments, target positions, query positions, mask."""
        names = ("q_rank", "k_rank", "q_seg", "k_seg", "target_pos", "q_pos", "attn_mask")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def with_floats(self, floats: dict) -> OpCall:
        """The same call on other differentiable tensors (named as ``floats`` names them)."""
        return self.replace(**{("q" if n == "q_h" else n): t for n, t in floats.items()})

    def call(self, fn=None, **options):
        """``fn(*args, **kwargs, **options)``; ``fn`` defaults to the op (``backend`` in ``options``).
        The output ``(B, M, H, D)``, or ``(out_h, out_g)`` for two streams."""
        if fn is None:
            import xlnet_fast

            fn = xlnet_fast.rel_attention_two_stream if self.two_stream else xlnet_fast.rel_attention
        return fn(*self.args(), **self.kwargs(), **options)

    def prepared(self, backend: str = "triton") -> OpCall:
        """The same call with its masks prepared once (``masks=``, tables for ``backend``), as a
        model's layers call the op; the index arguments are then left out."""
        import xlnet_fast

        B, M = self.q.shape[:2]
        K, device = self.k.shape[1], self.q.device
        if self.two_stream:
            masks = xlnet_fast.prepare_two_stream_masks(B, M, K, device=device, backend=backend, **self.index)
        else:
            masks = xlnet_fast.prepare_masks(B, M, K, device=device, backend=backend, qlen=self.qlen,
                                             **self.index, **({} if self.self_visible is None
                                                              else {"self_visible": self.self_visible}))
        return self.replace(**dict.fromkeys(self.index), qlen=None, self_visible=None, masks=masks)

    def replace(self, **changes) -> OpCall:
        return dataclasses.replace(self, **changes)

    def to(self, device=None, dtype=None) -> OpCall:
        """Floating-point tensors cast to ``dtype``, then every tensor moved to ``device``."""
        def move(value):
            if not torch.is_tensor(value):
                return value
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            return value if device is None else value.to(device)

        return self.replace(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})


def _floats(case: AttentionCase, device) -> dict:
    names = [n for n in GRAD_NAMES if case.segments or n not in SEGMENT_ARGS]
    if case.two_stream:
        names.insert(1, "q_g")
    shapes = {"q": (case.B, case.qlen), "q_g": (case.B, case.targets), "k": (case.B, case.klen),
              "v": (case.B, case.klen), "k_r": (1, case.rlen), "r_w_bias": (), "r_r_bias": (), "r_s_bias": (),
              "seg_embed": (2,)}
    if torch.device(device).type == "meta":
        return {n: torch.empty(*shapes[n], case.H, case.D, dtype=case.dtype, device="meta") for n in names}
    draw_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    g = torch.Generator(device=device).manual_seed(case.seed)
    return {n: (torch.randn(*shapes[n], case.H, case.D, generator=g, device=device, dtype=draw_dtype)
                * (0.1 if n in SMALL_ARGS else 1.0)).to(case.dtype) for n in names}


def _index(case: AttentionCase) -> dict:
    """Index data on CPU: the order first, then the segment boundaries, from one generator."""
    from xlnet_fast import masks

    B, L, P = case.B, case.qlen, case.targets
    g = torch.Generator().manual_seed(case.seed)
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)  # factorisation order
    rank = torch.argsort(order, dim=1).to(torch.int32)  # each position's place in it
    index = {}
    if case.ranks == "permutation":
        q_rank, k_rank = rank + 1, rank
    else:
        is_target = rank >= L - P
        q_rank, k_rank = torch.where(is_target, rank, 0), torch.where(is_target, rank, -1)
    index.update(q_rank=q_rank, k_rank=masks.with_memory(k_rank, case.mlen))
    if case.segments:
        seg = (torch.arange(L) >= torch.randint(L // 4, L, (B, 1), generator=g)).long()
        index.update(q_seg=seg, k_seg=torch.cat([torch.zeros(B, case.mlen, dtype=torch.long), seg], 1))
    if case.two_stream:  # the last P of the order, by position
        index["target_pos"] = torch.sort(torch.argsort(rank, dim=1, descending=True)[:, :P], dim=1).values
    return index


def attention_inputs(case: AttentionCase, device="cpu") -> OpCall:
    """The op's call for ``case`` on ``device`` ("meta": empty floats, for compiling only)."""
    index = {name: t.to(device) for name, t in _index(case).items()}
    return OpCall(**_floats(case, device), **index)


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A standard-normal tensor shaped like ``t`` (an upstream gradient), drawn in float32 (float64
    for float64) from ``seed`` on ``t``'s device; empty on ``meta``."""
    if t.device.type == "meta":
        return torch.empty_like(t)
    draw_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    g = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randn(t.shape, generator=g, device=t.device, dtype=draw_dtype).to(t.dtype)


# --------------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCase:
    """A model size (a name in ``MODEL_SIZES``, ``n_layer`` overridable) and its batch: ``B`` rows
    of ``seq`` tokens, ``mlen`` memory, ``predict`` targets per row (0: no query stream)."""

    size: str
    B: int
    seq: int
    mlen: int = 0
    predict: int = 0
    vocab: int = 32000
    n_layer: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.size not in MODEL_SIZES:
            raise ValueError(f"size must be one of {sorted(MODEL_SIZES)}, got {self.size!r}")
        if not 0 <= self.predict <= self.seq:
            raise ValueError(f"need 0 <= predict <= seq, got predict={self.predict}, seq={self.seq}")

    @property
    def dims(self) -> dict:
        """``d_model, n_layer, n_head, d_inner``."""
        dims = dict(MODEL_SIZES[self.size])
        if self.n_layer is not None:
            dims["n_layer"] = self.n_layer
        return dims

    def config(self, **extra) -> dict:
        """Keyword arguments of ``XLNetConfig`` (ours or transformers') for this case."""
        return dict(vocab_size=self.vocab, **self.dims, mem_len=self.mlen, **extra)

    def flops(self, mode: str = "fwd", lm_head: bool = False) -> float:
        """Work of one step, for time estimates: per layer and row the projections (q, k, v, o and
        the relative keys), the feed-forward and the attention; rows are the ``seq`` content rows
        plus the ``predict`` query rows; with ``lm_head`` the logits of the predicted rows (of every
        row without targets). x3 for forward+backward."""
        d = self.dims
        rows = self.seq + self.predict
        per_row = 2 * (5 * d["d_model"] ** 2 + 2 * d["d_model"] * d["d_inner"])
        per_row += 2 * d["d_model"] * (2 * (self.mlen + self.seq) + self.mlen + 2 * self.seq)
        forward = self.B * rows * per_row * d["n_layer"]
        if lm_head:
            forward += 2 * self.B * (self.predict or self.seq) * d["d_model"] * self.vocab
        return forward * (3 if mode == "fwd_bwd" else 1)


def token_ids(case: ModelCase) -> torch.Tensor:
    """``(B, seq)`` random ordinary token ids (the first draw of the case's generator)."""
    g = torch.Generator().manual_seed(case.seed)
    return torch.randint(FIRST_ORDINARY_ID, case.vocab, (case.B, case.seq), generator=g)


def pretraining_batch(case: ModelCase, device="cpu") -> dict:
    """One two-stream pretraining batch: ``ids (B, seq)``; the compact masks XLNet's ``local_perm``
    gives (``q_rank, k_rank`` int32 ``(B, seq)``, ``target_pos (B, predict)``); the same as dense
    transformers inputs (``perm_mask (B, seq, seq)``, one-hot ``target_mapping (B, predict, seq)``);
    ``labels (B, predict)``; ``mems``: one ``(mlen, B, d_model)`` tensor per layer."""
    from xlnet_fast.masks import local_perm

    B, seq, predict = case.B, case.seq, case.predict
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(FIRST_ORDINARY_ID, case.vocab, (B, seq), generator=g)
    q_ranks, k_ranks, targets = [], [], []
    for b in range(B):
        masked = torch.zeros(seq, dtype=torch.bool)
        masked[torch.randperm(seq, generator=g)[:predict]] = True
        q, k, t = local_perm(ids[b], masked, seq, sep_id=SEP_ID, cls_id=CLS_ID, generator=g)
        q_ranks.append(q)
        k_ranks.append(k)
        targets.append(t.nonzero().flatten())
    target_pos = torch.stack(targets)
    q_rank, k_rank = torch.stack(q_ranks), torch.stack(k_ranks)
    perm_mask = (q_rank[:, :, None] <= k_rank[:, None, :]).float()
    target_mapping = torch.zeros(B, predict, seq).scatter_(2, target_pos[..., None], 1.0)
    d = case.dims
    mems = [torch.randn(case.mlen, B, d["d_model"], generator=g) for _ in range(d["n_layer"])]
    batch = dict(ids=ids, q_rank=q_rank, k_rank=k_rank, target_pos=target_pos, perm_mask=perm_mask,
                 target_mapping=target_mapping, labels=ids.gather(1, target_pos))
    return {**{k: v.to(device) for k, v in batch.items()}, "mems": [m.to(device) for m in mems]}

