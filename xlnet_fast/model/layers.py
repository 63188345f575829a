"""The XLNet layer, read top to bottom: relative attention over both streams, then the feed-forward.

Activations are batch-first ``(B, L, d_model)``. Each attention call goes through the op
(``xlnet_fast.attention``) with the masks the backbone built once per forward (``AttentionInputs``).
In pretraining (both streams in one attention launch) the two streams' rows go side by side,
``(B, L + P, d_model)``, through the query and output projections and the feed-forward: row-wise ops,
so the same values, with one launch each instead of one per stream (``joint_streams``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..attention import attention_probabilities, rel_attention, rel_attention_two_stream
from ..config import XLNetConfig
from ..attention import PreparedMasks
from ..attention.args import autocast_dtype
from ..masks import AttentionInputs

_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
}


def activation(name):
    if callable(name):
        return name
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; choose from {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def product_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a matrix product takes ``weight`` in: under ``torch.autocast`` on its device the
    autocast dtype (autocast casts floating tensors but float64), else its own."""
    dtype = autocast_dtype(weight.device.type)
    if dtype is not None and weight.is_floating_point() and weight.dtype != torch.float64:
        return dtype
    return weight.dtype


def _average_blocked_rows(attn: Tensor, probs: Tensor | None, v: Tensor, blocked: Tensor | None):
    """Rows marked in ``blocked (B, M)`` attend uniformly to all K keys: transformers' result for a row
    that sees no key (its -1e30 mask swamps the scores); the op gives such rows zeros."""
    if blocked is None:
        return attn, probs
    attn = torch.where(blocked[:, :, None, None], v.mean(1, keepdim=True).to(attn.dtype), attn)
    if probs is not None:
        probs = torch.where(blocked[:, None, :, None], 1.0 / v.shape[1], probs)
    return attn, probs


class XLNetRelativeAttention(nn.Module):
    """Two-stream relative attention with transformers' parameters: projections ``q, k, v, o, r``
    ``(d_model, H, D)``, biases ``r_w_bias, r_r_bias, r_s_bias (H, D)``, ``seg_embed (2, H, D)``."""

    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.config = config
        self.n_head, self.d_head, self.d_model = config.n_head, config.d_head, config.d_model
        shape = (config.d_model, config.n_head, config.d_head)
        self.q = nn.Parameter(torch.empty(shape))
        self.k = nn.Parameter(torch.empty(shape))
        self.v = nn.Parameter(torch.empty(shape))
        self.o = nn.Parameter(torch.empty(shape))
        self.r = nn.Parameter(torch.empty(shape))
        self.r_r_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.r_s_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.r_w_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.seg_embed = nn.Parameter(torch.empty(2, config.n_head, config.d_head))
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def _project(self, x: Tensor, weight: Tensor) -> Tensor:
        """(..., d_model) @ (d_model, H, D) -> (..., H, D)."""
        return torch.matmul(x, weight.flatten(1)).unflatten(-1, (self.n_head, self.d_head))

    def post_attention(self, h: Tensor, attn_vec: Tensor) -> Tensor:
        out = torch.matmul(attn_vec.flatten(-2), self.o.flatten(1).t())
        return self.layer_norm(self.dropout(out) + h)

    def _op_options(self, inputs: AttentionInputs) -> dict:
        """The op's keywords that come from this layer: segment weights (when the forward has
        segments), dropout, backend."""
        options = dict(dropout_p=self.dropout.p if self.dropout.training else 0.0, backend=self.config.attn_backend)
        if inputs.has_segments:
            options.update(r_s_bias=self.r_s_bias, seg_embed=self.seg_embed)
        return options

    def _attend(self, q, k, v, k_r, masks: PreparedMasks, inputs: AttentionInputs, output_attentions: bool):
        kwargs = dict(masks=masks, **self._op_options(inputs))
        out = rel_attention(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **kwargs)
        probs = None
        if output_attentions:
            probs = attention_probabilities(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **kwargs)
        return out, probs

    def _keys(self, h: Tensor, pos_emb: Tensor, mems: Tensor | None, inputs: AttentionInputs):
        """k, v (B, mlen + L, H, D) from the memory and the content stream, k_r (Br, R, H, D)."""
        cat = h if mems is None else torch.cat([mems.to(h.dtype), h], dim=1)
        # k and v in one product (one launch, one cast of its input under autocast): views of it
        kv = torch.matmul(cat, torch.cat([self.k.flatten(1), self.v.flatten(1)], dim=1))
        k, v = kv.unflatten(-1, (2, self.n_head, self.d_head)).unbind(-3)
        k_r = self._project(pos_emb, self.r)  # pos_emb in the product's dtype (the backbone's cast)
        if inputs.k_r_index is not None:
            k_r = k_r[inputs.k_r_index]
        return k, v, k_r

    def joint_streams(self, h: Tensor, g: Tensor, pos_emb: Tensor, mems: Tensor | None,
                      inputs: AttentionInputs) -> Tensor:
        """Both streams in one launch, the query stream on its target rows only; the new rows of
        both side by side, ``(B, L + P, d)``, content first. The projections, the output's dropout and
        layer norm (and the layer's feed-forward, ``XLNetLayer``) run once over both streams' rows:
        row-wise, the same values, with half the launches of a training step's forward and backward."""
        k, v, k_r = self._keys(h, pos_emb, mems, inputs)
        streams = torch.cat([h, g], dim=1)
        q_h, q_g = self._project(streams, self.q).split([h.shape[1], g.shape[1]], dim=1)
        attn_h, attn_g = rel_attention_two_stream(q_h, q_g, k, v, k_r, self.r_w_bias, self.r_r_bias,
                                                  masks=inputs.joint, **self._op_options(inputs))
        attn_g, _ = _average_blocked_rows(attn_g, None, v, inputs.blocked_g)
        return self.post_attention(streams, torch.cat([attn_h, attn_g], dim=1))

    def _query_stream(self, g: Tensor, k, v, k_r, inputs: AttentionInputs, output_attentions: bool):
        """The query stream in a launch of its own; with a general ``target_mapping (B, P, L)`` its
        rows are placed on all L positions and gathered back, as transformers does."""
        q_g = self._project(g, self.q)
        tm = inputs.target_mapping
        if tm is not None:
            q_g = torch.einsum("bpl,bphd->blhd", tm.to(q_g.dtype), q_g)
        attn_g, prob_g = self._attend(q_g, k, v, k_r, inputs.query, inputs, output_attentions)
        attn_g, prob_g = _average_blocked_rows(attn_g, prob_g, v, inputs.blocked_g)
        if tm is not None:
            attn_g = torch.einsum("bpl,blhd->bphd", tm.to(attn_g.dtype), attn_g)
        return self.post_attention(g, attn_g), prob_g

    def forward(self, h: Tensor, g: Tensor | None, pos_emb: Tensor, mems: Tensor | None,
                inputs: AttentionInputs, output_attentions: bool = False):
        """h (B, L, d), g (B, P, d) or None, pos_emb (Br, R, d), mems (B, mlen, d) or None.
        Returns the new h, g and the attention probabilities (when asked for)."""
        if g is not None and inputs.joint is not None:
            out_h, out_g = self.joint_streams(h, g, pos_emb, mems, inputs).split([h.shape[1], g.shape[1]], dim=1)
            return out_h, out_g, None
        k, v, k_r = self._keys(h, pos_emb, mems, inputs)
        attn_h, prob_h = self._attend(self._project(h, self.q), k, v, k_r, inputs.content, inputs, output_attentions)
        out_h = self.post_attention(h, attn_h)
        if g is None:
            return out_h, None, prob_h
        out_g, prob_g = self._query_stream(g, k, v, k_r, inputs, output_attentions)
        return out_h, out_g, (prob_h, prob_g) if output_attentions else None


class XLNetFeedForward(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.layer_1 = nn.Linear(config.d_model, config.d_inner)
        self.layer_2 = nn.Linear(config.d_inner, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_function = activation(config.ff_activation)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dropout(self.activation_function(self.layer_1(x)))
        y = self.dropout(self.layer_2(y))
        return self.layer_norm(y + x)


class XLNetLayer(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.rel_attn = XLNetRelativeAttention(config)
        self.ff = XLNetFeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, h, g, pos_emb, mems, inputs: AttentionInputs, output_attentions=False):
        if g is not None and inputs.joint is not None:  # both streams' rows through one feed-forward
            out = self.ff(self.rel_attn.joint_streams(h, g, pos_emb, mems, inputs))
            h, g = out.split([h.shape[1], g.shape[1]], dim=1)
            return h, g, None
        h, g, probs = self.rel_attn(h, g, pos_emb, mems, inputs, output_attentions)
        return self.ff(h), (self.ff(g) if g is not None else None), probs
