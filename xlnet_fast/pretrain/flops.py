"""The FLOP model of a pretraining step, the devices' peaks, and the throughput meter (tokens/s, MFU).

Model FLOPs of one forward pass (a multiply-add is 2 FLOPs) for one record, in the steady state
where every layer attends to ``M = mem_len`` memory rows besides the ``L = seq_len`` tokens:

    K = M + L keys, P = num_predict query-stream (target) rows, A = n_head * d_head, d = d_model,
    F = d_inner, V = vocab_size, N = n_layer

    per layer, content stream:  q and o projections 2*L*d*A each, k and v 2*K*d*A each,
                                attention 6*L*K*A (q.k, q.k_r after the relative shift, p.v),
                                feed-forward 4*L*d*F
    per layer, query stream:    q and o projections 2*P*d*A each, attention 6*P*K*A,
                                feed-forward 4*P*d*F (k, v and k_r are the content stream's)
    LM head (targets only):     2*P*d*V

    forward(record) = N * (2*d*A*(2L + 2K + 2P) + 6*A*K*(L + P) + 4*d*F*(L + P)) + 2*P*d*V

plus, once per batch, the projection of the ``R = K + L`` relative positions per layer,
``N * 2 * Br * R * d * A`` (``Br = 2`` with ``bi_data``: forward and backward positions, else 1).
A training step is 3 x the forward (the backward pass costs twice the forward), times the rows,
``grad_accum`` and the ranks. Attention is counted dense (the permutation masks hide about half of
the keys but the kernels still visit them); terms linear in the tokens and d (biases, layer norms,
softmax, GELU, the segment term, embeddings) are left out (< 1% at the presets' sizes); activation
checkpointing's recomputation is not counted (model FLOPs, not hardware FLOPs).

MFU = model FLOPs per second / (ranks x the device's dense bf16 peak).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PEAK_TFLOPS_ENV = "XLNET_FAST_PEAK_TFLOPS"

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's data sheets, matched against
# torch.cuda.get_device_name() in this order (the first match wins).
DEVICE_PEAK_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"GH200", "GH200", 989.4),
    (r"H200 NVL", "H200 NVL", 835.5),
    (r"H200", "H200 SXM", 989.4),
    (r"H100 NVL", "H100 NVL", 835.5),
    (r"H100.*PCIe", "H100 PCIe", 756.5),
    (r"H100", "H100 SXM", 989.4),
    (r"B200", "B200", 2250.0),
    (r"A100", "A100", 312.0),
    (r"L40S", "L40S", 362.05),
    (r"\bL40\b", "L40", 181.05),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
)


@dataclass(frozen=True)
class StepShape:
    """What one training step computes: the model's sizes and the record layout."""

    d_model: int
    n_layer: int
    n_head: int
    d_head: int
    d_inner: int
    vocab_size: int
    seq_len: int
    mem_len: int
    num_predict: int
    rows: int  # records per forward pass (one rank's micro-batch)
    bi_data: bool = False


def forward_flops_per_record(s: StepShape) -> int:
    """Forward FLOPs of one record (both streams and the LM head), excluding the per-batch
    relative-position projection; see the module docstring."""
    d, A, F, L, K, P = s.d_model, s.n_head * s.d_head, s.d_inner, s.seq_len, s.mem_len + s.seq_len, s.num_predict
    per_layer = 2 * d * A * (2 * L + 2 * K + 2 * P) + 6 * A * K * (L + P) + 4 * d * F * (L + P)
    return s.n_layer * per_layer + 2 * P * d * s.vocab_size


def forward_flops_per_batch(s: StepShape) -> int:
    """Forward FLOPs of one micro-batch of ``s.rows`` records."""
    A, K = s.n_head * s.d_head, s.mem_len + s.seq_len
    positions = s.n_layer * 2 * (2 if s.bi_data else 1) * (K + s.seq_len) * s.d_model * A
    return s.rows * forward_flops_per_record(s) + positions


def training_flops_per_step(s: StepShape, grad_accum: int = 1, world: int = 1) -> int:
    """Model FLOPs of one optimizer step over all ranks: 3 x forward x micro-batches x ranks."""
    return 3 * forward_flops_per_batch(s) * grad_accum * world


def parameter_count(d_model: int, n_layer: int, n_head: int, d_inner: int, vocab_size: int) -> int:
    """Parameters of ``XLNetLMHeadModel`` (word embeddings tied to the LM head)."""
    d, A = d_model, d_model  # d_head = d_model // n_head
    attention = 5 * d * A + 3 * A + 2 * A + 2 * d  # q k v o r, three biases, seg_embed, layer norm
    feed_forward = 2 * d * d_inner + d_inner + d + 2 * d
    return vocab_size * d + d + n_layer * (attention + feed_forward) + vocab_size  # + mask_emb, lm bias


def transfo_xl_parameter_count(vocab_size: int, cutoffs: list[int], d_model: int, d_embed: int, n_head: int,
                               d_head: int, d_inner: int, n_layer: int, div_val: int = 1, untie_r: bool = True,
                               **_) -> int:
    """Parameters of ``TransfoXLLMHeadModel`` with 4.x's default ties (the softmax's weights and the
    tail clusters' projections are the adaptive input's)."""
    d, E, A = d_model, d_embed, n_head * d_head
    ends = [0, *cutoffs, vocab_size]
    sizes = [hi - lo for lo, hi in zip(ends[:-1], ends[1:])]
    if div_val == 1:
        widths = [E] * len(sizes)
        embedding = vocab_size * E + (d * E if d != E else 0)
        softmax = vocab_size + (d * E if d != E else 0)  # the bias; the head's projection (tails' tied)
    else:
        widths = [E // div_val**i for i in range(len(sizes))]
        embedding = sum(n * w + d * w for n, w in zip(sizes, widths))
        softmax = sum(sizes) + d * widths[0]  # the biases; the head's projection (tails' tied)
    softmax += len(cutoffs) * (E + 1)  # the head's scores of the tail clusters
    biases = 2 * A * (n_layer if untie_r else 1)
    layer = 5 * A * d + 2 * d + 2 * d * d_inner + d_inner + d + 2 * d  # qkv, o, r; norm; feed-forward; norm
    return embedding + softmax + biases + n_layer * layer


def device_peak_tflops(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """``(dense bf16 peak of one device in TFLOP/s, what it is)``; the peak is None where MFU cannot
    be stated (a CPU, an unknown GPU). ``override`` (``--peak-tflops``), else the environment variable
    ``XLNET_FAST_PEAK_TFLOPS``, replaces the table."""
    if override is None and os.environ.get(PEAK_TFLOPS_ENV):
        try:
            override = float(os.environ[PEAK_TFLOPS_ENV])
        except ValueError:
            override = math.nan
        if not (math.isfinite(override) and override > 0):
            return None, f"{PEAK_TFLOPS_ENV}={os.environ[PEAK_TFLOPS_ENV]!r} is not a positive number: MFU omitted"
    if override is not None:
        return float(override), f"peak {override:g} TFLOP/s (given)"
    if device.type != "cuda":
        return None, f"MFU is not meaningful on a {device.type.upper()} (no tensor-core peak): MFU omitted"
    name = torch.cuda.get_device_name(device)
    for pattern, label, tflops in DEVICE_PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops, f"{name}: {label}, dense bf16 peak {tflops:g} TFLOP/s"
    return None, (f"{name}: peak unknown, MFU omitted (pass --peak-tflops or set {PEAK_TFLOPS_ENV} to the "
                  "device's dense bf16 TFLOP/s)")


class Throughput:
    """Tokens/s and MFU per step, and the session's means. ``peak_tflops`` is one device's peak
    (None: MFU omitted); the step's FLOPs are over all ``world`` ranks."""

    def __init__(self, tokens_per_step: int, flops_per_step: int, world: int, peak_tflops: float | None) -> None:
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_flops = None if peak_tflops is None else peak_tflops * 1e12 * world
        self.steps, self.seconds = 0, 0.0

    def step(self, seconds: float) -> dict:
        """``{"tokens_per_s", "mfu"}`` of one step that took ``seconds`` (``mfu`` only with a peak)."""
        seconds = max(seconds, 1e-9)
        self.steps += 1
        self.seconds += seconds
        return self._rates(self.tokens_per_step, seconds)

    def mean(self) -> dict:
        """The session's ``{"tokens_per_s", "mfu"}`` over the time spent in training steps."""
        if self.steps == 0:
            return {}
        return self._rates(self.tokens_per_step * self.steps, self.seconds, steps=self.steps)

    def _rates(self, tokens: int, seconds: float, steps: int = 1) -> dict:
        rates = {"tokens_per_s": tokens / seconds}
        if self.peak_flops is not None:
            rates["mfu"] = self.flops_per_step * steps / seconds / self.peak_flops
        return rates


def run_throughput(c, model_config, world: int, device: torch.device) -> tuple[Throughput, str]:
    """The meter of a pretraining run (``c``: its resolved ``TrainConfig``) and what its MFU is
    measured against (or why there is none)."""
    mc = model_config
    shape = StepShape(d_model=mc.d_model, n_layer=mc.n_layer, n_head=mc.n_head, d_head=mc.d_head,
                      d_inner=mc.d_inner, vocab_size=mc.vocab_size, seq_len=c.seq_len, mem_len=c.mem_len,
                      num_predict=c.num_predict, rows=c.batch_size, bi_data=c.bi_data)
    peak, note = device_peak_tflops(device, c.peak_tflops)
    tokens_per_step = c.batch_size * world * c.seq_len * c.grad_accum
    return Throughput(tokens_per_step, training_flops_per_step(shape, c.grad_accum, world), world, peak), note
