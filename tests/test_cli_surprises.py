"""A newcomer's first hour (issue 35): what the commands say and write when the input is small, already
there, bad or unfinished — a vocabulary smaller than asked is said, every command follows one overwrite
rule, a run that fails on its data writes nothing, "no checkpoint yet" is told apart from "none
readable", every command logs in one format, eval uses a transformers directory's own layout and says
which, and `info` says what the Triton backend is on a machine without a GPU."""

import json
import logging
import os
import shutil

import pytest

from helpers.faults import xlnet_fast
from helpers.pretraining import TINY_RUN, train_config, write_corpus

from xlnet_fast import cli
from xlnet_fast.cli import main
from xlnet_fast.pretrain import loop, pretrain
from xlnet_fast.pretrain.checkpoint import newest_readable
from xlnet_fast.pretrain.tokenizers import load_tokenizer_dir, tokenizer_kind

LAYOUT = ["--seq-len", "32", "--num-predict", "6", "--perm-size", "8", "--batch-size", "4"]  # TINY_RUN's


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cache):
    out = tmp_path_factory.mktemp("runs") / "run"
    pretrain(train_config(out, corpus, cache, steps=1))
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert main(["tokenizer", "train", corpus, "--vocab-size", "60", "--out", str(out)]) == 0
    return out


def tree(path) -> dict | None:
    """Every directory (``name/``: None) and file (its bytes) under ``path``; None when there is no ``path``."""
    if not os.path.exists(path):
        return None
    found = {}
    for d, _, names in os.walk(path):
        found[os.path.relpath(d, path) + "/"] = None
        for n in names:
            found[os.path.relpath(os.path.join(d, n), path)] = open(os.path.join(d, n), "rb").read()
    return found


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("xlnet-fast")]
    assert len(err) == 1 and ": error: " in err[0], err
    return err[0]


# ---------------------------------------------------------------------------------------------
# 1. A vocabulary smaller than asked is said, with what limited it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,what", [("sentencepiece", "distinct words of"), ("word", "distinct symbols besides")])
def test_a_vocabulary_smaller_than_asked_is_a_warning(corpus, tmp_path, caplog, kind, what):
    with caplog.at_level(logging.WARNING):
        assert main(["tokenizer", "train", corpus, "--kind", kind, "--vocab-size", "32000", "--out",
                     str(tmp_path / "tok")]) == 0
    size = load_tokenizer_dir(tmp_path / "tok").vocab_size
    assert size < 32000
    (record,) = [r for r in caplog.records if "fewer than the 32000 asked" in r.getMessage()]
    assert record.levelno == logging.WARNING and f"has {size} " in record.getMessage()
    assert what in record.getMessage()


def test_a_vocabulary_of_the_size_asked_is_not_warned(corpus, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert main(["tokenizer", "train", corpus, "--vocab-size", "40", "--out", str(tmp_path / "tok")]) == 0
    assert load_tokenizer_dir(tmp_path / "tok").vocab_size == 40 and "fewer than" not in caplog.text


# ---------------------------------------------------------------------------------------------
# 2. One overwrite rule for every command that writes a directory
# ---------------------------------------------------------------------------------------------


def test_tokenizer_train_replaces_a_tokenizer_only_with_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", corpus, "--vocab-size", "40", "--out", str(out)]) == 0
    before = tree(out)
    assert main(["tokenizer", "train", corpus, "--vocab-size", "50", "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert f"--out {out} already holds spiece.model" in line and "from an earlier tokenizer train" in line
    assert "pass --overwrite to replace it" in line and tree(out) == before
    assert main(["tokenizer", "train", corpus, "--kind", "word", "--vocab-size", "20", "--out", str(out)]) == 2
    assert "--overwrite" in one_error_line(capsys) and tree(out) == before
    assert main(["tokenizer", "train", corpus, "--kind", "word", "--vocab-size", "20", "--out", str(out),
                 "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["tokenizer_config.json", "vocab.txt"]  # the other kind's files went too
    assert tokenizer_kind(load_tokenizer_dir(out)) == "word"


def test_data_prepare_replaces_other_data_only_with_overwrite(corpus, tok, tmp_path, capsys):
    out = tmp_path / "data"
    other = write_corpus(tmp_path / "other.txt", seed=1, docs=10)
    prepare = ["data", "prepare", "--tokenizer", str(tok), "--out", str(out), "--no-progress", "--workers", "1"]
    assert main([*prepare, corpus]) == 0
    before = tree(out)
    assert main([*prepare, other]) == 2
    line = one_error_line(capsys)
    assert f"--out {out} already holds prepared data that is out of date" in line and "--overwrite" in line
    assert tree(out) == before
    assert main([*prepare, corpus]) == 0  # the same files: continued (here: verified), no --overwrite needed
    assert tree(out) == before
    assert main([*prepare, other, "--overwrite"]) == 0
    assert json.loads((out / "index.json").read_text())["sources"][0]["path"] == other


def test_pretrain_refuses_an_earlier_runs_metrics_without_overwrite(corpus, cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    monkeypatch.setattr(loop, "_prepare_tokenizer", lambda *a: pytest.fail("set-up started"))
    assert main(["pretrain", "--data", corpus, "--out", str(out), "--cache-dir", cache, "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "already holds metrics.jsonl (no checkpoint) from an earlier pretrain: pass --overwrite" in line
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_every_command_says_the_same_rule(run, corpus, tok, tmp_path, capsys):
    """export, tokenizer train, data prepare and pretrain refuse their own earlier output in one sentence."""
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    capsys.readouterr()
    data = tmp_path / "data"
    assert main(["data", "prepare", corpus, "--tokenizer", str(tok), "--out", str(data), "--no-progress",
                 "--workers", "1"]) == 0
    again = {"export": ["export", str(run), "--out", str(export)],
             "tokenizer train": ["tokenizer", "train", corpus, "--vocab-size", "50", "--out", str(tok)],
             "data prepare": ["data", "prepare", corpus, "--tokenizer", str(tok), "--out", str(data), "--no-progress",
                              "--shard-tokens", "7"],
             "pretrain": ["pretrain", "--data", corpus, "--out", str(run)]}
    for command, argv in again.items():
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert f"from an earlier {command}: pass " in line and "--overwrite to replace it (or choose another --out)" \
            in line, line


# ---------------------------------------------------------------------------------------------
# 3. A pretrain that fails on its data writes nothing
# ---------------------------------------------------------------------------------------------


def _bad_data(tmp_path, tok):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("na\u00efve caf\u00e9\n".encode("latin-1"))
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated}\n')
    (d / "not_prepared").mkdir()
    (d / "small.txt").write_text("in the beginning god created the heaven and the earth.\n" * 20)
    return {
        "missing": ["--data", str(d / "missing.txt")],
        "empty": ["--data", str(d / "empty.txt")],
        "non-utf8": ["--data", str(d / "latin1.txt")],
        "bad jsonl": ["--data", str(d / "bad.jsonl")],
        "unprepared directory": ["--data", str(d / "not_prepared")],
        "vocabulary mismatch": ["--tokenizer", str(tok), "--vocab-size", "50"],
        "too small": ["--data", str(d / "small.txt"), "--batch-size", "64"],  # found after tokenizing
    }


CASES = ["missing", "empty", "non-utf8", "bad jsonl", "unprepared directory", "vocabulary mismatch", "too small"]


@pytest.mark.parametrize("existing", [False, True], ids=["new out", "existing out"])
@pytest.mark.parametrize("case", CASES)
def test_a_pretrain_failing_on_its_data_leaves_out_as_it_was(corpus, tok, cache, tmp_path, capsys, case, existing):
    argv = ["--data", corpus, *_bad_data(tmp_path, tok)[case]]
    out = tmp_path / "runs" / "run"
    if existing:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    before = tree(tmp_path / "runs")
    sizes = [a for name, v in TINY_RUN.items() if name != "vocab_size" for a in (f"--{name.replace('_', '-')}", str(v))]
    assert main(["pretrain", "--out", str(out), "--cache-dir", cache, "--no-progress", "--backend", "eager",
                 "--steps", "1", *sizes, *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("xlnet-fast: error: ")
    assert tree(tmp_path / "runs") == before  # no out (nor its parent), or out as it was: no checkpoints/, no lock


# ---------------------------------------------------------------------------------------------
# 4, 5. No checkpoint yet, none readable, no metrics
# ---------------------------------------------------------------------------------------------


def test_the_fallback_warning_says_whether_an_older_checkpoint_remains(tmp_path, caplog):
    root = tmp_path / "run" / "checkpoints"
    for name in ("step_0000001", "step_0000002"):
        (root / name).mkdir(parents=True)  # no COMPLETE: unreadable
    with caplog.at_level(logging.WARNING):
        assert newest_readable([str(root / "step_0000001"), str(root / "step_0000002")]) == (
            None, [str(root / "step_0000002"), str(root / "step_0000001")])
    newer, older = [r.getMessage() for r in caplog.records]
    assert "step_0000002 is unreadable" in newer and newer.endswith("falling back to the previous one, step_0000001")
    assert "step_0000001 is unreadable" in older and older.endswith("no older checkpoint to fall back to")


def test_eval_of_a_run_whose_only_checkpoint_is_unreadable(run, tmp_path, capsys, caplog):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "step_0000001" / "COMPLETE").unlink()
    with caplog.at_level(logging.WARNING):
        assert main(["eval", "--model", str(copy)]) == 2
    assert "falling back" not in caplog.text and "no older checkpoint to fall back to" in caplog.text
    line = one_error_line(capsys)
    assert "no readable checkpoint" in line and "the only one, step_0000001, is unreadable" in line


@pytest.mark.parametrize("holds", [["checkpoints/"], ["metrics.jsonl"]])
@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_run_that_never_saved_has_no_checkpoint_yet(tmp_path, capsys, command, holds):
    out = tmp_path / "run"
    out.mkdir()
    for name in holds:
        if name.endswith("/"):
            (out / name).mkdir()
        else:
            (out / name).write_text('{"step": 1, "loss": 4.0}\n')
    argv = ["export", str(out), "--out", str(tmp_path / "export")] if command == "export" else \
        ["eval", "--model", str(out)]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert f"no checkpoint yet in {out / 'checkpoints'}: the run has not saved one" in line
    assert "readable" not in line and not (tmp_path / "export").exists()


def test_plot_names_the_missing_metrics_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "run").mkdir()
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'run' / 'metrics.jsonl'} does not exist" in one_error_line(capsys)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "run")]) == 2
    assert "metrics.jsonl: no training rows to plot" in one_error_line(capsys)


# ---------------------------------------------------------------------------------------------
# 6. One logging format for every command
# ---------------------------------------------------------------------------------------------


def test_generate_logs_as_every_command_does(run, tmp_path):
    """A warning while loading (the newest checkpoint unreadable) in the format of the other commands."""
    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints" / "step_0000001", copy / "checkpoints" / "step_0000001")
    (copy / "checkpoints" / "step_0000002").mkdir()  # unfinished: no COMPLETE
    res = xlnet_fast("generate", "--model", copy, "--prompt", "in the beginning", "--max-new-tokens", "2")
    assert res.returncode == 0, res.stderr
    (warning,) = [line for line in res.stderr.splitlines() if "is unreadable" in line]
    assert warning.startswith("WARNING xlnet_fast.pretrain.checkpoint: checkpoint ")


def test_every_command_sets_up_logging_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "setup_logging", lambda: calls.append(1))
    for argv in (["info"], ["plot", "/nonexistent/run"], ["eval", "--model", "/nonexistent"]):
        main(argv)
    assert calls == [1, 1, 1]


# ---------------------------------------------------------------------------------------------
# 7. eval of a transformers directory: its own layout, said in the JSON line
# ---------------------------------------------------------------------------------------------


def eval_json(capsys, *args) -> dict:
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_a_transformers_directory_uses_its_config_layout(run, corpus, cache, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    flags = ["--data", corpus, "--cache-dir", cache, "--batches", "2"]
    ckpt = eval_json(capsys, "--model", str(run), *flags)
    exported = eval_json(capsys, "--model", str(export), *flags, *LAYOUT)  # no --mem-len, --reuse-len
    assert exported["layout"] == ckpt["layout"] == {"seq_len": 32, "reuse_len": 16, "mem_len": 16, "num_predict": 6,
                                                    "perm_size": 8, "bi_data": False}
    assert exported["layout_from"] == {"seq_len": "--seq-len", "reuse_len": "config.json", "mem_len": "config.json",
                                       "num_predict": "--num-predict", "perm_size": "--perm-size"}
    assert ckpt["layout_from"]["mem_len"] == "the run"
    assert exported["eval_loss"] == pytest.approx(ckpt["eval_loss"], rel=1e-5)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "mem_len": None}))  # as on the hub: no memory length
    base = eval_json(capsys, "--model", str(export), *flags, *LAYOUT)
    assert base["layout"]["mem_len"] == 384 and base["layout_from"]["mem_len"] == "the base preset"


def test_an_invalid_layout_says_where_its_values_came_from(run, corpus, cache, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(export), "--data", corpus, "--cache-dir", cache]) == 2
    line = one_error_line(capsys)
    assert "reuse_len 16 (config.json)" in line and "perm_size 256 (the base preset)" in line


# ---------------------------------------------------------------------------------------------
# 8. info without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpret", [None, "1"])
def test_info_without_a_gpu_says_what_the_triton_backend_is(monkeypatch, capsys, interpret):
    import torch

    from xlnet_fast.attention import triton_status

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert main(["info"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("triton backend usable:")]
    assert not line.startswith("triton backend usable: yes")
    if triton_status()[0]:
        assert "for tests" in line and ("only in Triton's CPU interpreter" in line) == (interpret == "1")


# ---------------------------------------------------------------------------------------------
# 9. Found by probing the commands as a careless user would (bench/NOTES.md, 2026-11-30)
# ---------------------------------------------------------------------------------------------


def test_a_loss_png_of_the_users_is_kept_by_plot_and_by_a_run(run, corpus, cache, tmp_path, capsys):
    """RUN_DIR/loss.png was replaced whatever it held, by ``plot RUN_DIR`` and at the end of a run
    (``--out`` of plot was checked, the default path not)."""
    pytest.importorskip("matplotlib")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "loss.png").write_text("my notes")
    assert main(["plot", str(copy)]) == 2
    assert "loss.png exists and is not a plot" in one_error_line(capsys)
    assert (copy / "loss.png").read_text() == "my notes"
    os.remove(copy / "loss.png")
    assert main(["plot", str(copy)]) == 0 and main(["plot", str(copy)]) == 0  # its own plot, drawn again
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "loss.png").write_text("my notes")
    pretrain(train_config(fresh, corpus, cache, steps=1))
    assert (fresh / "loss.png").read_text() == "my notes"


@pytest.mark.parametrize("command", [["tokenizer", "train", "CORPUS", "--vocab-size", "60"],
                                     ["data", "prepare", "CORPUS", "--tokenizer", "TOK"],
                                     ["export", "RUN"], ["plot", "RUN"]])
def test_an_empty_out_is_refused_not_taken_for_the_working_directory(command, run, tok, corpus, tmp_path, monkeypatch,
                                                                     capsys):
    """``tokenizer train --out ""`` wrote into the working directory over a tokenizer.json there
    (``os.path.lexists("")`` is False: the directory looked new)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("mine")
    argv = [{"CORPUS": corpus, "TOK": str(tok), "RUN": str(run)}.get(a, a) for a in command]
    assert main([*argv, "--out", ""]) == 2
    assert "--out is empty" in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json"] and (tmp_path / "tokenizer.json").read_text() == "mine"


def test_a_vocabulary_below_the_texts_characters_and_a_text_of_overlong_lines_are_one_line(corpus, tmp_path, capsys):
    """sentencepiece's CHECK failures came out as tracebacks (exit 1): a --vocab-size below the
    characters the text needs, and a text whose every line is past its 4192 bytes."""
    assert main(["tokenizer", "train", corpus, "--vocab-size", "10", "--out", str(tmp_path / "a")]) == 2
    assert "--vocab-size 10 is below the" in one_error_line(capsys)
    long = tmp_path / "long.txt"
    long.write_text(" ".join(["word"] * 2000) + "\n")
    assert main(["tokenizer", "train", str(long), "--vocab-size", "60", "--out", str(tmp_path / "b")]) == 2
    assert "longer than 4192 bytes" in one_error_line(capsys)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["pretrain", "generate", "eval"])
def test_a_forced_triton_backend_without_a_gpu_is_refused_before_anything_is_written(command, run, corpus, cache,
                                                                                    tmp_path, monkeypatch, capsys):
    """``--backend triton`` on a machine without CUDA (and not in the interpreter) failed at the first
    forward with a traceback; pretrain left a run directory that refused the retry."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "out"
    argv = {"pretrain": ["pretrain", "--data", corpus, "--out", str(out), "--cache-dir", cache, *LAYOUT, "--steps", "1"],
            "generate": ["generate", "--model", str(run), "--prompt", "the"],
            "eval": ["eval", "--model", str(run), "--data", corpus, "--cache-dir", cache]}[command]
    assert main([*argv, "--backend", "triton"]) == 2
    assert "--backend triton: backend='triton' needs CUDA tensors" in one_error_line(capsys)
    assert not out.exists()


def test_prepare_refuses_more_workers_than_the_machine_can_hold(tok, corpus, tmp_path, capsys):
    """``data prepare --workers 100000`` forked thousands of processes until the machine ran out of
    memory, leaving its lock and index behind."""
    out = tmp_path / "prepared"
    assert main(["data", "prepare", corpus, "--tokenizer", str(tok), "--out", str(out), "--workers", "100000"]) == 2
    assert "--workers 100000: at most 4 x the" in one_error_line(capsys)
    assert not out.exists()


def test_resume_without_a_checkpoint_keeps_the_metrics_it_would_have_deleted(corpus, cache, tmp_path, capsys):
    """``--resume`` on a run directory with metrics but no checkpoint (a run killed before its first
    save) started over and deleted them, where a plain run there asks for --overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 7.5}\n')
    argv = ["pretrain", "--data", corpus, "--out", str(out), "--cache-dir", cache, *LAYOUT, "--steps", "1",
            "--backend", "eager", "--no-progress"]
    assert main([*argv, "--resume"]) == 2
    assert "holds metrics.jsonl but no checkpoint" in one_error_line(capsys)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 7.5}\n'


def test_the_last_steps_checkpoint_is_saved_before_its_evaluation(corpus, cache, tmp_path, monkeypatch):
    """Ctrl-C during the last step's evaluation (which does not look at Ctrl-C) lost the whole run
    when nothing was saved before (``--save-every 0``, the default): the last step saved after it."""
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.Trainer, "_evaluate", interrupted)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        pretrain(train_config(out, corpus, cache, steps=2, save_every=0))
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000002"]


def test_fsdp_in_one_process_says_it_shards_nothing(corpus, cache, tmp_path, caplog):
    """``--fsdp`` without torchrun was silently ignored."""
    with caplog.at_level(logging.WARNING, logger="xlnet_fast"):
        pretrain(train_config(tmp_path / "run", corpus, cache, steps=1, fsdp=True))
    assert any("--fsdp: a single process has nothing to shard" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("seed", [str(10**23), "-1", str(2**63)])
def test_a_seed_torch_cannot_take_names_its_flag(seed, run, capsys):
    """``generate --sample --seed 10**23`` failed with "Overflow when unpacking long long", no flag
    named; -1 was taken. The range is pretrain's (``settings.MAX_SEED``)."""
    assert main(["generate", "--model", str(run), "--prompt", "the", "--sample", "--seed", seed]) == 2
    assert f"--seed must be an integer in [0, 2**63 - 1], got {seed}" in one_error_line(capsys)


@pytest.mark.parametrize("flags", [["--top-k", "5"], ["--temperature", "0.7"], ["--top-p", "0.9"], ["--seed", "3"]])
def test_sampling_settings_without_sample_are_refused(flags, run, capsys):
    """``generate`` decodes greedily unless --sample: its sampling settings were ignored without it."""
    assert main(["generate", "--model", str(run), "--prompt", "the", *flags]) == 2
    assert f"{flags[0]}: sampling settings, but decoding is greedy: add --sample" in one_error_line(capsys)


def test_eval_of_a_transfo_xl_directory_refuses_the_data_cache_it_does_not_use(tmp_path, capsys):
    """``eval --model TXL_DIR --cache-dir D`` ignored --cache-dir (a Transformer-XL directory's text is
    read as it is), while --verify-data on the same command was refused."""
    from helpers.transfo_xl import SMALL, write_hf4_dir

    write_hf4_dir(tmp_path / "txl", SMALL)
    (tmp_path / "text.txt").write_text("a b c\n")
    argv = ["eval", "--model", str(tmp_path / "txl"), "--data", str(tmp_path / "text.txt")]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "--cache-dir: XLNet's record layout" in one_error_line(capsys)
    assert not (tmp_path / "cache").exists()
