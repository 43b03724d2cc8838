"""Tests for train_checks.py: a resume compares the fields that shape the model with the checkpoint
(by what they mean, not how they are spelled) and any other shape difference by the state dicts,
each refusal naming the field; a fresh run never writes over a run in out_dir."""
import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest

import train
from model import GPT, GPTConfig
from test_ffn import BASE
from train_checks import TrainError, check_against_checkpoint, check_out_dir, check_state_fits


@pytest.mark.parametrize("route,field,old,new", [("exit", "exit_layers", "1,2", "2,3"),
                                                 ("exit", "exit_head", "own", "shared"),
                                                 ("ensemble", "ens_layers", 2, 3)])
def test_resume_refuses_changed_exit_and_ensemble_fields(route, field, old, new):
    shape = dict(
        n_layer=4, n_embd=32, n_head=2, **({'exit_head': 'own'} if field == 'exit_layers' else {})
    )
    """Fields that change the model's parameters are compared with the checkpoint by name, and any
    other shape difference is caught by comparing the state dicts, not by load_state_dict's
    traceback."""
    margs = asdict(GPTConfig(route=route, **shape, **{field: old}))
    ck = dict(model_args=margs, data_meta={}, config={})
    cfg = SimpleNamespace(**{**train.DEFAULTS, **margs, field: new})
    with pytest.raises(TrainError, match=field):
        check_against_checkpoint(cfg, {}, ck, train.RESUME_KEYS)
    model = GPT(GPTConfig(route=route, **shape, **{field: new}))
    with pytest.raises(TrainError, match="does not fit"):
        check_state_fits(model, GPT(GPTConfig.from_dict(margs)).state_dict(), "ckpt.pt")


def test_resume_compares_the_layers_meant_not_the_spelling():
    """An ffn checkpoint saved with ffn_layers='all' resumes under the default 'auto' (the same
    layers); a different layer set is refused by name."""
    ck = dict(model_args=asdict(GPTConfig(**BASE, n_layer=4, route='ffn', ffn_layers='all')))
    cfg = SimpleNamespace(**asdict(GPTConfig(**BASE, n_layer=4, route='ffn')), dataset='synthetic')
    check_against_checkpoint(cfg, {}, ck, ['ffn_layers'])
    cfg.ffn_layers = 'every_other'
    with pytest.raises(TrainError, match="ffn_layers"):
        check_against_checkpoint(cfg, {}, ck, ['ffn_layers'])


def test_a_fresh_run_never_writes_over_a_run_in_out_dir(tmp_path):
    out = tmp_path / "run"
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'out_dir': str(out), 'dataset': 'synthetic',
                             'data_dir': str(tmp_path / "data")})
    check_out_dir(cfg)                                  # nothing there yet (nothing created)
    assert not out.exists()
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "ckpt.pt").write_bytes(b"")
    with pytest.raises(TrainError) as e:
        check_out_dir(cfg)
    assert str(e.value) == (
        f"out_dir {out} already holds a run (ckpt.pt, metrics.jsonl); continue it with "
        "--init_from=resume, pick another --out_dir, or replace it with --overwrite=True"
    )
    check_out_dir(SimpleNamespace(**{**vars(cfg), 'init_from': 'resume'}))
    check_out_dir(SimpleNamespace(**{**vars(cfg), 'overwrite': True}))


def test_a_folder_holding_only_sharded_checkpoints_holds_a_run(tmp_path):
    """An FSDP run's DCP folder ckpt_dcp/ (its model and optimizer shards) is a run's: a fresh run
    refuses it as it refuses ckpt.pt, since it would remove it (train_report.open_run_files)."""
    from sharding import SHARDED_DIR
    out = tmp_path / "run"
    (out / SHARDED_DIR / "iter_0000010").mkdir(parents=True)
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'out_dir': str(out), 'dataset': 'synthetic',
                             'data_dir': str(tmp_path / "data")})
    with pytest.raises(TrainError) as e:
        check_out_dir(cfg)
    assert str(e.value) == (
        f"out_dir {out} already holds a run ({SHARDED_DIR}); continue it with "
        "--init_from=resume, pick another --out_dir, or replace it with --overwrite=True"
    )
    check_out_dir(SimpleNamespace(**{**vars(cfg), 'overwrite': True}))


def test_only_rank_0_judges_the_run_files_under_its_lock(tmp_path):
    """Under DDP, rank 0 may write a fresh run's files before another rank reaches its checks: the
    run files are judged once, by rank 0 holding the lock (hold_out_dir), and every rank's own
    checks (open_inputs: check_out_dir with held=False) pass over them. A refused run leaves the
    folder unlocked."""
    import run_state
    from runlock import lock_folder
    out = tmp_path / "run"
    cfg = SimpleNamespace(**{**train.DEFAULTS, 'out_dir': str(out), 'dataset': 'synthetic',
                             'data_dir': str(tmp_path / "data")})
    master = SimpleNamespace(master=True, ddp=False)
    out.mkdir()
    run_state.hold_out_dir(cfg, master).release()          # an empty folder: taken
    (out / "config.json").write_text("{}")                 # what rank 0 writes first
    check_out_dir(cfg, held=False)                         # a later rank's own checks
    with pytest.raises(TrainError, match=r"already holds a run \(config.json\)"):
        run_state.hold_out_dir(cfg, master)
    lock_folder(str(out)).release()                        # the refusal let the lock go


def test_a_ddp_rank_told_of_a_held_folder_above_names_it(tmp_path, monkeypatch):
    """Under DDP only rank 0 takes the lock and the others learn the holder's PID: where that PID
    holds a folder above out_dir (a running sweep's out_root), they say so, as rank 0 does, not
    that out_dir itself is in use."""
    import run_state
    import torch
    from runlock import FolderBusy, lock_folder
    root = tmp_path / "study"
    held = lock_folder(str(root), "out_root")
    try:
        cfg = SimpleNamespace(**{**train.DEFAULTS, 'out_dir': str(root / "arm" / "seed1")})
        rank1 = SimpleNamespace(master=False, ddp=True, dev=torch.device('cpu'))
        monkeypatch.setattr(torch.distributed, 'broadcast',
                            lambda status, src: status.fill_(os.getpid()))   # rank 0's verdict
        with pytest.raises(FolderBusy) as e:
            run_state.hold_out_dir(cfg, rank1)
        assert str(e.value).startswith(f"out_dir {root / 'arm' / 'seed1'} is inside {root}, which "
                                       f"another run holds (PID {os.getpid()} on ")
    finally:
        held.release()


def test_a_draft_run_ignores_other_families_options_but_not_its_models():
    """trainable='draft' from an ffn checkpoint whose run set other families' options in a shared
    config file (exit_weight, halt_lambda, mod_capacity: recorded, never read by route=ffn) starts
    under this config's defaults for them; a field that shapes or routes the ffn model is still
    refused by name."""
    ffn = dict(**BASE, n_layer=4, route='ffn', ffn_layers='all', ffn_draft_rank=8)
    margs = asdict(GPTConfig(**ffn, exit_weight=4.0, halt_lambda=0.05, mod_capacity=0.125))
    ck = dict(model_args=margs, data_meta={}, config={})
    keys = train.draft_run_keys(train.FAMILIES['ffn'])
    cfg = SimpleNamespace(**{**train.DEFAULTS, **asdict(GPTConfig(**ffn))})
    check_against_checkpoint(cfg, {}, ck, keys)
    for field, value in (('ffn_budget', 0.25), ('ffn_cheap_rank', 7), ('n_embd', 64)):
        with pytest.raises(TrainError, match=f"'{field}' differs"):
            check_against_checkpoint(SimpleNamespace(**{**vars(cfg), field: value}), {}, ck, keys)


@pytest.mark.parametrize("key,value,ok", [("seed", 2**32 - 1, True), ("seed", 2**32, False),
                                          ("eval_seed", 2**40, False), ("eval_seed", -1, False)])
def test_seeds_out_of_numpys_range_are_refused_before_any_work(key, value, ok):
    # numpy seeds 32-bit; a larger seed passed the check and failed later in a traceback
    if ok:
        train.read_config([f"--{key}={value}"])
    else:
        with pytest.raises(TrainError, match=f"{key} must be"):
            train.read_config([f"--{key}={value}"])
