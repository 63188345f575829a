"""Transformer-XL references and fixtures, independent of xlnet_fast's model:

- ``layout_state``: random weights with transformers 4.x's ``TransfoXLLMHeadModel`` names and shapes
  for a config (built from the config alone, as 4.x lays them out);
- ``write_hf4_dir``: a transformers-4.x-layout directory (``config.json`` as 4.x writes it,
  ``model.safetensors`` without the tied weights, or a ``pytorch_model.bin`` holding every name);
- ``reference_forward``: the model in float64 from the paper's and the original code's equations,
  one batch row and head at a time, the relative term through the original zero-pad ``_rel_shift``;
- ``reference_log_probs`` / ``reference_nll``: the adaptive softmax written out per token.
"""

import json
import math
import os

import torch

SMALL = dict(vocab_size=60, cutoffs=[15, 35], d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24, div_val=1,
             n_layer=2, mem_len=5, clamp_len=-1, same_length=False, pre_lnorm=False, untie_r=True, dropout=0.0,
             dropatt=0.0)
# The three configurations of the parity record: div_val 2 (per-cluster widths and projections),
# same_length + pre_lnorm + projected input (d_embed != d_model), shared r biases + clamp_len.
CONFIGS = {
    "div_val_2": dict(SMALL, div_val=2, d_embed=16, clamp_len=4),
    "same_length_pre_lnorm": dict(SMALL, d_embed=12, same_length=True, pre_lnorm=True, cutoffs=[20]),
    "shared_r_bias": dict(SMALL, untie_r=False, same_length=True, clamp_len=3, n_head=3, d_head=5),
}
# transformers 4.46's TransfoXLConfig defaults for the fields a test config leaves out
HF4_DEFAULTS = dict(vocab_size=267735, cutoffs=[20000, 40000, 200000], d_model=1024, d_embed=1024, n_head=16,
                    d_head=64, d_inner=4096, div_val=4, pre_lnorm=False, n_layer=18, mem_len=1600, clamp_len=1000,
                    same_length=True, attn_type=0, sample_softmax=-1, adaptive=True, dropout=0.1, dropatt=0.0,
                    untie_r=True, init="normal", init_range=0.01, proj_init_std=0.01, init_std=0.02,
                    layer_norm_epsilon=1e-5, eos_token_id=0)


def hf4_config(**fields) -> dict:
    """A ``config.json`` as transformers 4.46 writes it (with ``tie_projs`` derived as 4.x does)."""
    c = {**HF4_DEFAULTS, **fields}
    c["tie_projs"] = [False] + [True] * len(c["cutoffs"])
    c.update(model_type="transfo-xl", architectures=["TransfoXLLMHeadModel"], transformers_version="4.46.3",
             torch_dtype="float32", tie_word_embeddings=True, trainer_compatible=False)
    return c


def _bounds(c):
    ends = [0, *c["cutoffs"], c["vocab_size"]]
    return list(zip(ends[:-1], ends[1:]))


def tied_names(c) -> dict:
    """``{crit weight: embedding weight}`` as 4.x ties them (``tie_word_embeddings``, ``tie_projs``)."""
    out = {}
    n_out = 1 if c["div_val"] == 1 else len(_bounds(c))
    for i in range(n_out):
        out[f"crit.out_layers.{i}.weight"] = f"transformer.word_emb.emb_layers.{i}.weight"
    for i, tie in enumerate(c["tie_projs"]):
        if tie and c["div_val"] == 1 and c["d_model"] != c["d_embed"]:
            out[f"crit.out_projs.{i}"] = "transformer.word_emb.emb_projs.0"
        elif tie and c["div_val"] != 1:
            out[f"crit.out_projs.{i}"] = f"transformer.word_emb.emb_projs.{i}"
    return out


def layout_state(c, seed=0, std=0.3) -> dict:
    """Random weights under 4.x's names (tied ones share the tensor; shared r biases too)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, mean=0.0):
        return mean + std * torch.randn(*shape, generator=g)

    H, D, d, F, V = c["n_head"], c["d_head"], c["d_model"], c["d_inner"], c["vocab_size"]
    s, bounds = {}, _bounds(c)
    widths = [c["d_embed"] // c["div_val"] ** i for i in range(len(bounds))] if c["div_val"] > 1 else [c["d_embed"]]
    if c["div_val"] == 1:
        s["transformer.word_emb.emb_layers.0.weight"] = rnd(V, c["d_embed"])
        if d != c["d_embed"]:
            s["transformer.word_emb.emb_projs.0"] = rnd(d, c["d_embed"])
    else:
        for i, ((lo, hi), w) in enumerate(zip(bounds, widths)):
            s[f"transformer.word_emb.emb_layers.{i}.weight"] = rnd(hi - lo, w)
            s[f"transformer.word_emb.emb_projs.{i}"] = rnd(d, w)
    if not c["untie_r"]:
        s["transformer.r_w_bias"], s["transformer.r_r_bias"] = rnd(H, D), rnd(H, D)
    for n in range(c["n_layer"]):
        p = f"transformer.layers.{n}."
        if c["untie_r"]:
            s[p + "dec_attn.r_w_bias"], s[p + "dec_attn.r_r_bias"] = rnd(H, D), rnd(H, D)
        else:
            s[p + "dec_attn.r_w_bias"] = s["transformer.r_w_bias"]  # one tensor under both names
            s[p + "dec_attn.r_r_bias"] = s["transformer.r_r_bias"]
        s[p + "dec_attn.qkv_net.weight"] = rnd(3 * H * D, d)
        s[p + "dec_attn.o_net.weight"] = rnd(d, H * D)
        s[p + "dec_attn.layer_norm.weight"], s[p + "dec_attn.layer_norm.bias"] = rnd(d, mean=1.0), rnd(d)
        s[p + "dec_attn.r_net.weight"] = rnd(H * D, d)
        s[p + "pos_ff.CoreNet.0.weight"], s[p + "pos_ff.CoreNet.0.bias"] = rnd(F, d), rnd(F)
        s[p + "pos_ff.CoreNet.3.weight"], s[p + "pos_ff.CoreNet.3.bias"] = rnd(d, F), rnd(d)
        s[p + "pos_ff.layer_norm.weight"], s[p + "pos_ff.layer_norm.bias"] = rnd(d, mean=1.0), rnd(d)
    s["transformer.pos_emb.inv_freq"] = 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
    if c["cutoffs"]:
        s["crit.cluster_weight"], s["crit.cluster_bias"] = rnd(len(c["cutoffs"]), c["d_embed"]), rnd(len(c["cutoffs"]))
    if c["div_val"] == 1:
        s["crit.out_layers.0.bias"] = rnd(V)
        for i in range(len(bounds)):
            if d != c["d_embed"]:
                s[f"crit.out_projs.{i}"] = rnd(d, c["d_embed"])
    else:
        for i, ((lo, hi), w) in enumerate(zip(bounds, widths)):
            s[f"crit.out_layers.{i}.bias"] = rnd(hi - lo)
            s[f"crit.out_projs.{i}"] = rnd(d, w)
    for name, source in tied_names(c).items():
        s[name] = s[source]
    if c["div_val"] == 1 and "crit.out_layers.0.weight" not in s:
        s["crit.out_layers.0.weight"] = rnd(V, c["d_embed"])
    return s


def write_hf4_dir(path, fields: dict, seed=0, fmt="safetensors") -> tuple[dict, dict]:
    """A 4.x-layout directory; returns (config dict, state). ``safetensors``: the tied crit weights
    left out, as 4.46's ``save_pretrained`` does (it refuses shared r biases there); ``bin``: every
    name, shared tensors shared, as ``torch.save`` of 4.x's state dict."""
    c = hf4_config(**fields)
    state = layout_state(c, seed)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        tied = tied_names(c)
        save_file({k: v.contiguous() for k, v in state.items() if k not in tied},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    return c, state


# --------------------------------------------------------------------------------------------------
# float64 references
# --------------------------------------------------------------------------------------------------


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rel_shift_original(x):
    """The original code's ``_rel_shift`` on ``(qlen, klen)``: a zero column in front, the padded
    matrix read as ``(klen + 1, qlen)``, its first row dropped, read back as ``(qlen, klen)``."""
    qlen, klen = x.shape
    padded = torch.cat([x.new_zeros(qlen, 1), x], dim=1)
    return padded.view(klen + 1, qlen)[1:].reshape(qlen, klen)


def reference_embed(c, s, ids):
    """Adaptive input: each token from its cluster's table and projection, times sqrt(d_model)."""
    d = c["d_model"]
    out = torch.zeros(*ids.shape, d, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in ids.shape]):
        t = int(ids[tuple(idx)])
        if c["div_val"] == 1:
            e = s["transformer.word_emb.emb_layers.0.weight"][t].double()
            proj = s.get("transformer.word_emb.emb_projs.0")
        else:
            i, (lo, _) = next((i, b) for i, b in enumerate(_bounds(c)) if b[0] <= t < b[1])
            e = s[f"transformer.word_emb.emb_layers.{i}.weight"][t - lo].double()
            proj = s[f"transformer.word_emb.emb_projs.{i}"]
        out[tuple(idx)] = (proj.double() @ e if proj is not None else e) * math.sqrt(d)
    return out


def _attention_layer(c, s, n, h, mem, pos):
    """One layer on one batch row: h (qlen, d), mem (mlen, d), pos (klen, d) sinusoids of klen-1..0."""
    p = f"transformer.layers.{n}."
    H, D, eps = c["n_head"], c["d_head"], c["layer_norm_epsilon"]
    w = {k[len(p):]: v.double() for k, v in s.items() if k.startswith(p)}
    qlen, mlen = h.shape[0], mem.shape[0]
    klen = qlen + mlen
    cat = torch.cat([mem, h], 0)
    x = _layer_norm(cat, w["dec_attn.layer_norm.weight"], w["dec_attn.layer_norm.bias"], eps) if c["pre_lnorm"] else cat
    q, k, v = (x @ w["dec_attn.qkv_net.weight"].T).split(H * D, dim=-1)
    q = q[-qlen:]
    r = pos @ w["dec_attn.r_net.weight"].T
    blocked = torch.triu(torch.ones(qlen, klen, dtype=torch.bool), diagonal=1 + mlen)
    if c["same_length"]:
        mask_len = klen - c["mem_len"]
        shift = qlen - mask_len if mask_len > 0 else qlen
        blocked = blocked | torch.tril(torch.ones(qlen, klen, dtype=torch.bool), diagonal=-shift)
    heads, probs = [], []
    for hd in range(H):
        sl = slice(hd * D, (hd + 1) * D)
        ac = (q[:, sl] + w["dec_attn.r_w_bias"][hd]) @ k[:, sl].T
        bd = rel_shift_original((q[:, sl] + w["dec_attn.r_r_bias"][hd]) @ r[:, sl].T)
        score = ((ac + bd) / math.sqrt(D)).masked_fill(blocked, float("-inf"))
        prob = torch.softmax(score, -1)
        probs.append(prob)
        heads.append(prob @ v[:, sl])
    out = torch.cat(heads, -1) @ w["dec_attn.o_net.weight"].T
    if c["pre_lnorm"]:
        h = h + out
        ff = _layer_norm(h, w["pos_ff.layer_norm.weight"], w["pos_ff.layer_norm.bias"], eps)
    else:
        h = _layer_norm(h + out, w["dec_attn.layer_norm.weight"], w["dec_attn.layer_norm.bias"], eps)
        ff = h
    y = torch.relu(ff @ w["pos_ff.CoreNet.0.weight"].T + w["pos_ff.CoreNet.0.bias"])
    y = y @ w["pos_ff.CoreNet.3.weight"].T + w["pos_ff.CoreNet.3.bias"]
    if c["pre_lnorm"]:
        return h + y, torch.stack(probs)
    return _layer_norm(h + y, w["pos_ff.layer_norm.weight"], w["pos_ff.layer_norm.bias"], eps), torch.stack(probs)


def reference_forward(c, s, ids, mems=None):
    """(hidden (B, L, d) float64, new mems per layer (mem_len', B, d), probs per layer (B, H, L, K)).
    ``mems=None``: 4.x's zero memory of ``mem_len`` rows."""
    B, L = ids.shape
    d = c["d_model"]
    if mems is None:
        mems = [torch.zeros(c["mem_len"], B, d, dtype=torch.float64) for _ in range(c["n_layer"])]
    mlen = mems[0].shape[0]
    klen = mlen + L
    pos_seq = torch.arange(klen - 1, -1, -1, dtype=torch.float64)
    if c["clamp_len"] > 0:
        pos_seq = pos_seq.clamp(max=c["clamp_len"])
    inv_freq = 1 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
    pos = torch.cat([torch.sin(pos_seq[:, None] * inv_freq), torch.cos(pos_seq[:, None] * inv_freq)], -1)
    h = reference_embed(c, s, ids)
    hids, all_probs = [], []
    for n in range(c["n_layer"]):
        hids.append(h)
        rows = [_attention_layer(c, s, n, h[b], mems[n][:, b].double(), pos) for b in range(B)]
        h = torch.stack([r[0] for r in rows])
        all_probs.append(torch.stack([r[1] for r in rows]))
    new_mems = [torch.cat([m.double(), x.transpose(0, 1)], 0)[-c["mem_len"]:] if c["mem_len"] else m[:0].double()
                for m, x in zip(mems, hids)]
    return h, new_mems, all_probs


def _cluster_logits(c, s, hidden, i):
    """Scores of cluster i's tokens (the head's with the tail clusters' scores appended)."""
    bounds = _bounds(c)
    lo, hi = bounds[i]
    if c["div_val"] == 1:
        W, b = s["crit.out_layers.0.weight"][lo:hi], s["crit.out_layers.0.bias"][lo:hi]
    else:
        W, b = s[f"crit.out_layers.{i}.weight"], s[f"crit.out_layers.{i}.bias"]
    if i == 0 and c["cutoffs"]:
        W, b = torch.cat([W, s["crit.cluster_weight"]]), torch.cat([b, s["crit.cluster_bias"]])
    proj = s.get(f"crit.out_projs.{i}")
    x = hidden @ proj.double() if proj is not None else hidden
    return x @ W.double().T + b.double()


def reference_log_probs(c, s, hidden):
    """(N, V): log p(t) = log p_head(t) for head tokens, log p_head(cluster) + log p_tail(t) otherwise."""
    head = torch.log_softmax(_cluster_logits(c, s, hidden, 0), -1)
    out = torch.empty(hidden.shape[0], c["vocab_size"], dtype=torch.float64)
    short = c["cutoffs"][0] if c["cutoffs"] else c["vocab_size"]
    out[:, :short] = head[:, :short]
    for i, (lo, hi) in enumerate(_bounds(c)[1:], start=1):
        out[:, lo:hi] = head[:, short + i - 1, None] + torch.log_softmax(_cluster_logits(c, s, hidden, i), -1)
    return out


def reference_nll(c, s, hidden, target):
    """(N,): -log p(target), 0 where the target is -100."""
    lp = reference_log_probs(c, s, hidden)
    picked = lp.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(target == -100, torch.zeros_like(picked), -picked)
