"""Tests for checkpoint.py: save_checkpoint writes atomically (a full disk, as an OSError or as
torch's zip writer reports it, is one error naming the file and the free space, and keeps the old
checkpoint and no temp file); load_checkpoint turns a foreign file into one error; stale temp files
of dead writers are removed, a live writer's kept. (A SIGKILL mid-write: test_faults.py.)"""
import os
import re
from pathlib import Path

import pytest
import torch

from checkpoint import (CheckpointError, load_checkpoint,
                        save_checkpoint)
from configurator import UserError
from files import remove_stale_temps


def failing_save(obj, f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)):   # a partial file, then the disk fills up
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 partial")
    else:
        f.write(b"PK\x03\x04 partial")
        f.flush()
    raise OSError(28, "No space left on device")


def failing_zip_save(obj, f, *args, **kwargs):
    """A full disk as torch.save's zip writer reports it: a RuntimeError that does not say why."""
    f.write(b"PK\x03\x04 partial")
    raise RuntimeError(
        "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
        "data/0: "
        "file write failed"
    )


def test_save_checkpoint_writes_and_replaces(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"iter_num": 1, "w": torch.arange(3)})
    save_checkpoint(path, {"iter_num": 2, "w": torch.arange(4)})
    ck = torch.load(path, weights_only=False)
    assert ck["iter_num"] == 2 and torch.equal(ck["w"], torch.arange(4))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


@pytest.mark.parametrize("save", [failing_save, failing_zip_save])
def test_save_checkpoint_failure_keeps_old_checkpoint(tmp_path, monkeypatch, save):
    """A full disk: one line naming the file and the free space on its disk; the old checkpoint
    kept."""
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"iter_num": 1})
    before = Path(path).read_bytes()
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(UserError, match="could not write checkpoint") as e:
        save_checkpoint(path, {"iter_num": 2})
    msg = str(e.value)
    assert (
        path in msg
        and re.search(r"\d+ MiB free on its disk: free some space", msg)
        and "\n" not in msg
    ), msg
    assert Path(path).read_bytes() == before
    monkeypatch.undo()
    assert torch.load(path, weights_only=False)["iter_num"] == 1


def test_save_checkpoint_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"iter_num": 1})
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(UserError, match="could not write checkpoint"):
        save_checkpoint(path, {"iter_num": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_load_checkpoint_refuses_a_missing_or_foreign_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(CheckpointError, match=f"no checkpoint file at {re.escape(str(path))}$"):
        load_checkpoint(str(path))
    torch.save({"model": {}}, path)                     # a torch file, not a run's checkpoint
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(path))
    assert str(e.value) == f"{path} is not a nanodepth checkpoint (no model_args, config)"
    torch.save({"model": {}, "model_args": {}, "config": {"seed": 3}}, path)
    assert load_checkpoint(str(path))["config"] == {"seed": 3}


def tiny_checkpoint():
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=11))
    return {"model": model.state_dict(), "model_args": dict(vars(model.config)), "config": {}}


@pytest.mark.parametrize("damage, needle", [
    (lambda c: c.update(config=None), r"is not a nanodepth checkpoint \(its config not a mapping"),
    (lambda c: c.update(model=[1]), r"\(its model not a mapping\)"),
    (lambda c: c["model_args"].update(route="bogus"), "its model_args describe no model"),
    (lambda c: c["model_args"].update(n_layer=-1), "its model_args describe no model"),
])
def test_load_checkpoint_refuses_fields_no_model_is_built_from(tmp_path, damage, needle):
    """Hand-made or foreign checkpoints whose fields are not what a run saves are one line naming
    the file, not a TypeError or ValueError from deep in the model."""
    ckpt = tiny_checkpoint()
    damage(ckpt)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match=needle) as e:
        load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert str(tmp_path / "ckpt.pt") in str(e.value) and "\n" not in str(e.value)


def test_a_text_file_given_for_a_checkpoint_is_named_as_one(tmp_path):
    """A run's config.json (or any text) given where a checkpoint goes is not 'truncated or
    corrupt': it is a text file; binary garbage still is."""
    for name, data in [("config.json", b'{\n  "n_layer": 4\n}\n'), ("notes.txt", b"plain text\t")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(str(tmp_path / name))
        assert str(e.value) == (f"{tmp_path / name} is a text file, not a checkpoint (a file "
                                "torch.save wrote); give the ckpt.pt a run saved")
    (tmp_path / "bin").write_bytes(bytes(range(256)))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(str(tmp_path / "bin"))


def test_load_model_refuses_weights_of_another_model_in_one_line():
    """A state dict of another shape, or with torch.compile's '_orig_mod.' prefixes: one line."""
    from checkpoint import load_model
    ckpt = tiny_checkpoint()
    load_model(ckpt, "cpu")                                     # as saved: loads
    prefixed = dict(ckpt, model={"_orig_mod." + k: v for k, v in ckpt["model"].items()})
    wider = dict(ckpt, model_args=dict(ckpt["model_args"], n_embd=16, n_head=2))
    for bad in (prefixed, wider):
        with pytest.raises(CheckpointError, match="weights do not fit the model") as e:
            load_model(bad, "cpu")
        assert "\n" not in str(e.value)
        with pytest.raises(CheckpointError, match=r"^checkpoint runs/a/ckpt.pt: its weights"):
            load_model(bad, "cpu", "runs/a/ckpt.pt")


def test_remove_stale_temps_removes_only_files_no_live_process_writes(tmp_path):
    """A temp file of a dead writer (a pid above Linux's PID_MAX_LIMIT, 2**22, never runs) goes;
    a live process's (this one's, the parent's) stay, and so do other files."""
    path = str(tmp_path / "ckpt.pt")
    dead, own, live = (f"{path}.tmp-{pid}" for pid in (2**22 + 1, os.getpid(), os.getppid()))
    for f in (path, dead, own, live, str(tmp_path / "other.pt.tmp-1")):
        Path(f).write_bytes(b"x")
    assert remove_stale_temps(tmp_path, 'ckpt.pt') == [dead]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["ckpt.pt", os.path.basename(own), os.path.basename(live), "other.pt.tmp-1"]
    )
