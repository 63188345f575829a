"""Model outputs: dataclasses that also index and unpack like transformers' ``ModelOutput``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor


class ModelOutput:
    """Dataclass output that also indexes like HF's: ``out[0]`` is the first field that is not None."""

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def keys(self):
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


@dataclass
class XLNetModelOutput(ModelOutput):
    last_hidden_state: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


@dataclass
class XLNetLMHeadModelOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


XLNetForSequenceClassificationOutput = XLNetLMHeadModelOutput
XLNetForTokenClassificationOutput = XLNetLMHeadModelOutput
XLNetForMultipleChoiceOutput = XLNetLMHeadModelOutput


@dataclass
class XLNetForQuestionAnsweringSimpleOutput(ModelOutput):
    loss: Tensor | None = None
    start_logits: Tensor | None = None
    end_logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


@dataclass
class XLNetForQuestionAnsweringOutput(ModelOutput):
    loss: Tensor | None = None
    start_top_log_probs: Tensor | None = None
    start_top_index: Tensor | None = None
    end_top_log_probs: Tensor | None = None
    end_top_index: Tensor | None = None
    cls_logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None
