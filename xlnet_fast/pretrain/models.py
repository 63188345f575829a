"""The two models pretraining trains and its directories hold: XLNet (``XLNetLMHeadModel``, the
permutation LM) and Transformer-XL (``TransfoXLLMHeadModel``, the causal LM), told apart by the
``model_type`` of a directory's ``config.json`` (``"xlnet"``, the default, or ``"transfo-xl"``)."""

from __future__ import annotations

import json
import os

import torch

from ..config import XLNetConfig
from ..model import XLNetLMHeadModel
from ..transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel

XLNET, TRANSFO_XL = "xlnet", "transfo-xl"
MODELS = (XLNET, TRANSFO_XL)  # pretrain --model
_CLASSES = {XLNET: (XLNetConfig, XLNetLMHeadModel), TRANSFO_XL: (TransfoXLConfig, TransfoXLLMHeadModel)}


def config_class(model: str) -> type:
    return _CLASSES[model][0]


def lm_class(model: str) -> type:
    return _CLASSES[model][1]


def model_of_config(config) -> str:
    return TRANSFO_XL if isinstance(config, TransfoXLConfig) else XLNET


def model_of_dir(directory: str | os.PathLike) -> str:
    """``"transfo-xl"`` when ``directory/config.json`` says so, else ``"xlnet"`` (also when it is
    missing or unreadable: reading it as an XLNet's then names the problem)."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            found = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return XLNET
    return TRANSFO_XL if found == TransfoXLConfig.model_type else XLNET


def read_model_config(directory: str | os.PathLike, **overrides):
    """The directory's config (an ``XLNetConfig`` or a ``TransfoXLConfig``, by its ``model_type``)."""
    return config_class(model_of_dir(directory)).from_pretrained(directory, **overrides)


def tied_weight_names(config) -> set[str]:
    """The weights of the LM model of ``config`` that are another weight (not saved)."""
    with torch.device("meta"):  # no memory, no init cost: only the names
        model = lm_class(model_of_config(config))(config)
    return set(model._tied_weights_keys)
