"""Tests for sharding.py (train.py --parallel=fsdp): the option's checks in-process, and one slow
check on 2 CPU processes (gloo) that FSDP2 trains as one process does, resumes after a kill from
its last sharded checkpoint, and trains every routing family."""
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sharding  # noqa: E402
import train  # noqa: E402
from conftest import _signal_all, finish, run_group, started  # noqa: E402
from data import prepare  # noqa: E402
from model import FAMILIES, GPT, GPTConfig, is_controller_key  # noqa: E402
from train_checks import TrainError  # noqa: E402

ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")}
ENV.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


# --------------------------------------------------------------------------------------------------
# the option and its checks (no processes)

def cfg(**kw):
    base = dict(parallel='fsdp', dtype='auto', compile=False, out_dir='out/x')
    return SimpleNamespace(**{**base, **kw})


def test_parallel_defaults_to_ddp_and_reads_from_the_command_line():
    assert train.DEFAULTS['parallel'] == 'ddp'
    c, _ = train.read_config(['--parallel=ddp'])
    assert c.parallel == 'ddp'


@pytest.mark.parametrize("kw, words", [
    (dict(parallel='zero3'), "parallel must be one of ddp, fsdp; got 'zero3'"),
    (dict(dtype='float16'), "--dtype=bfloat16"),
    (dict(compile=True), "--compile=False"),
])
def test_check_parallel_refuses_with_the_fix(kw, words):
    with pytest.raises(TrainError, match=words.replace('(', r'\(').replace(')', r'\)')):
        sharding.check_parallel(cfg(**kw), distributed=True)


def test_fsdp_needs_torchrun_and_ddp_needs_nothing():
    with pytest.raises(TrainError, match="torchrun --standalone --nproc_per_node=N"):
        sharding.check_parallel(cfg(), distributed=False)
    sharding.check_parallel(cfg(parallel='ddp', dtype='float16', compile=True), distributed=False)


def test_train_refuses_a_bad_parallel_before_any_work(tmp_path):
    with pytest.raises(TrainError, match="parallel must be one of"):
        train.read_config([f'--out_dir={tmp_path / "out"}', '--parallel=fdsp'])
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_resumes_under_the_mode_that_wrote_it(monkeypatch):
    monkeypatch.setenv('RANK', '0')
    sharding.check_resume(cfg(), {'sharded': 'ckpt_dcp/iter_0000004'})
    sharding.check_resume(cfg(parallel='ddp'), {'sharded': None})
    with pytest.raises(TrainError, match="written by parallel=fsdp under torchrun"):
        sharding.check_resume(cfg(parallel='ddp'), {'sharded': 'ckpt_dcp/iter_0000004'})
    with pytest.raises(TrainError, match="written by one process or parallel=ddp"):
        sharding.check_resume(cfg(), {'sharded': None})
    monkeypatch.delenv('RANK')
    with pytest.raises(TrainError, match="resume it the same way"):
        sharding.check_resume(cfg(), {'sharded': 'ckpt_dcp/iter_0000004'})


def test_a_stopped_run_prints_the_launch_that_resumes_it(monkeypatch):
    """The resume command a signal prints: under torchrun the same launch (a sharded checkpoint
    is refused by one process), one process otherwise."""
    argv = ['--parallel=fsdp', '--out_dir=out/x']
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')
    cmd = train.resume_command(SimpleNamespace(ddp=True, world=2), argv)
    assert cmd == ('torchrun --standalone --nproc_per_node=2 train.py --parallel=fsdp '
                   '--out_dir=out/x --init_from=resume')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '8')
    assert train.resume_command(SimpleNamespace(ddp=True, world=16), argv).startswith(
        'torchrun --nnodes=2 --nproc_per_node=8 ')
    monkeypatch.delenv('LOCAL_WORLD_SIZE')
    assert train.resume_command(SimpleNamespace(ddp=False, world=1), argv) == (
        'python train.py --parallel=fsdp --out_dir=out/x --init_from=resume')
    # a resumed run's, or one started from another checkpoint: one --init_from, the resume
    for start in ('--init_from=resume', '--init_from=out/base/ckpt.pt'):
        assert train.resume_command(SimpleNamespace(ddp=False, world=1), [start, *argv]) == (
            'python train.py --parallel=fsdp --out_dir=out/x --init_from=resume')


def test_prune_keeps_only_the_folder_ckpt_names(tmp_path):
    for it in (2, 4, 6):              # 6: a save killed midway, after ckpt.pt named 4
        (tmp_path / sharding.SHARDED_DIR / f'iter_{it:07d}').mkdir(parents=True)
    sharding.prune_sharded(tmp_path, os.path.join(sharding.SHARDED_DIR, 'iter_0000004'))
    assert os.listdir(tmp_path / sharding.SHARDED_DIR) == ['iter_0000004']


@pytest.fixture
def one_process_group():
    """A gloo process group of one process (in this one): FSDP2 and DCP run as on one rank."""
    import torch.distributed as dist
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_parameter_without_optimizer_state_resumes_without_one(one_process_group, tmp_path):
    """A parameter no step has given a gradient yet (an exit head out of its rotation) has no
    AdamW state in the shards: loading them leaves it without state, as the run had it, instead
    of refusing the checkpoint."""
    def sharded():
        torch.manual_seed(0)
        m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))
        m = sharding.shard_model(m, torch.device('cpu'))
        return m, m.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')

    model, opt = sharded()
    x = torch.randint(0, 32, (2, 8))
    model(x, x)[1].backward()
    idle = dict(model.named_parameters())['transformer.h.1.mlp.c_fc.weight']
    idle.grad = None
    opt.step()
    rel, _ = sharding.save_sharded(model, opt, tmp_path, 1, master=True)
    again, opt2 = sharded()
    sharding.load_sharded(again, opt2, tmp_path, rel)
    by_name = dict(again.named_parameters())
    assert by_name['transformer.h.1.mlp.c_fc.weight'] not in opt2.state
    for name, p in model.named_parameters():
        if p is idle:
            continue
        q = by_name[name]
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), msg=name)
        for k in ('exp_avg', 'exp_avg_sq'):
            torch.testing.assert_close(opt2.state[q][k].full_tensor(),
                                       opt.state[p][k].full_tensor(), msg=name)


@pytest.mark.parametrize("damage", ["truncated_shard", "no_metadata"])
def test_a_damaged_sharded_checkpoint_is_one_error(one_process_group, tmp_path, damage):
    """The DCP folder ckpt.pt names, truncated or incompletely copied (no .metadata): one line
    naming it and the fix, not DCP's traceback (CheckpointException is not an Exception)."""
    torch.manual_seed(0)
    model = sharding.shard_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8,
                                               vocab_size=32)), torch.device('cpu'))
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
    rel, _ = sharding.save_sharded(model, opt, tmp_path, 1, master=True)
    folder = tmp_path / rel
    if damage == "no_metadata":
        (folder / ".metadata").unlink()
    else:
        shard = next(folder.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(TrainError) as e:
        sharding.load_sharded(model, opt, tmp_path, rel)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < len(str(folder)) + 320, msg
    assert msg.startswith(f"the sharded checkpoint {folder} that ckpt.pt names is unreadable "
                          "("), msg
    assert msg.endswith("): it is truncated or corrupt; restore it, or start the run afresh with "
                        "--overwrite=True"), msg


def test_a_sharded_save_on_a_full_disk_is_one_error(one_process_group, tmp_path, monkeypatch):
    """A full disk under DCP's writers (their OSError comes wrapped in DCP's CheckpointException,
    not an Exception): one line naming the folder, the error and the fix, as a full disk under
    ckpt.pt gives."""
    import errno

    import torch.distributed.checkpoint as dcp
    from checkpoint import CheckpointError
    torch.manual_seed(0)
    model = sharding.shard_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8,
                                               vocab_size=32)), torch.device('cpu'))
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')

    def full_disk(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise dcp.api.CheckpointException("ranks:dict_keys([0])",
                                               {0: dcp.api._wrap_exception(e)}) from None
    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        sharding.save_sharded(model, opt, tmp_path, 3, master=True)
    msg = str(e.value)
    folder = tmp_path / sharding.SHARDED_DIR / "iter_0000003"
    assert "\n" not in msg, msg
    assert msg.startswith(f"could not write the sharded checkpoint {folder} (OSError: [Errno "
                          f"{errno.ENOSPC}] No space left on device); "), msg
    assert msg.endswith(" MiB free on its disk: free some space and resume with "
                        "--init_from=resume (the previous checkpoint, if any, is kept "
                        "unchanged)"), msg


def test_routed_blocks_stay_in_the_root_unit():
    base = dict(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    for route, layers, own in [('none', {}, [0, 1, 2]), ('ffn', dict(ffn_layers='1'), [0, 2]),
                               ('mod', dict(mod_layers='1'), [0, 2]), ('halt', {}, [0, 1, 2])]:
        m = GPT(GPTConfig(route=route, **base, **layers))
        assert [b.layer for b in sharding.block_units(m)] == own, route


# --------------------------------------------------------------------------------------------------
# 2 processes (gloo): FSDP == one process, a kill then a resume, every family

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=2",
        "--eval_iters=1", "--log_interval=1", "--warmup_iters=1",
        "--device=cpu", "--dropout=0.0", "--gradient_accumulation_steps=2"]
MAX_ITERS, CKPT_EVERY, KILL_AT = 6, 3, 4
# one short run per family, and the configurations whose DDP needs find_unused_parameters
FAMILY_RUNS = {
    'none': [], 'ffn': [], 'mod': [], 'exit': [], 'halt': [],
    'ensemble': ['--route=ensemble', '--ens_layers=2'],     # (of n_layer's 2)
    'ffn_ungraded_gate': ['--route=ffn', '--ffn_gate_grad=none'],
    'mod_unused_predictor': ['--route=mod', '--mod_infer_rule=predictor',
                             '--mod_predictor_weight=0'],
    'exit_rotating_own_heads': ['--route=exit', '--exit_head=own', '--exit_layers=every',
                                '--exit_rotation=2'],
    # the distilled draft's loss runs every block's modules outside the block's own forward
    'ffn_with_a_draft': ['--route=ffn', '--ffn_layers=all', '--ffn_draft_rank=4'],
}


def family_args(name, extra):
    return [*TINY, '--max_iters=2', '--eval_interval=2', '--parallel=fsdp',
            *(extra or [f'--route={name}'])]


def read_metrics(out_dir, kind):
    return [r for r in map(json.loads, Path(out_dir, 'metrics.jsonl').read_text().splitlines())
            if r['type'] == kind]


def ckpt(out_dir):
    return torch.load(Path(out_dir, 'ckpt.pt'), map_location='cpu', weights_only=False)


@pytest.mark.slow
def test_fsdp_matches_one_process_resumes_after_a_kill_and_trains_every_family(tmp_path):
    """One torchrun launch trains (a) a run that one process also trains: the same losses (rel
    1e-5: FSDP averages the two ranks' gradients where one process sums halves, so the last bits
    may differ) and weights; (c) every family: its controller's parameters get optimizer state,
    losses near ln(vocab); (b) the run again, SIGKILLed with its group one step after its last
    checkpoint: a second launch resumes from that checkpoint (iteration 3, its sharded optimizer)
    and logs the uninterrupted run's losses (rel 1e-6) to the end; (d) the run again, a SIGTERM
    to rank 0 alone as an evaluation starts: both ranks abandon it and stop with a checkpoint at
    its iteration, without its record."""
    data = tmp_path / 'data' / 'syn'
    prepare.prepare('synthetic', out_dir=data, num_tokens=20000)
    common = [*TINY, f'--data_dir={data.parent}', f'--dataset={data.name}',
              f'--max_iters={MAX_ITERS}', f'--eval_interval={CKPT_EVERY}']
    fams = {n: [*family_args(n, x), f'--data_dir={data.parent}', f'--dataset={data.name}']
            for n, x in FAMILY_RUNS.items()}
    fsdp = [*common, '--parallel=fsdp']
    with started([sys.executable, 'train.py', *common, f'--out_dir={tmp_path / "single"}'],
                 cwd=REPO, env=ENV) as single:
        with started([*TORCHRUN, 'tests/sharding_driver.py', tmp_path, json.dumps(fsdp),
                      json.dumps(fams), KILL_AT], cwd=REPO, env=ENV) as driver:
            blocked = tmp_path / 'killed' / 'blocked'
            deadline = time.time() + 1200   # (a hang; the check takes far less)
            while not blocked.exists() and driver.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            assert blocked.exists(), finish(driver, 30).stderr[-3000:]
            _signal_all(driver, signal.SIGKILL)           # the whole group, mid-run
        r = finish(single, 300)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = tmp_path / 'killed'
    assert ckpt(killed)['iter_num'] == CKPT_EVERY
    resumed = run_group([*TORCHRUN, 'train.py', *fsdp, f'--out_dir={killed}',
                         '--init_from=resume'], 300, cwd=REPO, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    # (a) FSDP == one process
    one, sharded = tmp_path / 'single', tmp_path / 'uninterrupted'
    losses = {d: [m['loss'] for m in read_metrics(d, 'train')] for d in (one, sharded, killed)}
    assert len(losses[one]) == len(losses[sharded]) == MAX_ITERS
    assert losses[sharded] == pytest.approx(losses[one], rel=1e-5)
    assert [e['val_loss'] for e in read_metrics(sharded, 'eval')] == pytest.approx(
        [e['val_loss'] for e in read_metrics(one, 'eval')], rel=1e-5)
    c1, cs = ckpt(one), ckpt(sharded)
    assert cs['iter_num'] == MAX_ITERS and cs['optimizer'] is None
    assert set(cs['model']) == set(c1['model'])         # ckpt.pt: the whole model, as eval reads
    for k in c1['model']:
        torch.testing.assert_close(cs['model'][k], c1['model'][k], rtol=1e-5, atol=1e-6, msg=k)
    assert os.listdir(sharded / sharding.SHARDED_DIR) == [f'iter_{MAX_ITERS:07d}']

    # (b) the resume: from iteration 3, the uninterrupted run's losses after it, one record each
    assert 'blocked' not in resumed.stdout and resumed.stdout.count('done:') == 1
    assert [m['iter'] for m in read_metrics(killed, 'train')] == list(range(1, MAX_ITERS + 1))
    assert losses[killed] == pytest.approx(losses[sharded], rel=1e-6)
    assert ckpt(killed)['iter_num'] == MAX_ITERS

    # (c) every family trained under FSDP, its routers and heads included
    import torch.distributed.checkpoint as dcp
    vocab = ckpt(one)['model_args']['vocab_size']
    for name in FAMILY_RUNS:
        out = tmp_path / name
        c = ckpt(out)
        assert c['iter_num'] == 2, name
        for m in read_metrics(out, 'train'):
            assert abs(m['lm_loss'] - math.log(vocab)) < 1.5, (name, m)
        model = GPT(GPTConfig.from_dict(c['model_args']))
        unused = set(model.family.no_gradient(model.config))
        ctrl = [k for k, _ in model.named_parameters() if is_controller_key(k) and k not in unused]
        # (exit's defaults read out through the shared lm_head; its own heads: the rotating run)
        assert bool(ctrl) == (name not in ('none', 'exit')), name
        saved = dcp.FileSystemReader(out / c['sharded']).read_metadata().state_dict_metadata
        stepped = [k for k in ctrl if f'optimizer.state.{k}.exp_avg' in saved]
        # a family's defaults train every controller parameter, and so do rotating own exit heads
        # over a full rotation; the other configurations leave some (ffn_ungraded_gate: all)
        # without a gradient by design, as DDP's find_unused_parameters says
        if name in FAMILIES or name == 'exit_rotating_own_heads':
            assert stepped == ctrl, (name, ctrl, stepped)
    assert set(FAMILIES) <= set(FAMILY_RUNS)

    # (d) rank 0 alone signalled as the eval at CKPT_EVERY starts: both ranks abandon it and save
    abandoned = tmp_path / 'abandoned'
    assert ckpt(abandoned)['iter_num'] == CKPT_EVERY
    assert [m['iter'] for m in read_metrics(abandoned, 'eval')] == [0]
    assert [m['iter'] for m in read_metrics(abandoned, 'train')] == list(range(1, CKPT_EVERY + 1))
    assert read_metrics(abandoned, 'summary')[-1]['stopped'] is True
