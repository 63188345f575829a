"""The command line: its entry points, and a user's mistake is one line on stderr naming the flag or
the file (and line), exit status 2, before any model or data set-up; never a traceback."""

import json
import os
import subprocess
import sys

import pytest

from xlnet_fast.pretrain import loop
from xlnet_fast.pretrain.run_dir import LOCK_NAME
from xlnet_fast.cli import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("in the beginning god created the heaven and the earth.\n" * 50)
    return str(path)


@pytest.fixture
def no_setup(monkeypatch):
    """Fail the test if the tokenizer, the token shard or the model is ever set up."""
    def reached(*args, **kwargs):
        raise AssertionError("model or data set-up started before the error was found")

    for name in ("_prepare_tokenizer", "_prepare_batches", "XLNetLMHeadModel"):
        monkeypatch.setattr(loop, name, reached)


def run(tmp_path, corpus, *extra, data=True):
    args = ["pretrain", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--no-progress",
            "--seq-len", "32", "--reuse-len", "16", "--perm-size", "8", "--vocab-size", "60"]
    return main(args + (["--data", corpus] if data else []) + list(extra))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xlnet-fast"), err
    assert ": error: " in err[0]
    return err[0]


BAD_FLAGS = [
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--perm-size", "0"], "--perm-size must be a positive integer, got 0"),
    (["--log-every", "0"], "--log-every must be a positive integer, got 0"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer, got 0"),
    (["--save-every", "-1"], "--save-every must be 0 (save at the end only) or a positive integer, got -1"),
    (["--keep", "-1"], "--keep must be"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--mem-len", "-1"], "--mem-len must be 0 (no memory) or a positive integer, got -1"),
    (["--reuse-len", "0"], "--reuse-len must be a positive integer, got 0"),
    (["--reuse-len", "-16"], "--reuse-len must be a positive integer, got -16"),
    (["--reuse-len", "28"], r"--reuse-len must be in [1, --seq-len - 5] = [1, 27]"),
    (["--perm-size", "5"], "--perm-size (5) must divide --reuse-len (16)"),
    (["--num-predict", "0"], "--num-predict must be a positive integer"),
    (["--num-predict", "33"], "--num-predict must be in [1, --seq-len] = [1, 32]"),
    (["--seq-len", "0"], "--seq-len must be a positive integer"),
    (["--vocab-size", "5"], "--vocab-size must be an integer above 9"),
    (["--warmup", "-1"], "--warmup must be 0 or a positive integer"),
    (["--lr", "inf"], "--lr must be a positive number up to 1e30, got inf"),
    (["--lr", "nan"], "--lr must be a positive number up to 1e30, got nan"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--bi-data", "--batch-size", "3"], "--bi-data needs an even global batch"),
    (["--resume", "--overwrite"], "--resume continues the run in --out and --overwrite starts a new one"),
    (["--eval-every", "-1"], "--eval-every must be 0 (at the end only) or a positive integer, got -1"),
    (["--eval-batches", "0"], "--eval-batches must be a positive integer, got 0"),
    (["--peak-tflops", "0"], "--peak-tflops must be a positive number, got 0.0"),
    (["--eval-data", "/nonexistent/held.txt"], "--eval-data: data file not found: /nonexistent/held.txt"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63 - 1], got -1"),
    (["--seed", str(10**23)], f"--seed must be an integer in [0, 2**63 - 1], got {10**23}"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
]


def exit_status(call) -> int:
    try:
        return call()
    except SystemExit as exc:  # argparse's own errors
        return exc.code


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_invalid_flag_values(tmp_path, corpus, capsys, no_setup, flags, message):
    assert exit_status(lambda: run(tmp_path, corpus, *flags)) == 2
    assert message in one_error_line(capsys)


def _bad_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.txt").write_text("\n   \n\t\n")
    (d / "latin1.txt").write_bytes("first line\nna\u00efve caf\u00e9\n".encode("latin-1"))
    (d / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    lines = ['{"text": "fine"}', '{"book": 1}']
    (d / "no_text.jsonl").write_text("\n".join(lines) + "\n")
    (d / "null_text.jsonl").write_text('{"text": "fine"}\n\n{"text": null}\n')
    (d / "int_text.jsonl").write_text('{"text": 42}\n')
    (d / "bad_json.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated}\n')
    (d / "list.jsonl").write_text('["text"]\n')
    (d / "blank_text.jsonl").write_text('{"text": "  "}\n')
    return d


BAD_FILES = [
    ("missing.txt", "data file not found: {path}"),
    (".", "--data {path} is a directory without index.json, not prepared data"),
    ("empty.txt", "{path}: no text (the file is empty or holds only blank lines)"),
    ("blank.txt", "{path}: no text"),
    ("blank_text.jsonl", "{path}: no text"),
    ("latin1.txt", "{path}:2: not UTF-8 text"),
    ("latin1.jsonl", "{path}:2: not UTF-8 text"),
    ("no_text.jsonl", "{path}:2: expected a JSON object with a 'text' field"),
    ("null_text.jsonl", "{path}:3: 'text' must be a string, got NoneType"),
    ("int_text.jsonl", "{path}:1: 'text' must be a string, got int"),
    ("bad_json.jsonl", "{path}:2: invalid JSON"),
    ("list.jsonl", "{path}:1: expected a JSON object with a 'text' field"),
]


@pytest.mark.parametrize("name,message", BAD_FILES, ids=[n for n, _ in BAD_FILES])
def test_unusable_data_files(tmp_path, corpus, capsys, no_setup, name, message):
    path = os.path.normpath(str(_bad_files(tmp_path) / name))
    assert run(tmp_path, corpus, "--data", corpus, path, data=False) == 2
    assert message.format(path=path) in one_error_line(capsys)


def test_out_naming_a_file(tmp_path, corpus, capsys, no_setup):
    (tmp_path / "run").write_text("not a directory")
    assert run(tmp_path, corpus) == 2
    assert f"--out {tmp_path / 'run'} is a file, not a directory" in one_error_line(capsys)


def test_out_below_a_file(tmp_path, corpus, capsys, no_setup):
    (tmp_path / "file").write_text("x")
    assert main(["pretrain", "--data", corpus, "--out", str(tmp_path / "file" / "run")]) == 2
    assert f"--out {tmp_path / 'file' / 'run'} is not writable" in one_error_line(capsys)


def test_read_only_out(tmp_path, corpus, capsys, no_setup):
    if os.geteuid() != 0:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
    elif os.path.isdir("/sys"):  # root may write anywhere but in sysfs
        out = "/sys"
    else:
        pytest.skip("no read-only directory for root")
    assert main(["pretrain", "--data", corpus, "--out", str(out)]) == 2
    assert f"--out {out} is not writable" in one_error_line(capsys)


def test_tokenizer_train_reports_a_bad_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["tokenizer", "train", str(empty), "--out", str(tmp_path / "tok")]) == 2
    assert f"{empty}: no text" in one_error_line(capsys)


def test_too_small_corpus_after_set_up_is_one_line(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("in the beginning god created the heaven and the earth.\n" * 20)
    assert run(tmp_path, str(small), "--batch-size", "64", "--steps", "1", "--backend", "eager") == 2
    assert "corpus too small" in capsys.readouterr().err.strip().splitlines()[-1]


def test_divergence_is_one_line_and_exit_status_1(tmp_path, corpus, capsys):
    assert run(tmp_path, corpus, "--lr", "1e30", "--steps", "3", "--batch-size", "2", "--backend", "eager") == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("xlnet-fast: error: step 2: the loss is nan")


def test_no_traceback_from_the_command_line(tmp_path):
    """End to end, as a user runs it: the error is the only line on stderr, and the lock is released."""
    res = subprocess.run([sys.executable, "-m", "xlnet_fast", "pretrain", "--data", str(tmp_path / "nope.txt"),
                          "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"xlnet-fast: error: data file not found: {tmp_path / 'nope.txt'}"]
    assert not os.path.exists(tmp_path / "run" / LOCK_NAME)


def test_jsonl_records_still_train(tmp_path, capsys):
    """Well-formed .jsonl (book boundaries, a trailing blank line) passes the checks and trains."""
    path = tmp_path / "ok.jsonl"
    rows = [{"book": b, "text": f"in the beginning god created day {i} and night"} for b in (1, 2) for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert run(tmp_path, str(path), "--steps", "1", "--batch-size", "2", "--backend", "eager") == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["step"], "eval_loss" in r) for r in rows] == [(1, False), (1, True)]


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backend='auto'" in out


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "xlnet_fast", "info"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "xlnet_fast" in res.stdout
