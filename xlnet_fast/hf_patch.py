"""Use xlnet_fast inside HuggingFace ``transformers`` XLNet models, and convert models both ways.

``patch_transformers(model)`` gives every ``transformers`` ``XLNetModel`` inside ``model`` (any head
class, PEFT-wrapped too) the forward of ``xlnet_fast.XLNetModel``, run over the *same* modules and
parameters: embeddings, feed-forward blocks (with any adapters on them), layer norms and the attention
parameters are shared, not copied, so optimizers, ``.to()``, ``state_dict`` and adapters keep working.
transformers' attention core and its dense L×L masks are no longer used: masks are built in compact
form and every attention goes through ``xlnet_fast.rel_attention``.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from .config import XLNetConfig
from .modeling import MODEL_CLASSES, XLNetModel, XLNetPreTrainedModel

_ATTN_PARAMS = ("q", "k", "v", "o", "r", "r_r_bias", "r_s_bias", "r_w_bias", "seg_embed")
_OUR_FORWARD_ARGS = set(inspect.signature(XLNetModel.forward).parameters) - {"self", "kwargs"}
_ORIGINAL: dict[str, Any] = {}


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
    leftover = [n for n, p in ours.named_parameters() if p.is_meta]
    if leftover:  # pragma: no cover - a transformers version with other modules
        raise RuntimeError(f"could not share these parameters with transformers: {leftover}")
    return ours


def _sources(hf_backbone: nn.Module) -> tuple:
    return tuple(id(m) for m in hf_backbone.modules()) + tuple(id(p) for p in hf_backbone.parameters())


def _fast_forward(self, *args, **kwargs):
    """Replacement for transformers' ``XLNetModel.forward``."""
    backend = getattr(self, "_xlnet_fast_backend", _ORIGINAL.get("class_backend", "auto"))
    src = _sources(self)
    cached = self.__dict__.get("_xlnet_fast_cache")
    if cached is None or cached[0] != src or cached[1].config.attn_backend != backend:
        cached = (src, _shared_backbone(self, backend))
        self.__dict__["_xlnet_fast_cache"] = cached
    ours = cached[1]
    ours.train(self.training)
    # transformers' forward accepts and ignores unknown keyword arguments; so do we here
    kwargs = {k: v for k, v in kwargs.items() if k in _OUR_FORWARD_ARGS}
    kwargs["return_dict"] = kwargs.get("return_dict") if kwargs.get("return_dict") is not None else self.config.return_dict
    out = ours(*args, **kwargs)
    if not kwargs["return_dict"]:
        return out
    return _hf_xlnet().XLNetModelOutput(last_hidden_state=out.last_hidden_state, mems=out.mems,
                                        hidden_states=out.hidden_states, attentions=out.attentions)


def patch_transformers(model: nn.Module | None = None, backend: str = "auto"):
    """Make transformers' XLNet use xlnet_fast's attention.

    With ``model``: patch every transformers ``XLNetModel`` inside it (returns ``model``). Without:
    patch the ``transformers`` ``XLNetModel`` class, so every model, built before or after, uses it
    (returns None). ``backend`` is ``"auto" | "eager" | "triton"``. ``unpatch_transformers`` undoes it.
    """
    if backend not in ("auto", "eager", "triton"):
        raise ValueError(f"backend must be 'auto', 'eager' or 'triton', got {backend!r}")
    hf = _hf_xlnet()
    if model is None:
        if "class_forward" not in _ORIGINAL:
            _ORIGINAL["class_forward"] = hf.XLNetModel.forward
        _ORIGINAL["class_backend"] = backend
        hf.XLNetModel.forward = _fast_forward
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backbones = [m for m in model.modules() if isinstance(m, hf.XLNetModel)]
    if not backbones:
        raise ValueError(f"no transformers XLNetModel found inside {type(model).__name__}")
    for m in backbones:
        m._xlnet_fast_backend = backend
        m.forward = types.MethodType(_fast_forward, m)
    return model


def unpatch_transformers(model: nn.Module | None = None) -> None:
    """Undo ``patch_transformers``: for ``model``'s backbones, or (None) for the class and every
    patched instance reachable from ``model`` if given."""
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
    ours = MODEL_CLASSES[name](_config_from_hf(hf_model.config, backend))
    ours.load_hf_state_dict(hf_model.state_dict(), source=f"transformers {name}")
    ours.to(device=next(hf_model.parameters()).device, dtype=next(hf_model.parameters()).dtype)
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
