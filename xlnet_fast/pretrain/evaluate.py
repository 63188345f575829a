"""Held-out evaluation: the permutation-LM loss of a model on fixed records of held-out text.

The records are made exactly as in training (the run's layout, span masks, factorization orders,
two streams, mems carried from zero through the evaluation) but from a fixed seed, ``EVAL_SEED``, so
a value is comparable across steps and across runs with the same layout and data. The model is in
eval mode (no dropout); the training run's random generators and data streams are not touched.
The rows are those of the run's global batch and each rank evaluates its own rows, so the loss (a
sum over every target in float64, divided by their number) does not depend on how the rows are
split across ranks. ``xlnet-fast eval`` evaluates the same rows one rank's share at a time.

Without ``--eval-data`` a run holds out the tail of its training tokens: ``heldout_length`` tokens,
about 1% of the corpus, at least 2 x seq_len and at most 32 x seq_len per row of the global batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys

import numpy as np
import torch

from .artifacts import load_lm, load_tokenizer, resolve_model_dir
from .models import XLNET
from .tokenizers import SENTENCEPIECE, tokenizer_kind
from .corpus import check_corpus, check_readable
from .data import DataConfig, PretrainBatches, model_on_batch
from .distributed import all_sum
from .errors import UsageError
from .outputs import default_cache_dir
from .prepare import TokenShards, data_digest, prepared_directory, prepared_tokens
from .settings import PRESETS
from .tokenizer import XLNetTokenizer

logger = logging.getLogger(__name__)

EVAL_SEED = 1234  # masking and factorization seed of every evaluation
DEFAULT_EVAL_BATCHES = 10
HELDOUT_SHARE = 100  # hold out ~1/100 of the corpus ...
HELDOUT_MIN_SEQS, HELDOUT_MAX_SEQS = 2, 32  # ... between 2 and 32 sequences per row of the global batch


# --------------------------------------------------------------------------------------------------
# Held-out text
# --------------------------------------------------------------------------------------------------


def heldout_length(n_tokens: int, seq_len: int, global_rows: int) -> int:
    """Tokens held out at the end of a corpus of ``n_tokens`` for evaluation."""
    per_row = n_tokens // (HELDOUT_SHARE * global_rows)
    per_row = min(max(per_row, HELDOUT_MIN_SEQS * seq_len), HELDOUT_MAX_SEQS * seq_len)
    return per_row * global_rows


def split_heldout(tokens, seq_len: int, global_rows: int) -> tuple:
    """``(training part, held-out tail)`` of a token array or ``TokenShards`` (the training part is a
    view). ``UsageError`` when the training part would be too small for ``global_rows`` streams of
    2 x ``seq_len`` tokens."""
    n_held = heldout_length(len(tokens), seq_len, global_rows)
    n_train = len(tokens) - n_held
    if n_train < global_rows * 2 * seq_len:
        raise UsageError(f"corpus too small: {len(tokens)} tokens; holding out {n_held} for evaluation leaves "
                         f"{max(n_train, 0)}, fewer than {global_rows} rows x 2 x seq_len = "
                         f"{global_rows * 2 * seq_len}: "
                         "use more text, fewer rows, a shorter --seq-len, or --eval-data FILE... (then nothing "
                         "is held out)")
    train = tokens.head(n_train) if hasattr(tokens, "head") else tokens[:n_train]  # TokenShards: no copy
    return train, np.asarray(tokens[n_train:])


def check_eval_files(paths: list[str], flag: str = "--eval-data") -> None:
    """``UsageError`` naming the flag and the first unusable file (missing, not UTF-8, no text), or
    the problem of a prepared directory given instead of text files (not prepared data, unfinished,
    damaged)."""
    try:
        directory = prepared_directory(paths, flag)
        if directory is not None:
            TokenShards(directory)  # the index, the tokenizer, every shard's size (and hash if it changed)
            return
        check_readable(paths)
        check_corpus(paths)
    except UsageError as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(flag) else f"{flag}: {message}") from None


# --------------------------------------------------------------------------------------------------
# The evaluation
# --------------------------------------------------------------------------------------------------


class Evaluator:
    """Fixed evaluation records from ``tokens``: ``n_batches`` batches of one rank's ``rows`` rows
    (global rows ``[rank * rows, (rank + 1) * rows)`` of ``rows * world``), the record layout of
    ``layout`` with the seed ``EVAL_SEED``."""

    def __init__(self, tokens: np.ndarray | TokenShards, tokenizer: XLNetTokenizer, layout: DataConfig, rows: int,
                 n_batches: int, mem_len: int, rank: int = 0, world: int = 1, source: str = "eval data") -> None:
        if n_batches < 1:
            raise ValueError(f"n_batches must be positive, got {n_batches}")
        try:
            self.batches = PretrainBatches(tokens, tokenizer, dataclasses.replace(layout, seed=EVAL_SEED),
                                           rows=rows, rank=rank, world_size=world)
        except UsageError as exc:
            raise UsageError(f"{source}: {exc}") from None
        self._start = self.batches.state_dict()
        self.n_batches, self.mem_len, self.source = n_batches, mem_len, source
        self.n_tokens = len(tokens)

    @torch.no_grad()
    def sums(self, model: torch.nn.Module, device: torch.device, bar=None) -> tuple[float, int]:
        """``(sum of the targets' cross-entropies, number of targets)`` over this rank's rows; ``bar``
        (an ``eval_bar``) advances by one per batch."""
        self.batches.load_state_dict(self._start)
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        mems, use_mems = None, self.mem_len > 0
        cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda_devices), \
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                for _ in range(self.n_batches):
                    batch = {k: v.to(device) for k, v in self.batches.next_batch().items()}
                    out = model_on_batch(model, batch, mems, use_mems)
                    labels = batch["labels"].reshape(-1)
                    ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(labels.numel(), -1), labels,
                                                           reduction="none")
                    loss_sum += ce.double().sum()  # padding targets (label -100) contribute 0
                    count += (labels != -100).sum()
                    mems = out.mems if use_mems else None
                    if bar is not None:
                        bar.update(1)
        finally:
            model.train(was_training)
        return float(loss_sum), int(count)

    def evaluate(self, model: torch.nn.Module, device: torch.device, world: int = 1) -> dict:
        """``{"eval_loss", "eval_ppl", "eval_tokens"}`` over every rank's rows (a collective under
        torchrun: every rank calls it and gets the same values)."""
        loss_sum, count = self.sums(model, device)
        totals = all_sum(torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=device), world)
        return eval_row(float(totals[0]), int(totals[1]))


def eval_bar(total: int, enabled: bool = True, unit: str = "batch"):
    """The progress bar of ``xlnet-fast eval`` on stderr (stdout keeps its one JSON line): ``total``
    batches or segments; disabled (``--no-progress``), it prints nothing."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # no monitor thread (as prepare's bar: a later prepare may fork its workers)

    return Bar(total=total, desc="eval", unit=unit, file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def eval_row(loss_sum: float, count: int) -> dict:
    loss = loss_sum / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def training_evaluator(c, tokenizer: XLNetTokenizer, heldout: np.ndarray | None, cache_dir: str, rank: int,
                       world: int, build=None) -> Evaluator | None:
    """The run's evaluator: on ``c.eval_data``, else on the held-out tail of the training tokens; None
    (said once) when the run has neither (a run started before held-out evaluation existed).
    ``build(tokens, source)``: another model's evaluator (default: the permutation LM's ``Evaluator``)."""
    if c.eval_data:
        tokens = prepared_tokens(c.eval_data, tokenizer, cache_dir, rank, world, verify=c.verify_data)
        source = f"--eval-data {' '.join(c.eval_data)}"
    elif heldout is not None:
        tokens, source = heldout, "the held-out tail of the training data"
    else:
        if rank == 0:
            logger.warning("no evaluation: this run holds out no text (it started before held-out evaluation "
                           "existed); pass --eval-data FILE... to evaluate")
        return None
    if build is not None:
        evaluator = build(tokens, source)
    else:
        layout = DataConfig(seq_len=c.seq_len, reuse_len=c.reuse_len, num_predict=c.num_predict,
                            perm_size=c.perm_size, bi_data=c.bi_data)
        evaluator = Evaluator(tokens, tokenizer, layout, c.batch_size, c.eval_batches, c.mem_len, rank, world, source)
    if rank == 0:
        when = f"every {c.eval_every} steps and at the end" if c.eval_every else "at the end"
        logger.info("evaluating %s on %s (%d tokens): %d batches of %d rows", when, source, len(tokens),
                    c.eval_batches, c.batch_size * world)
    return evaluator


def hold_out_tail(tokens, c, rank: int, world: int, seq_len: int | None = None) -> tuple:
    """``split_heldout`` for a run (its sequence length, or ``seq_len``, and its global batch), said once."""
    train, held = split_heldout(tokens, seq_len or c.seq_len, c.batch_size * world)
    if rank == 0:
        logger.info("holding out the last %d of %d tokens (%.1f%%) of the training data for evaluation (pass "
                    "--eval-data FILE... to evaluate on other text and train on all of it)", len(held), len(tokens),
                    100 * len(held) / len(tokens))
    return train, held


# --------------------------------------------------------------------------------------------------
# `xlnet-fast eval`: any checkpoint, the run's evaluation or given text
# --------------------------------------------------------------------------------------------------

LAYOUT_SETTINGS = ("seq_len", "reuse_len", "mem_len", "num_predict", "perm_size", "batch_size")
CONFIG_LAYOUT = ("mem_len", "reuse_len")  # the layout fields an XLNet's config.json may hold
BASE_PRESET = "the base preset"


def _config_layout(path: str) -> dict:
    """``CONFIG_LAYOUT`` fields that the directory's config.json sets (not null)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}  # read_config names the problem when the model is loaded
    return {n: config[n] for n in CONFIG_LAYOUT if isinstance(config, dict) and isinstance(config.get(n), int)}


def _eval_settings(src, overrides: dict) -> dict:
    """The record layout, rows and batches: the run's for a training checkpoint; for a transformers
    directory its config.json's ``mem_len`` and ``reuse_len`` where it sets them, else the 'base'
    preset's; ``overrides`` (not None) replace them. ``world``: the run's number of ranks;
    ``layout_from``: where each layout value came from."""
    if src.is_checkpoint:
        stored = src.record["settings"]
        s = {n: stored[n] for n in LAYOUT_SETTINGS}
        s.update(world=src.record.get("world_size") or 1, eval_batches=stored.get("eval_batches"))
        origin = dict.fromkeys(LAYOUT_SETTINGS, "the run")
    else:
        s = {n: PRESETS["base"][n] for n in LAYOUT_SETTINGS}
        s.update(world=1, eval_batches=None)
        origin = dict.fromkeys(LAYOUT_SETTINGS, BASE_PRESET)
        from_config = _config_layout(src.path)
        s.update(from_config)
        origin.update(dict.fromkeys(from_config, "config.json"))
    given = {k: v for k, v in overrides.items() if v is not None}
    s.update(given)
    origin.update({k: "--" + k.replace("_", "-") for k in given if k in origin})
    s["layout_from"] = origin
    if s["eval_batches"] is None:  # neither --batches nor the run's --eval-batches (0 is refused below)
        s["eval_batches"] = DEFAULT_EVAL_BATCHES
    for name, flag in (("batch_size", "--batch-size"), ("eval_batches", "--batches"), ("seq_len", "--seq-len")):
        if s[name] < 1:
            raise UsageError(f"{flag} must be a positive integer, got {s[name]}")
    if s["mem_len"] < 0:
        raise UsageError(f"--mem-len must be 0 (no memory) or a positive integer, got {s['mem_len']}")
    return s


def eval_tokens(src, data: list[str] | None, tokenizer, cache_dir: str, verify_data: bool = False,
                progress: bool = False) -> tuple[np.ndarray | TokenShards, str]:
    """What ``xlnet-fast eval`` runs on, and its description: ``data``'s files (``--data``, prepared
    and cached), else the text the run evaluated on (``_run_eval_tokens``; ``src`` must then be a
    training checkpoint)."""
    if data:
        data = [os.path.abspath(p) for p in data]
        check_eval_files(data, "--data")
        return prepared_tokens(data, tokenizer, cache_dir, progress=progress, verify=verify_data), " ".join(data)
    if not src.is_checkpoint:
        raise UsageError(f"--model {src.path} is not a training checkpoint: pass --data FILE... to evaluate on")
    return _run_eval_tokens(src, tokenizer, cache_dir, verify_data, progress)


def _run_eval_tokens(src, tokenizer: XLNetTokenizer, cache_dir: str, verify_data: bool = False,
                     progress: bool = False) -> tuple[np.ndarray | TokenShards, str]:
    """The text the run evaluated on: its ``--eval-data`` (refused when its content changed since
    the run, so the value is the run's), else the held-out tail of its data (text files or a prepared
    directory, which must be the run's). ``progress``: a bar while text is prepared."""
    settings, record = src.record["settings"], src.record
    if settings.get("eval_data"):
        files = settings["eval_data"]
        check_eval_files(files, "the run's --eval-data")
        _check_unchanged(files, record.get("eval_data_digest"), "--eval-data", "the text it evaluated on")
        tokens = prepared_tokens(files, tokenizer, cache_dir, progress=progress, verify=verify_data)
        return tokens, " ".join(files)
    if not settings.get("hold_out"):
        raise UsageError(f"{src.path}: its run held out no text (it predates held-out evaluation): pass --data FILE...")
    files = record["data"]
    check_eval_files(files, "the run's --data")
    _check_unchanged(files, record.get("data_digest"), "data", "its held-out tail")
    tokens = prepared_tokens(files, tokenizer, cache_dir, progress=progress, verify=verify_data)
    segment = settings["seq_len"] if settings.get("seq_len") else settings["tgt_len"] + 1  # XLNet's or Transformer-XL's
    held = split_heldout(tokens, segment, settings["batch_size"] * (record.get("world_size") or 1))[1]
    return held, "the held-out tail of " + " ".join(files)


def _check_unchanged(files: list[str], recorded: str | None, what: str, used: str) -> None:
    """``UsageError`` when the content of the run's ``files`` is no longer the one it recorded."""
    if recorded is None:
        logger.warning("cannot tell whether the run's %s %s changed since the run (its checkpoint records no "
                       "content digest of it)", what, " ".join(files))
        return
    digest = data_digest(files)
    if digest != recorded:
        raise UsageError(f"the run's {what} {' '.join(files)} changed since the run (content digest {recorded[:12]} "
                         f"-> {digest[:12]}): {used} is no longer the run's; pass --data FILE... to evaluate on it "
                         "as it is now")


def evaluate_model_dir(model: str, data: list[str] | None = None, batches: int | None = None,
                       tokenizer: str | None = None, cache_dir: str | None = None, backend: str | None = None,
                       device: torch.device | None = None, verify: bool = True, verify_data: bool | None = None,
                       progress: bool = False, **layout: int | None) -> dict:
    """``xlnet-fast eval``: the held-out permutation-LM loss of the model in ``model`` (a run
    directory, a training checkpoint or a transformers directory) on ``data`` (text files or a
    prepared directory; default: the text the run evaluated on), as one JSON-able dict. ``layout``:
    ``LAYOUT_SETTINGS`` overrides; ``verify``: compare a checkpoint with its checksums;
    ``verify_data``: hash every shard of prepared data; ``progress``: bars on stderr (preparing the
    text, the batches)."""
    src = resolve_model_dir(model, "--model", verify=verify)
    if src.model != XLNET:
        raise UsageError(f"--model {src.path} is a Transformer-XL: its evaluation is the perplexity with memory "
                         "(xlnet_fast.pretrain.causal.evaluate_checkpoint, or xlnet-fast eval)")
    s = _eval_settings(src, {**layout, "eval_batches": batches})
    tok = load_tokenizer(src, tokenizer)
    if tokenizer_kind(tok) != SENTENCEPIECE:
        raise UsageError(f"--tokenizer {tokenizer}: a word-level vocabulary, but XLNet needs its sentencepiece "
                         "tokenizer")
    cache_dir = default_cache_dir(cache_dir)
    verify_data = bool(verify_data)
    tokens, what = eval_tokens(src, data, tok, cache_dir, verify_data, progress)
    overrides = {"mem_len": s["mem_len"], "reuse_len": s["reuse_len"]}
    lm = load_lm(src, **overrides, **({"attn_backend": backend} if backend else {}))
    if tok.vocab_size > lm.config.vocab_size:
        raise UsageError(f"the tokenizer has {tok.vocab_size} pieces, the model only {lm.config.vocab_size}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm.to(device)
    layout_cfg = DataConfig(seq_len=s["seq_len"], reuse_len=s["reuse_len"], num_predict=s["num_predict"],
                            perm_size=s["perm_size"], bi_data=bool(lm.config.bi_data))
    try:
        layout_cfg.check(name=lambda n: "--" + n.replace("_", "-"))
    except UsageError as exc:
        if all(where.startswith("--") or where == "the run" for where in s["layout_from"].values()):
            raise
        raise UsageError(f"{exc} (the layout: {_layout_origins(s)}): give the layout with the flags") from None
    loss_sum, count = 0.0, 0
    with eval_bar(s["world"] * s["eval_batches"], progress) as bar:
        for rank in range(s["world"]):  # the run's ranks' shares of the rows, one after the other
            ev = Evaluator(tokens, tok, layout_cfg, s["batch_size"], s["eval_batches"], s["mem_len"], rank,
                           s["world"], source=what)
            part_sum, part_count = ev.sums(lm, device, bar)
            loss_sum, count = loss_sum + part_sum, count + part_count
    layout = {n: s[n] for n in LAYOUT_SETTINGS if n != "batch_size"}
    return {"model": src.path, "step": src.step, "data": what, "batches": s["eval_batches"],
            "rows": s["batch_size"] * s["world"], "layout": {**layout, "bi_data": layout_cfg.bi_data},
            "layout_from": {n: s["layout_from"][n] for n in layout}, **eval_row(loss_sum, count)}


def _layout_origins(s: dict) -> str:
    """``seq_len 512 (the base preset), reuse_len 16 (config.json), ...``."""
    return ", ".join(f"{n} {s[n]} ({s['layout_from'][n]})" for n in LAYOUT_SETTINGS if n != "batch_size")
