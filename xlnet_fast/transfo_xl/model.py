"""Transformer-XL (Dai et al. 2019), the original code's ``MemTransformerLM`` with the default relative
attention, with transformers 4.x's parameter names, forward arguments and outputs.

Read top to bottom: the attention layer, the feed-forward, the layer, the backbone
(``TransfoXLModel``: adaptive input, relative positions, memory) and the LM head
(``TransfoXLLMHeadModel``: adaptive softmax). Activations are batch-first ``(B, L, d_model)``
inside; ``mems`` are seq-first ``(mlen, B, d_model)`` per layer at the boundary, like 4.x's.

Attention is ``xlnet_fast.rel_attention`` — XLNet's op without the segment term: content and
position terms with ``r_w_bias``/``r_r_bias`` and the relative shift, causal masks as ranks
(``masks.causal_masks``), memory keys first. The relative rows are the sinusoids of the distances
``K, K-1, ..., 0`` (K = mlen + qlen keys; the op reads row ``qlen + j - i`` for query i and key j,
i.e. distance ``mlen + i - j``), clamped at ``clamp_len``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import PreparedMasks, attention_probabilities, rel_attention
from ..attention.args import check_values
from ..generation import TransfoXLCache, generate_transfo_xl
from ..masks import causal_masks
from ..model.inputs import _check_mems, _check_tokens, _layer_mems
from ..model.outputs import ModelOutput
from ..model.pretrained import PreTrainedModel
from .adaptive import IGNORE_INDEX, AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from .config import MEM_STARTS, TransfoXLConfig


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """Relative multi-head attention. ``qkv_net (3·H·D, d_model)``, ``r_net (H·D, d_model)``,
    ``o_net (d_model, H·D)``, biases ``r_w_bias, r_r_bias (H, D)`` (the backbone's, shared, unless
    ``untie_r``); post-norm residual, or pre-norm with ``pre_lnorm`` (memory included in the norm)."""

    def __init__(self, config: TransfoXLConfig, r_w_bias: nn.Parameter | None, r_r_bias: nn.Parameter | None):
        super().__init__()
        c = config
        self.config, self.n_head, self.d_head, self.pre_lnorm = c, c.n_head, c.d_head, c.pre_lnorm
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.drop = nn.Dropout(c.dropout)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)
        if r_w_bias is None:
            r_w_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
            r_r_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
        self.r_r_bias, self.r_w_bias = r_r_bias, r_w_bias
        self.r_net = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n_head, self.d_head))

    def project_positions(self, pos_emb: Tensor) -> Tensor:
        """``k_r (1, R, H, D)``: the relative position rows the op reads, from sinusoids ``(R, d)``."""
        return self._heads(self.r_net(pos_emb))[None]

    def forward(self, h: Tensor, pos_emb: Tensor | None, mems: Tensor | None, masks: PreparedMasks,
                output_attentions: bool = False, memory_kv: tuple[Tensor, Tensor] | None = None,
                k_r: Tensor | None = None, return_kv: bool = False) -> tuple[Tensor, Tensor | None, tuple | None]:
        """h ``(B, L, d)``, pos_emb ``(R, d)`` (R = K + 1), mems ``(B, mlen, d)`` or None. Generation
        passes instead the memory's keys and values ``memory_kv`` ``(B, mlen, H, D)`` (projected when
        those rows were new: the same numbers) and ``k_r`` (``project_positions``, cached per K).
        Returns the new h, the probabilities ``(B, H, L, K)`` when asked, and with ``return_kv`` the keys
        and values ``(B, K, H, D)`` (views: returned only to generation, which keeps them)."""
        L = h.shape[1]
        x = h if mems is None or memory_kv is not None else torch.cat([mems.to(h.dtype), h], dim=1)
        if self.pre_lnorm:  # a per-row norm: the memory's rows as when they were new
            x = self.layer_norm(x)
        q, k, v = (self._heads(t) for t in self.qkv_net(x).chunk(3, dim=-1))
        q = q[:, -L:]
        if memory_kv is not None:
            k, v = torch.cat([memory_kv[0], k], dim=1), torch.cat([memory_kv[1], v], dim=1)
        if k_r is None:
            k_r = self.project_positions(pos_emb)
        kwargs = dict(masks=masks)
        dropout_p = self.config.dropatt if self.training else 0.0
        attn = rel_attention(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **kwargs, dropout_p=dropout_p,
                             backend=self.config.attn_backend)
        probs = attention_probabilities(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **kwargs) \
            if output_attentions else None
        out = self.drop(self.o_net(attn.flatten(-2)))
        return (h + out if self.pre_lnorm else self.layer_norm(h + out)), probs, ((k, v) if return_kv else None)


class PositionwiseFF(nn.Module):
    """``CoreNet``: Linear(d_model, d_inner), ReLU, dropout, Linear(d_inner, d_model), dropout;
    post-norm residual, or pre-norm with ``pre_lnorm``."""

    def __init__(self, config: TransfoXLConfig):
        super().__init__()
        c = config
        self.pre_lnorm = c.pre_lnorm
        self.CoreNet = nn.Sequential(nn.Linear(c.d_model, c.d_inner), nn.ReLU(), nn.Dropout(c.dropout),
                                     nn.Linear(c.d_inner, c.d_model), nn.Dropout(c.dropout))
        self.layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_epsilon)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, config: TransfoXLConfig, r_w_bias=None, r_r_bias=None):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(config, r_w_bias, r_r_bias)
        self.pos_ff = PositionwiseFF(config)

    def forward(self, h, pos_emb, mems, masks: PreparedMasks, output_attentions=False, memory_kv=None, k_r=None,
                return_kv=False):
        h, probs, kv = self.dec_attn(h, pos_emb, mems, masks, output_attentions, memory_kv, k_r, return_kv)
        return self.pos_ff(h), probs, kv


class PositionalEmbedding(nn.Module):
    """Sinusoids of distances: ``(R,)`` float -> ``(R, d)`` = ``[sin(p·f), cos(p·f)]``,
    ``f = 10000^(-2k/d)``; ``inv_freq`` is a buffer, as in 4.x's state dict."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d)))

    def forward(self, pos_seq: Tensor) -> Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype not in (torch.float32, torch.float64):  # a half-precision model: sin/cos of
            d = 2 * inv_freq.shape[0]                              # distances in the thousands need fp32
            inv_freq = 1 / (10000 ** (torch.arange(0.0, d, 2.0, device=inv_freq.device) / d))
        sinusoid = torch.outer(pos_seq.to(inv_freq.dtype), inv_freq)
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class TransfoXLModelOutput(ModelOutput):
    last_hidden_state: Tensor | None = None  # (B, L, d_model)
    mems: list[Tensor] | None = None  # per layer (mem_len, B, d_model)
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class TransfoXLLMHeadModelOutput(ModelOutput):
    losses: Tensor | None = None  # (B, L - 1): -log p(labels[:, t + 1] | ... t); 0 where the label is -100
    prediction_scores: Tensor | None = None  # (B, L, vocab) log-probabilities (without labels)
    mems: list[Tensor] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    loss: Tensor | None = None  # () the mean of losses over the labelled targets

    @property
    def logits(self) -> Tensor | None:
        return self.prediction_scores


# --------------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------------


class TransfoXLPreTrainedModel(PreTrainedModel):
    """Transformer-XL's weight init (transformers 4.x's) and its directory format."""

    config_class = TransfoXLConfig

    def _init_weight(self, weight: Tensor) -> None:
        c = self.config
        if c.init == "uniform":
            nn.init.uniform_(weight, -c.init_range, c.init_range)
        else:
            nn.init.normal_(weight, 0.0, c.init_std)

    def _init_weights(self, module: nn.Module) -> None:
        c = self.config
        if isinstance(module, nn.Linear):
            self._init_weight(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax)):
            projs = module.emb_projs if isinstance(module, AdaptiveEmbedding) else module.out_projs
            for proj in projs:
                if proj is not None:
                    nn.init.normal_(proj, 0.0, c.proj_init_std)
            if getattr(module, "n_clusters", 0):
                self._init_weight(module.cluster_weight)
                nn.init.zeros_(module.cluster_bias)
        elif isinstance(module, nn.Embedding):
            self._init_weight(module.weight)
        elif isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, 1.0, c.init_std)
            nn.init.zeros_(module.bias)
        elif isinstance(getattr(module, "r_w_bias", None), nn.Parameter) and "r_w_bias" in module._parameters:
            self._init_weight(module.r_w_bias)
            self._init_weight(module.r_r_bias)


class TransfoXLModel(TransfoXLPreTrainedModel):
    base_model_prefix = "transformer"

    def __init__(self, config: TransfoXLConfig):
        super().__init__(config)
        c = config
        self.word_emb = AdaptiveEmbedding(c.vocab_size, c.d_embed, c.d_model, c.cutoffs, div_val=c.div_val)
        self.drop = nn.Dropout(c.dropout)
        shared = (None, None)
        if not c.untie_r:  # one pair of biases for every layer
            self.r_w_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
            self.r_r_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
            shared = (self.r_w_bias, self.r_r_bias)
        self.layers = nn.ModuleList([RelPartialLearnableDecoderLayer(c, *shared) for _ in range(c.n_layer)])
        self.pos_emb = PositionalEmbedding(c.d_model)
        self.post_init()

    def get_input_embeddings(self) -> AdaptiveEmbedding:
        return self.word_emb

    def set_input_embeddings(self, emb: AdaptiveEmbedding) -> None:
        self.word_emb = emb

    def init_mems(self, bsz: int, length: int | None = None, start: str | None = None) -> list[Tensor] | None:
        """The memory a forward starts from when given none: per layer ``(length, bsz, d_model)``
        zeros. ``start`` (default ``config.mem_start``): ``"zeros"``, transformers 4.x's ``mem_len``
        rows of zeros; ``"empty"``, the original code's start, no row. ``length`` gives the number
        of zero rows instead (0: empty). None when ``mem_len`` is 0 and no row is asked for.
        ``forward``, ``generate`` and the evaluations start from ``init_mems(B)`` when given no ``mems``."""
        c = self.config
        if length is None:
            start = c.mem_start if start is None else start
            if start not in MEM_STARTS:
                raise ValueError(f"start must be one of {MEM_STARTS}, got {start!r}")
            length = c.mem_len if start == "zeros" else 0
        elif start is not None:
            raise ValueError("init_mems takes length= or start=, not both")
        if length == 0 and c.mem_len == 0:
            return None
        p = self.word_emb.emb_layers[0].weight
        return [p.new_zeros(length, bsz, c.d_model) for _ in range(c.n_layer)]

    def _update_mems(self, hids: list[Tensor], mems: list[Tensor] | None) -> list[Tensor] | None:
        """The last ``mem_len`` rows of each layer's ``[mems, input]``, seq-first and detached."""
        if mems is None:
            return None
        keep = self.config.mem_len
        with torch.no_grad():
            out = []
            for m, h in zip(mems, hids):
                cat = torch.cat([m.to(h.dtype), h.transpose(0, 1)], dim=0)
                out.append(cat[max(0, cat.shape[0] - keep):].detach())
        return out

    def _positions(self, klen: int, device) -> Tensor:
        """Sinusoids ``(K + 1, d_model)`` of the distances ``K, K-1, ..., 0``, clamped at ``clamp_len``."""
        pos_seq = torch.arange(klen, -1, -1.0, device=device)
        if self.config.clamp_len > 0:
            pos_seq = pos_seq.clamp(max=self.config.clamp_len)
        return self.pos_emb(pos_seq)

    def _masks(self, batch: int, qlen: int, mlen: int, device) -> PreparedMasks:
        """Causal masks; with ``same_length`` each query sees its last ``mem_len`` keys (4.x's and the
        original's mask once more than ``mem_len`` keys exist)."""
        c = self.config
        span = c.mem_len if c.same_length and mlen + qlen > c.mem_len else None
        return causal_masks(batch, qlen, mlen, device, span=span, backend=c.attn_backend)

    def forward(
        self,
        input_ids: Tensor | None = None,
        mems: list[Tensor] | tuple[Tensor, ...] | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> TransfoXLModelOutput | tuple:
        """input_ids ``(B, L)`` in ``[0, vocab_size)`` or inputs_embeds ``(B, L, d_model)``; mems: per layer
        ``(mlen, B, d_model)`` (None: ``init_mems(B)``, the start ``config.mem_start`` names; by default
        4.x's zero memory of ``mem_len`` rows).
        Returns ``last_hidden_state (B, L, d_model)`` and the new ``mems``."""
        c = self.config
        if head_mask is not None:
            raise ValueError("head_mask is not supported by xlnet_fast's Transformer-XL (the attention op has no "
                             "per-head mask): pass head_mask=None")
        B, L = _check_tokens(c, self.word_emb.emb_layers[0].weight, input_ids, inputs_embeds)
        mems = _layer_mems(mems)
        _check_mems(c, mems, B)
        if mems is None:
            mems = self.init_mems(B)
        output_attentions = c.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = c.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = c.return_dict if return_dict is None else return_dict

        h = self.word_emb(input_ids) if input_ids is not None else inputs_embeds
        mlen = mems[0].shape[0] if mems is not None else 0
        masks = self._masks(B, L, mlen, h.device)
        pos_emb = self.drop(self._positions(mlen + L, h.device).to(h.dtype))
        h = self.drop(h)
        hids, attentions = [], []
        for i, layer in enumerate(self.layers):
            hids.append(h)
            layer_mems = mems[i].transpose(0, 1) if mems is not None else None
            h, probs, _ = layer(h, pos_emb, layer_mems, masks, output_attentions)
            attentions.append(probs)
        h = self.drop(h)
        out = TransfoXLModelOutput(last_hidden_state=h, mems=self._update_mems(hids, mems),
                                   hidden_states=tuple(hids + [h]) if output_hidden_states else None,
                                   attentions=tuple(attentions) if output_attentions else None)
        return out if return_dict else out.to_tuple()

    @torch.no_grad()
    def generation_step(self, input_ids: Tensor, cache: TransfoXLCache) -> Tensor:
        """``input_ids (B, L)`` after the memory ``cache`` holds; returns the last hidden states
        ``(B, L, d_model)`` and updates the cache. Equal to ``forward`` with the same memory, but the
        memory's keys and values and the relative positions are not projected again."""
        c = self.config
        B, L = input_ids.shape
        mlen = cache.mlen
        masks = self._masks(B, L, mlen, input_ids.device)
        h = self.drop(self.word_emb(input_ids))
        klen = mlen + L
        if cache.k_r is None or cache.k_r[0].shape[1] < klen + 1:
            # rows by distance, K down to 0: a longer table's last K + 1 rows serve every shorter K
            pos_emb = self._positions(max(klen, c.mem_len + 1), h.device).to(h.dtype)
            cache.k_r = [layer.dec_attn.project_positions(pos_emb) for layer in self.layers]
        kvs = []
        for i, layer in enumerate(self.layers):
            mems = cache.mems[i].transpose(0, 1) if cache.kv is None and cache.mems is not None else None
            memory_kv = cache.kv[i] if cache.kv is not None else None
            k_r = cache.k_r[i][:, -(klen + 1):]
            h, _, (k, v) = layer(h, None, mems, masks, memory_kv=memory_kv, k_r=k_r, return_kv=True)
            keep = max(0, k.shape[1] - c.mem_len)
            kvs.append((k[:, keep:], v[:, keep:]))
        cache.kv, cache.mems = kvs, None
        return self.drop(h)


def _check_labels(labels, B: int, L: int, vocab_size: int, device) -> None:
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != (B, L):
        raise ValueError(f"labels must have the shape of input_ids ({B}, {L}), got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but the model is on {device}")
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if labels.numel():  # a check of values (check_values: no host sync on a GPU)
        first_bad = labels.flatten()[bad.flatten().int().argmax()]  # a bad label where there is one
        check_values(~bad.any(), f"labels must be in [0, vocab_size={vocab_size}) or -100 (ignored), got {{}}",
                     first_bad)


class TransfoXLLMHeadModel(TransfoXLPreTrainedModel):
    """Transformer-XL with the adaptive softmax ``crit`` (weights and projections tied to the adaptive
    input as ``tie_word_embeddings`` and ``tie_projs`` say)."""

    def __init__(self, config: TransfoXLConfig):
        super().__init__(config)
        c = config
        self.transformer = TransfoXLModel(config)
        self.crit = ProjectedAdaptiveLogSoftmax(c.vocab_size, c.d_embed, c.d_model, c.cutoffs, div_val=c.div_val)
        self.post_init()

    def _tied_pairs(self) -> dict[str, str]:
        """``{crit weight: input embedding weight}`` that tie_weights ties."""
        c = self.config
        pairs = {}
        if c.tie_word_embeddings:
            pairs.update({f"crit.out_layers.{i}.weight": f"transformer.word_emb.emb_layers.{i}.weight"
                          for i in range(len(self.crit.out_layers))})
        for i, tie in enumerate(c.tie_projs):
            if tie and c.div_val == 1 and c.d_model != c.d_embed:
                pairs[f"crit.out_projs.{i}"] = "transformer.word_emb.emb_projs.0"
            elif tie and c.div_val != 1:
                pairs[f"crit.out_projs.{i}"] = f"transformer.word_emb.emb_projs.{i}"
        return pairs

    @property
    def _tied_weights_keys(self) -> dict[str, str]:
        # (the shared r_w_bias / r_r_bias are saved under every layer's name too, as 4.x's files hold them)
        return self._tied_pairs()

    def tie_weights(self) -> None:
        if not hasattr(self, "crit"):  # the backbone's post_init runs first
            return
        emb = self.transformer.word_emb
        for name, source in self._tied_pairs().items():
            i = int(name.split(".")[2])
            if name.startswith("crit.out_layers"):
                self.crit.out_layers[i].weight = emb.emb_layers[i].weight
            else:
                self.crit.out_projs[i] = emb.emb_projs[int(source.rsplit(".", 1)[1])]

    def get_output_embeddings(self) -> nn.Linear:
        return self.crit.out_layers[-1]

    def init_mems(self, bsz: int, length: int | None = None, start: str | None = None) -> list[Tensor] | None:
        return self.transformer.init_mems(bsz, length, start)

    def reset_memory_length(self, mem_len: int) -> None:
        """Keep ``mem_len`` rows of memory from now on (4.x's method)."""
        if not isinstance(mem_len, int) or isinstance(mem_len, bool) or mem_len < 0:
            raise ValueError(f"mem_len must be an integer >= 0, got {mem_len!r}")
        if mem_len == 0 and self.config.same_length:
            raise ValueError("mem_len=0 with same_length=True: every token would attend to no key")
        self.config.mem_len = mem_len

    def forward(
        self,
        input_ids: Tensor | None = None,
        mems: list[Tensor] | tuple[Tensor, ...] | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
    ) -> TransfoXLLMHeadModelOutput | tuple:
        """4.x's forward. Without labels: ``prediction_scores (B, L, vocab)`` log-probabilities (only
        the last ``logits_to_keep`` positions when it is > 0). With labels ``(B, L)`` (-100: ignored),
        shifted inside as in 4.x: ``losses (B, L-1)`` in token order, ``loss`` their mean over the
        labelled targets; no ``prediction_scores`` (only each target's cluster is scored)."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, mems=mems, head_mask=head_mask, inputs_embeds=inputs_embeds,
                               output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                               return_dict=True)
        hidden = out.last_hidden_state
        B, L, d = hidden.shape
        losses = loss = scores = None
        if labels is not None:
            _check_labels(labels, B, L, self.config.vocab_size, hidden.device)
            target = labels[:, 1:].reshape(-1)
            losses = self.crit.nll(hidden[:, :-1].reshape(-1, d), target).view(B, L - 1)
            loss = losses.sum() / (target != IGNORE_INDEX).sum().clamp(min=1)
        else:
            if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
                raise ValueError(f"logits_to_keep must be an integer >= 0, got {logits_to_keep!r}")
            kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
            scores = self.crit.log_probs(kept.reshape(-1, d)).view(B, kept.shape[1], -1)
        result = TransfoXLLMHeadModelOutput(losses=losses, prediction_scores=scores, mems=out.mems,
                                            hidden_states=out.hidden_states, attentions=out.attentions, loss=loss)
        if return_dict:
            return result
        # 4.x's tuple: (losses,) (prediction_scores or ()), mems, hidden states, attentions, (loss)
        rest = tuple(x for x in (out.mems, out.hidden_states, out.attentions) if x is not None)
        head = (scores if scores is not None else (),) + rest
        return (losses,) + head + (loss,) if losses is not None else head

    def generate(self, input_ids: Tensor, max_new_tokens: int = 20, **kwargs: Any) -> Tensor:
        """Sample or decode greedily with memory: see ``xlnet_fast.generation.generate_transfo_xl``."""
        return generate_transfo_xl(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)


def is_transfo_xl_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory/config.json`` describes a Transformer-XL."""
    import json

    try:
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f).get("model_type") == TransfoXLConfig.model_type
    except (OSError, ValueError, AttributeError):
        return False
