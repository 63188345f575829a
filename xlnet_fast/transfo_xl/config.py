"""TransfoXLConfig: the fields and defaults of transformers 4.x's ``TransfoXLConfig``, read from and
written to ``config.json`` (``model_type: "transfo-xl"``), so 4.x directories load and ours load in 4.x."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from ..attention.backends import BACKENDS
from ..config import read_config_json, write_config_json

MODEL_TYPE = "transfo-xl"

# transformers 4.x's defaults (the wt103 large model's shape)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 267735,
    "cutoffs": [20000, 40000, 200000],
    "d_model": 1024,
    "d_embed": 1024,
    "n_head": 16,
    "d_head": 64,
    "d_inner": 4096,
    "div_val": 4,
    "pre_lnorm": False,
    "n_layer": 18,
    "mem_len": 1600,
    "clamp_len": 1000,
    "same_length": True,
    "attn_type": 0,
    "sample_softmax": -1,
    "adaptive": True,
    "dropout": 0.1,
    "dropatt": 0.0,
    "untie_r": True,
    "init": "normal",
    "init_range": 0.01,
    "proj_init_std": 0.01,
    "init_std": 0.02,
    "layer_norm_epsilon": 1e-5,
    "eos_token_id": 0,
    "tie_word_embeddings": True,
    "output_attentions": False,
    "output_hidden_states": False,
    "return_dict": True,
    # ours: which backend the attention op uses
    "attn_backend": "auto",
    # ours: the memory a forward, an evaluation or generate starts from when given none (MEM_STARTS)
    "mem_start": "zeros",
}
# "zeros": transformers 4.x's ``init_mems``, ``mem_len`` rows of zeros per layer; "empty": the original
# code's, no row (the first segment attends to itself only)
MEM_STARTS = ("zeros", "empty")
# Model sizes of the benchmarks (and of pretraining): "wt103_base" and "wt103_large" are the paper's
# WikiText-103 models (adaptive input and softmax over its 267,735 words).
TRANSFO_XL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=1000, cutoffs=[200, 500], d_model=64, d_embed=64, n_head=4, d_head=16, d_inner=128,
                 n_layer=2, div_val=1),
    "small": dict(vocab_size=10000, cutoffs=[2000, 5000], d_model=256, d_embed=256, n_head=4, d_head=64,
                  d_inner=1024, n_layer=4, div_val=1),
    "wt103_base": dict(vocab_size=267735, cutoffs=[20000, 40000, 200000], d_model=410, d_embed=410, n_head=10,
                       d_head=41, d_inner=2100, n_layer=16, div_val=1),
    "wt103_large": dict(vocab_size=267735, cutoffs=[20000, 40000, 200000], d_model=1024, d_embed=1024, n_head=16,
                        d_head=64, d_inner=4096, n_layer=18, div_val=4),
}
_ALIASES = {"n_token": "vocab_size", "hidden_size": "d_model", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"}
_DROPPED = ("model_type", "transformers_version", "proj_share_all_but_first")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class TransfoXLConfig:
    """Configuration of a Transformer-XL; transformers 4.x's field names, defaults (the WikiText-103
    large model's shape) and ``config.json``. Unknown keys of a ``config.json`` are kept and written back.

    Sizes:
        vocab_size (267735): tokens; ids are ordered by frequency for the adaptive input and softmax.
        d_model (1024): width of the hidden states (``hidden_size``).
        n_layer (18), n_head (16), d_head (64): layers, attention heads and their width (``n_head *
        d_head`` need not be ``d_model``); d_inner (4096): the feed-forward's hidden width.
    Adaptive input and softmax (``adaptive.py``):
        cutoffs ([20000, 40000, 200000]): the vocabulary cut into a head ``[0, cutoffs[0])`` and tail
        clusters; ``[]``: one plain softmax. d_embed (1024): the head's embedding width (projected to
        d_model when it differs). div_val (4): cluster i's width is ``d_embed // div_val**i``.
        adaptive (True): kept for 4.x (the adaptive softmax is always used). tie_word_embeddings
        (True): the softmax's weights are the input embedding's. proj_share_all_but_first (True):
        sets ``tie_projs``, the tail clusters' output projections tied to the input's.
    Attention and memory:
        mem_len (1600): rows of memory per layer carried to the next segment (0: none).
        clamp_len (1000): relative distances clamped there (<= 0: no clamp).
        same_length (True): every token attends to the same number of keys, its last ``mem_len``.
        pre_lnorm (False): layer norm before each block instead of after the residual.
        untie_r (True): ``r_w_bias``/``r_r_bias`` per layer (False: one pair shared by all layers).
        attn_type (0): relative attention, the only kind (others are refused).
        mem_start ("zeros", ours): the memory ``forward``, ``generate`` and the evaluations start from
        when given none: "zeros", transformers 4.x's ``mem_len`` zero rows (so a 4.x checkpoint gives
        4.x's numbers and tokens), or "empty", the original code's (no row; the first segment sees
        itself only). attn_backend ("auto", ours): the attention op's backend.
    Regularisation and init: dropout (0.1), dropatt (0.0, on the attention probabilities), init
        ("normal"), init_range (0.01), proj_init_std (0.01), init_std (0.02), layer_norm_epsilon (1e-5).
    Others: eos_token_id (0), sample_softmax (-1: off; sampled softmax training is refused),
        output_attentions, output_hidden_states, return_dict.

    Sizes of the benchmarks: ``TRANSFO_XL_SIZES``; pretraining presets (tiny, small, base, large):
    ``xlnet_fast.pretrain.settings.TRANSFO_XL_PRESETS`` (``xlnet-fast pretrain --help``).
    """

    model_type = MODEL_TYPE

    def __init__(self, proj_share_all_but_first: bool = True, **kwargs: Any) -> None:
        for alias, name in _ALIASES.items():
            if alias in kwargs:
                kwargs[name] = kwargs.pop(alias)
        for name in _DROPPED:
            kwargs.pop(name, None)
        values = {**copy.deepcopy(_DEFAULTS), **kwargs}
        for name, value in values.items():
            setattr(self, name, value)
        self.cutoffs = list(self.cutoffs)
        if "tie_projs" not in kwargs:  # 4.x derives it; a config.json stores it
            self.tie_projs = [False] + [bool(proj_share_all_but_first)] * len(self.cutoffs)
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "d_model", "d_embed", "n_head", "d_head", "d_inner", "n_layer", "div_val"):
            _positive_int(name, getattr(self, name))
        for name in ("mem_len", "clamp_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.mem_len < 0:
            raise ValueError(f"mem_len must be >= 0 (0: no memory), got {self.mem_len}")
        if self.same_length and self.mem_len == 0:
            raise ValueError("same_length=True makes every token attend to its last mem_len keys: it needs mem_len > 0 "
                             "(or pass same_length=False)")
        c = self.cutoffs
        if any(not isinstance(x, int) or isinstance(x, bool) for x in c) or c != sorted(set(c)) or (
                c and (c[0] <= 0 or c[-1] >= self.vocab_size)):
            raise ValueError(f"cutoffs must be increasing integers in (0, vocab_size={self.vocab_size}), got {c}")
        if len(self.tie_projs) != len(c) + 1:
            raise ValueError(f"tie_projs must have len(cutoffs) + 1 = {len(c) + 1} entries, got {self.tie_projs}")
        if self.div_val > 1 and self.d_embed // self.div_val ** len(c) < 1:
            raise ValueError(f"d_embed={self.d_embed} with div_val={self.div_val} leaves no dimension for the "
                             f"last of the {len(c) + 1} clusters")
        if self.attn_type != 0:
            raise ValueError(f"attn_type must be 0 (relative attention, the only kind 4.x ships), got {self.attn_type}")
        if self.sample_softmax > 0:
            raise ValueError("sample_softmax > 0 (sampled softmax training) is not supported (nor in transformers)")
        if self.mem_start not in MEM_STARTS:
            raise ValueError(f"mem_start must be one of {MEM_STARTS}, got {self.mem_start!r}")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {self.attn_backend!r}")

    def is_field(self, name: str) -> bool:
        return name in vars(self) or name in _ALIASES

    hidden_size = property(lambda self: self.d_model)
    num_attention_heads = property(lambda self: self.n_head)
    num_hidden_layers = property(lambda self: self.n_layer)

    def to_dict(self) -> dict[str, Any]:
        out = copy.deepcopy(vars(self))
        out["model_type"] = self.model_type
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransfoXLConfig":
        return cls(**d)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        write_config_json(directory, self.to_dict())

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **overrides: Any) -> "TransfoXLConfig":
        """Read ``directory/config.json``; ``overrides`` replace fields."""
        d = read_config_json(directory, MODEL_TYPE)
        d.update(overrides)
        return cls(**d)

    def __repr__(self) -> str:
        return f"TransfoXLConfig({json.dumps(self.to_dict(), sort_keys=True)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransfoXLConfig) and self.to_dict() == other.to_dict()
