"""A training checkpoint is verified against its COMPLETE wherever it is read by its path —
``load_model_weights``/``read_model_state``, ``xlnet-fast export`` and ``xlnet-fast eval`` — with
``--no-verify`` (``verify=False``) skipping only the checksums; a damaged or unfinished checkpoint is one
line naming the file (exit 2), never a traceback or a silently different result; so is a checkpoint
of the format before 0.1's sharded checkpoints, which is not read."""

import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers.faults import flip_byte, truncate
from helpers.pretraining import as_written_before_0_1, train_config

from xlnet_fast import XLNetConfig, XLNetLMHeadModel
from xlnet_fast.cli import main
from xlnet_fast.pretrain import pretrain
from xlnet_fast.pretrain.artifacts import NO_VERIFY_NOTE
from xlnet_fast.pretrain.checkpoint import dcp_metadata, load_model_weights, read_model_state
from xlnet_fast.pretrain.errors import CheckpointError, UsageError

WEIGHT = "model.transformer.word_embedding.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus, cache):
    out = tmp_path_factory.mktemp("run") / "run"
    pretrain(train_config(out, corpus, cache, steps=1))
    return out / "checkpoints" / "step_0000001"


@pytest.fixture
def damaged(checkpoint, tmp_path):
    """A copy of the checkpoint (in a run directory of its own) and where its embedding's bytes are."""
    copy = tmp_path / "run" / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (info,) = [v for k, v in dcp_metadata(str(copy)).storage_data.items() if k.fqn == WEIGHT]
    return copy, copy / info.relative_path, info.offset + info.length // 2


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("xlnet-fast")]
    assert len(err) == 1 and ": error: " in err[0], err
    return err[0]


def model_for(path) -> XLNetLMHeadModel:
    return XLNetLMHeadModel(XLNetConfig.from_pretrained(str(path)))


def test_a_flipped_byte_is_refused_by_every_reader(damaged, cache, tmp_path, capsys):
    path, shard, offset = damaged
    flip_byte(shard, offset)
    with pytest.raises(CheckpointError, match=f"{shard} does not match its checksum in COMPLETE"):
        load_model_weights(model_for(path), str(path))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_model_state(str(path))
    assert main(["export", str(path), "--out", str(tmp_path / "export")]) == 2
    assert f"{shard} does not match its checksum in COMPLETE (corrupted; --no-verify" in one_error_line(capsys)
    assert not (tmp_path / "export").exists()
    assert main(["eval", "--model", str(path), "--cache-dir", cache]) == 2
    assert f"{shard} does not match its checksum" in one_error_line(capsys)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 2  # the run: none readable
    assert "no readable checkpoint" in one_error_line(capsys)


def test_no_verify_skips_the_checksums_only_and_says_so(damaged, checkpoint, tmp_path, capsys, caplog):
    path, shard, offset = damaged
    flip_byte(shard, offset)
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(path), "--out", str(tmp_path / "export"), "--no-verify"]) == 0
    assert NO_VERIFY_NOTE in caplog.text
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))["transformer.word_embedding.weight"]
    original = read_model_state(str(checkpoint))["transformer.word_embedding.weight"]
    assert (exported != original).sum() == 1  # the flipped element, read as asked
    model = model_for(path)
    load_model_weights(model, str(path), verify=False)
    assert not torch.equal(model.transformer.word_embedding.weight, original)
    truncate(shard, offset)  # sizes are still checked
    with pytest.raises(CheckpointError, match=f"{shard} has {offset} bytes, the manifest says .* \\(truncated\\?\\)"):
        load_model_weights(model, str(path), verify=False)


def test_a_truncated_shard_is_one_line(damaged, cache, tmp_path, capsys):
    path, shard, offset = damaged
    truncate(shard, offset)
    for args in (["export", str(path), "--out", str(tmp_path / "export")], ["export", str(path), "--out",
                 str(tmp_path / "export"), "--no-verify"], ["eval", "--model", str(path), "--cache-dir", cache]):
        assert main(args) == 2
        assert f"{shard} has {offset} bytes, the manifest says" in one_error_line(capsys)


def test_an_unfinished_checkpoint_is_refused(damaged, cache, tmp_path, capsys):
    path, _, _ = damaged
    unfinished = path.parent / (path.name + ".tmp")
    os.replace(path, unfinished)
    os.remove(unfinished / "COMPLETE")
    for args in (["export", str(unfinished), "--out", str(tmp_path / "export")],
                 ["eval", "--model", str(unfinished), "--cache-dir", cache]):
        assert main(args) == 2
        assert f"{unfinished / 'COMPLETE'} is missing (the checkpoint was never finished)" in one_error_line(capsys)
    with pytest.raises(CheckpointError, match="COMPLETE is missing"):
        load_model_weights(model_for(unfinished), str(unfinished))


def test_a_checkpoint_written_before_0_1_is_refused_by_every_reader(damaged, cache, tmp_path, capsys):
    path, _, _ = damaged
    as_written_before_0_1(path)
    message = (f"{path} was written by xlnet_fast before 0.1's sharded checkpoints (trainer.pt, model.safetensors), "
               "which this version does not read: re-run pretraining")
    with pytest.raises(UsageError) as refused:
        load_model_weights(model_for(path), str(path))
    assert str(refused.value) == message
    with pytest.raises(UsageError, match="before 0.1's sharded checkpoints"):
        read_model_state(str(path), verify=False)
    for args in (["export", str(path), "--out", str(tmp_path / "export")],
                 ["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")],  # the run directory
                 ["eval", "--model", str(path), "--cache-dir", cache, "--no-verify"]):
        assert main(args) == 2
        assert one_error_line(capsys) == f"xlnet-fast: error: {message}"
    assert not (tmp_path / "export").exists()
