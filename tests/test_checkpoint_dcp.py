"""Sharded checkpoints (torch.distributed.checkpoint): a 2-rank FSDP2 run resumes on 1 and on 2 ranks
with the uninterrupted run's loss curve, async save writes what sync save writes, a background
failure is raised, a bad shard is fallen back from by name, a changed global batch is refused."""

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from helpers.pretraining import free_port

from xlnet_fast import XLNetConfig, XLNetLMHeadModel
from xlnet_fast.cli import main
from xlnet_fast.pretrain import TrainConfig, UsageError, check_checkpoint, load_latest_checkpoint, pretrain
from xlnet_fast.pretrain import sharded
from xlnet_fast.pretrain.checkpoint import dcp_load, dcp_metadata, empty_entries, read_model_state, read_run_record

SMALL = ["--vocab-size", "120", "--seq-len", "32", "--reuse-len", "16", "--mem-len", "16", "--num-predict", "6",
         "--perm-size", "8", "--backend", "eager", "--no-progress", "--dropout", "0"]


def torchrun(out, cache, *args):
    """``xlnet-fast pretrain`` on 2 gloo ranks (FSDP2 on the CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "xlnet_fast", "pretrain", "--out", str(out), "--cache-dir", cache, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def losses(out):
    rows = map(json.loads, open(os.path.join(out, "metrics.jsonl")))
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # training rows (evaluation rows have eval_loss)


def branch(src_out, step, dst_out):
    """A run directory stopped after ``src_out``'s checkpoint of ``step`` (its metrics up to there)."""
    name = f"step_{step:07d}"
    os.makedirs(dst_out / "checkpoints")
    shutil.copytree(src_out / "checkpoints" / name, dst_out / "checkpoints" / name)
    rows = [line for line in open(src_out / "metrics.jsonl") if json.loads(line)["step"] <= step]
    (dst_out / "metrics.jsonl").write_text("".join(rows))
    return dst_out


def full_state(path) -> dict:
    """Every entry of a checkpoint's DCP state, flattened (``model.<name>``, ``rows.3.mems``, ...)."""
    metadata = dcp_metadata(str(path))
    state = {top: empty_entries(metadata, (top,)) for top in {p[0] for p in metadata.planner_data.values()}}
    dcp_load(state, str(path), no_dist=True)
    flat = {}

    def walk(prefix, node):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                flat[prefix + key] = value
    walk("", state)
    return flat


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, corpus, cache):
    """An uninterrupted 2-rank FSDP2 run, --batch-size 8, saving asynchronously at steps 2 and 4."""
    out = tmp_path_factory.mktemp("two") / "run"
    torchrun(out, cache, "--data", corpus, *SMALL, "--batch-size", "8", "--steps", "4", "--save-every", "2",
             "--keep", "5", "--fsdp", "--async-save")
    return out


def test_two_rank_checkpoint_layout(two_rank_run):
    path = two_rank_run / "checkpoints" / "step_0000004"
    assert check_checkpoint(str(path)) == 4
    manifest = json.loads((path / "COMPLETE").read_text())["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "run.json", "spiece.model"} <= set(manifest)
    assert set(manifest) == set(os.listdir(path)) - {"COMPLETE"}
    record = read_run_record(str(path))
    assert (record["world_size"], record["settings"]["batch_size"], record["scheduler"]["last_epoch"]) == (2, 8, 4)
    entries = dcp_metadata(str(path)).state_dict_metadata
    assert sorted(k for k in entries if k.endswith(".data")) == sorted(f"rows.{g}.data" for g in range(16))
    assert {k for k in entries if k.startswith("ranks.")} == {"ranks.0.torch", "ranks.1.torch"}
    assert "model.lm_loss.weight" not in entries  # tied to the word embedding: stored once
    # the full model in one process, under transformers' names, from both ranks' shards
    state = read_model_state(str(path))
    expected = XLNetLMHeadModel(XLNetConfig.from_pretrained(str(path))).state_dict()
    assert state.keys() == expected.keys() - {"lm_loss.weight"}
    assert all(state[k].shape == expected[k].shape and state[k].device.type == "cpu" for k in state)


def test_resume_on_one_and_on_two_ranks_continues_the_loss_curve(two_rank_run, cache, tmp_path):
    """2 ranks x 8 rows -> 1 rank x 16 rows and -> 2 ranks x 8 rows, from the step-2 checkpoint. With
    dropout 0 nothing random depends on the ranks: 2 -> 2 repeats the run bit for bit. 1 rank adds the
    same per-row terms in another order (one sum instead of FSDP's reduce-scatter of two partial sums):
    float32 rounding, measured at most 1.2e-7 relative on the losses and, on the step-4 state, 1.6e-6
    of a tensor's largest value (optimizer moments; weights 2.4e-7, mems 1.3e-7). The tolerances (1e-5
    on the losses, 1e-4 of the largest value on the state) are ~60x that; restoring no mems moves
    the state by 1.5e-2 to 1.1, rows handed to the wrong rank make the data states differ."""
    ref = losses(two_rank_run)
    one = branch(two_rank_run, 2, tmp_path / "one")
    pretrain(TrainConfig(out=str(one), cache_dir=cache, resume=True, batch_size=16, steps=4, progress=False,
                         backend="eager"))
    got = losses(one)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    # weights, AdamW moments, every row's mems and data state (positions and generators: exactly)
    ref_state = full_state(two_rank_run / "checkpoints" / "step_0000004")
    one_state = full_state(one / "checkpoints" / "step_0000004")
    for key, value in ref_state.items():
        if key.startswith("ranks."):  # the dropout RNG: reseeded on another number of ranks
            continue
        if torch.is_tensor(value) and value.is_floating_point():
            assert (one_state[key] - value).abs().max() <= 1e-4 * value.abs().max(), key
        elif torch.is_tensor(value):
            assert torch.equal(one_state[key], value), key
        else:
            assert one_state[key] == value, key
    assert read_run_record(str(one / "checkpoints" / "step_0000004"))["world_size"] == 1

    two = branch(two_rank_run, 2, tmp_path / "two")
    torchrun(two, cache, "--resume", "--steps", "4")  # saves synchronously
    got = losses(two)
    assert [got[s] for s in (1, 2, 3, 4)] == [ref[s] for s in (1, 2, 3, 4)]
    # the async-written checkpoint of the uninterrupted run and the sync-written one of the resumed
    # run hold the same tensors: model and optimizer shards, every row's data state and mems, RNG
    assert_same_state(full_state(two / "checkpoints" / "step_0000004"),
                      full_state(two_rank_run / "checkpoints" / "step_0000004"))


def test_one_rank_checkpoint_resumes_on_two_ranks(corpus, cache, tmp_path):
    ref_out = tmp_path / "ref"
    pretrain(TrainConfig(preset="tiny", data=[corpus], out=str(ref_out), cache_dir=cache, vocab_size=120, seq_len=32,
                         reuse_len=16, mem_len=16, num_predict=6, perm_size=8, dropout=0.0, batch_size=8, steps=3,
                         save_every=2, keep=5, progress=False, backend="eager"))
    two = branch(ref_out, 2, tmp_path / "two")
    torchrun(two, cache, "--resume", "--steps", "3", "--batch-size", "4", "--fsdp")
    assert losses(two)[3] == pytest.approx(losses(ref_out)[3], rel=1e-5)


def test_changed_global_batch_is_refused_naming_the_batch_size_that_keeps_it(two_rank_run, cache, tmp_path, capsys):
    out = branch(two_rank_run, 2, tmp_path / "run")
    before = sorted(os.listdir(out / "checkpoints"))
    with pytest.raises(UsageError, match=r"--batch-size 8 on 1 rank\(s\) makes a global batch of 8 .*the "
                                         r"checkpoint's is 16 \(2 x 8 x 1\): pass --batch-size 16 to keep it"):
        pretrain(TrainConfig(out=str(out), cache_dir=cache, resume=True, steps=4, progress=False))
    assert main(["pretrain", "--out", str(out), "--cache-dir", cache, "--resume", "--steps", "4",
                 "--batch-size", "12", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --batch-size 16 to keep it" in err[0]
    assert sorted(os.listdir(out / "checkpoints")) == before


@pytest.mark.parametrize("how", ["missing", "garbage"])
def test_a_bad_shard_of_one_rank_falls_back_naming_it(two_rank_run, tmp_path, caplog, how):
    out = tmp_path / "run"
    shutil.copytree(two_rank_run, out)
    shard = out / "checkpoints" / "step_0000004" / "__1_0.distcp"
    if how == "missing":
        shard.unlink()
    else:
        shard.write_bytes(bytes((b + 1) % 256 for b in shard.read_bytes()))
    with caplog.at_level(logging.WARNING):
        assert load_latest_checkpoint(TrainConfig(out=str(out))) == str(out / "checkpoints" / "step_0000002")
    assert "__1_0.distcp" in caplog.text and "falling back" in caplog.text


def one_rank_cfg(out, corpus, cache, **kw):
    base = dict(preset="tiny", data=[corpus], out=str(out), cache_dir=cache, vocab_size=120, seq_len=32, reuse_len=16,
                mem_len=16, num_predict=6, perm_size=8, batch_size=4, steps=3, save_every=1, keep=5,
                progress=False, backend="eager")
    return TrainConfig(**{**base, **kw})


def test_async_save_writes_what_sync_save_writes(corpus, cache, tmp_path):
    pretrain(one_rank_cfg(tmp_path / "sync", corpus, cache))
    pretrain(one_rank_cfg(tmp_path / "async", corpus, cache, async_save=True))
    for step in (1, 2, 3):
        name = f"step_{step:07d}"
        assert check_checkpoint(str(tmp_path / "async" / "checkpoints" / name)) == step
        assert_same_state(full_state(tmp_path / "sync" / "checkpoints" / name),
                          full_state(tmp_path / "async" / "checkpoints" / name))


def test_async_saves_run_one_at_a_time_and_finish_before_the_run_ends(corpus, cache, tmp_path, monkeypatch):
    """Fault injection: a slow background write. Each save starts only after the previous one was
    sealed, and the last one is sealed before ``pretrain`` returns."""
    events = []
    real_state, real_seal = sharded.training_state, sharded.seal

    def state(*args, **kwargs):
        events.append("state")
        return real_state(*args, **kwargs)

    def slow_seal(directory, step, files):
        time.sleep(0.3)
        real_seal(directory, step, files)
        events.append(f"sealed {step}")

    monkeypatch.setattr(sharded, "training_state", state)
    monkeypatch.setattr(sharded, "seal", slow_seal)
    res = pretrain(one_rank_cfg(tmp_path / "run", corpus, cache, async_save=True))
    assert events == ["state", "sealed 1", "state", "sealed 2", "state", "sealed 3"]
    assert check_checkpoint(res["checkpoint"]) == 3


def test_a_failed_background_save_is_raised(corpus, cache, tmp_path, monkeypatch):
    def broken_seal(directory, step, files):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(sharded, "seal", broken_seal)
    with pytest.raises(RuntimeError, match=r"asynchronous save of .*step_0000001 failed.*No space left"):
        pretrain(one_rank_cfg(tmp_path / "run", corpus, cache, async_save=True))
    assert load_latest_checkpoint(TrainConfig(out=str(tmp_path / "run"))) is None  # nothing half-written published
