"""XLNetConfig: the fields and defaults of ``transformers`` 5.x, read from / written to ``config.json``."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

from .attention.backends import BACKENDS

CONFIG_FILE = "config.json"


def write_config_json(directory: str | os.PathLike, fields: dict[str, Any]) -> None:
    """``directory/config.json`` (created if needed) holding ``fields``, keys sorted, as transformers writes it."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)


def read_config_json(directory: str | os.PathLike, model_type: str, default_type: str | None = None) -> dict[str, Any]:
    """The fields of ``directory/config.json``, which must describe a ``model_type`` model (a file
    without the key counts as ``default_type``); a clear error when it is missing or not JSON."""
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    found = d.get("model_type", default_type)
    if found != model_type:
        raise ValueError(f"{path} describes a {found!r} model, not {model_type!r}")
    return d

_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "d_model": 1024,
    "n_layer": 24,
    "n_head": 16,
    "d_inner": 4096,
    "d_head": None,
    "ff_activation": "gelu",
    "attn_type": "bi",
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "dropout": 0.1,
    "mem_len": 512,
    "reuse_len": None,
    "use_mems_eval": True,
    "use_mems_train": False,
    "bi_data": False,
    "clamp_len": -1,
    "same_length": False,
    "summary_type": "last",
    "summary_use_proj": True,
    "summary_activation": "tanh",
    "summary_last_dropout": 0.1,
    "start_n_top": 5,
    "end_n_top": 5,
    "pad_token_id": 5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
    # generic PretrainedConfig fields the heads read
    "output_attentions": False,
    "output_hidden_states": False,
    "return_dict": True,
    "problem_type": None,
    "chunk_size_feed_forward": 0,
    # ours: which backend the attention op uses
    "attn_backend": "auto",
}
# The model sizes of the pretraining presets and the benchmarks: "base" and "large" are the paper's.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, n_layer=2, n_head=4, d_inner=256),
    "base": dict(d_model=768, n_layer=12, n_head=12, d_inner=3072),
    "large": dict(d_model=1024, n_layer=24, n_head=16, d_inner=4096),
}

_ALIASES = {"n_token": "vocab_size", "hidden_size": "d_model", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"}
_LABEL_FIELDS = ("num_labels", "id2label", "label2id")
logger = logging.getLogger(__name__)


def _labels(id2label: dict | None, num_labels: int | None) -> dict[int, str]:
    """``id2label`` (int keys) if given, else ``LABEL_0..`` for ``num_labels`` (default 2)."""
    if id2label is None:
        return {i: f"LABEL_{i}" for i in range(2 if num_labels is None else int(num_labels))}
    if num_labels is not None and int(num_labels) != len(id2label):
        logger.warning("num_labels=%s disagrees with id2label (%d labels); id2label is used",
                       num_labels, len(id2label))
    return {int(k): v for k, v in id2label.items()}


class XLNetConfig:
    """Configuration of an XLNet model; same field names, defaults and ``config.json`` as HF.

    Unknown keys found in a ``config.json`` are kept and written back, so a round trip loses nothing.
    """

    model_type = "xlnet"

    def __init__(self, **kwargs: Any) -> None:
        for alias, name in _ALIASES.items():
            if alias in kwargs:
                kwargs[name] = kwargs.pop(alias)
        id2label = kwargs.pop("id2label", None)
        num_labels = kwargs.pop("num_labels", None)
        kwargs.pop("label2id", None)
        kwargs.pop("model_type", None)
        kwargs.pop("transformers_version", None)
        values = {**copy.deepcopy(_DEFAULTS), **kwargs}
        for name, value in values.items():
            setattr(self, name, value)
        self.id2label = _labels(id2label, num_labels)
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.d_head is None:
            self.d_head = self.d_model // self.n_head
        if self.d_head != self.d_model // self.n_head:
            raise ValueError(f"d_head ({self.d_head}) must equal d_model // n_head ({self.d_model // self.n_head})")
        if self.attn_type not in ("bi", "uni"):
            raise ValueError(f"attn_type must be 'bi' or 'uni', got {self.attn_type!r}")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {self.attn_backend!r}")

    def is_field(self, name: str) -> bool:
        """Whether ``name`` is a field of this config (or an alias of one, or a label field)."""
        return name in vars(self) or name in _ALIASES or name in _LABEL_FIELDS

    # HF-style aliases
    hidden_size = property(lambda self: self.d_model)
    num_attention_heads = property(lambda self: self.n_head)
    num_hidden_layers = property(lambda self: self.n_layer)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        self.id2label = {i: f"LABEL_{i}" for i in range(n)}

    @property
    def label2id(self) -> dict[str, int]:
        return {v: k for k, v in self.id2label.items()}

    def to_dict(self) -> dict[str, Any]:
        out = {k: copy.deepcopy(v) for k, v in vars(self).items() if k != "id2label"}
        out["id2label"] = {str(k): v for k, v in self.id2label.items()}
        out["label2id"] = self.label2id
        out["model_type"] = self.model_type
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "XLNetConfig":
        return cls(**d)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        write_config_json(directory, self.to_dict())

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **overrides: Any) -> "XLNetConfig":
        """Read ``directory/config.json``; ``overrides`` replace fields (``num_labels``, ``id2label`` or
        ``label2id`` replace the saved labels)."""
        d = read_config_json(directory, "xlnet", default_type="xlnet")
        overrides = dict(overrides)
        if "label2id" in overrides and "id2label" not in overrides:
            overrides["id2label"] = {int(i): label for label, i in overrides["label2id"].items()}
        if "num_labels" in overrides or "id2label" in overrides:  # relabel, as transformers does
            d.pop("id2label", None)
            d.pop("label2id", None)
        d.update(overrides)
        return cls(**d)

    def __repr__(self) -> str:
        return f"XLNetConfig({json.dumps(self.to_dict(), sort_keys=True)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, XLNetConfig) and self.to_dict() == other.to_dict()
