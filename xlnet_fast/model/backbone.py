"""The XLNet backbone (transformers' ``XLNetModel``): embeddings, relative positions, the layers, mems.

Activations are batch-first ``(B, L, d_model)`` inside; mems are seq-first ``(mlen, B, d_model)`` at
the boundary, like transformers, so they are interchangeable. One forward: ``prepare_inputs`` checks
the arguments, ``masks.build_attention_inputs`` builds the masks once, each layer calls the op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..config import XLNetConfig
from ..masks import AttentionInputs, MaskSpec, build_attention_inputs
from .inputs import BackboneInputs, prepare_inputs
from .layers import XLNetLayer, product_dtype
from .outputs import XLNetModelOutput
from .pretrained import XLNetPreTrainedModel


def _record(outputs: list | None, *items) -> None:
    """Append the items that are not None to ``outputs``, unless it is None (output not asked for)."""
    if outputs is not None:
        outputs.extend(item for item in items if item is not None)


class XLNetModel(XLNetPreTrainedModel):
    base_model_prefix = "transformer"
    #: A query-stream row that sees no key outputs zeros (DESIGN.md §2) unless this is True: then it
    #: averages every key uniformly, as transformers' XLNet does (``patch_transformers`` sets it).
    average_blocked_rows = False

    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.word_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.mask_emb = nn.Parameter(torch.empty(1, 1, config.d_model))
        self.layer = nn.ModuleList([XLNetLayer(config) for _ in range(config.n_layer)])
        self.dropout = nn.Dropout(config.dropout)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embedding

    def set_input_embeddings(self, emb: nn.Embedding) -> None:
        self.word_embedding = emb

    def relative_positional_encoding(self, qlen: int, klen: int, device) -> Tensor:
        """Sinusoids ``(Br0, R, d_model)``; ``Br0 = 2`` with bi_data (forward, then negated positions)."""
        c = self.config
        freq_seq = torch.arange(0, c.d_model, 2, device=device).float()
        inv_freq = 1 / torch.pow(10000, freq_seq / c.d_model)
        end = -qlen if c.attn_type == "bi" else -1
        fwd = torch.arange(klen, end, -1, device=device).float()
        seqs = torch.stack([fwd, -fwd]) if c.bi_data else fwd[None]
        if c.clamp_len > 0:
            seqs = seqs.clamp(-c.clamp_len, c.clamp_len)
        sinusoid = seqs[..., None] * inv_freq
        return torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], dim=-1)

    def _cache_mem(self, h: Tensor, prev: Tensor | None) -> Tensor:
        """New seq-first mem ``(mlen', B, d)`` from this layer's input ``h (B, L, d)``."""
        c = self.config
        cur = h.transpose(0, 1)
        if c.reuse_len is not None and c.reuse_len > 0:
            cur = cur[: c.reuse_len]
        new = cur if prev is None else torch.cat([prev, cur], dim=0)
        if c.mem_len is not None and c.mem_len > 0:
            new = new[-c.mem_len:]
        return new.detach().contiguous()

    prepare_inputs = prepare_inputs

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        mems: list[Tensor] | tuple[Tensor, ...] | Tensor | None = None,
        perm_mask: Tensor | None = None,
        target_mapping: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        input_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        use_mems: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        q_rank: Tensor | None = None,
        k_rank: Tensor | None = None,
        target_pos: Tensor | None = None,
        **kwargs: Any,
    ) -> XLNetModelOutput | tuple:
        """HF's ``XLNetModel.forward`` plus compact masks: ``q_rank``/``k_rank`` ``(B, L)`` int
        permutation ranks (see ``xlnet_fast.masks.local_perm``) and ``target_pos (B, P)`` int positions
        of the query-stream rows (negative = padding row), used instead of ``perm_mask`` /
        ``target_mapping``. ``mems`` may also be one stacked tensor; ``head_mask``, ``position_ids``,
        ``logits_to_keep``, ``use_cache`` and ``num_items_in_batch`` are accepted and ignored, as
        transformers' XLNetModel does."""
        prepared = self.prepare_inputs(
            input_ids=input_ids, attention_mask=attention_mask, mems=mems, perm_mask=perm_mask,
            target_mapping=target_mapping, token_type_ids=token_type_ids, input_mask=input_mask,
            inputs_embeds=inputs_embeds, use_mems=use_mems, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict, q_rank=q_rank, k_rank=k_rank,
            target_pos=target_pos, **kwargs)
        return self.forward_prepared(prepared)

    def forward_prepared(self, a: BackboneInputs) -> XLNetModelOutput | tuple:
        """The forward pass over the inputs ``prepare_inputs`` returned."""
        h = self.word_embedding(a.input_ids) if a.input_ids is not None else a.inputs_embeds
        device = h.device
        attention = build_attention_inputs(MaskSpec(
            batch=a.batch, seq_len=a.seq_len, mlen=a.mlen, attn_type=self.config.attn_type,
            same_length=self.config.same_length, bi_data=self.config.bi_data, padding=a.padding,
            perm_mask=a.perm_mask, target_mapping=a.target_mapping, token_type_ids=a.token_type_ids,
            q_rank=a.q_rank, k_rank=a.k_rank, target_pos=a.target_pos,
            separate_query_launch=a.output_attentions, average_blocked_rows=self.average_blocked_rows,
            backend=self.config.attn_backend), device)
        h = self.dropout(h)
        g = None
        if attention.has_query_stream:
            g = self.dropout(self.mask_emb.expand(a.batch, attention.target_rows, -1))
        pos_emb = self.dropout(self.relative_positional_encoding(a.seq_len, a.mlen + a.seq_len, device))
        if len(self.layer):  # in the dtype every layer's k_r product takes it in: one cast, not one per layer
            pos_emb = pos_emb.to(product_dtype(self.layer[0].rel_attn.r))
        out = self._run_layers(h, g, pos_emb, attention, a)
        return out if a.return_dict else out.to_tuple()

    def _run_layers(self, h: Tensor, g: Tensor | None, pos_emb: Tensor, attention: AttentionInputs,
                    a: BackboneInputs) -> XLNetModelOutput:
        new_mems: tuple = ()
        hidden_states: list | None = [] if a.output_hidden_states else None
        attentions: list | None = [] if a.output_attentions else None
        for i, layer in enumerate(self.layer):
            layer_mems = a.mems[i] if a.mems is not None else None
            if a.use_mems:
                new_mems += (self._cache_mem(h, layer_mems),)
            _record(hidden_states, h, g)
            h, g, probs = layer(h, g, pos_emb,
                                layer_mems.transpose(0, 1) if layer_mems is not None else None,
                                attention, a.output_attentions)
            _record(attentions, probs)
        _record(hidden_states, h, g)
        return XLNetModelOutput(
            last_hidden_state=self.dropout(g if g is not None else h),
            mems=new_mems if a.use_mems else None,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
        )
