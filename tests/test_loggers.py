"""loggers.py: train.py's --log sends every metrics.jsonl record to TensorBoard and W&B at its
iteration. Each test trains a tiny routed model in-process (4 iterations, evals at 0, 2 and 4) and
reads the values back with the logger's own reader (TensorBoard's EventAccumulator; the offline W&B
run file, decoded with W&B's record protobuf), against metrics.jsonl."""
import glob
import json
import struct
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import loggers  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError  # noqa: E402
from data import prepare as P  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')
TINY = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=4',
        '--eval_iters=1', '--calib_iters=1', '--log_interval=1', '--eval_interval=2',
        '--warmup_iters=1', '--max_iters=4', '--device=cpu']


@pytest.fixture(scope='module')
def data_args(tmp_path_factory):
    folder = tmp_path_factory.mktemp('data') / 'syn'
    P.prepare('synthetic', out_dir=folder, num_tokens=20000)
    return [f'--data_dir={folder.parent}', '--dataset=syn']


def records(out_dir):
    return [json.loads(line) for line in (out_dir / 'metrics.jsonl').read_text().splitlines()]


def expected(recs, kind, key):
    """[(iter, value)] of a top-level field of the records of one type, read here, not by
    loggers.scalars."""
    return [(r['iter'], r[key]) for r in recs if r['type'] == kind]


def test_tensorboard_holds_every_logged_value_at_its_step(data_args, tmp_path):
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / 'out'
    for max_iters in (2, 4):               # the second run replaces the first, event files too
        train.main([*TINY, *data_args, f'--out_dir={out}', '--log=tensorboard',
                    f'--max_iters={max_iters}', '--overwrite=True'])
    assert len(glob.glob(str(out / 'events.out.tfevents.*'))) == 1
    acc = EventAccumulator(str(out), size_guidance={'scalars': 0}).Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}
    recs = records(out)
    want = {f'{kind}/{key}': expected(recs, kind, key)
            for kind, key in [('train', 'loss'), ('train', 'lm_loss'), ('train', 'lr'),
                              ('train', 'grad_norm'), ('eval', 'val_loss'),
                              ('eval', 'train_loss'), ('summary', 'best_val_loss')]}
    want['train/full_frac/1'] = [(r['iter'], r['full_frac'][1]) for r in recs
                                 if r['type'] == 'train']
    assert [s for s, _ in want['train/loss']] == [1, 2, 3, 4]
    assert [s for s, _ in want['eval/val_loss']] == [0, 2, 4]
    for tag, pairs in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in pairs], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in pairs], rel=1e-6), tag
    # every number of the records is there: flags, text and None are not
    n_numbers = sum(isinstance(v, (int, float)) and not isinstance(v, bool)
                    for r in recs for k, v in r.items() if k != 'iter')
    assert sum(len(v) for t, v in got.items() if t.count('/') == 1) == n_numbers
    assert any(t.startswith('summary/routing/') for t in got)     # nested: the routing report


def test_a_resume_shows_each_step_once_with_the_resumed_values(data_args, tmp_path):
    """A run killed after logging past its last checkpoint: its resume logs those steps again, and
    TensorBoard shows them once, with the values metrics.jsonl keeps."""
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, args = tmp_path / 'out', [*TINY, *data_args, '--log=tensorboard', '--eval_interval=2']
    train.main([*args, f'--out_dir={out}', '--max_iters=2'])
    ckpt_at_2 = (out / 'ckpt.pt').read_bytes()
    train.main([*args, f'--out_dir={out}', '--max_iters=4', '--init_from=resume'])
    (out / 'ckpt.pt').write_bytes(ckpt_at_2)           # as if killed before its checkpoint at 4
    train.main([*args, f'--out_dir={out}', '--max_iters=4', '--init_from=resume',
                '--learning_rate=1e-3'])               # other values from step 3 on
    acc = EventAccumulator(str(out), size_guidance={'scalars': 0}).Reload()
    want = expected(records(out), 'train', 'lr')
    assert [e.step for e in acc.Scalars('train/lr')] == [s for s, _ in want] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars('train/lr')] == pytest.approx([v for _, v in want],
                                                                       rel=1e-6)


def test_an_eval_only_resume_hides_what_metrics_jsonl_drops(data_args, tmp_path):
    """An evaluation of a killed run's checkpoint drops the records logged after it from
    metrics.jsonl: TensorBoard hides the same steps."""
    pytest.importorskip('tensorboard')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / 'out'
    args = [*TINY, *data_args, '--log=tensorboard', f'--out_dir={out}']
    train.main([*args, '--max_iters=2'])
    ckpt_at_2 = (out / 'ckpt.pt').read_bytes()
    train.main([*args, '--max_iters=4', '--init_from=resume'])
    (out / 'ckpt.pt').write_bytes(ckpt_at_2)           # as if killed before its checkpoint at 4
    train.main([*args, '--max_iters=4', '--init_from=resume', '--eval_only=True'])
    acc = EventAccumulator(str(out), size_guidance={'scalars': 0}).Reload()
    want = expected(records(out), 'train', 'lr')
    assert [e.step for e in acc.Scalars('train/lr')] == [s for s, _ in want] == [1, 2]


def wandb_records(path):
    """The records of an offline W&B run file: a 7-byte header, then LevelDB-log chunks (32 KiB
    blocks; 7-byte chunk headers: crc, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) holding
    wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    assert data[:4] == b':W&B'
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:           # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b''.join(parts))
            parts = []
            yield record


def test_wandb_offline_run_holds_the_logged_values(data_args, tmp_path, monkeypatch):
    wandb = pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_DIR', str(tmp_path / 'wandb_dir'))
    monkeypatch.setenv('WANDB_SILENT', 'true')
    out = tmp_path / 'out'
    build = train.build_model

    def build_model(cfg, meta, ckpt):         # as GPT-2 weights do: the built shape wins
        model = build(cfg, meta, ckpt)
        cfg.vocab_size = model.config.vocab_size
        return model
    monkeypatch.setattr(train, 'build_model', build_model)
    try:
        train.main([*TINY, *data_args, f'--out_dir={out}', '--log=wandb',
                    '--wandb_project=tiny', '--wandb_run_name=run-a'])
    finally:
        wandb.teardown()                      # its service process ends with the test
    runs = glob.glob(str(tmp_path / 'wandb_dir' / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
    assert len(runs) == 1, runs
    history, summary, names, config = {}, {}, [], {}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof('record_type')
        # the config: the run record's, then updates (the last value of each key counts)
        for item in (record.run.config.update if kind == 'run' else
                     record.config.update if kind == 'config' else []):
            config[item.key] = json.loads(item.value_json)
        items = (record.history.item if kind == 'history' else
                 record.summary.update if kind == 'summary' else [])
        for item in items:
            key = item.key or '/'.join(item.nested_key)
            value = json.loads(item.value_json)
            if kind == 'history':
                history.setdefault(key, []).append(value)
            else:
                summary[key] = value
        if kind == 'run':
            names.append((record.run.project, record.run.display_name))
    recs = records(out)
    assert names[0] == ('tiny', 'run-a')
    # the run's config.json, the built model's fields included (W&B started before the build)
    written = json.loads((out / 'config.json').read_text())
    assert written['vocab_size'] > 0
    assert {k: config[k] for k in written} == written
    assert history['train/loss'] == pytest.approx([v for _, v in expected(recs, 'train', 'loss')])
    assert history['eval/val_loss'] == pytest.approx(
        [v for _, v in expected(recs, 'eval', 'val_loss')])
    assert history['_step'][-1] == 4
    final = [r for r in recs if r['type'] == 'train'][-1]['loss']
    assert summary['train/loss'] == pytest.approx(final)
    assert summary['summary/best_val_loss'] == pytest.approx(recs[-1]['best_val_loss'])


def files(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def run_to_replace(out, data_args):
    """A finished run with TensorBoard events in out, for a run to replace: its files' bytes."""
    train.main([*TINY, *data_args, f'--out_dir={out}', '--log=tensorboard', '--max_iters=2'])
    kept = files(out)
    assert {'ckpt.pt', 'metrics.jsonl'} <= set(kept) and len(glob.glob(str(out / 'events.*'))) == 1
    return kept


def test_a_failed_wandb_start_is_one_line_and_keeps_the_run_it_would_replace(data_args, tmp_path,
                                                                             monkeypatch):
    """W&B refuses the run (no login, a bad project, no network): one error line naming the
    project and W&B's reason, before the model is built, and --overwrite=True has not yet removed
    the old run's checkpoint, metrics or TensorBoard events."""
    pytest.importorskip('tensorboard')
    wandb = pytest.importorskip('wandb')
    out = tmp_path / 'out'
    kept = run_to_replace(out, data_args)

    def refuse(**kw):
        raise wandb.errors.CommError('project tiny not found\n(more detail)')
    monkeypatch.setattr(wandb, 'init', refuse)

    def build_model(*a):
        raise AssertionError('the model was built before W&B was asked')
    monkeypatch.setattr(train, 'build_model', build_model)
    with pytest.raises(train.TrainError) as e:
        train.main([*TINY, *data_args, f'--out_dir={out}', '--log=tensorboard,wandb',
                    '--wandb_project=tiny', '--overwrite=True'])
    assert str(e.value) == ("--log=wandb: W&B could not start a run in project 'tiny' (CommError: "
                            "project tiny not found); check the project name and `wandb login`, "
                            "or log offline with WANDB_MODE=offline")
    assert files(out) == kept


def test_a_failed_tensorboard_start_keeps_the_run_it_would_replace(data_args, tmp_path,
                                                                   monkeypatch):
    """TensorBoard's writer fails (a broken install, an I/O error) in a run that replaces another
    (--overwrite=True): the old run's checkpoint, metrics and events are all still there."""
    tensorboard = pytest.importorskip('torch.utils.tensorboard')
    out = tmp_path / 'out'
    kept = run_to_replace(out, data_args)

    def broken(*a, **kw):
        raise OSError(5, 'Input/output error')
    monkeypatch.setattr(tensorboard, 'SummaryWriter', broken)
    with pytest.raises(OSError, match='Input/output error'):
        train.main([*TINY, *data_args, f'--out_dir={out}', '--log=tensorboard',
                    '--overwrite=True'])
    assert files(out) == kept


def test_a_wandb_run_whose_training_fails_is_marked_failed(data_args, tmp_path, monkeypatch):
    """W&B starts before the model is built: a run that then fails (here, its model) is finished
    with exit code 1 in W&B, not left looking like a finished run; a good run ends with 0."""
    wandb = pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')

    def exit_codes(folder):
        codes = []
        for path in glob.glob(str(folder / 'wandb' / 'offline-run-*' / 'run-*.wandb')):
            codes += [r.exit.exit_code for r in wandb_records(path)
                      if r.WhichOneof('record_type') == 'exit']
        return codes

    def build_model(*a):
        raise train.TrainError('the model cannot be built')
    try:
        monkeypatch.setenv('WANDB_DIR', str(tmp_path / 'failed'))
        with monkeypatch.context() as m:
            m.setattr(train, 'build_model', build_model)
            with pytest.raises(train.TrainError, match='cannot be built'):
                train.main([*TINY, *data_args, f'--out_dir={tmp_path / "a"}', '--log=wandb'])
        monkeypatch.setenv('WANDB_DIR', str(tmp_path / 'good'))
        train.main([*TINY, *data_args, f'--out_dir={tmp_path / "b"}', '--log=wandb'])
    finally:
        wandb.teardown()
    assert exit_codes(tmp_path / 'failed') == [1] and exit_codes(tmp_path / 'good') == [0]


@pytest.mark.parametrize('value', ['tensorbord', 'tensorboard,mlflow', 'wandb;tensorboard'])
def test_an_unknown_logger_is_refused_naming_the_valid_ones(data_args, tmp_path, value):
    with pytest.raises(train.TrainError, match=r"unknown logger .*tensorboard, wandb") as e:
        train.main([*TINY, *data_args, f'--out_dir={tmp_path / "out"}', f'--log={value}'])
    assert '\n' not in str(e.value)
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('name', ['tensorboard', 'wandb'])
def test_a_missing_package_is_one_line_naming_its_pip_install(data_args, tmp_path, monkeypatch,
                                                              name):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, 'find_spec',
                        lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(train.TrainError, match=f'needs the {name} package: pip install {name}$'):
        train.main([*TINY, *data_args, f'--out_dir={tmp_path / "out"}',
                    '--log=tensorboard,wandb'])
    assert not (tmp_path / 'out').exists()
    assert loggers.parse_log('') == [] and loggers.parse_log(' ') == []
    with pytest.raises(ConfigError):
        loggers.parse_log(name)


def test_scalars_flattens_numbers_and_drops_the_rest():
    rec = dict(type='eval', iter=3, val_loss=2.5, n=2, frac=[0.5, None], ok=True, note='x',
               routing=dict(val=dict(loss=1.0)), mfu=None)
    assert loggers.scalars(rec) == {'eval/val_loss': 2.5, 'eval/n': 2.0, 'eval/frac/0': 0.5,
                                    'eval/routing/val/loss': 1.0}
