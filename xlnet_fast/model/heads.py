"""The task heads on the backbone, with transformers' names and outputs: LM, sequence and token
classification, multiple choice, and the two question-answering heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import XLNetConfig
from .backbone import XLNetModel
from .layers import activation
from .outputs import (XLNetForMultipleChoiceOutput, XLNetForQuestionAnsweringOutput,
                      XLNetForQuestionAnsweringSimpleOutput, XLNetForSequenceClassificationOutput,
                      XLNetForTokenClassificationOutput, XLNetLMHeadModelOutput, XLNetModelOutput)
from .pretrained import XLNetPreTrainedModel


def _wrap(output_cls, return_dict: bool, backbone_out: XLNetModelOutput, **head):
    out = output_cls(**head, mems=backbone_out.mems, hidden_states=backbone_out.hidden_states,
                     attentions=backbone_out.attentions)
    return out if return_dict else out.to_tuple()


def _keep_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """The rows of ``hidden (B, L, d)`` that ``logits_to_keep`` selects (see ``XLNetLMHeadModel``)."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, Tensor)):
        raise TypeError(f"logits_to_keep must be an int or a tensor, got {type(logits_to_keep).__name__}")
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return _keep_tensor_positions(hidden, logits_to_keep.to(hidden.device))


def _keep_tensor_positions(hidden: Tensor, keep: Tensor) -> Tensor:
    integer = not keep.is_floating_point() and not keep.is_complex() and keep.dtype != torch.bool
    if keep.dim() == 1 and integer:
        return hidden[:, keep]
    if keep.dim() == 2 and keep.dtype == torch.bool and keep.shape == hidden.shape[:2]:
        return hidden[keep]
    if keep.dim() == 2 and integer and keep.shape[0] == hidden.shape[0]:
        return torch.take_along_dim(hidden, keep[..., None].long(), dim=1)
    raise ValueError(f"logits_to_keep must be an int, a 1-D integer tensor, a (batch, n) integer tensor or a "
                     f"(batch, seq_len) bool tensor; got {keep.dtype} of shape {tuple(keep.shape)}")


class XLNetLMHeadModel(XLNetPreTrainedModel):
    _tied_weights_keys = {"lm_loss.weight": "transformer.word_embedding.weight"}

    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.transformer = XLNetModel(config)
        self.lm_loss = nn.Linear(config.d_model, config.vocab_size, bias=True)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_loss.weight = self.transformer.word_embedding.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_loss

    def forward(self, input_ids: Tensor | None = None, labels: Tensor | None = None,
                return_dict: bool | None = None, logits_to_keep: int | Tensor = 0, **kwargs: Any):
        """HF's forward; ``logits`` are ``(B, P, vocab)`` over the query stream when it runs.
        ``logits_to_keep`` projects only some positions, as in transformers: an int keeps the last
        that many (0: all), a 1-D tensor these positions, a ``(B, n)`` int tensor per-row positions, a
        ``(B, L)`` bool tensor the True positions (flattened)."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.lm_loss(_keep_positions(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return _wrap(XLNetLMHeadModelOutput, return_dict, out, loss=loss, logits=logits)

    def generate(self, input_ids: Tensor, max_new_tokens: int = 20, **kwargs: Any) -> Tensor:
        """Greedy or sampled continuation with memory, as transformers' XLNet ``generate`` (same greedy
        tokens): see ``xlnet_fast.generation.generate_xlnet``."""
        from ..generation import generate_xlnet

        return generate_xlnet(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)


class XLNetSequenceSummary(nn.Module):
    """HF's sequence summary: pick a token (last/first/mean/cls_index), project, activate."""

    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.summary_type = config.summary_type
        if self.summary_type == "attn":
            raise NotImplementedError("summary_type='attn' is not implemented (nor in transformers)")
        self.summary = nn.Identity()
        if config.summary_use_proj:
            proj_to_labels = getattr(config, "summary_proj_to_labels", False)
            n = config.num_labels if proj_to_labels and config.num_labels > 0 else config.d_model
            self.summary = nn.Linear(config.d_model, n)
        act = config.summary_activation
        self.activation = activation(act) if act else nn.Identity()
        first = getattr(config, "summary_first_dropout", 0.0) or 0.0
        self.first_dropout = nn.Dropout(first) if first > 0 else nn.Identity()
        last = config.summary_last_dropout or 0.0
        self.last_dropout = nn.Dropout(last) if last > 0 else nn.Identity()

    def forward(self, hidden: Tensor, cls_index: Tensor | None = None) -> Tensor:
        if self.summary_type == "last":
            out = hidden[:, -1]
        elif self.summary_type == "first":
            out = hidden[:, 0]
        elif self.summary_type == "mean":
            out = hidden.mean(dim=1)
        elif self.summary_type == "cls_index":
            if cls_index is None:
                idx = torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
            else:
                idx = cls_index
            out = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx.long()]
        else:
            raise ValueError(f"unknown summary_type {self.summary_type!r}")
        return self.last_dropout(self.activation(self.summary(self.first_dropout(out))))


def _classification_loss(config: XLNetConfig, logits: Tensor, labels: Tensor) -> Tensor:
    n = config.num_labels
    if config.problem_type is None:
        if n == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze()) if n == 1 else F.mse_loss(logits, labels)
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


class XLNetForSequenceClassification(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.sequence_summary = XLNetSequenceSummary(config)
        self.logits_proj = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, labels=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.logits_proj(self.sequence_summary(out.last_hidden_state))
        loss = _classification_loss(self.config, logits, labels) if labels is not None else None
        return _wrap(XLNetForSequenceClassificationOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForTokenClassification(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, labels=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.classifier(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return _wrap(XLNetForTokenClassificationOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForMultipleChoice(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.transformer = XLNetModel(config)
        self.sequence_summary = XLNetSequenceSummary(config)
        self.logits_proj = nn.Linear(config.d_model, 1)
        self.post_init()

    def forward(self, input_ids=None, token_type_ids=None, input_mask=None, attention_mask=None,
                inputs_embeds=None, labels=None, return_dict=None, **kwargs):
        """Inputs are ``(B, num_choices, L)``; logits ``(B, num_choices)``."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        ref = input_ids if input_ids is not None else inputs_embeds
        num_choices = ref.shape[1]

        def flat(t, keep):
            return None if t is None else t.reshape((-1,) + tuple(t.shape[-keep:]))

        out = self.transformer(flat(input_ids, 1), token_type_ids=flat(token_type_ids, 1),
                               input_mask=flat(input_mask, 1), attention_mask=flat(attention_mask, 1),
                               inputs_embeds=flat(inputs_embeds, 2), return_dict=True, **kwargs)
        logits = self.logits_proj(self.sequence_summary(out.last_hidden_state)).view(-1, num_choices)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return _wrap(XLNetForMultipleChoiceOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForQuestionAnsweringSimple(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.qa_outputs = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, start_positions=None, end_positions=None, return_dict=None,
                **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()
        end_logits = end_logits.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            sp = start_positions.reshape(-1).clamp(0, ignored)
            ep = end_positions.reshape(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits, sp, ignore_index=ignored)
                    + F.cross_entropy(end_logits, ep, ignore_index=ignored)) / 2
        return _wrap(XLNetForQuestionAnsweringSimpleOutput, return_dict, out, loss=loss,
                     start_logits=start_logits, end_logits=end_logits)


def _mask_logits(x: Tensor, p_mask: Tensor | None) -> Tensor:
    if p_mask is None:
        return x
    big = 65500 if p_mask.dtype == torch.float16 else 1e30
    return x * (1 - p_mask) - big * p_mask


class XLNetPoolerStartLogits(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense = nn.Linear(config.d_model, 1)

    def forward(self, hidden: Tensor, p_mask: Tensor | None = None) -> Tensor:
        return _mask_logits(self.dense(hidden).squeeze(-1), p_mask)


def _gather_start(hidden: Tensor, start_positions: Tensor) -> Tensor:
    """(B, L, d), (B,) -> (B, 1, d)."""
    idx = start_positions[:, None, None].expand(-1, -1, hidden.shape[-1])
    return hidden.gather(-2, idx)


class XLNetPoolerEndLogits(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense_0 = nn.Linear(config.d_model * 2, config.d_model)
        self.activation = nn.Tanh()
        self.LayerNorm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dense_1 = nn.Linear(config.d_model, 1)

    def forward(self, hidden, start_states=None, start_positions=None, p_mask=None) -> Tensor:
        if start_positions is not None:
            start_states = _gather_start(hidden, start_positions).expand(-1, hidden.shape[-2], -1)
        elif start_states is None:
            raise ValueError("pass start_states or start_positions")
        x = self.dense_1(self.LayerNorm(self.activation(self.dense_0(torch.cat([hidden, start_states], -1)))))
        return _mask_logits(x.squeeze(-1), p_mask)


class XLNetPoolerAnswerClass(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense_0 = nn.Linear(config.d_model * 2, config.d_model)
        self.activation = nn.Tanh()
        self.dense_1 = nn.Linear(config.d_model, 1, bias=False)

    def forward(self, hidden, start_states=None, start_positions=None, cls_index=None) -> Tensor:
        if start_positions is not None:
            start_states = _gather_start(hidden, start_positions).squeeze(-2)
        elif start_states is None:
            raise ValueError("pass start_states or start_positions")
        if cls_index is not None:
            cls_state = _gather_start(hidden, cls_index).squeeze(-2)
        else:
            cls_state = hidden[:, -1, :]
        x = self.activation(self.dense_0(torch.cat([start_states, cls_state], dim=-1)))
        return self.dense_1(x).squeeze(-1)


class XLNetForQuestionAnswering(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.start_n_top = config.start_n_top
        self.end_n_top = config.end_n_top
        self.transformer = XLNetModel(config)
        self.start_logits = XLNetPoolerStartLogits(config)
        self.end_logits = XLNetPoolerEndLogits(config)
        self.answer_class = XLNetPoolerAnswerClass(config)
        self.post_init()

    def forward(self, input_ids=None, start_positions=None, end_positions=None, is_impossible=None,
                cls_index=None, p_mask=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        hidden = out.last_hidden_state
        start_logits = self.start_logits(hidden, p_mask=p_mask)
        if start_positions is not None and end_positions is not None:
            squeeze = [None if x is None else (x.squeeze(-1) if x.dim() > 1 else x)
                       for x in (start_positions, end_positions, cls_index, is_impossible)]
            start_positions, end_positions, cls_index, is_impossible = squeeze
            end_logits = self.end_logits(hidden, start_positions=start_positions, p_mask=p_mask)
            loss = (F.cross_entropy(start_logits, start_positions)
                    + F.cross_entropy(end_logits, end_positions)) / 2
            if cls_index is not None and is_impossible is not None:
                cls_logits = self.answer_class(hidden, start_positions=start_positions, cls_index=cls_index)
                loss = loss + 0.5 * F.binary_cross_entropy_with_logits(cls_logits, is_impossible)
            return _wrap(XLNetForQuestionAnsweringOutput, return_dict, out, loss=loss)

        B, L, d = hidden.shape
        start_probs = F.softmax(start_logits, dim=-1)
        start_top_probs, start_top_index = torch.topk(start_probs, self.start_n_top, dim=-1)
        start_states = hidden.gather(-2, start_top_index[..., None].expand(-1, -1, d))
        start_states = start_states[:, None].expand(-1, L, -1, -1)
        hidden_exp = hidden[:, :, None].expand_as(start_states)
        pm = p_mask[..., None] if p_mask is not None else None
        end_logits = self.end_logits(hidden_exp, start_states=start_states, p_mask=pm)
        end_probs = F.softmax(end_logits, dim=1)
        end_top_probs, end_top_index = torch.topk(end_probs, self.end_n_top, dim=1)
        end_top_probs = end_top_probs.reshape(-1, self.start_n_top * self.end_n_top)
        end_top_index = end_top_index.reshape(-1, self.start_n_top * self.end_n_top)
        weighted_start = torch.einsum("blh,bl->bh", hidden, start_probs)
        cls_logits = self.answer_class(hidden, start_states=weighted_start, cls_index=cls_index)
        return _wrap(XLNetForQuestionAnsweringOutput, return_dict, out,
                     start_top_log_probs=start_top_probs, start_top_index=start_top_index,
                     end_top_log_probs=end_top_probs, end_top_index=end_top_index,
                     cls_logits=cls_logits)


MODEL_CLASSES = {
    "XLNetModel": XLNetModel,
    "XLNetLMHeadModel": XLNetLMHeadModel,
    "XLNetForSequenceClassification": XLNetForSequenceClassification,
    "XLNetForTokenClassification": XLNetForTokenClassification,
    "XLNetForMultipleChoice": XLNetForMultipleChoice,
    "XLNetForQuestionAnsweringSimple": XLNetForQuestionAnsweringSimple,
    "XLNetForQuestionAnswering": XLNetForQuestionAnswering,
}
