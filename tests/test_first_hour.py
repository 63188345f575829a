"""A newcomer's first hour (issue 35): the README's set-up (the clone's folder, the virtual environment,
the CPU torch wheel), a clone named ``xlnet_fast`` shadowing the package, and long work that shows
progress: ``xlnet-fast eval``'s bar on stderr (stdout: its JSON line only, ``--no-progress``: no bar)
and the log lines around the tokenizer the first ``pretrain`` trains."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.pretraining import train_config

import xlnet_fast
from xlnet_fast.cli import main
from xlnet_fast.pretrain import pretrain
from xlnet_fast.pretrain.tokenizers import load_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The README's set-up
# ---------------------------------------------------------------------------------------------


def setup_block() -> list[str]:
    """The lines of the first bash block of the README's "Set-up" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set-up"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return block[:block.index("```")].splitlines()


def test_the_readme_clones_into_a_folder_python_cannot_import():
    """A clone named ``xlnet_fast`` is imported as the package by Python started in its parent."""
    lines = setup_block()
    clone = next(line for line in lines if line.startswith("git clone "))
    folder = clone.split()[3]
    assert not folder.isidentifier(), clone  # never importable as a module
    assert f"&& cd {folder}" in clone


def test_the_readme_sets_up_a_venv_outside_the_checkout_then_two_commands():
    lines = [line.split("#")[0].strip() for line in setup_block()]
    commands = [line for line in lines if line]
    assert commands[0].startswith("git clone ") and commands[1].startswith("python3 -m venv ")
    venv = commands[1].split()[3]
    assert venv.startswith(("~/", "/", "../")), commands[1]  # outside the checkout (the mutation gate copies it)
    assert f"&& . {venv}/bin/activate" in commands[1]
    install, tests = commands[2:]  # after the clone and the venv: two commands
    assert install.endswith("&& xlnet-fast pretrain --preset tiny") and tests == "python -m pytest -q -n auto"
    # CI runs that command (-n auto: one pytest-xdist worker per core, from the test extra)
    assert '-m pytest -q -n auto -c "$CHECKOUT/pyproject.toml"' in (ROOT / ".ci" / "run").read_text()
    assert re.search(r'test = \[[^]]*"pytest-xdist"', (ROOT / "pyproject.toml").read_text())
    # the CPU wheel from PyTorch's CPU index, at CI's pin
    pin = re.search(r"torch==([0-9.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    assert install.startswith(f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu && ")


# ---------------------------------------------------------------------------------------------
# A clone named xlnet_fast, Python started in its parent
# ---------------------------------------------------------------------------------------------

# What an editable install (setuptools' finder, appended to sys.meta_path) gives, without site-packages:
# xlnet_fast and its submodules from the package under test, found after Python's own path search.
EDITABLE_LIKE = """
import importlib.machinery, importlib.util, runpy, sys
PACKAGE = {package!r}

class Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "xlnet_fast":
            return importlib.util.spec_from_file_location(fullname, PACKAGE + "/__init__.py",
                                                          submodule_search_locations=[PACKAGE])
        if fullname.startswith("xlnet_fast.") and fullname.count(".") == 1:
            return importlib.machinery.PathFinder.find_spec(fullname, [PACKAGE])
        return None

sys.meta_path.append(Finder)
runpy.run_module("xlnet_fast", run_name="__main__", alter_sys=True)
"""


def test_python_m_in_the_parent_of_a_clone_named_xlnet_fast_says_so_in_one_line(tmp_path):
    """The checkout's root becomes an empty namespace package ``xlnet_fast`` and the editable finder
    supplies ``xlnet_fast.__main__`` only: one line naming the folder, exit status 1, no traceback."""
    clone = tmp_path / "xlnet_fast"
    clone.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    for name in ("xlnet_fast", "kernels"):
        shutil.copytree(ROOT / name, clone / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("bench", "tests", "docs"):
        (clone / name).mkdir()
    code = EDITABLE_LIKE.format(package=os.path.dirname(xlnet_fast.__file__))
    # -E -S: no PYTHONPATH, no site-packages (where an installed package would win over the namespace)
    res = subprocess.run([sys.executable, "-E", "-S", "-c", code, "info"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1 and res.stdout == "", res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"xlnet-fast: error: Python imported {clone} as the package xlnet_fast")
    assert "rename the clone" in lines[0]


# ---------------------------------------------------------------------------------------------
# Long work shows progress
# ---------------------------------------------------------------------------------------------


@contextmanager
def log_messages(name: str):
    """The messages logged at INFO or above to the logger ``name`` inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, handler = logging.getLogger(name), Collect(logging.INFO)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus):
    """Two tiny one-step runs on the same text and cache: the first trains the tokenizer, the second
    finds it cached. Returns (root, the loop's log messages of each run)."""
    root = tmp_path_factory.mktemp("first_hour")
    logs = []
    for name in ("run", "again"):
        with log_messages("xlnet_fast.pretrain.loop") as messages:
            pretrain(train_config(root / name, corpus, root / "cache", steps=1, eval_batches=1))
        logs.append(messages)
    return root, logs


def test_the_first_pretrain_says_it_trains_the_tokenizer_and_what_it_got(two_runs, corpus):
    root, (first, second) = two_runs
    training = [m for m in first if m.startswith("training ")]
    assert len(training) == 1, first
    assert f"training a sentencepiece (unigram) tokenizer of at most 120 tokens on {corpus}" in training[0]
    cached = re.search(r"cached in (\S+) ", training[0]).group(1)
    vocab = load_tokenizer_dir(cached).vocab_size
    done = [m for m in first if m.startswith("trained the tokenizer")]
    assert len(done) == 1 and done[0].endswith(f": a vocabulary of {vocab} tokens"), first
    assert first.index(training[0]) < first.index(done[0])
    assert not [m for m in second if "tokenizer" in m], second  # cached: nothing trained, nothing said


def test_eval_shows_a_progress_bar_on_stderr_and_only_json_on_stdout(two_runs, capsys):
    root, _ = two_runs
    args = ["eval", "--model", str(root / "run"), "--cache-dir", str(root / "cache"), "--batches", "2"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    assert json.loads(line)["batches"] == 2
    assert "eval: 100%" in err and "2/2" in err, err
    assert main([*args, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["eval_loss"] == json.loads(line)["eval_loss"]
    assert "eval:" not in err and "%|" not in err, err
