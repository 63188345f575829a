"""``xlnet-fast export``: a training checkpoint (or a run's newest) as a clean transformers directory.

The output holds ``config.json``, ``model.safetensors`` (in the chosen dtype, tied weights once) and
the tokenizer files (``spiece.model``, ``tokenizer.json``, ``tokenizer_config.json``) — no optimizer,
trainer, rank or run state. ``transformers.XLNetLMHeadModel.from_pretrained(out)`` and
``xlnet_fast.XLNetLMHeadModel.from_pretrained(out)`` load it. It is written into a temporary sibling
directory, fsynced, and renamed into place; a non-empty ``out`` is replaced only with ``overwrite``.
"""

from __future__ import annotations

import os
import shutil

import torch

from .artifacts import load_tokenizer, model_state, read_config, resolve_model_dir
from .checkpoint import fsync_dir, hash_file
from .errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch's names
TIED_WEIGHTS = ("lm_loss.weight",)  # = transformer.word_embedding.weight


def _check_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UsageError(f"--out {out} is not empty: pass --overwrite to replace it")


def _write(tmp: str, src, dtype: str) -> int:
    """config.json, model.safetensors and the tokenizer into ``tmp``; returns the parameter count."""
    from safetensors.torch import save_file

    config = read_config(src, attn_backend="auto")
    config.architectures = ["XLNetLMHeadModel"]
    config.dtype = DTYPE_NAMES[dtype]
    state = {k: v.detach().to("cpu") for k, v in model_state(src).items() if k not in TIED_WEIGHTS}
    state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(src, flag=None).save_pretrained(tmp)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)  # safetensors writes 0600; the export is for sharing
        hash_file(os.path.join(tmp, name), sync=True)
    fsync_dir(tmp)
    return sum(v.numel() for v in state.values())


def export_model(source: str, out: str, dtype: str = "fp32", overwrite: bool = False) -> dict:
    """Write ``source`` (a run directory, a training checkpoint or a transformers directory with a
    tokenizer) to ``out``; returns ``{"source", "out", "dtype", "parameters"}``."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = os.path.abspath(out)
    _check_out(out, overwrite)
    src = resolve_model_dir(source, "export")
    if os.path.abspath(src.path) == out or out.startswith(os.path.abspath(src.path) + os.sep):
        raise UsageError(f"--out {out} is inside the exported checkpoint {src.path}")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp{os.getpid()}")
    old = os.path.join(parent, f".{os.path.basename(out)}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        n_params = _write(tmp, src, dtype)
        if os.path.isdir(out) and os.listdir(out):  # --overwrite: move the old one aside, then swap
            os.replace(out, old)
        os.replace(tmp, out)  # also replaces an empty directory
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {"source": src.path, "out": out, "dtype": dtype, "parameters": n_params}
