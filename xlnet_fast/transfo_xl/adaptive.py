"""Adaptive input embedding and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017), with
transformers 4.x's parameter names, as Transformer-XL uses them.

The vocabulary is cut into clusters at ``cutoffs``: the head ``[0, cutoffs[0])`` and tail clusters
``[cutoffs[i-1], cutoffs[i])``. With ``div_val > 1`` cluster ``i`` has embeddings of width
``d_embed // div_val**i``, each projected to ``d_proj``. The softmax's head scores the head's tokens
and one token per tail cluster; a token of tail cluster ``i`` has

    log p(token) = log p_head(cluster i) + log p_tail_i(token)

so a target only needs the head and its own cluster's scores (``nll``). ``log_probs`` gives the whole
``(N, vocab)`` table (the model's ``prediction_scores``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

IGNORE_INDEX = -100


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the token range of each cluster, the head first."""
    ends = [0, *cutoffs, vocab_size]
    return list(zip(ends[:-1], ends[1:]))


def cluster_width(d_embed: int, div_val: int, i: int) -> int:
    return d_embed // div_val**i


def rows_by_cluster(ids: Tensor, bounds: list[tuple[int, int]]) -> list[Tensor]:
    """For each cluster, the positions of ``ids (N,)`` in it, ascending; ids in no cluster (-100) are
    in none. One read of the clusters' sizes on the host (the original and transformers 4.x read
    one per cluster); every cluster gets its tensor, empty ones too, so every cluster's weights
    take part in the autograd graph of each call (DDP needs every parameter in every step)."""
    cutoffs = torch.tensor([hi for _, hi in bounds[:-1]], dtype=ids.dtype, device=ids.device)
    ids = ids.contiguous()
    cluster = torch.bucketize(ids, cutoffs, right=True)  # 0 .. len(bounds) - 1 for ids in [0, vocab)
    cluster = torch.where((ids < 0) | (ids >= bounds[-1][1]), len(bounds), cluster)
    order = torch.argsort(cluster, stable=True)
    sizes = torch.bincount(cluster, minlength=len(bounds) + 1).tolist()
    return list(order.split(sizes))[:len(bounds)]


class AdaptiveEmbedding(nn.Module):
    """Token ids ``(...)`` -> embeddings ``(..., d_proj)``, scaled by ``sqrt(d_proj)``.

    ``emb_layers[i]`` embeds cluster i (one table for the whole vocabulary when ``div_val == 1``);
    ``emb_projs[i]`` ``(d_proj, d_i)`` projects it (absent when ``div_val == 1`` and ``d_proj == d_embed``).
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int = 1):
        super().__init__()
        self.vocab_size, self.d_embed, self.d_proj, self.div_val = vocab_size, d_embed, d_proj, div_val
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.emb_scale = d_proj**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(vocab_size, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, (lo, hi) in enumerate(self.bounds):
                width = cluster_width(d_embed, div_val, i)
                self.emb_layers.append(nn.Embedding(hi - lo, width))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, width)))

    def forward(self, ids: Tensor) -> Tensor:
        if self.div_val == 1:
            embed = self.emb_layers[0](ids)
            if len(self.emb_projs):
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.emb_scale
        flat = ids.reshape(-1)
        embed = self.emb_projs[0].new_zeros(flat.shape[0], self.d_proj)
        for (lo, hi), table, proj, rows in zip(self.bounds, self.emb_layers, self.emb_projs,
                                               rows_by_cluster(flat, self.bounds)):
            # in the weights' dtype: under autocast F.linear gives the autocast dtype
            embed = embed.index_put((rows,), F.linear(table(flat[rows] - lo), proj).to(embed.dtype))
        return embed.view(*ids.shape, self.d_proj) * self.emb_scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Hidden states ``(N, d_proj)`` -> log-probabilities (``log_probs``) or the negative
    log-likelihood of targets (``nll``).

    Parameters (transformers 4.x's): ``out_layers`` — one ``Linear(d_embed, vocab)`` when
    ``div_val == 1``, else one ``Linear(d_i, cluster size)`` per cluster; ``out_projs[i]``
    ``(d_proj, d_i)`` or None (no projection); ``cluster_weight (n_clusters, d_embed)`` and
    ``cluster_bias (n_clusters,)``: the head's scores of the tail clusters.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int = 1):
        super().__init__()
        self.vocab_size, self.d_embed, self.d_proj, self.div_val = vocab_size, d_embed, d_proj, div_val
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.n_clusters = len(cutoffs)
        self.shortlist = self.bounds[0][1]
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in self.bounds:
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)) if d_proj != d_embed else None)
            self.out_layers.append(nn.Linear(d_embed, vocab_size))
        else:
            for i, (lo, hi) in enumerate(self.bounds):
                width = cluster_width(d_embed, div_val, i)
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, width)))
                self.out_layers.append(nn.Linear(width, hi - lo))

    def _cluster_logits(self, hidden: Tensor, i: int) -> Tensor:
        """Scores ``(N, n_i)`` of cluster ``i``'s tokens; the head's also score the tail clusters."""
        lo, hi = self.bounds[i]
        if self.div_val == 1:
            weight, bias = self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        proj = self.out_projs[i]
        if proj is not None:
            hidden = hidden @ proj  # (N, d_proj) -> (N, d_i)
        return F.linear(hidden, weight, bias)

    def _log_softmax(self, hidden: Tensor, i: int) -> Tensor:
        logits = self._cluster_logits(hidden, i)  # half precision: normalised in float32
        return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """``(N, vocab)`` log-probabilities of every token (float32, or float64 for float64 weights)."""
        head = self._log_softmax(hidden, 0)
        if not self.n_clusters:
            return head
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            parts.append(head[:, self.shortlist + i - 1, None] + self._log_softmax(hidden, i))
        return torch.cat(parts, dim=1)

    def nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        """``(N,)`` negative log-likelihood (float32 or float64) of ``target (N,)``; 0 where the target is -100.
        Each tail cluster's scores are computed only for the rows whose target is in it
        (``rows_by_cluster``: one host read per call)."""
        head = self._log_softmax(hidden, 0)
        out = head.new_zeros(target.shape[0])
        for i, ((lo, hi), rows) in enumerate(zip(self.bounds, rows_by_cluster(target, self.bounds))):
            if i == 0:
                logp = head[rows, target[rows]]
            else:
                tail = self._log_softmax(hidden[rows], i)
                logp = head[rows, self.shortlist + i - 1] + tail.gather(1, (target[rows] - lo)[:, None]).squeeze(1)
            out = out.index_put((rows,), -logp)
        return out
