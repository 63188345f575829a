"""Build twin models: a transformers XLNet and ours with the same weights."""

import torch
import transformers

import xlnet_fast
from xlnet_fast.config import XLNetConfig

SMALL = dict(vocab_size=50, d_model=32, n_layer=2, n_head=4, d_inner=48, dropout=0.0,
             summary_last_dropout=0.0, mem_len=6)


def twins(class_name: str, seed: int = 0, **overrides):
    """(hf_model, our_model) in eval mode with identical weights, eager attention backend."""
    kw = {**SMALL, **overrides}
    torch.manual_seed(seed)
    hf = getattr(transformers, class_name)(transformers.XLNetConfig(**kw)).eval()
    ours = getattr(xlnet_fast, class_name)(XLNetConfig(**kw, attn_backend="eager")).eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
