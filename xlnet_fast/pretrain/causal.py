"""Causal-LM pretraining of Transformer-XL (docs/DESIGN.md §7): the token stream cut into parallel
streams, segments of ``tgt_len`` tokens scoring the next ones, memory carried across steps.

The batches are the original code's ``LMOrderedIterator``: the stream cut into as many contiguous
parts as the global batch has rows (row ``g`` of the global batch reads part ``g``), each step the
next ``tgt_len`` tokens of every row as input and the same shifted by one as targets, so the memory a
row carries into the next step (its last ``mem_len`` hidden states per layer, detached) holds the text
right before it. At the end of its part a row starts over from the part's beginning and the memory
starts afresh (``restart``), as the original starts each epoch with an empty memory. Each row has
its own position, so a rank's batches do not depend on the number of ranks.

The loss is the adaptive softmax's negative log-likelihood of every target (``crit.nll``: the head
and each target's own cluster only), summed; the loop divides by the number of targets of all ranks.
The evaluation is the perplexity of held-out text read the same way (every row a part of it, memory
carried from the start memory, no dropout) over at most ``eval_batches`` segments.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .distributed import all_sum
from .errors import UsageError
from .evaluate import eval_bar, eval_row, eval_tokens


class StreamBatches:
    """Deterministic, resumable causal-LM batches for one rank (see the module docstring): rows
    ``[rank * rows, (rank + 1) * rows)`` of ``rows * world_size`` parallel streams."""

    def __init__(self, tokens, tgt_len: int, rows: int, rank: int = 0, world_size: int = 1,
                 name: str = "the training data") -> None:
        if tgt_len < 1 or rows < 1:
            raise UsageError(f"tgt_len and rows must be positive, got {tgt_len} and {rows}")
        self.tokens, self.tgt_len, self.rows = tokens, tgt_len, rows
        self.global_rows = rows * world_size
        self.stream_len = len(tokens) // self.global_rows
        self.segments = (self.stream_len - 1) // tgt_len  # whole segments per part (the tail is left out)
        if self.segments < 1:
            raise UsageError(f"{name}: {len(tokens)} tokens are too few for {self.global_rows} rows of at least "
                             f"--tgt-len + 1 = {tgt_len + 1} tokens: use more text, fewer rows or a shorter --tgt-len")
        self.row_ids = list(range(rank * rows, (rank + 1) * rows))
        self.pos = {r: 0 for r in self.row_ids}

    def next_batch(self) -> dict:
        """``input_ids``, ``labels`` ``(B, tgt_len)`` (the next tokens) and ``restart``: whether the
        rows start their parts over (the memory starts afresh)."""
        restart = False
        starts = []
        for r in self.row_ids:
            pos = self.pos[r]
            if pos + self.tgt_len + 1 > self.stream_len:
                pos, restart = 0, True
            starts.append(r * self.stream_len + pos)
            self.pos[r] = pos + self.tgt_len
        idx = np.asarray(starts)[:, None] + np.arange(self.tgt_len + 1)
        ids = torch.from_numpy(np.asarray(self.tokens[idx.reshape(-1)], dtype=np.int64).reshape(idx.shape))
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "restart": restart}

    def row_state(self, row: int) -> dict:
        return {"pos": int(self.pos[row])}

    def load_row_states(self, states: dict[int, dict]) -> None:
        for r in self.row_ids:
            self.pos[r] = int(states[r]["pos"])

    def state_dict(self) -> dict:
        return {"pos": dict(self.pos)}

    def load_state_dict(self, state: dict) -> None:
        self.load_row_states({r: {"pos": state["pos"][r]} for r in self.row_ids})


class CausalLMLoss(nn.Module):
    """What DDP or FSDP2 wraps for Transformer-XL's training: ``forward(input_ids, labels, mems)`` ->
    ``(sum of the targets' negative log-likelihoods, number of targets, new mems)``. It holds the
    ``TransfoXLLMHeadModel`` (its parameters, no others), so wrapping it wraps the model, and every
    parameter takes part in every step (the adaptive softmax scores empty clusters too)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, mems, dtype: torch.dtype = torch.float32):
        """The sum in ``dtype`` (the evaluation sums in float64)."""
        out = self.lm.transformer(input_ids, mems=mems)
        hidden = out.last_hidden_state
        nll = self.lm.crit.nll(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))
        return nll.to(dtype).sum(), torch.tensor(labels.numel(), device=labels.device), out.mems


class StreamEvaluator:
    """The perplexity of ``tokens`` read as ``StreamBatches`` do (this rank's rows of ``rows * world``),
    memory carried from the model's start memory, at most ``n_batches`` segments, no dropout."""

    def __init__(self, tokens, tgt_len: int, rows: int, n_batches: int, rank: int = 0, world: int = 1,
                 source: str = "eval data") -> None:
        if n_batches < 1:
            raise ValueError(f"n_batches must be positive, got {n_batches}")
        self.batches = StreamBatches(tokens, tgt_len, rows, rank, world, name=source)
        self.n_batches = min(n_batches, self.batches.segments)
        self.source, self.n_tokens = source, len(tokens)

    @torch.no_grad()
    def sums(self, model: nn.Module, device: torch.device, bar=None) -> tuple[float, int]:
        """``(sum of the targets' negative log-likelihoods, number of targets)`` over this rank's rows.
        ``model``: a ``TransfoXLLMHeadModel`` or the run's ``CausalLMLoss`` around it (under FSDP2 the
        module whose forward gathers the shards); ``bar`` (an ``eval_bar``) advances by one per segment."""
        self.batches.load_state_dict({"pos": {r: 0 for r in self.batches.row_ids}})
        step = model if isinstance(model, CausalLMLoss) else CausalLMLoss(model)
        was_training = step.training
        step.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count, mems = 0, None
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                for _ in range(self.n_batches):
                    batch = self.batches.next_batch()
                    total, n, mems = step(batch["input_ids"].to(device), batch["labels"].to(device), mems,
                                          dtype=torch.float64)
                    loss_sum += total
                    count += batch["labels"].numel()
                    if bar is not None:
                        bar.update(1)
        finally:
            step.train(was_training)
        return float(loss_sum), count

    def evaluate(self, model: nn.Module, device: torch.device, world: int = 1) -> dict:
        """``{"eval_loss", "eval_ppl", "eval_tokens"}`` over every rank's rows (a collective)."""
        loss_sum, count = self.sums(model, device)
        totals = all_sum(torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=device), world)
        return eval_row(float(totals[0]), int(totals[1]))


def forward_flops_per_batch(d_model: int, n_layer: int, n_head: int, d_head: int, d_inner: int, tgt_len: int,
                            mem_len: int, head_size: int, d_embed: int, rows: int) -> int:
    """Forward FLOPs of a Transformer-XL on ``rows`` segments (a multiply-add = 2 FLOPs), at
    ``K = mem_len + tgt_len`` keys. Per row and layer: the q, k, v projections of all K rows (the
    model projects the memory with the segment, ``6·K·d·A``), attention (``6·L·K·A``: q·k, q·k_r
    after the shift, p·v), the output projection ``2·L·A·d`` and the feed-forward ``4·L·d·F``; per row
    the adaptive softmax's head (``2·L·d_embed·head_size``, ``head_size`` = the shortlist and one
    score per tail cluster; its tail clusters, scored for the rare targets only, are left out); once
    per batch and layer the relative positions ``2·(K + 1)·d·A``."""
    d, A, F, L, K = d_model, n_head * d_head, d_inner, tgt_len, mem_len + tgt_len
    per_row = n_layer * (6 * K * d * A + 6 * L * K * A + 2 * L * A * d + 4 * L * d * F) + 2 * L * d_embed * head_size
    return rows * per_row + n_layer * 2 * (K + 1) * d * A


def evaluate_checkpoint(src, data: list[str] | None = None, batches: int | None = None, tokenizer: str | None = None,
                        cache_dir: str | None = None, device: torch.device | None = None, verify_data: bool = False,
                        rows: int | None = None, progress: bool = False, **overrides) -> dict:
    """``xlnet-fast eval`` of a Transformer-XL training checkpoint (``artifacts.ModelDir``): the run's
    evaluation — its rows (``--batch-size`` x ranks), ``tgt_len`` segments, memory carried, at most its
    ``--eval-batches`` segments — on the text it evaluated on (or ``data``), so it prints the
    ``eval_loss`` of the run's metrics row at that step. ``overrides``: ``tgt_len``, ``mem_len``,
    ``clamp_len``, ``same_length``, ``mem_start``, ``attn_backend`` (None: the run's); ``progress``: bars on
    stderr (preparing the text, the segments)."""
    from .artifacts import load_lm, load_tokenizer
    from .outputs import default_cache_dir

    settings = src.record["settings"]
    world = src.record.get("world_size") or 1
    tgt_len = overrides.pop("tgt_len", None)
    tgt_len = settings["tgt_len"] if tgt_len is None else tgt_len
    n_rows = settings["batch_size"] * world if rows is None else rows
    n_batches = (settings.get("eval_batches") or 10) if batches is None else batches
    for flag, value in (("--tgt-len", tgt_len), ("--batch-size", n_rows), ("--batches", n_batches)):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    tok = load_tokenizer(src, tokenizer)
    cache_dir = default_cache_dir(cache_dir)
    tokens, what = eval_tokens(src, data, tok, cache_dir, verify_data, progress)
    lm = load_lm(src, **{k: v for k, v in overrides.items() if v is not None})
    if tok.vocab_size != lm.config.vocab_size:
        raise UsageError(f"the tokenizer has {tok.vocab_size} symbols but the model's vocabulary "
                         f"{lm.config.vocab_size}: pass the model's own with --tokenizer DIR")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm.to(device)
    evaluator = StreamEvaluator(tokens, tgt_len, n_rows, n_batches, source=what)
    with eval_bar(evaluator.n_batches, progress, unit="segment") as bar:
        loss_sum, count = evaluator.sums(lm, device, bar)
    c = lm.config
    return {"model": src.path, "step": src.step, "data": what, "batches": evaluator.n_batches, "rows": n_rows,
            "tgt_len": tgt_len, "mem_len": c.mem_len, "clamp_len": c.clamp_len, "same_length": c.same_length,
            "mem_start": c.mem_start, **eval_row(loss_sum, count)}
