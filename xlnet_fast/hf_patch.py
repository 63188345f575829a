"""Use xlnet_fast inside HuggingFace ``transformers`` XLNet models, and convert models both ways.

``patch_transformers(model)`` gives every ``transformers`` ``XLNetModel`` inside ``model`` (any head
class, PEFT-wrapped too) the forward of ``xlnet_fast.XLNetModel``, run over the *same* modules and
parameters: embeddings, feed-forward blocks (with any adapters on them), layer norms and the attention
parameters are shared, not copied, so optimizers, ``.to()``, ``state_dict`` and adapters keep working.
transformers' attention core and its dense L×L masks are no longer used: masks are built in compact
form and every attention goes through ``xlnet_fast.rel_attention``.

The patched forward is a drop-in: it has transformers' signature and binds arguments like it, returns
transformers' output types (``mems`` a tuple), and gives a query-stream row that sees no key
transformers' uniform average. Input that xlnet_fast's own ``XLNetModel`` rejects but transformers
accepts (e.g. a ``target_mapping`` over another length than the sequence) runs transformers' forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import types
from typing import Any

import torch
from torch import nn

from .attention import BACKENDS
from .config import XLNetConfig
from .model import MODEL_CLASSES, XLNetModel, XLNetPreTrainedModel

logger = logging.getLogger(__name__)

_ATTN_PARAMS = ("q", "k", "v", "o", "r", "r_r_bias", "r_s_bias", "r_w_bias", "seg_embed")
# xlnet_fast's own forward arguments; the patched forward takes them through transformers' **kwargs
_EXTENSION_ARGS = ("q_rank", "k_rank", "target_pos")
# config fields xlnet_fast reads at call time: taken from transformers' config on every call
_LIVE_CONFIG_FIELDS = ("vocab_size", "attn_type", "same_length", "bi_data", "clamp_len", "mem_len",
                       "reuse_len", "use_mems_eval", "use_mems_train", "output_attentions",
                       "output_hidden_states", "return_dict")
_ORIGINAL: dict[str, Any] = {}
_FAST_FORWARDS: dict[Any, Any] = {}
_fallbacks_logged: set[str] = set()  # the kinds of rejection warned about (_rejection_kind)
_NUMBER = re.compile(r"\d+")


def _hf_xlnet():
    try:
        from transformers.models.xlnet import modeling_xlnet
    except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
        raise ImportError("patch_transformers/from_hf/to_hf need `transformers` installed") from exc
    return modeling_xlnet


def _config_from_hf(hf_config, backend: str) -> XLNetConfig:
    d = hf_config.to_dict()
    d["attn_backend"] = backend
    return XLNetConfig(**d)


def _shared_backbone(hf_backbone: nn.Module, backend: str) -> XLNetModel:
    """An xlnet_fast.XLNetModel whose modules and parameters are those of ``hf_backbone``."""
    with torch.device("meta"):
        ours = XLNetModel(_config_from_hf(hf_backbone.config, backend))
    ours.word_embedding = hf_backbone.word_embedding
    ours.mask_emb = hf_backbone.mask_emb
    ours.dropout = hf_backbone.dropout
    for mine, theirs in zip(ours.layer, hf_backbone.layer):
        mine.ff = theirs.ff
        mine.dropout = theirs.dropout
        for name in _ATTN_PARAMS:
            setattr(mine.rel_attn, name, getattr(theirs.rel_attn, name))
        mine.rel_attn.layer_norm = theirs.rel_attn.layer_norm
        mine.rel_attn.dropout = theirs.rel_attn.dropout
    # built on meta: a parameter still there is one not taken from transformers (those of a model
    # on the meta device, e.g. built for a later ``to_empty``, are meta too: told apart by identity)
    theirs = {id(p) for p in hf_backbone.parameters()}
    leftover = [n for n, p in ours.named_parameters() if p.is_meta and id(p) not in theirs]
    if leftover:  # pragma: no cover - a transformers version with other modules
        raise RuntimeError(f"could not share these parameters with transformers: {leftover}")
    ours.average_blocked_rows = True  # a row that sees no key: transformers' uniform average
    return ours


def _sources(hf_backbone: nn.Module) -> tuple:
    return tuple(id(m) for m in hf_backbone.modules()) + tuple(id(p) for p in hf_backbone.parameters())


def _backbone_for(hf_backbone: nn.Module) -> XLNetModel:
    """The (cached) xlnet_fast backbone sharing ``hf_backbone``'s modules, in its mode and config."""
    backend = getattr(hf_backbone, "_xlnet_fast_backend", _ORIGINAL.get("class_backend", "auto"))
    src = _sources(hf_backbone)
    cached = hf_backbone.__dict__.get("_xlnet_fast_cache")
    if cached is None or cached[0] != src or cached[1].config.attn_backend != backend:
        cached = (src, _shared_backbone(hf_backbone, backend))
        hf_backbone.__dict__["_xlnet_fast_cache"] = cached
    ours = cached[1]
    for name in _LIVE_CONFIG_FIELDS:
        setattr(ours.config, name, getattr(hf_backbone.config, name))
    # only the flag forward reads: the shared modules keep their own train/eval state
    ours.training = hf_backbone.training
    return ours


def _rejection_kind(exc: Exception) -> str:
    """What a rejection is, whatever the sizes in it: the error's type and message with each number
    replaced (``ValueError: target_mapping must have shape (#, *, #), got (#, #, #)``)."""
    return f"{type(exc).__name__}: {_NUMBER.sub('#', str(exc))}"


def _log_fallback(exc: Exception) -> None:
    """Warn once per kind of rejection: two kinds (a wrong dtype, a wrong shape of one argument) warn
    twice, one kind at other sizes once."""
    message = str(exc)
    key = _rejection_kind(exc)
    if key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        logger.warning("xlnet_fast does not take this input (%s); transformers' own XLNetModel.forward "
                       "runs it", message)


def _to_transformers_output(out, return_dict: bool):
    if not return_dict:
        return out
    return _hf_xlnet().XLNetModelOutput(last_hidden_state=out.last_hidden_state, mems=out.mems,
                                        hidden_states=out.hidden_states, attentions=out.attentions)


def _fast_forward_for(original):
    """transformers' XLNetModel ``original`` forward, run by xlnet_fast over the same modules.

    It has ``original``'s signature (``__signature__``, ``__wrapped__``, name and annotations) and binds
    its arguments the same way. Input xlnet_fast's backbone does not take (its validation rejects it,
    e.g. a ``target_mapping`` over another length than the sequence) runs ``original`` itself, so
    whatever transformers computes, the patched model computes.
    """
    if original in _FAST_FORWARDS:
        return _FAST_FORWARDS[original]
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    self_name = params[0].name
    var_keyword = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        arguments = dict(signature.bind(self, *args, **kwargs).arguments)
        del arguments[self_name]
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        extensions = {k: extra[k] for k in _EXTENSION_ARGS if k in extra}
        ours = _backbone_for(self)
        try:
            prepared = ours.prepare_inputs(**arguments, **extensions)
        except (ValueError, TypeError) as exc:
            if extensions:  # transformers does not know these: its forward would ignore them
                raise
            _log_fallback(exc)
            return original(self, *args, **kwargs)
        return _to_transformers_output(ours.forward_prepared(prepared), prepared.return_dict)

    forward.__signature__ = signature
    forward._xlnet_fast_wraps = original
    _FAST_FORWARDS[original] = forward
    return forward


def _unpatched_forward(cls) -> Any:
    """``cls.forward`` as transformers defines it (looking through a class-level patch)."""
    forward = cls.forward
    return getattr(forward, "_xlnet_fast_wraps", forward)


def patch_transformers(model: nn.Module | None = None, backend: str = "auto"):
    """Make transformers' XLNet use xlnet_fast's attention.

    With ``model``: patch every transformers ``XLNetModel`` inside it (returns ``model``). Without:
    patch the ``transformers`` ``XLNetModel`` class, so every model, built before or after, uses it
    (returns None). ``backend`` is ``"auto" | "eager" | "triton"``. ``unpatch_transformers`` undoes it.
    The patched forward has transformers' signature; input xlnet_fast does not take (which its own
    ``XLNetModel`` rejects) runs transformers' forward, so whatever transformers computes, the patched
    model computes too.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    hf = _hf_xlnet()
    if model is None:
        original = _unpatched_forward(hf.XLNetModel)
        _ORIGINAL.setdefault("class_forward", original)
        _ORIGINAL["class_backend"] = backend
        hf.XLNetModel.forward = _fast_forward_for(original)
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backbones = [m for m in model.modules() if isinstance(m, hf.XLNetModel)]
    if not backbones:
        raise ValueError(f"no transformers XLNetModel found inside {type(model).__name__}")
    for m in backbones:
        m._xlnet_fast_backend = backend
        m.forward = types.MethodType(_fast_forward_for(_unpatched_forward(type(m))), m)
    return model


def unpatch_transformers(model: nn.Module | None = None) -> None:
    """Undo ``patch_transformers``: for ``model``'s backbones, or (None) for the class."""
    hf = _hf_xlnet()
    if model is None:
        if "class_forward" in _ORIGINAL:
            hf.XLNetModel.forward = _ORIGINAL.pop("class_forward")
            _ORIGINAL.pop("class_backend", None)
        return
    for m in model.modules():
        if isinstance(m, hf.XLNetModel):
            for attr in ("forward", "_xlnet_fast_backend", "_xlnet_fast_cache"):
                m.__dict__.pop(attr, None)


def from_hf(hf_model: nn.Module, backend: str = "auto") -> XLNetPreTrainedModel:
    """An xlnet_fast model of the same class with a copy of ``hf_model``'s weights."""
    name = type(hf_model).__name__
    if name not in MODEL_CLASSES:
        raise TypeError(f"from_hf takes one of {sorted(MODEL_CLASSES)}, got {name}")
    weight = next(hf_model.parameters())
    # a model on the meta device (weights not materialised yet) gives one on the meta device
    with torch.device("meta") if weight.is_meta else contextlib.nullcontext():
        ours = MODEL_CLASSES[name](_config_from_hf(hf_model.config, backend))
    ours.load_hf_state_dict(hf_model.state_dict(), source=f"transformers {name}")
    ours.to(device=weight.device, dtype=weight.dtype)
    return ours.train(hf_model.training)


def to_hf(model: XLNetPreTrainedModel) -> nn.Module:
    """A transformers model of the same class with a copy of ``model``'s weights."""
    import transformers

    name = type(model).__name__
    if name not in MODEL_CLASSES:
        raise TypeError(f"to_hf takes one of {sorted(MODEL_CLASSES)}, got {name}")
    d = model.config.to_dict()
    d.pop("attn_backend", None)
    hf_model = getattr(transformers, name)(transformers.XLNetConfig(**d))
    missing, unexpected = hf_model.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(hf_model, "_tied_weights_keys", None) or [])
    if [k for k in missing if k not in tied] or unexpected:
        raise RuntimeError(f"to_hf: missing {missing}, unexpected {unexpected}")
    hf_model.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)
    return hf_model.train(model.training)
