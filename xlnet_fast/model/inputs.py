"""``XLNetModel.forward``'s arguments: transformers' defaults and conventions, checked before any compute.

``prepare_inputs`` applies the config's defaults, normalises (mems as one tensor per layer, padding as
a bool mask) and validates every argument — shapes, dtypes, devices, ranges and the arguments that
exclude each other — with the op's own checks (``xlnet_fast.attention.args``), and returns the typed
``BackboneInputs`` the backbone runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..attention.args import autocast_dtype, check_tensor, check_values
from ..config import XLNetConfig

logger = logging.getLogger(__name__)

# transformers' XLNetModel.forward takes these and ignores them (it ignores every extra keyword)
IGNORED_KWARGS = ("head_mask", "position_ids", "logits_to_keep", "num_items_in_batch", "use_cache")
_warned: set[str] = set()


@dataclass
class BackboneInputs:
    """``XLNetModel.forward``'s arguments after the config's defaults, normalisation and validation
    (``prepare_inputs``); ``XLNetModel.forward_prepared`` runs them."""

    batch: int
    seq_len: int
    input_ids: Tensor | None  # (B, L)
    inputs_embeds: Tensor | None  # (B, L, d_model)
    padding: Tensor | None  # (B, L) bool, True = padding
    mems: tuple[Tensor, ...] | None  # per layer (mlen, B, d_model)
    perm_mask: Tensor | None  # (B, L, L)
    target_mapping: Tensor | None  # (B, P, L) float
    token_type_ids: Tensor | None  # (B, L)
    q_rank: Tensor | None  # (B, L)
    k_rank: Tensor | None  # (B, L)
    target_pos: Tensor | None  # (B, P)
    use_mems: bool
    output_attentions: bool
    output_hidden_states: bool
    return_dict: bool

    @property
    def mlen(self) -> int:
        return self.mems[0].shape[0] if self.mems is not None else 0


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _check_extra_kwargs(kwargs: dict[str, Any]) -> None:
    """Accept the keywords transformers' XLNet accepts and ignores; any other is a TypeError."""
    if kwargs.get("use_cache") is not None:
        warn_once("use_cache is deprecated in XLNet and ignored; use use_mems")
    if kwargs.get("head_mask") is not None:
        warn_once("XLNet has no head masking: head_mask is ignored (as in transformers)")
    unknown = sorted(k for k in kwargs if k not in IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"XLNetModel.forward() got unexpected keyword arguments: {unknown}")


def _layer_mems(mems: Any) -> tuple[Tensor, ...] | None:
    """``mems`` as one tensor per layer. Takes a list or tuple, or one stacked
    ``(n_layer, mlen, B, d_model)`` tensor (transformers indexes it the same way); all None means no
    memory, a mix of None and tensors is an error."""
    if mems is None:
        return None
    if isinstance(mems, Tensor):
        if mems.dim() != 4:
            raise ValueError("mems given as one tensor must be (n_layer, mlen, batch, d_model), got shape "
                             f"{tuple(mems.shape)}")
        return tuple(mems.unbind(0))
    if not isinstance(mems, (list, tuple)):
        raise TypeError(f"mems must be a list or tuple with one tensor per layer, got {type(mems).__name__}")
    missing = [i for i, m in enumerate(mems) if m is None]
    if len(missing) == len(mems):
        return None
    if missing:
        raise ValueError(f"mems[{missing[0]}] is None but other layers have memory: pass a tensor for "
                         "every layer, or mems=None")
    return tuple(mems)


def _as_bool_padding(attention_mask: Tensor | None, input_mask: Tensor | None) -> Tensor | None:
    """(B, L) True where a token is padding, from HF's ``attention_mask`` (0 = pad) or ``input_mask``
    (1 = pad); at most one is given (checked by ``_validate_inputs``)."""
    if input_mask is not None:
        return input_mask > 0
    if attention_mask is not None:
        return (1.0 - attention_mask.float()) > 0
    return None


def _check_target_pos_range(target_pos: Tensor | None, L: int) -> None:
    """A check of values (``check_values``: no host sync on a GPU)."""
    if target_pos is None or not target_pos.numel():
        return
    top = target_pos.max()
    check_values(top < L, f"target_pos values must be < seq_len = {L} (negative marks a padding row), got {{}}", top)


def _check_tokens(config: XLNetConfig, weights: Tensor, input_ids, inputs_embeds) -> tuple[int, int]:
    """``input_ids`` or ``inputs_embeds``, exactly one, well formed; returns (B, L)."""
    if input_ids is not None and inputs_embeds is not None:
        raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("You have to specify either input_ids or inputs_embeds")
    if input_ids is not None:
        _check_input_ids(config, input_ids)
    else:
        _check_inputs_embeds(config, weights, inputs_embeds)
    B, L = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if L == 0:
        raise ValueError("the sequence is empty (seq_len = 0)")
    return B, L


def _check_input_ids(config: XLNetConfig, input_ids) -> None:
    vocab_size = config.vocab_size
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int):
        raise TypeError(f"input_ids must be an integer tensor, got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    if input_ids.numel():  # a check of values (check_values: no host sync on a GPU)
        lo, hi = input_ids.min(), input_ids.max()
        check_values((lo >= 0) & (hi < vocab_size),
                     f"input_ids must be in [0, vocab_size={vocab_size}), got values in [{{}}, {{}}]", lo, hi)


def _check_inputs_embeds(config: XLNetConfig, weights: Tensor, inputs_embeds) -> None:
    d_model = config.d_model
    if not isinstance(inputs_embeds, Tensor):
        raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d_model:
        raise ValueError(f"inputs_embeds must be (batch, seq_len, d_model={d_model}), got "
                         f"{tuple(inputs_embeds.shape)}")
    if not inputs_embeds.is_floating_point():
        raise TypeError(f"inputs_embeds must be floating point, got {inputs_embeds.dtype}")
    if inputs_embeds.dtype != weights.dtype and autocast_dtype(inputs_embeds.device.type) is None:
        raise TypeError(f"inputs_embeds has dtype {inputs_embeds.dtype} but the model's weights are "
                        f"{weights.dtype}: cast it (inputs_embeds.to(model.dtype)) or run under torch.autocast")


def _check_mems(config: XLNetConfig, mems: tuple[Tensor, ...] | None, B: int) -> None:
    c = config
    if mems is None:
        return
    if len(mems) != c.n_layer:
        raise ValueError(f"mems must hold one tensor per layer ({c.n_layer}), got {len(mems)}")
    for i, m in enumerate(mems):
        if not isinstance(m, Tensor):
            raise TypeError(f"mems[{i}] must be a torch.Tensor, got {type(m).__name__}")
        if m.dim() != 3 or m.shape[1] != B or m.shape[2] != c.d_model:
            raise ValueError(f"mems[{i}] must be (mlen, batch={B}, d_model={c.d_model}), got "
                             f"{tuple(m.shape)}")
        if m.shape[0] != mems[0].shape[0]:
            raise ValueError(f"mems[{i}] has mlen {m.shape[0]}, mems[0] has {mems[0].shape[0]}")


def _check_combinations(config: XLNetConfig, B, L, attention_mask, input_mask, perm_mask, target_mapping, q_rank,
                        k_rank, target_pos) -> None:
    """Arguments that exclude or need each other, and values that depend on L."""
    c = config
    if attention_mask is not None and input_mask is not None:
        raise ValueError("pass only one of attention_mask (0 = padding) and input_mask (1 = padding)")
    if (q_rank is None) != (k_rank is None):
        raise ValueError("q_rank and k_rank must be given together")
    if q_rank is not None and perm_mask is not None:
        raise ValueError("pass either perm_mask or q_rank/k_rank, not both")
    if q_rank is not None and c.attn_type != "bi":
        raise ValueError("q_rank/k_rank (permutation ranks) need attn_type='bi'")
    if target_pos is not None and target_mapping is not None:
        raise ValueError("pass either target_mapping or target_pos, not both")
    if c.bi_data and B % 2:
        raise ValueError(f"bi_data needs an even batch size, got {B}")
    _check_target_pos_range(target_pos, L)


def _validate_inputs(config: XLNetConfig, weights: Tensor, input_ids, inputs_embeds, attention_mask, input_mask,
                     mems, perm_mask, target_mapping, token_type_ids, q_rank, k_rank, target_pos) -> tuple[int, int]:
    """Check shapes, ranges, dtypes and devices before any compute; returns (B, L)."""
    B, L = _check_tokens(config, weights, input_ids, inputs_embeds)
    _check_mems(config, mems, B)
    tensors = {"input_ids": (input_ids, None), "inputs_embeds": (inputs_embeds, None),
               "attention_mask": (attention_mask, (B, L)), "input_mask": (input_mask, (B, L)),
               "token_type_ids": (token_type_ids, (B, L)), "perm_mask": (perm_mask, (B, L, L)),
               "target_mapping": (target_mapping, (B, None, L)), "q_rank": (q_rank, (B, L)),
               "k_rank": (k_rank, (B, L)),
               "target_pos": (target_pos, (B, None))}
    tensors.update({f"mems[{i}]": (m, None) for i, m in enumerate(mems or ())})
    for name, (t, shape) in tensors.items():
        if t is not None:
            ndim = len(shape) if shape is not None else t.dim() if isinstance(t, Tensor) else 0
            check_tensor(name, t, ndim, shape, device=weights.device, device_owner="the model")
    for name, t in (("token_type_ids", token_type_ids), ("q_rank", q_rank), ("k_rank", k_rank),
                    ("target_pos", target_pos)):
        if t is not None and t.is_floating_point():
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    _check_combinations(config, B, L, attention_mask, input_mask, perm_mask, target_mapping, q_rank,
                             k_rank, target_pos)
    return B, L


def prepare_inputs(model, *, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                   mems: Any = None, perm_mask: Tensor | None = None, target_mapping: Tensor | None = None,
                   token_type_ids: Tensor | None = None, input_mask: Tensor | None = None,
                   inputs_embeds: Tensor | None = None, use_mems: bool | None = None,
                   output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                   return_dict: bool | None = None, q_rank: Tensor | None = None, k_rank: Tensor | None = None,
                   target_pos: Tensor | None = None, **ignored: Any) -> BackboneInputs:
    """``XLNetModel.forward``'s arguments (``model``: an ``XLNetModel``; also its method
    ``prepare_inputs``) with the config's defaults applied, normalised and validated before any
    compute; bad input raises ValueError or TypeError naming the argument. ``ignored``: the keywords
    transformers' XLNetModel accepts and ignores (``IGNORED_KWARGS``); any other is a TypeError."""
    c = model.config
    _check_extra_kwargs(ignored)
    layer_mems = _layer_mems(mems)
    B, L = _validate_inputs(c, model.mask_emb, input_ids, inputs_embeds, attention_mask, input_mask, layer_mems,
                            perm_mask, target_mapping, token_type_ids, q_rank, k_rank, target_pos)
    if target_mapping is not None and not target_mapping.is_floating_point():
        target_mapping = target_mapping.to(model.mask_emb.dtype)  # e.g. a bool one-hot mapping
    if use_mems is None:
        use_mems = c.use_mems_train if model.training else c.use_mems_eval
    return BackboneInputs(
        batch=B, seq_len=L, input_ids=input_ids, inputs_embeds=inputs_embeds,
        padding=_as_bool_padding(attention_mask, input_mask), mems=layer_mems, perm_mask=perm_mask,
        target_mapping=target_mapping, token_type_ids=token_type_ids, q_rank=q_rank, k_rank=k_rank,
        target_pos=target_pos, use_mems=bool(use_mems),
        output_attentions=c.output_attentions if output_attentions is None else output_attentions,
        output_hidden_states=c.output_hidden_states if output_hidden_states is None else output_hidden_states,
        return_dict=c.return_dict if return_dict is None else return_dict,
    )
