"""The trainer's run directory: one run owns it (lock), fresh runs do not clobber checkpoints,
resume checks every file and the stored settings, metrics survive a torn tail, divergence never
saves non-finite weights."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers.pretraining import as_written_before_0_1, pretrain_command, train_config, write_corpus

from xlnet_fast.pretrain import (NonFiniteLossError, TrainConfig, UsageError, list_checkpoints,
                                 load_latest_checkpoint, pretrain)
from xlnet_fast.pretrain.checkpoint import dcp_metadata
from xlnet_fast.pretrain.run_dir import LOCK_NAME


def resume_cfg(out, cache, **kw):
    """A resume that gives only what a user retyping the command would: the settings come from the run."""
    return TrainConfig(out=str(out), cache_dir=cache, resume=True, progress=False, backend="eager", **kw)


def training_rows(out):
    """metrics.jsonl without the held-out evaluation rows."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r]


def steps_in(out):
    return [r["step"] for r in training_rows(out)]


def names(out):
    return [os.path.basename(p) for p in list_checkpoints(TrainConfig(out=str(out)))]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, corpus, cache):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied, never changed, by the tests)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    pretrain(train_config(out, corpus, cache, steps=2, save_every=1, keep=5))
    return out


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Fresh runs, --overwrite, --resume without a checkpoint
# ---------------------------------------------------------------------------------------------


def test_fresh_run_refuses_a_directory_with_checkpoints(two_checkpoints, corpus, cache, tmp_path):
    out = copy_run(two_checkpoints, tmp_path / "run")
    before = {n: (out / "checkpoints" / n / "COMPLETE").read_bytes() for n in names(out)}
    metrics = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(UsageError, match="already holds checkpoints.*--resume.*--overwrite"):
        pretrain(train_config(out, corpus, cache, steps=3, save_every=1, keep=1))
    assert {n: (out / "checkpoints" / n / "COMPLETE").read_bytes() for n in names(out)} == before
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert not (out / LOCK_NAME).exists()


def test_overwrite_deletes_the_old_checkpoints_first(two_checkpoints, corpus, cache, tmp_path, caplog):
    out = copy_run(two_checkpoints, tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        pretrain(train_config(out, corpus, cache, steps=1, keep=1, seed=7, overwrite=True))
    assert "--overwrite: deleted 2 checkpoint(s)" in caplog.text
    assert names(out) == ["step_0000001"]
    assert steps_in(out) == [1]
    with open(out / "checkpoints" / "step_0000001" / "run.json") as f:
        assert json.load(f)["settings"]["seed"] == 7


def test_resume_without_a_checkpoint_says_it_starts_from_step_0(corpus, cache, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        res = pretrain(train_config(tmp_path / "run", corpus, cache, steps=1, resume=True))
    assert "no checkpoint" in caplog.text and "starting from step 0" in caplog.text
    assert res["step"] == 1 and steps_in(tmp_path / "run") == [1]


def test_resume_and_overwrite_together_is_an_error(corpus, cache, tmp_path):
    with pytest.raises(UsageError, match="--resume.*--overwrite"):
        pretrain(train_config(tmp_path / "run", corpus, cache, resume=True, overwrite=True))


# ---------------------------------------------------------------------------------------------
# Settings stored in the checkpoint
# ---------------------------------------------------------------------------------------------


def test_resume_restores_the_stored_settings(two_checkpoints, cache, tmp_path):
    out = copy_run(two_checkpoints, tmp_path / "run")
    res = pretrain(resume_cfg(out, cache, steps=3))  # no --data, --batch-size, --seq-len, ... given
    assert res["step"] == 3 and steps_in(out) == [1, 2, 3]
    with open(out / "checkpoints" / "step_0000003" / "run.json") as f:
        settings = json.load(f)["settings"]
    assert (settings["batch_size"], settings["seq_len"], settings["perm_size"], settings["keep"]) == (4, 32, 8, 5)


@pytest.mark.parametrize("change,message", [
    (dict(batch_size=8), r"--batch-size 8 on 1 rank\(s\) makes a global batch of 8 .*the checkpoint's is 4 .*"
                         "pass --batch-size 4 to keep it"),
    (dict(grad_accum=2), "--grad-accum 2 differs from the checkpoint's 1"),
    (dict(preset="base"), "--preset base differs from the checkpoint's tiny"),
    (dict(seed=5), "--seed 5 differs from the checkpoint's 0"),
    (dict(mem_len=8), "--mem-len 8 differs from the checkpoint's 16"),
    (dict(perm_size=4), "--perm-size 4 differs from the checkpoint's 8"),
])
def test_resume_refuses_a_setting_that_cannot_change(two_checkpoints, cache, tmp_path, change, message):
    out = copy_run(two_checkpoints, tmp_path / "run")
    with pytest.raises(UsageError, match=message + ".*cannot change mid-run"):
        pretrain(resume_cfg(out, cache, steps=3, **change))
    assert names(out) == ["step_0000001", "step_0000002"] and steps_in(out) == [1, 2]


def test_resume_refuses_other_data(two_checkpoints, cache, tmp_path, corpus):
    out = copy_run(two_checkpoints, tmp_path / "run")
    other = write_corpus(tmp_path / "other.txt", seed=1)
    with pytest.raises(UsageError, match=f"--data {other} differs from the checkpoint's data {corpus}"):
        pretrain(resume_cfg(out, cache, steps=3, data=[other]))


def test_resume_applies_a_changed_lr_and_steps_once(two_checkpoints, cache, tmp_path, caplog):
    out = copy_run(two_checkpoints, tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        pretrain(resume_cfg(out, cache, steps=6, lr=1e-3))
    changes = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert len(changes) == 1 and "--steps 2 -> 6" in changes[0] and "--lr 0.002 -> 0.001" in changes[0]
    rows = training_rows(out)
    # a row's lr is the next update's: lr * (s + 1) / 4 during the 4 warmup steps, then linear decay
    # to the new end: (6 - s) / (6 - 4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[1]["lr"] == pytest.approx(2e-3 * 3 / 4)  # the old run's rows stay as they were
    assert rows[2]["lr"] == pytest.approx(1e-3 * 4 / 4)
    assert rows[4]["lr"] == pytest.approx(1e-3 * 1 / 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # said once: the new values are now the run's own
        pretrain(resume_cfg(out, cache, steps=7))
    assert "--lr" not in caplog.text and "--steps 6 -> 7" in caplog.text


def test_steps_not_above_the_checkpoint_is_an_error(two_checkpoints, cache, tmp_path):
    out = copy_run(two_checkpoints, tmp_path / "run")
    with pytest.raises(UsageError, match="already finished at step 2.*larger --steps"):
        pretrain(resume_cfg(out, cache))
    with pytest.raises(UsageError, match="--steps 1 is below the checkpoint's step 2"):
        pretrain(resume_cfg(out, cache, steps=1))
    assert not (out / LOCK_NAME).exists()


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------


def test_live_lock_refuses_and_a_dead_owners_lock_is_taken_over(corpus, cache, tmp_path, caplog):
    out = tmp_path / "run"
    os.makedirs(out)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(f"{owner.pid} {socket.gethostname()}\n")
        with pytest.raises(UsageError, match=f"in use by another run \\(pid {owner.pid}"):
            pretrain(train_config(out, corpus, cache, steps=1))
        assert (out / LOCK_NAME).read_text().split()[0] == str(owner.pid)  # left alone
    finally:
        owner.kill()
        owner.wait()
    with caplog.at_level(logging.WARNING):
        pretrain(train_config(out, corpus, cache, steps=1))
    assert f"took over the lock of pid {owner.pid}" in caplog.text
    assert not (out / LOCK_NAME).exists()  # released on exit


def test_lock_of_another_host_is_not_taken_over(corpus, cache, tmp_path):
    out = tmp_path / "run"
    os.makedirs(out)
    (out / LOCK_NAME).write_text("12345 some-other-host\n")
    with pytest.raises(UsageError, match="pid 12345 on some-other-host"):
        pretrain(train_config(out, corpus, cache, steps=1))


def test_lock_is_released_when_the_run_fails(corpus, cache, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(UsageError):
        pretrain(train_config(out, corpus, cache, data=[str(tmp_path / "missing.txt")]))
    assert not (out / LOCK_NAME).exists()

    def explode(self):
        raise RuntimeError("injected fault")

    monkeypatch.setattr("xlnet_fast.pretrain.loop.Trainer._train_step", explode)
    with pytest.raises(RuntimeError, match="injected fault"):
        pretrain(train_config(out, corpus, cache))
    assert not (out / LOCK_NAME).exists()


def test_concurrent_run_is_refused_and_a_killed_runs_lock_is_taken_over(corpus, cache, tmp_path):
    """Fault injection: a second run on a busy --out, then SIGKILL of the first and --resume."""
    out = tmp_path / "run"
    first = subprocess.Popen(pretrain_command(out, corpus, cache, "--steps", "100000", "--save-every", "2"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list_checkpoints(TrainConfig(out=str(out)))) < 1:
            time.sleep(0.2)
        second = subprocess.run(pretrain_command(out, corpus, cache, "--steps", "3"), capture_output=True, text=True)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].startswith("xlnet-fast: error: --out")
        assert "in use by another run" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (out / LOCK_NAME).exists()  # left behind by the killed run
    step = int(names(out)[-1].split("_")[1])
    res = subprocess.run(pretrain_command(out, corpus, cache, "--resume", "--steps", str(step + 2)),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "took over the lock" in res.stderr
    assert steps_in(out) == list(range(1, step + 3))
    assert not (out / LOCK_NAME).exists()
    assert not [n for n in os.listdir(out / "checkpoints") if n.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------
# Corrupt checkpoints, torn metrics, non-finite values, fsync
# ---------------------------------------------------------------------------------------------


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "garbage": lambda p: p.write_bytes(bytes((b + 1) % 256 for b in p.read_bytes())),
    "empty": lambda p: p.write_bytes(b""),
    "missing": lambda p: p.unlink(),
}


def test_every_file_of_the_newest_checkpoint_is_checked(two_checkpoints, tmp_path, caplog):
    """Fault injection: each file of the newest checkpoint corrupted in turn, each way."""
    files = sorted(os.listdir(two_checkpoints / "checkpoints" / "step_0000002"))
    assert {"COMPLETE", "config.json", ".metadata", "__0_0.distcp", "spiece.model", "run.json"} <= set(files)
    for name in files:
        for how, corrupt in CORRUPTIONS.items():
            out = copy_run(two_checkpoints, tmp_path / f"{name}-{how}")
            corrupt(out / "checkpoints" / "step_0000002" / name)
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                chosen = load_latest_checkpoint(TrainConfig(out=str(out)))
            assert chosen == str(out / "checkpoints" / "step_0000001"), (name, how)
            assert name in caplog.text and "falling back" in caplog.text, (name, how)
            shutil.rmtree(out)


def test_a_run_written_before_0_1_is_refused_not_resumed(two_checkpoints, cache, tmp_path):
    out = copy_run(two_checkpoints, tmp_path / "run")
    as_written_before_0_1(out / "checkpoints" / "step_0000002")
    metrics = (out / "metrics.jsonl").read_bytes()
    message = (f"{out / 'checkpoints' / 'step_0000002'} was written by xlnet_fast before 0.1's sharded checkpoints "
               r"\(trainer.pt, model.safetensors\), which this version does not read: re-run pretraining")
    with pytest.raises(UsageError, match=message):
        load_latest_checkpoint(TrainConfig(out=str(out)))
    with pytest.raises(UsageError, match=message):
        pretrain(resume_cfg(out, cache, steps=3))
    assert names(out) == ["step_0000001", "step_0000002"] and (out / "metrics.jsonl").read_bytes() == metrics
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("name,how", [("__0_0.distcp", "truncated"), (".metadata", "garbage"),
                                      ("config.json", "empty")])
def test_resume_falls_back_past_a_corrupt_newest_checkpoint(two_checkpoints, cache, tmp_path, caplog, name, how):
    out = copy_run(two_checkpoints, tmp_path / "run")
    CORRUPTIONS[how](out / "checkpoints" / "step_0000002" / name)
    with caplog.at_level(logging.WARNING):
        pretrain(resume_cfg(out, cache, steps=3, keep=1))
    assert name in caplog.text and "falling back" in caplog.text
    # the unreadable one is set aside (not rotated in among the new ones), the new run continues from 1
    assert names(out) == ["step_0000003"]
    assert (out / "checkpoints" / "step_0000002.unreadable").is_dir()
    rows, ref = training_rows(out), training_rows(two_checkpoints)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-6)  # step 2 again, exactly


def test_corrupted_latest_training_checkpoint_falls_back(two_checkpoints, tmp_path, caplog):
    out = copy_run(two_checkpoints, tmp_path / "run")
    root = out / "checkpoints"
    (root / "step_0000002" / "run.json").write_bytes(b"garbage")
    shutil.copytree(root / "step_0000001", root / "step_0000006.tmp")  # a half-written one is never picked
    with caplog.at_level(logging.WARNING):
        assert load_latest_checkpoint(TrainConfig(out=str(out))) == str(root / "step_0000001")
    assert "step_0000002" in caplog.text and "falling back" in caplog.text


def test_torn_metrics_tail_is_dropped_on_resume(two_checkpoints, cache, tmp_path, caplog):
    out = copy_run(two_checkpoints, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # a kill or a full disk mid-append
    with caplog.at_level(logging.WARNING):
        pretrain(resume_cfg(out, cache, steps=3))
    assert "dropped 1 torn" in caplog.text
    assert steps_in(out) == [1, 2, 3]


def test_non_finite_loss_stops_before_saving(corpus, cache, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match="step 2: the loss is nan.*step_0000001"):
        pretrain(train_config(out, corpus, cache, lr=1e30, steps=4, save_every=1))
    assert names(out) == ["step_0000001"]  # the last good one stays newest
    assert steps_in(out) == [1]
    assert not (out / LOCK_NAME).exists()


def test_non_finite_weights_are_never_saved(corpus, cache, tmp_path, monkeypatch):
    """Fault injection: the optimizer step leaves an infinite weight behind."""
    step = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(NonFiniteLossError, match="step 1: the weights are no longer finite"):
        pretrain(train_config(tmp_path / "run", corpus, cache, steps=2, save_every=1))
    assert names(tmp_path / "run") == []


def test_mem_len_0_means_no_memory(corpus, cache, tmp_path):
    for mem_len in (0, 16):
        out = tmp_path / f"mem{mem_len}"
        pretrain(train_config(out, corpus, cache, steps=2, mem_len=mem_len))
        entries = dcp_metadata(str(out / "checkpoints" / "step_0000002")).state_dict_metadata
        mems = {k: md.size for k, md in entries.items() if k.startswith("rows.") and k.endswith(".mems")}
        if mem_len == 0:
            assert mems == {}
        else:  # one per batch row (n_layer, mlen, d_model), bounded by mem_len, not growing by reuse_len
            assert sorted(mems) == [f"rows.{g}.mems" for g in range(4)]
            assert {tuple(size)[1] for size in mems.values()} == {16}


def test_checkpoint_files_and_directories_are_fsynced_before_the_rename(corpus, cache, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "run"
    pretrain(train_config(out, corpus, cache, steps=1))
    final = os.path.realpath(out / "checkpoints" / "step_0000001")
    rename = events.index(("replace", final + ".tmp", final))
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {os.path.join(final + ".tmp", n) for n in os.listdir(final)} | {final + ".tmp"} <= synced_before
    assert ("fsync", os.path.dirname(final)) in events[rename:]
