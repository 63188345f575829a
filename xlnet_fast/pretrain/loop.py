"""Pretraining: one process, DDP or FSDP2 under ``torchrun``, exact resume; XLNet's permutation LM or
Transformer-XL's causal LM (``objective.py``: what differs between them).

``pretrain(TrainConfig(...))`` (or ``xlnet-fast pretrain``) plans the run (``run_dir.plan_run``),
builds the tokenizer, the batches (XLNet: ``data.PretrainBatches``, two streams, the query stream on
the ``num_predict`` targets only; Transformer-XL: ``causal.StreamBatches``, ``tgt_len`` segments of
parallel streams) and the model, and trains with mems carried per rank across steps. Checkpoints:
``checkpoint.py`` (layout), ``sharded.py`` (saving, restoring). SIGTERM or Ctrl-C (SIGINT) saves a
checkpoint at the next step boundary and exits 0 (a second Ctrl-C stops at once, without saving); a
non-finite loss, gradient norm or weight stops the run before anything non-finite is saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable

import torch

from ..model import XLNetLMHeadModel
from ..transfo_xl import TransfoXLLMHeadModel
from .checkpoint import hash_file
from .corpus import iter_lines
from .distributed import agree, all_sum, barrier, from_rank0, init_distributed, shutdown_distributed
from .errors import NonFiniteLossError
from .evaluate import hold_out_tail
from .models import XLNET
from .objective import objective_for
from .plot import plot_at_end
from .prepare import TokenShards, prepared_directory, prepared_tokens
from .run_dir import METRICS_NAME, MetricsLog, RunLock, RunPlan, cache_root, open_run_dir, plan_run
from .settings import TrainConfig, check_settings
from .sharded import CheckpointWriter, restore_training_state
from .tokenizer import SPIECE_NAME, XLNetTokenizer
from .tokenizers import Tokenizer, load_tokenizer_dir

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------


def _publish_dir(tmp: str, final: str) -> None:
    """Rename a freshly written directory into place, unless another process did first."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare_tokenizer(c: TrainConfig, plan: RunPlan, rank: int, world: int) -> Tokenizer:
    """The checkpoint's tokenizer on resume, else ``c.tokenizer``, else one trained on the data (XLNet:
    sentencepiece; Transformer-XL: a word-level vocabulary) and cached by the data's content and the
    vocabulary size. Cached copies keep a sentencepiece model file in place while old checkpoints are
    rotated away (a word-level vocabulary is held in memory)."""
    if plan.checkpoint is None and c.tokenizer:
        return load_tokenizer_dir(c.tokenizer)
    directory = prepared_directory(c.data)
    if plan.checkpoint is None and directory is not None:
        return TokenShards(directory).tokenizer()  # the one that encoded the data
    objective = objective_for(c)
    if plan.checkpoint is not None:
        if not os.path.exists(os.path.join(plan.checkpoint, SPIECE_NAME)):
            return load_tokenizer_dir(plan.checkpoint)  # word-level
        source = os.path.join(plan.checkpoint, SPIECE_NAME)
        key = "model-" + hash_file(source)["sha256"][:16]
    else:
        source = None
        recipe = f"{objective.tokenizer_recipe}:" if objective.tokenizer_recipe else ""  # XLNet's keys as before
        key = hashlib.sha256(f"{recipe}v{c.vocab_size}:{plan.data_digest}".encode()).hexdigest()[:16]
    d = os.path.join(cache_root(c), "tokenizers", key)
    trained_in = None  # seconds, when this process trained it
    if rank == 0 and not os.path.isdir(d):
        tmp = d + f".tmp{os.getpid()}"
        if source is None:
            kind = "a sentencepiece (unigram)" if objective.model == XLNET else "a word-level"
            files = " ".join(map(str, c.data[:3])) + (f" and {len(c.data) - 3} more files" if len(c.data) > 3 else "")
            logger.info("training %s tokenizer of at most %d tokens on %s (once: cached in %s for runs on the same "
                        "text)", kind, c.vocab_size, files, d)
            t0 = time.perf_counter()
            objective.train_tokenizer(iter_lines(c.data), c.vocab_size, tmp)
            trained_in = time.perf_counter() - t0
        else:
            os.makedirs(tmp, exist_ok=True)
            shutil.copyfile(source, os.path.join(tmp, SPIECE_NAME))
        _publish_dir(tmp, d)
    barrier(world)
    if os.path.exists(os.path.join(d, SPIECE_NAME)):
        tokenizer = XLNetTokenizer(os.path.join(d, SPIECE_NAME))
    else:
        tokenizer = load_tokenizer_dir(d)
    if trained_in is not None:
        logger.info("trained the tokenizer in %.1f s: a vocabulary of %d tokens", trained_in, tokenizer.vocab_size)
    return tokenizer


def _prepare_batches(c: TrainConfig, plan: RunPlan, tokenizer: Tokenizer, rank: int, world: int) -> tuple:
    """The training batches and the held-out tail of the tokens (None with ``--eval-data``). The
    tokens: the prepared directory given as ``--data``, or the text files prepared (by rank 0, the
    others wait) into the cache, keyed by the text's and the tokenizer's contents."""
    objective = objective_for(c)
    tokens = prepared_tokens(c.data, tokenizer, cache_root(c), rank, world, c.progress, digest=plan.data_digest,
                             verify=c.verify_data)
    tokens, heldout = (hold_out_tail(tokens, c, rank, world, objective.segment_len(c)) if c.hold_out
                       else (tokens, None))
    return objective.batches(tokens, tokenizer, c, rank, world), heldout


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on LayerNorm weights and on biases (1-dim parameters)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_norm = "layer_norm" in name or "LayerNorm" in name
        (no_decay if p.dim() < 2 or is_norm or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _lr_lambda(c: TrainConfig):
    def f(step: int) -> float:
        if step < c.warmup:
            return (step + 1) / max(1, c.warmup)
        progress = min(1.0, (step - c.warmup) / max(1, c.steps - c.warmup))
        if c.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)
    return f


def _apply_optimizer_settings(optimizer, scheduler, c: TrainConfig) -> None:
    """After loading a checkpoint's optimizer and scheduler: this run's lr, schedule, weight decay and
    eps (the loaded state carries the old ones)."""
    factor = _lr_lambda(c)(scheduler.last_epoch)
    scheduler.base_lrs = [c.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = c.lr
        group["lr"] = c.lr * factor
        group["eps"] = c.adam_eps
    optimizer.param_groups[0]["weight_decay"] = c.weight_decay


def _checkpointed(fn):
    from torch.utils.checkpoint import checkpoint

    def wrapper(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return wrapper


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _Preemption:
    """Turns SIGTERM and SIGINT (Ctrl-C) into a flag checked at step boundaries, where the run saves
    and stops; a second SIGINT raises ``KeyboardInterrupt`` at once (stop without saving)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = "SIGTERM"
        self._old: dict = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        first, self.requested = not self.requested, True  # before logging: a signal may land inside it
        if first:
            self.signal_name = signal.Signals(signum).name
            if signum == signal.SIGINT:
                logger.warning("Ctrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again "
                               "stops at once, without saving)")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Trainer:
    """One rank's model, optimizer, data and loop for a planned run."""

    def __init__(self, plan: RunPlan, rank: int, world: int, device: torch.device,
                 open_out: Callable[[], None] | None = None) -> None:
        """``open_out``: rank 0's creation and tidying of the run directory, called (on every rank, a
        collective) once the tokenizer, the data and the evaluation text are set up."""
        self.started = time.perf_counter()  # the session's wall time counts the set-up too
        c = self.c = plan.config
        self.plan, self.rank, self.world, self.device = plan, rank, world, device
        if rank == 0 and plan.notes:
            logger.warning("resuming %s with changed settings: %s", plan.checkpoint, ", ".join(plan.notes))
        torch.manual_seed(c.seed + rank)
        self.objective = objective_for(c)
        self.tokenizer = _prepare_tokenizer(c, plan, rank, world)
        self.batches, heldout = _prepare_batches(c, plan, self.tokenizer, rank, world)
        self.evaluator = self.objective.evaluator(c, self.tokenizer, heldout, cache_root(c), rank, world)
        from_rank0(open_out or (lambda: None), rank, world)  # --out is written only now: the data is good
        self.raw_model = self._build_model()
        self.meter, self.mfu_note = self.objective.throughput(c, self.raw_model.config, world, device)
        if rank == 0:
            logger.info(self.mfu_note)
        self.model = self._wrap(self.raw_model)
        self.optimizer = torch.optim.AdamW(_param_groups(self.raw_model, c.weight_decay), lr=c.lr,
                                           betas=(0.9, 0.999), eps=c.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(c))
        self.mems = None
        self.step = plan.start_step
        self.ckpt_path = plan.checkpoint
        self.checkpoints = CheckpointWriter(c, rank, world)
        if plan.checkpoint is not None:
            self.mems = restore_training_state(plan.checkpoint, self.raw_model, self.optimizer, self.scheduler,
                                               self.batches, rank=rank, world=world, seed=c.seed,
                                               device=device if c.mem_len > 0 else None,
                                               group=self.checkpoints.group)
            _apply_optimizer_settings(self.optimizer, self.scheduler, c)

    def _build_model(self):
        c = self.c
        config = self.objective.model_config(c, self.tokenizer)
        torch.manual_seed(c.seed)  # the same initial weights on every rank
        model = (XLNetLMHeadModel if c.model == XLNET else TransfoXLLMHeadModel)(config).to(self.device)
        torch.manual_seed(c.seed + 1 + self.rank)
        return model  # a checkpoint's weights are loaded after wrapping (restore_training_state)

    def _wrap(self, raw_model):
        c = self.c
        layers = self.objective.layers(raw_model)
        if c.checkpointing:
            for layer in layers:
                layer.forward = _checkpointed(layer.forward)
        model = self.trainable = self.objective.trainable(raw_model)  # the model, or a loss around it
        if c.fsdp and self.world == 1 and self.rank == 0:
            logger.warning("--fsdp: a single process has nothing to shard: training without FSDP2 (run under "
                           "torchrun with several ranks)")
        if c.fsdp and self.world > 1:  # one rank has nothing to shard
            from torch.distributed.fsdp import fully_shard

            for layer in layers:
                fully_shard(layer)
            fully_shard(model)
        elif self.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return torch.compile(model) if c.compile else model

    def _train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (loss, grad norm). A non-finite one stops the run before the
        weights change."""
        c, world, device = self.c, self.world, self.device
        self.model.train()
        use_amp = device.type == "cuda"
        loss_sum = torch.zeros((), device=device)
        for micro in range(c.grad_accum):
            batch = self.batches.next_batch()
            sync = micro == c.grad_accum - 1 or world == 1 or c.fsdp
            no_sync = not sync and hasattr(self.model, "no_sync")
            ctx = self.model.no_sync() if no_sync else contextlib.nullcontext()
            with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                total, count, mems = self.objective.loss(self.model, batch, self.mems, c, device)
                # sum over this rank's targets / all ranks' targets; DDP averages gradients over
                # ranks, so multiply by world: the update equals one process with the whole batch
                n_targets = all_sum(count.float(), world) * c.grad_accum
                loss = total * world / n_targets
                loss.backward()
            self.mems = mems
            loss_sum += loss.detach() / world
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), c.clip))
        loss_value = float(all_sum(loss_sum, world))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {self.step + 1}: the loss is {loss_value} (gradient norm {grad_norm}): training diverged "
                f"and stopped before the update; the newest checkpoint is {self.ckpt_path or 'none'} "
                "(lower --lr, or resume from it)")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    def _weights_finite(self) -> bool:
        bad = any(not torch.isfinite(_local(p.detach())).all() for p in self.raw_model.parameters())
        return not agree(bad, self.world, self.device)

    def _save(self) -> None:
        if not self._weights_finite():
            raise NonFiniteLossError(
                f"step {self.step}: the weights are no longer finite after the update (too large --lr?); "
                f"nothing saved, the newest checkpoint is {self.ckpt_path or 'none'}")
        run_info = {"data": self.c.data, "data_digest": self.plan.data_digest,
                    "eval_data_digest": self.plan.eval_data_digest}
        self.ckpt_path = self.checkpoints.save(self.step, self.raw_model, self.optimizer, self.scheduler,
                                               self.batches, self.mems, self.tokenizer, run_info)

    def _report(self, loss: float, grad_norm: float, seconds: float) -> None:
        """A metrics row every ``log_every`` steps (and at the last), the progress bar every step."""
        c = self.c
        lr = self.scheduler.get_last_lr()[0]
        rates = self.meter.step(seconds)
        if self.metrics is not None and (self.step % c.log_every == 0 or self.step == c.steps):
            self.metrics.append({"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                 "tokens": self.step * self.meter.tokens_per_step, **rates})
        if self.bar is not None:
            self.bar.update(1)
            postfix = dict(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rates['tokens_per_s']:,.0f}")
            if "mfu" in rates:
                postfix["mfu"] = f"{100 * rates['mfu']:.1f}%"
            if self.last_eval is not None:
                postfix["eval"] = f"{self.last_eval:.3f}"
            self.bar.set_postfix(postfix)
            self._postfix = postfix

    def _eval_due(self) -> bool:
        c = self.c
        every = c.eval_every > 0 and self.step % c.eval_every == 0
        return self.evaluator is not None and (self.step == c.steps or every)

    def _evaluate(self) -> None:
        """A held-out evaluation (every rank takes part); its row goes to metrics.jsonl."""
        # the model itself, or (Transformer-XL) the loss around it, FSDP2's root: its forward gathers the shards
        evaluated = self.raw_model if self.trainable is self.raw_model else self.trainable
        row = {"step": self.step, **self.evaluator.evaluate(evaluated, self.device, self.world)}
        self.last_eval = row["eval_loss"]
        if self.bar is not None:
            self.bar.set_postfix({**self._postfix, "eval": f"{self.last_eval:.3f}"})
        if self.metrics is not None:
            self.metrics.append(row)
            logger.info("step %d: eval loss %.4f (perplexity %.1f, %d targets)", self.step, row["eval_loss"],
                        row["eval_ppl"], row["eval_tokens"])

    def _bar_safe_logging(self):
        """While the progress bar is open, log records go through ``tqdm.write`` (never through the bar)."""
        if self.bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm()

    def _session(self, wall_s: float) -> dict:
        return {"steps": self.c.steps, "out": self.c.out, "tokens_per_step": self.meter.tokens_per_step,
                "mfu_note": self.mfu_note,
                "session": {"steps": self.meter.steps, "tokens": self.meter.steps * self.meter.tokens_per_step,
                            "wall_s": wall_s, "train_s": self.meter.seconds, **self.meter.mean()}}

    def run(self) -> dict:
        c = self.c
        self.metrics = MetricsLog(os.path.join(c.out, METRICS_NAME)) if self.rank == 0 else None
        self.bar, self.last_eval = None, None
        if self.rank == 0 and c.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=c.steps, initial=self.step, desc="pretrain", dynamic_ncols=True)
        last_loss, preempted, stop = float("nan"), False, _Preemption()
        try:
            with stop, self._bar_safe_logging():
                while self.step < c.steps:
                    t_step = time.perf_counter()
                    last_loss, grad_norm = self._train_step()
                    self.step += 1
                    self._report(last_loss, grad_norm, time.perf_counter() - t_step)
                    preempted = agree(stop.requested, self.world, self.device)
                    last = self.step == c.steps
                    if last:  # saved before its evaluation, which a Ctrl-C may cut short
                        self._save()
                    if self._eval_due() and not preempted:
                        self._evaluate()
                    if not last and ((c.save_every and self.step % c.save_every == 0) or preempted):
                        self._save()
                    if preempted:
                        if self.rank == 0:
                            logger.warning("%s: saved %s at step %d, exiting", stop.signal_name, self.ckpt_path,
                                           self.step)
                        break
            self.checkpoints.wait()  # the last background save: written and sealed before the run ends
        finally:
            self.checkpoints.close()
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close()
        return {"step": self.step, "loss": last_loss, "checkpoint": self.ckpt_path, "preempted": preempted,
                "stopped_by": stop.signal_name if preempted else None, "model_class": type(self.raw_model).__name__,
                **self._session(time.perf_counter() - self.started)}


def pretrain(cfg: TrainConfig) -> dict:
    """Run pretraining; returns ``{"step", "loss", "checkpoint", "preempted", "steps", "out",
    "tokens_per_step", "mfu_note", "session", "plot"}`` (``summary.format_summary`` prints it;
    ``session``: this process's steps, tokens, wall and training seconds, mean tokens/s and MFU;
    ``plot``: rank 0's ``loss.png`` or why there is none).

    A bad setting, an unusable data file or run directory raises ``UsageError`` before any model or
    data set-up; divergence raises ``NonFiniteLossError``."""
    check_settings(cfg.resolved())  # the given values on their own, before anything else
    rank, world, device = init_distributed()
    lock = RunLock(cfg.out) if rank == 0 else None
    try:
        plan = from_rank0(lambda: plan_run(cfg, lock, world), rank, world)
        result = Trainer(plan, rank, world, device, open_out=lambda: open_run_dir(plan, lock)).run()
        if rank == 0:
            result["plot"] = plot_at_end(plan.config.out)
        return result
    finally:
        if lock is not None:
            lock.release()
        shutdown_distributed()
