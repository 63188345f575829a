"""The mutation gate: semantic mutations of the source that the test suite must kill (issue 37).

    python tests/mutation_gate.py                 # every mutation; exit 1 if one survives
    python tests/mutation_gate.py --list          # what each mutation changes and which tests it runs
    python tests/mutation_gate.py --only NAME ... # some of them
    python tests/mutation_gate.py --check         # only that every snippet is still in the source

Each mutation is ``(name, file, old snippet, new snippet, tests)``: the gate copies the checkout to a
temporary directory (the checkout itself is never written), replaces the snippet there, and runs the
selected tests on the copy with pytest; a mutation is *killed* when a test fails (pytest's exit status
1), *survives* when they all pass. First it runs every selection once on the unmutated copy
(``--no-baseline`` skips that): a selection that fails there would make any mutation look killed.

The gate fails (exit 1) when a mutation survives, when a snippet is not in its file exactly once (a
refactor moved the code: re-target the snippet, the gate does not pass silently), or when pytest
cannot run a selection (exit status other than 0 or 1: a test id that no longer exists, say).

Without a GPU the selected tests run the Triton kernels in Triton's interpreter, as the suite does.
The whole gate took 10 minutes on 2 shared CPU cores (one pytest process per mutation), more than
CI's budget allows: run it after changing the attention, the masks, the model, the patch or the
kernels, and before a release (README "Tests"). CI runs ``tests/test_mutation_gate.py``: every
snippet still found, every selected test still defined.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not copied: what git ignores here (.gitignore) and the repository's history
IGNORED = (".git", ".venv", "venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis",
           ".benchmarks", "runs", ".whl")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    what: str  # the defect it stands for


TERMS = "tests/test_terms_at_scale.py"
TRITON_MODELS = "tests/test_triton_models.py"
PATCH = "tests/test_hf_patch.py"

MUTATIONS = (
    Mutation("clamp_removed", "xlnet_fast/model/backbone.py", "if c.clamp_len > 0:", "if False:",
             (f"{TERMS}::test_position_terms_over_two_calls_with_mems",),
             "XLNet's clamp_len ignored"),
    Mutation("bi_data_sign", "xlnet_fast/model/backbone.py", "torch.stack([fwd, -fwd])", "torch.stack([fwd, fwd])",
             (f"{TERMS}::test_position_terms_over_two_calls_with_mems",),
             "bi_data's backward positions not negated"),
    Mutation("distance_shift", "xlnet_fast/model/backbone.py", "fwd = torch.arange(klen, end, -1,",
             "fwd = torch.arange(klen - 1, end - 1, -1,",
             (f"{TERMS}::test_position_terms_over_two_calls_with_mems",),
             "every relative distance off by one"),
    Mutation("positions_zeroed", "xlnet_fast/model/backbone.py",
             "return torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], dim=-1)",
             "return 0 * torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], dim=-1)",
             (f"{TERMS}::test_position_terms_over_two_calls_with_mems",),
             "no positional encoding"),
    Mutation("memory_segment", "xlnet_fast/masks.py", "F.pad(ids, (s.mlen, 0))",
             "F.pad(ids, (s.mlen, 0), value=1)",
             (f"{TERMS}::test_segments_and_the_memorys_segment",),
             "memory keys given segment 1 instead of 0"),
    Mutation("txl_clamp_removed", "xlnet_fast/transfo_xl/model.py", "if self.config.clamp_len > 0:", "if False:",
             (f"{TERMS}::test_transfo_xl_terms_against_the_float64_reference",),
             "Transformer-XL's clamp_len ignored"),
    Mutation("generate_starts_empty", "xlnet_fast/generation.py", "mems = model.init_mems(B, start=mem_start)",
             'mems = model.init_mems(B, start="empty")',
             ("tests/test_generation.py::test_generate_is_greedy_decoding_over_the_models_own_forward",
              "tests/test_generation.py::test_greedy_tokens_equal_transformers_4x_recorded_from_both_starts"),
             "Transformer-XL's generate starts from an empty memory while its forward starts from zeros"),
    Mutation("reuse_len_ignored", "xlnet_fast/model/backbone.py", "cur = cur[: c.reuse_len]", "cur = cur",
             (f"{TERMS}::test_memory_and_reuse_len",),
             "the new mems keep the whole segment instead of its first reuse_len rows"),
    Mutation("query_stream_sees_own_key", "xlnet_fast/masks.py", "dense_g=blocked)", "dense_g=blocked & ~own)",
             (f"{TERMS}::test_two_stream_with_perm_mask_mems_and_gradients",),
             "the query stream sees its own token under a perm_mask"),
    Mutation("biases_swapped", "xlnet_fast/model/layers.py",
             "out = rel_attention(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **kwargs)",
             "out = rel_attention(q, k, v, k_r, self.r_r_bias, self.r_w_bias, **kwargs)",
             (f"{TERMS}::test_segments_and_the_memorys_segment",),
             "r_w_bias and r_r_bias swapped in the model's content-stream call"),
    Mutation("seg_embed_index", "xlnet_fast/model/layers.py", "seg_embed=self.seg_embed)",
             "seg_embed=self.seg_embed.flip(0))",
             (f"{TERMS}::test_segments_and_the_memorys_segment",),
             "seg_embed's same/different rows exchanged by the model"),
    Mutation("self_visible_dropped", "xlnet_fast/masks.py", "dense_h=blocked & ~own", "dense_h=blocked",
             (f"{TERMS}::test_content_stream_with_perm_mask_and_attentions",),
             "the content stream no longer sees its own key under a perm_mask"),
    Mutation("triton_shift_transposed", "kernels/rel_attention.py",
             "lag = tl.minimum(tl.maximum(p_hi - pos, 0), BLOCK_N)",
             "lag = BLOCK_N - tl.minimum(tl.maximum(p_hi - pos, 0), BLOCK_N)",
             (f"{TRITON_MODELS}::test_xlnet_position_options_on_triton[bi_data_clamp_len]",
              f"{TRITON_MODELS}::test_xlnet_query_stream_in_its_own_launch_on_triton",
              f"{TRITON_MODELS}::test_transfo_xl_configs_on_triton[div_val_2]",
              f"{TRITON_MODELS}::test_transfo_xl_generation_on_triton"),
             "the fused kernels' relative shift read in the other direction"),
    Mutation("triton_head_offset", "kernels/operands.py",
             "    head = h * HEAD_DIM + d\n    out_rows = pid_bh.to(tl.int64) * M + rows\n    out_ptrs",
             "    head = d\n    out_rows = pid_bh.to(tl.int64) * M + rows\n    out_ptrs",
             ("tests/test_triton_kernels.py::test_fuzz_heads_and_head_dims_against_eager",),
             "every head takes head 0's biases in the fused kernels"),
    Mutation("triton_backward_lse", "kernels/operands.py", "lse * LOG2E - e_same", "lse * LOG2E",
             (f"{TRITON_MODELS}::test_xlnet_two_stream_training_step_on_triton",),
             "the backward's lse without its same-segment term"),
    Mutation("triton_dkr_group_ignored", "kernels/rel_attention.py",
             "for bi in range(first_bi, tl.minimum(first_bi + batch_per_split, batch_per_kr)):",
             "for bi in range(0, batch_per_kr):",
             ("tests/test_triton_kernels.py::test_deterministic_dk_r_split_over_batch_rows_matches_eager",),
             "each of the deterministic dk_r kernel's groups of batch rows sums every batch row"),
    Mutation("patch_falls_back_on_mems", "xlnet_fast/hf_patch.py",
             "prepared = ours.prepare_inputs(**arguments, **extensions)",
             "prepared = ours.prepare_inputs(**arguments, **extensions, "
             "**({'rejected': 1} if arguments.get('mems') is not None else {}))",
             (f"{PATCH}::test_patched_forward_runs_xlnet_fast",
              f"{PATCH}::test_each_accepted_input_runs_the_forward_it_should"),
             "the patch silently runs transformers' forward whenever mems are given"),
    Mutation("fallback_warning_by_first_word", "xlnet_fast/hf_patch.py", "key = _rejection_kind(exc)",
             "key = str(exc).split(' ', 1)[0]",
             (f"{PATCH}::test_each_kind_of_rejection_is_warned_once",),
             "two kinds of rejection share one fallback warning"),
    Mutation("op_saves_scores", "xlnet_fast/attention/op.py", "ctx.save_for_backward(*dense, r_s_bias,",
             "ctx.save_for_backward(out.new_zeros(out.shape[0], out.shape[2], out.shape[1], dense[1].shape[1]), "
             "*dense, r_s_bias,",
             (f"{TRITON_MODELS}::test_the_op_keeps_o_of_l_for_backward",),
             "the op keeps an M x K tensor (the probabilities) for its backward"),
    Mutation("forced_backend_falls_back", "xlnet_fast/attention/backends.py",
             'if backend == "triton":  # forced: never fall back', 'if False:  # forced: never fall back',
             (f"{TRITON_MODELS}::test_forced_triton_never_falls_back_under_the_interpreter",),
             "a forced Triton backend runs input the kernels do not take eagerly"),
    Mutation("triton_dropout_unscaled", "kernels/__init__.py", "fwd=dict(attn, TMA=shape.tma, keep_scale=_keep_scale(",
             "fwd=dict(attn, TMA=shape.tma, keep_scale=1.0 + 0 * (",
             (f"{TRITON_MODELS}::test_triton_dropout_keep_rate_and_expectation",),
             "kept probabilities not rescaled by 1 / (1 - rate)"),
    Mutation("segment_codes_not_distinct", "kernels/tables.py",
             "below += tl.sum(((key_ids[None, :] < ids[:, None]) & first[None, :]).to(tl.int32), axis=1)",
             "below += tl.sum((key_ids[None, :] < ids[:, None]).to(tl.int32), axis=1)",
             ("tests/test_triton_kernels.py::test_mask_tables_match_a_python_reference",),
             "segment codes count the keys below an id, not the distinct ids (the dK/dV one-hot wants them dense)"),
    Mutation("padding_rows_at_position_zero", "kernels/tables.py",
             "pos_code = tl.where(real, pos, last_real).to(tl.int32)", "pos_code = tl.where(real, pos, 0).to(tl.int32)",
             ("tests/test_triton_kernels.py::test_mask_tables_match_a_python_reference",
              "tests/test_triton_kernels.py::test_two_stream_rows_are_banded_for_every_tile_size"),
             "padding rows (sorted last) take position 0, so the last tile's position range is wrong"),
    Mutation("finish_chunks_sum_every_tile", "kernels/operands.py",
             "t_end = tl.minimum(n_used, (chunk + 1) * per_chunk)", "t_end = n_used",
             ("tests/test_triton_kernels.py::test_bias_and_segment_gradients_add_every_batch_row",),
             "each chunk of the finishing kernel sums every per-tile sum from its first on, not its share"),
    Mutation("eval_data_not_rewound", "xlnet_fast/pretrain/evaluate.py", "self.batches.load_state_dict(self._start)",
             "pass",
             ("tests/test_pretrain.py::test_exact_resume_with_accumulation_bi_data_checkpointing_and_evals",),
             "each evaluation reads on from where the last one stopped"),
    Mutation("checkpointing_redraws_dropout", "xlnet_fast/pretrain/loop.py",
             "checkpoint(fn, *args, use_reentrant=False, **kwargs)",
             "checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)",
             ("tests/test_pretrain.py::test_exact_resume_with_accumulation_bi_data_checkpointing_and_evals",),
             "activation checkpointing recomputes with other dropout masks than the forward's"),
    Mutation("campaign_record_unnamed", "bench/campaign.py", '"gpu_only_tests": gpu_only}', '"gpu_only_tests": {}}',
             ("tests/test_campaign.py::test_gpu_only_tests_are_named_in_the_record_with_their_outcome",),
             "the GPU campaign's record does not name the GPU-only tests"),
    Mutation("campaign_skips_a_gpu_test", "bench/campaign.py",
             '"tests/test_hf_patch.py::test_convergence_bf16_on_gpu_is_close",', "",
             ("tests/test_campaign.py::test_every_gpu_only_test_is_named_on_gpu_and_run_by_the_campaign",),
             "a GPU-only test the campaign does not run"),
)


def _ignore(directory, names):
    import fnmatch

    return {n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in IGNORED)}


def snippet_problems(mutations=MUTATIONS, root: Path = ROOT) -> list[str]:
    """What keeps a mutation from being applied: its file missing, its snippet absent or ambiguous."""
    problems = []
    for m in mutations:
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            problems.append(f"{m.name}: the snippet {m.old!r} occurs {n} times in {m.file} (must be once): "
                            "re-target it")
        if m.old == m.new:
            problems.append(f"{m.name}: the new snippet is the old one")
    return problems


def copy_checkout(dst: Path, root: Path = ROOT) -> Path:
    """A copy of the checkout at ``dst`` in which ``import xlnet_fast`` and ``import
    xlnet_fast.kernels`` find the copy's sources (``xlnet_fast/kernels`` links to ``kernels/``, as in
    a developer's tree), whatever is installed."""
    shutil.copytree(root, dst, ignore=_ignore, symlinks=True)
    link = dst / "xlnet_fast" / "kernels"
    if not link.exists():
        link.symlink_to(Path("..") / "kernels", target_is_directory=True)
    return dst


def apply(m: Mutation, tree: Path) -> None:
    path = tree / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise ValueError(f"{m.name}: snippet not found once in {m.file}")
    path.write_text(text.replace(m.old, m.new))


def _env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLNET_FAST_TEST_INSTALLED"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def check_imports(tree: Path) -> None:
    """The copy's packages are the ones a pytest run in it imports (not an installed xlnet_fast)."""
    code = ("import importlib.util as u; "
            "print(u.find_spec('xlnet_fast').origin); print(u.find_spec('xlnet_fast.kernels').origin)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree), capture_output=True, text=True,
                         check=True).stdout.split()
    outside = [o for o in out if not os.path.realpath(o).startswith(os.path.realpath(tree) + os.sep)]
    if outside:
        raise RuntimeError(f"pytest in the copy would import {outside}, not the copy's sources")


def run_tests(tree: Path, tests, timeout: float = 1200) -> tuple[int, list[str], str]:
    """pytest on ``tests`` in ``tree``: (exit status, failed test ids, the last lines of its output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-c", str(tree / "pyproject.toml"),
           "--rootdir", str(tree), *tests]
    proc = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    failed = sorted({m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", out, re.M)})
    return proc.returncode, failed, "\n".join(out.strip().splitlines()[-15:])


def run_gate(mutations=MUTATIONS, baseline: bool = True, root: Path = ROOT, out=sys.stdout) -> int:
    """Every mutation of ``mutations`` on its own copy of ``root``; 0 when all are killed."""
    def say(line=""):
        print(line, file=out, flush=True)

    problems = snippet_problems(mutations, root)
    if problems:
        say("mutation gate: the source no longer holds these snippets:\n  " + "\n  ".join(problems))
        return 1
    results, status = [], 0
    with tempfile.TemporaryDirectory(prefix="mutation_gate_") as tmp:
        clean = copy_checkout(Path(tmp) / "clean", root)
        check_imports(clean)
        if baseline:
            selection = sorted({t for m in mutations for t in m.tests})
            t0 = time.time()
            code, failed, tail = run_tests(clean, selection)
            say(f"baseline (unmutated, {len(selection)} selections): pytest exit {code} in {time.time() - t0:.0f} s")
            if code != 0:
                say(f"mutation gate: the unmutated checkout fails the selections ({failed}):\n{tail}")
                return 1
        for m in mutations:
            tree = Path(tmp) / m.name
            shutil.copytree(clean, tree, symlinks=True)
            apply(m, tree)
            t0 = time.time()
            code, failed, tail = run_tests(tree, m.tests)
            seconds = time.time() - t0
            if code == 1:
                verdict = "killed"
            elif code == 0:
                verdict, status = "SURVIVED", 1
            else:
                verdict, status = f"ERROR (pytest exit {code})", 1
            results.append((m, verdict, failed, seconds))
            say(f"{m.name:32s} {verdict:10s} {seconds:5.0f} s  {', '.join(failed)}")
            if code not in (0, 1):
                say(tail)
            shutil.rmtree(tree)
    killed = sum(v == "killed" for _, v, _, _ in results)
    say(f"mutation gate: {killed} of {len(results)} mutations killed")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--check", action="store_true", help="only check that every snippet is in the source")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated selections")
    args = parser.parse_args(argv)
    mutations = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"no mutation named {', '.join(unknown)}; --list shows them")
        mutations = tuple(m for m in MUTATIONS if m.name in args.only)
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.what}\n  {m.file}: {m.old!r}\n    -> {m.new!r}\n  tests: {' '.join(m.tests)}")
        return 0
    if args.check:
        problems = snippet_problems(mutations)
        print("\n".join(problems) or f"all {len(mutations)} snippets found once")
        return 1 if problems else 0
    return run_gate(mutations, baseline=not args.no_baseline)


if __name__ == "__main__":
    sys.exit(main())
