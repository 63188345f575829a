"""``xlnet-fast export``: a training checkpoint (or a run's newest) as a clean transformers directory.

The output holds ``config.json``, ``model.safetensors`` (in the chosen dtype, tied weights once) and
the tokenizer files (``spiece.model``, ``tokenizer.json``, ``tokenizer_config.json``; a word-level
vocabulary's ``vocab.txt`` and ``tokenizer_config.json``) — no optimizer, trainer, rank or run state.
An XLNet's: ``transformers.XLNetLMHeadModel.from_pretrained(out)`` and
``xlnet_fast.XLNetLMHeadModel.from_pretrained(out)`` load it; a Transformer-XL's:
``xlnet_fast.TransfoXLLMHeadModel.from_pretrained(out)`` and transformers 4.x's (5.x deleted the model).
It is written into a temporary sibling directory, fsynced, and renamed into place; a failed write (a
full disk) leaves nothing behind. ``out``
follows ``outputs.check_output_dir``: never the source, inside it or around it, never a run, checkpoint
or prepared directory; an ``out`` holding an earlier export is replaced only with ``overwrite``, one
holding any other file never.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

from ..model.pretrained import _unshared
from .artifacts import load_tokenizer, model_state, read_config, resolve_model_dir
from .checkpoint import fsync_dir, hash_file
from .errors import UsageError
from .models import lm_class, tied_weight_names
from .outputs import check_output_dir
from .tokenizers import ALL_TOKENIZER_FILES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch's names
TIED_WEIGHTS = ("lm_loss.weight",)  # XLNet's: = transformer.word_embedding.weight (models.tied_weight_names)


EXPORT_FILES = ("config.json", "model.safetensors", *ALL_TOKENIZER_FILES)


def _check_out(source: str, out: str, overwrite: bool) -> None:
    check_output_dir(out, command="export", inputs=[source], owned=lambda name, is_dir: name in EXPORT_FILES,
                     overwrite=overwrite)


def _save_safetensors(state: dict, path: str) -> None:
    """``safetensors``' ``save_file``; its I/O errors (a Rust error type) become an ``OSError`` naming ``path``."""
    from safetensors.torch import save_file

    try:
        save_file(state, path, metadata={"format": "pt"})
    except Exception as exc:
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number) if number else str(exc), path) from None


def _write(tmp: str, src, dtype: str) -> int:
    """config.json, model.safetensors and the tokenizer into ``tmp``; returns the parameter count."""
    config = read_config(src, attn_backend="auto")
    config.architectures = [lm_class(src.model).__name__]
    config.dtype = DTYPE_NAMES[dtype]
    tied = tied_weight_names(config)
    state = {k: v.detach().to("cpu") for k, v in model_state(src).items() if k not in tied}
    state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    state = _unshared(state)  # a Transformer-XL's shared r biases, under every layer's name
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    _save_safetensors(state, os.path.join(tmp, "model.safetensors"))
    load_tokenizer(src, flag=None).save_pretrained(tmp)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)  # safetensors writes 0600; the export is for sharing
        hash_file(os.path.join(tmp, name), sync=True)
    fsync_dir(tmp)
    return sum(v.numel() for v in state.values())


def export_model(source: str, out: str, dtype: str = "fp32", overwrite: bool = False, verify: bool = True) -> dict:
    """Write ``source`` (a run directory, a training checkpoint or a transformers directory with a
    tokenizer) to ``out``; returns ``{"source", "out", "dtype", "parameters"}``. A training checkpoint
    is verified against its ``COMPLETE`` first (``verify=False``: sizes, not checksums)."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_out(source, out, overwrite)  # as given: abspath would make "" the working directory
    out = os.path.abspath(out)
    src = resolve_model_dir(source, "export", verify=verify)
    _check_out(src.path, out, overwrite)  # the checkpoint a run directory resolved to
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp{os.getpid()}")
    old = os.path.join(parent, f".{os.path.basename(out)}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    aside = False
    try:
        try:
            n_params = _write(tmp, src, dtype)
        except OSError as exc:  # named as the file in --out (the temporary directory is removed below)
            name = os.fspath(exc.filename) if exc.filename is not None else tmp
            raise OSError(exc.errno, exc.strerror, out + name[len(tmp):] if name.startswith(tmp) else name) from None
        if os.path.isdir(out) and os.listdir(out):  # --overwrite: move the old one aside, then swap
            os.replace(out, old)
            aside = True
        os.replace(tmp, out)  # also replaces an empty directory
        fsync_dir(parent)
    except BaseException:
        if aside and not os.path.exists(out):  # the swap failed: the earlier export goes back
            os.replace(old, out)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {"source": src.path, "out": out, "dtype": dtype, "parameters": n_params,
            "model_class": lm_class(src.model).__name__}
