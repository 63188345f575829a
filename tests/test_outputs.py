"""One rule for every output path: ``--out`` never is, contains or sits inside an input, a run, a
checkpoint or prepared data, and a command replaces only what it wrote — refused with one line
(exit 2) before anything is written, the user's files untouched. Also output paths that used to end
in a traceback: a missing parent, a path under a file, a file where a directory is needed."""

import json
import os
import shutil

import pytest

from helpers.pretraining import train_config

from xlnet_fast.cli import main
from xlnet_fast.pretrain import pretrain


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cache):
    out = tmp_path_factory.mktemp("runs") / "run"
    pretrain(train_config(out, corpus, cache, steps=1))
    return out


def tree(path) -> dict:
    """Every file under ``path`` with its bytes."""
    return {os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(path) for n in names}


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("xlnet-fast")]
    assert len(err) == 1 and ": error: " in err[0], err
    return err[0]


@pytest.mark.parametrize("where,message", [
    (lambda run: run, "is the input"),
    (lambda run: run / "checkpoints", "is inside the input"),
    (lambda run: run / "checkpoints" / "step_0000001", "is inside the input"),
    (lambda run: run.parent, "contains the input"),
])
def test_export_never_replaces_its_source(run, tmp_path, capsys, where, message):
    before = tree(run.parent)
    assert main(["export", str(run), "--out", str(where(run)), "--overwrite"]) == 2
    assert message in one_error_line(capsys)
    assert tree(run.parent) == before


def test_export_replaces_only_an_earlier_export(run, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 2
    assert f"holds {out / 'notes.txt'}, which export did not write" in one_error_line(capsys)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    other_run = tmp_path / "other"
    shutil.copytree(run, other_run)
    assert main(["export", str(run), "--out", str(other_run / "checkpoints"), "--overwrite"]) == 2
    assert f"is inside {other_run}, which is a pretraining run directory" in one_error_line(capsys)


def test_prepare_keeps_files_it_did_not_write(corpus, tmp_path, capsys):
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", corpus, "--vocab-size", "120", "--out", str(tok)]) == 0
    out = tmp_path / "data"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "my_notes.txt").write_text("mine")
    before = tree(out)
    assert main(["data", "prepare", corpus, "--tokenizer", str(tok), "--out", str(out), "--no-progress"]) == 2
    assert f"holds {out / 'tokenizer' / 'my_notes.txt'}, which data prepare did not write" in one_error_line(capsys)
    assert tree(out) == before
    assert main(["data", "prepare", corpus, "--tokenizer", str(tok), "--out", str(tok), "--no-progress"]) == 2
    assert "contains the input" in one_error_line(capsys)


def test_prepare_removes_what_it_wrote_when_the_input_is_bad(corpus, tmp_path, capsys):
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", corpus, "--vocab-size", "120", "--out", str(tok)]) == 0
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n" * 50 + b"caf\xe9\n")
    out = tmp_path / "data"
    assert main(["data", "prepare", corpus, str(bad), "--tokenizer", str(tok), "--out", str(out), "--no-progress",
                 "--shard-tokens", "50"]) == 2
    assert "not UTF-8" in one_error_line(capsys)
    assert sorted(os.listdir(out)) == ["prepare.lock"]  # no index, shard or tokenizer left half-made


def test_pretrain_out_inside_its_data_or_another_run(run, corpus, cache, tmp_path, capsys):
    with pytest.raises(ValueError, match="is inside .*, which is a pretraining run directory"):
        pretrain(train_config(run / "checkpoints" / "nested", corpus, cache))
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus, data / "text.txt")
    with pytest.raises(ValueError, match="contains the input"):
        pretrain(train_config(data, str(data / "text.txt"), cache))
    assert sorted(os.listdir(data)) == ["text.txt"]


def test_pretrain_overwrite_deletes_only_its_checkpoints(run, corpus, cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "checkpoints" / "README.txt").write_text("mine")
    (out / "notes.txt").write_text("mine")
    pretrain(train_config(out, corpus, cache, steps=1, overwrite=True, save_every=0))
    assert (out / "checkpoints" / "README.txt").read_text() == "mine" and (out / "notes.txt").read_text() == "mine"


def test_output_paths_that_used_to_end_in_a_traceback(run, corpus, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("x")
    assert main(["plot", str(run), "--out", str(tmp_path / "new" / "dir" / "loss.png")]) == 0
    assert (tmp_path / "new" / "dir" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(tmp_path / "file")]) == 2  # not a PNG this command wrote
    assert "exists and was not written by plot" in one_error_line(capsys)
    assert main(["export", str(run), "--out", str(tmp_path / "file" / "x")]) == 1  # a path under a file
    assert f"{tmp_path / 'file'}: " in one_error_line(capsys)
    assert main(["tokenizer", "train", corpus, "--vocab-size", "120", "--out", str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is a file, not a directory" in one_error_line(capsys)
    assert (tmp_path / "file").read_text() == "x"


def test_plot_without_a_learning_rate(run, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3)) + "\n")
    assert main(["plot", str(out)]) == 0 and (out / "loss.png").exists()
