"""Transformer-XL parity with transformers 4.x (the last line that has it), recorded: needs
``transformers<5`` (e.g. a separate venv with ``pip install transformers==4.46.3``; CI runs 5.x,
whose tests use float64 references and 4.x-layout directories they write themselves instead, and
the greedy tokens this script records).

    python -m bench.transfo_xl_parity [--out FILE | --record]

Greedy generation (``transfo_xl_generate.json``): for each configuration of ``GENERATE_CONFIGS`` (a
grid of the config's fields, ``mem_len`` below the final length), the weights of ``seeded_model``
(ours, filled from a seed: CI rebuilds them without 4.x) saved by our ``save_pretrained`` and loaded
by 4.x: 4.x's greedy tokens from its own start (``mems=None``, its ``mem_len`` zero rows; its
``generate`` and a loop over its forward with ``mems`` carried) and from the original code's empty
memory (a loop over its forward from empty ``mems``), with ours beside them. CI's
``tests/test_generation.py`` checks ours against the recorded tokens.

For three configurations (``div_val`` 2; ``same_length`` + ``pre_lnorm`` + a projected input;
shared ``r`` biases + ``clamp_len``), random weights: transformers 4.x's ``TransfoXLLMHeadModel``
writes its directory (``save_pretrained``: safetensors, or ``pytorch_model.bin`` where 4.x refuses
safetensors for the shared biases), ``xlnet_fast.TransfoXLLMHeadModel.from_pretrained`` loads it,
and both run three consecutive segments carried by their own ``mems`` (the first from 4.x's zero
memory, ``mems=None``): max abs differences of the log-probabilities, of the per-token losses (4.x
with ``crit.keep_order = True``, i.e. in token order, as ours; its default order groups them by
cluster, so its sorted losses are compared too), of the mean loss and of the mems, per segment, in
fp32. Then the other way: our ``save_pretrained`` loaded by 4.x. 4.46 calls
``Tensor.type_as(dtype=...)``, which torch rejects; the script replaces ``type_as`` while 4.x runs
(``_type_as_accepting_dtype``), a shim on torch's side only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from bench import runner

RECORDS = "transfo_xl_parity.json"
GENERATE_RECORDS = "transfo_xl_generate.json"
TOL = 1e-4
BASE = dict(vocab_size=1000, cutoffs=[100, 400], d_model=64, d_embed=64, n_head=4, d_head=16, d_inner=128,
            n_layer=3, mem_len=12, clamp_len=-1, same_length=False, pre_lnorm=False, untie_r=True, div_val=1,
            dropout=0.0, dropatt=0.0)
CONFIGS = {
    "div_val_2": dict(BASE, div_val=2, clamp_len=20),
    "same_length_pre_lnorm": dict(BASE, same_length=True, pre_lnorm=True, d_embed=48, cutoffs=[300]),
    "shared_r_bias": dict(BASE, untie_r=False, same_length=True, clamp_len=8, n_head=5, d_head=12),
}
B, L, SEGMENTS = 3, 10, 3

# Greedy generation: a grid of config fields, each with mem_len below the final length (prompt + new)
GEN_BASE = dict(vocab_size=60, cutoffs=[15, 35], d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24, div_val=1,
                n_layer=2, mem_len=5, clamp_len=-1, same_length=False, pre_lnorm=False, untie_r=True, dropout=0.0,
                dropatt=0.0)
GENERATE_CONFIGS = {
    "plain": dict(GEN_BASE),
    "div_val_2": dict(GEN_BASE, div_val=2, mem_len=3),
    "same_length": dict(GEN_BASE, same_length=True, mem_len=6),
    "pre_lnorm_projected_input": dict(GEN_BASE, pre_lnorm=True, d_embed=12, cutoffs=[20], mem_len=4),
    "clamp_len": dict(GEN_BASE, clamp_len=3, mem_len=7),
    "shared_r_bias_same_length_clamp": dict(GEN_BASE, untie_r=False, same_length=True, clamp_len=2, n_head=3,
                                            d_head=5, mem_len=5),
    "no_cutoffs_3_layers": dict(GEN_BASE, cutoffs=[], n_layer=3, mem_len=8),
    "div_val_2_pre_lnorm_same_length": dict(GEN_BASE, div_val=2, pre_lnorm=True, same_length=True, clamp_len=5,
                                            mem_len=10),
}
GEN_BATCH, GEN_PROMPT, GEN_NEW, GEN_STD = 3, 4, 12, 0.4
STARTS = ("zeros", "empty")  # 4.x's start (mems=None) and the original code's


def seeded_model(fields: dict, seed: int, **config):
    """Our ``TransfoXLLMHeadModel`` of ``fields`` in eval mode, every parameter (by sorted name, tied ones
    once) drawn from ``seed``: N(0, GEN_STD), layer norm weights around 1."""
    import xlnet_fast

    model = xlnet_fast.TransfoXLLMHeadModel(xlnet_fast.TransfoXLConfig(**fields, **config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_((1.0 if name.endswith("layer_norm.weight") else 0.0) + GEN_STD * torch.randn(p.shape, generator=g))
    return model


def weights_digest(model) -> str:
    """sha256 of the state dict (sorted names, float32 bytes): the record's weights, checked by CI."""
    import hashlib

    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def generation_prompt(fields: dict, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, fields["vocab_size"], (GEN_BATCH, GEN_PROMPT), generator=g)


def _greedy_loop(model, x: torch.Tensor, mems, n: int, scores_of) -> torch.Tensor:
    """Greedy decoding over ``model``'s forward: the prompt from ``mems``, then a token per forward."""
    out, seq = model(x, mems=mems), x
    for _ in range(n):
        token = scores_of(out)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, token], 1)
        out = model(token, mems=out.mems)
    return seq


def compare_generation(name: str, fields: dict, seed: int, workdir: Path) -> dict:
    from transformers.models.deprecated.transfo_xl import TransfoXLLMHeadModel

    ours = seeded_model(fields, seed, attn_backend="eager")
    ours.save_pretrained(workdir / f"gen_{name}")
    hf = TransfoXLLMHeadModel.from_pretrained(workdir / f"gen_{name}").eval()
    x = generation_prompt(fields, seed)
    empty = [torch.zeros(0, GEN_BATCH, fields["d_model"]) for _ in range(fields["n_layer"])]
    tokens = {}
    with torch.no_grad(), _type_as_accepting_dtype():
        generated = hf.generate(x, max_new_tokens=GEN_NEW, do_sample=False, num_beams=1, eos_token_id=None,
                                pad_token_id=0)
        hf_loop = {"zeros": _greedy_loop(hf, x, None, GEN_NEW, lambda o: o.prediction_scores),
                   "empty": _greedy_loop(hf, x, empty, GEN_NEW, lambda o: o.prediction_scores)}
        for start in STARTS:
            mine = ours.generate(x, max_new_tokens=GEN_NEW, eos_token_id=None, mem_start=start)
            tokens[start] = {"transformers_4x": hf_loop[start].tolist(), "xlnet_fast": mine.tolist(),
                             "equal": torch.equal(mine, hf_loop[start])}
    return {"config": name, "fields": fields, "seed": seed, "weights_sha256": weights_digest(ours),
            "prompt": x.tolist(), "new_tokens": GEN_NEW,
            "transformers_generate_equals_its_loop_from_zeros": torch.equal(generated, hf_loop["zeros"]),
            "tokens": tokens}


@contextlib.contextmanager
def _type_as_accepting_dtype():
    original = torch.Tensor.type_as

    def type_as(self, other=None, dtype=None):
        return self.to(dtype) if other is None else original(self, other)

    torch.Tensor.type_as = type_as
    try:
        yield
    finally:
        torch.Tensor.type_as = original


def _hf_model(name: str, fields: dict, seed: int):
    from transformers.models.deprecated.transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(seed)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**fields)).eval()
    with torch.no_grad():  # weights away from 4.x's tiny init, so differences show
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _save_hf(model, directory: Path) -> str:
    try:
        model.save_pretrained(directory)
    except RuntimeError:  # 4.x refuses safetensors with the shared r biases
        model.save_pretrained(directory, safe_serialization=False)
    return "model.safetensors" if (directory / "model.safetensors").exists() else "pytorch_model.bin"


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def compare(name: str, fields: dict, seed: int, workdir: Path) -> dict:
    import xlnet_fast

    hf = _hf_model(name, fields, seed)
    weights = _save_hf(hf, workdir / name)
    ours = xlnet_fast.TransfoXLLMHeadModel.from_pretrained(workdir / name, attn_backend="eager")
    g = torch.Generator().manual_seed(seed)
    segments, mh, mo = [], None, None
    for seg in range(SEGMENTS):
        x = torch.randint(0, fields["vocab_size"], (B, L), generator=g)
        labels = x.clone()
        labels[0, 3] = -100
        with torch.no_grad(), _type_as_accepting_dtype():
            a, b = hf(x, mems=mh), ours(x, mems=mo)
            hf.crit.keep_order = False
            a_default = hf(x, mems=mh, labels=labels.clone())
            hf.crit.keep_order = True
            a_lab = hf(x, mems=mh, labels=labels.clone())
            b_lab = ours(x, mems=mo, labels=labels)
        segments.append({
            "segment": seg,
            "mems_in": (f"None (4.x's zero memory, {fields['mem_len']} rows)" if mo is None
                        else f"carried ({mo[0].shape[0]} rows)"),
            "log_probs_max_abs_diff": _max_diff(a.prediction_scores, b.prediction_scores),
            "losses_max_abs_diff": _max_diff(a_lab.losses, b_lab.losses),
            "losses_sorted_vs_default_order_max_abs_diff": _max_diff(a_default.losses.flatten().sort().values,
                                                                     b_lab.losses.flatten().sort().values),
            "loss_abs_diff": abs(float(a_lab.loss) - float(b_lab.loss)),
            "mems_max_abs_diff": max(_max_diff(m1, m2) for m1, m2 in zip(a.mems, b.mems)),
            "log_probs_max_abs": float(a.prediction_scores.abs().max()),
        })
        mh, mo = a.mems, b.mems
    back = _reverse(ours, workdir / f"{name}_ours", fields, seed)
    worst = max(max(s["log_probs_max_abs_diff"], s["losses_max_abs_diff"], s["loss_abs_diff"]) for s in segments)
    return {"config": name, "fields": fields, "weights_file": weights, "segments": segments,
            "reverse_log_probs_max_abs_diff": back, "within_1e-4": worst < TOL and back < TOL}


def _reverse(ours, directory: Path, fields: dict, seed: int) -> float:
    """Our save_pretrained, loaded by 4.x: max abs difference of the log-probabilities."""
    from transformers.models.deprecated.transfo_xl import TransfoXLLMHeadModel

    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours.save_pretrained(directory)
    hf = TransfoXLLMHeadModel.from_pretrained(directory).eval()
    x = torch.randint(0, fields["vocab_size"], (B, L), generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad(), _type_as_accepting_dtype():
        return _max_diff(hf(x).prediction_scores, ours(x).prediction_scores)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runner.add_output_args(p, RECORDS, no_record=True)
    args = p.parse_args(argv)
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return runner.refuse(f"bench.transfo_xl_parity needs transformers<5 (Transformer-XL was deleted in 5.x), "
                             f"found {transformers.__version__}: run it from a venv with transformers==4.46.3")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="txl_parity_") as tmp:
        results = [compare(name, fields, seed, Path(tmp)) for seed, (name, fields) in enumerate(CONFIGS.items())]
        generation = [compare_generation(name, fields, seed, Path(tmp))
                      for seed, (name, fields) in enumerate(GENERATE_CONFIGS.items())]
    for r in results:
        for s in r["segments"]:
            print(f"{r['config']:22} segment {s['segment']}: log-probs {s['log_probs_max_abs_diff']:.2e}"
                  f"  losses {s['losses_max_abs_diff']:.2e}  loss {s['loss_abs_diff']:.2e}  mems "
                  f"{s['mems_max_abs_diff']:.2e}")
        print(f"{r['config']:22} ours -> 4.x: log-probs {r['reverse_log_probs_max_abs_diff']:.2e}; "
              f"{'within' if r['within_1e-4'] else 'OUTSIDE'} 1e-4 ({r['weights_file']})")
    record = {**runner.environment(), "op": "transfo_xl_parity",
              "B": B, "L": L, "dtype": "float32", "tolerance": TOL, "results": results,
              "all_within_tolerance": all(r["within_1e-4"] for r in results)}
    runner.write_records(args, RECORDS, [record])
    for g in generation:
        starts = ", ".join(f"{s} start {'equal' if g['tokens'][s]['equal'] else 'DIFFERENT'}" for s in STARTS)
        print(f"{g['config']:32} greedy, {g['new_tokens']} tokens, mem_len {g['fields']['mem_len']}: " + starts
              + f"; 4.x generate = its loop: {g['transformers_generate_equals_its_loop_from_zeros']}")
    gen_record = {**runner.environment(), "op": "transfo_xl_generate", "B": GEN_BATCH, "prompt_len": GEN_PROMPT,
                  "results": generation,
                  "all_equal": all(g["tokens"][s]["equal"] and g["transformers_generate_equals_its_loop_from_zeros"]
                                   for g in generation for s in STARTS)}
    runner.write_records(args, GENERATE_RECORDS, [gen_record])
    return 0 if record["all_within_tolerance"] and gen_record["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
