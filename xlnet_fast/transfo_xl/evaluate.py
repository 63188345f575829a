"""Long-context evaluation as the original ``eval.py``: perplexity over a token stream, read in
segments of ``tgt_len`` tokens with the memory of the previous ones (``mem_len`` rows per layer,
from the model's start memory, ``init_mems``: ``config.mem_start`` unless ``mem_start`` names one —
transformers 4.x's zero rows by default, ``"empty"`` the original code's), every token predicted once.

The stream is cut into ``batch_size`` rows of consecutive text (the original ``LMOrderedIterator``);
each step feeds ``tgt_len`` tokens of every row and scores the next ``tgt_len``. Only each target's
cluster of the adaptive softmax is computed (``crit.nll``).
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import Tensor

from ..pretrain.errors import UsageError


@torch.no_grad()
def stream_nll(model, tokens: Tensor, tgt_len: int, batch_size: int = 1, max_segments: int | None = None,
               mem_start: str | None = None, progress: bool = False) -> dict:
    """``{"loss_sum", "tokens", "segments", "seconds"}`` of a ``TransfoXLLMHeadModel`` over ``tokens
    (N,)``: the sum of the next-token negative log-likelihoods (float64) and how many were scored.
    The memory starts as ``model.init_mems(batch_size, start=mem_start)``. ``progress``: a bar of
    the segments on stderr."""
    from ..pretrain.evaluate import eval_bar

    if tgt_len < 1 or batch_size < 1:
        raise ValueError(f"tgt_len and batch_size must be positive, got {tgt_len} and {batch_size}")
    n_step = tokens.numel() // batch_size
    if n_step < 2:
        raise ValueError(f"{tokens.numel()} tokens are too few for {batch_size} rows of at least 2 tokens")
    device = model.device
    data = tokens[: n_step * batch_size].view(batch_size, n_step).to(device)
    was_training = model.training
    model.eval()
    mems = model.init_mems(batch_size, start=mem_start)
    loss_sum, count, segments = torch.zeros((), dtype=torch.float64, device=device), 0, 0
    starts = range(0, n_step - 1, tgt_len)
    if max_segments is not None:
        starts = starts[:max(max_segments, 0)]
    t0 = time.perf_counter()
    try:
        with eval_bar(len(starts), progress, unit="segment") as bar:
            for start in starts:
                L = min(tgt_len, n_step - 1 - start)
                out = model.transformer(data[:, start:start + L], mems=mems)
                hidden = out.last_hidden_state
                nll = model.crit.nll(hidden.reshape(-1, hidden.shape[-1]),
                                     data[:, start + 1:start + 1 + L].reshape(-1))
                loss_sum += nll.double().sum()
                count += nll.numel()
                segments += 1
                mems = out.mems
                bar.update(1)
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        model.train(was_training)
    return {"loss_sum": float(loss_sum), "tokens": count, "segments": segments, "seconds": time.perf_counter() - t0}


def encode_files(paths: list[str], tokenizer) -> Tensor:
    """Every line of the UTF-8 files, blank ones included, as symbols plus ``<eos>`` (the original
    corpus encoding), one stream of ids."""
    from ..pretrain.corpus import decode_line

    ids: list[int] = []
    for path in paths:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                ids.extend(tokenizer.encode(decode_line(path, lineno, raw), add_eos=True))
    return torch.tensor(ids, dtype=torch.long)


def evaluate_transfo_xl_dir(model_dir: str, data: list[str] | None, tgt_len: int = 128, mem_len: int | None = None,
                            clamp_len: int | None = None, same_length: bool | None = None,
                            mem_start: str | None = None, batch_size: int = 10,
                            batches: int | None = None, tokenizer: str | None = None, backend: str | None = None,
                            device: torch.device | None = None, progress: bool = False) -> dict:
    """``xlnet-fast eval`` for a Transformer-XL directory: perplexity of the text files ``data``.
    ``mem_len``, ``clamp_len``, ``same_length``: the model's unless given; ``batches``: at most this
    many segments; ``progress``: a bar of the segments on stderr. A user's mistake is a ``UsageError``."""
    from ..pretrain.corpus import check_readable
    from .model import TransfoXLLMHeadModel
    from .tokenizer import TransfoXLTokenizer

    if not data:
        raise UsageError("--data FILE... is needed to evaluate a Transformer-XL (the text to score)")
    for flag, value, low in (("--tgt-len", tgt_len, 1), ("--batch-size", batch_size, 1), ("--mem-len", mem_len, 0),
                             ("--batches", batches, 1)):
        if value is not None and value < low:
            what = "a positive integer" if low else "0 or a positive integer"
            raise UsageError(f"{flag} must be {what}, got {value}")
    check_readable(data)
    overrides = {k: v for k, v in (("mem_len", mem_len), ("clamp_len", clamp_len), ("same_length", same_length),
                                   ("mem_start", mem_start), ("attn_backend", backend)) if v is not None}
    try:
        model = TransfoXLLMHeadModel.from_pretrained(model_dir, **overrides)
        tok = TransfoXLTokenizer.from_pretrained(tokenizer or model_dir)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {model_dir}: {exc}") from None
    if tok.vocab_size > model.config.vocab_size:
        raise UsageError(f"the vocabulary has {tok.vocab_size} symbols, the model only {model.config.vocab_size}")
    tokens = encode_files([os.path.abspath(p) for p in data], tok)
    model.to(device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        r = stream_nll(model, tokens, tgt_len, batch_size, batches, progress=progress)
    except ValueError as exc:
        raise UsageError(f"--data: {exc}") from None
    loss = r["loss_sum"] / r["tokens"]
    c = model.config
    return {"model": model_dir, "data": " ".join(data), "tokens": r["tokens"], "segments": r["segments"],
            "loss": loss, "ppl": math.exp(min(loss, 700.0)), "tgt_len": tgt_len, "mem_len": c.mem_len,
            "clamp_len": c.clamp_len, "same_length": c.same_length, "mem_start": c.mem_start, "batch_size": batch_size,
            "tokens_per_s": r["tokens"] / max(r["seconds"], 1e-9)}
