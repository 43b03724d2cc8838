"""export_hf.py: a nanodepth checkpoint written as a transformers GPT-2 folder loads with
AutoModelForCausalLM and gives nanodepth's logits within 1e-4 (biases or none, exact or tanh GELU);
a routed model is refused, and with --dense_backbone=True exported as the model with every routed
decision forced open; bad options are one line before any work.

Checkpoints are tiny models saved here (no training); weights are drawn at std 0.2 rather than
GPT-2's 0.02, so that a wrong transpose, bias or activation moves the logits well past 1e-4."""
import errno
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import export_hf  # noqa: E402
from configurator import ConfigError  # noqa: E402
from conftest import run_group  # noqa: E402
from model import ROUTES, GPT, GPTConfig  # noqa: E402

transformers = pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytestmark = pytest.mark.usefixtures('one_thread')
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
ROUTED = dict(ensemble=dict(ens_layers=2))          # options a 2-layer model needs


def save_run(folder, seed=0, tokenizer='char', **kw):
    """A run folder holding ckpt.pt of a tiny random model; returns (folder, model)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **ROUTED.get(kw.get('route'), {}), **kw}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dict(model=model.state_dict(), model_args=asdict(model.config), config={},
                    data_meta=dict(tokenizer=tokenizer)), folder / 'ckpt.pt')
    return folder, model.eval()


def hf_logits(to, idx):
    hf = transformers.AutoModelForCausalLM.from_pretrained(to).eval()
    with torch.no_grad():
        return hf(idx).logits


def ours(model, idx):
    with torch.no_grad():
        return model(idx, last_only=False, force='full')[0]


@pytest.mark.parametrize('bias,gelu', [(True, 'tanh'), (False, 'none'), (True, 'none')])
def test_dense_export_loads_with_nanodepths_logits(tmp_path, bias, gelu):
    run, model = save_run(tmp_path / 'run', bias=bias, gelu=gelu)
    assert export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--check=False']) == 0
    assert {'config.json', 'model.safetensors'} <= set(os.listdir(tmp_path / 'hf'))
    idx = torch.randint(0, TINY['vocab_size'], (3, TINY['block_size']))
    want = ours(model, idx)
    assert want.abs().max() > 0.5            # logits large enough for a mapping error to show
    torch.testing.assert_close(hf_logits(tmp_path / 'hf', idx), want, rtol=0, atol=1e-4)
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / 'hf')
    assert (cfg.n_positions, cfg.vocab_size, cfg.n_layer) == (16, 50, 2)
    assert cfg.activation_function == ('gelu_new' if gelu == 'tanh' else 'gelu')
    assert cfg.eos_token_id is None          # a char vocabulary has no GPT-2 end-of-text id


def test_gpt2_tokenized_runs_get_gpt2s_end_of_text_id(tmp_path):
    run, _ = save_run(tmp_path / 'run', tokenizer='gpt2', vocab_size=50304)
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--check=False'])
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / 'hf')
    assert cfg.eos_token_id == cfg.bos_token_id == 50256


def test_the_export_checks_itself(tmp_path, capsys):
    run, _ = save_run(tmp_path / 'run')
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])
    out = capsys.readouterr().out
    assert float(re.search(r'max \|logit difference\| (\S+)', out)[1]) < 1e-4, out


@pytest.mark.parametrize('route', ROUTES)
def test_a_routed_model_is_refused_unless_its_dense_backbone_is_asked_for(tmp_path, route):
    run, model = save_run(tmp_path / 'run', route=route)
    with pytest.raises(ConfigError, match=f'route={route}: no transformers architecture') as e:
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])
    assert '\n' not in str(e.value) and '--dense_backbone=True' in str(e.value)
    assert not (tmp_path / 'hf').exists()
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--dense_backbone=True',
                    '--check=False'])
    idx = torch.randint(0, TINY['vocab_size'], (2, TINY['block_size']))
    torch.testing.assert_close(hf_logits(tmp_path / 'hf', idx), ours(model, idx),
                               rtol=0, atol=1e-4)


def test_rotary_positions_are_refused(tmp_path):
    run, _ = save_run(tmp_path / 'run', pos='rope')
    with pytest.raises(ConfigError, match="pos='rope': GPT-2 has learned absolute positions"):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])
    assert not (tmp_path / 'hf').exists()


@pytest.mark.parametrize('to,needle', [
    ('', '--to is empty'), ('{file}', 'is a file, not a folder'),
    ('{file}/hf', 'cannot be created'), ('{full}', 'already holds files'),
])
def test_a_bad_to_is_refused_before_any_work(tmp_path, to, needle):
    run, _ = save_run(tmp_path / 'run')
    (tmp_path / 'file').write_text('x')
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'keep.txt').write_text('mine')
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=needle) as e:
        export_hf.main([f'--out_dir={run}',
                        f'--to={to.format(file=tmp_path / "file", full=tmp_path / "full")}'])
    assert '\n' not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / 'full' / 'keep.txt').read_text() == 'mine'


def test_overwrite_replaces_the_export_and_keeps_other_files(tmp_path):
    run, model = save_run(tmp_path / 'run', seed=1)
    (tmp_path / 'hf').mkdir()
    (tmp_path / 'hf' / 'README.md').write_text('mine')
    (tmp_path / 'hf' / 'config.json').write_text('{}')
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--overwrite=True',
                    '--check=False'])
    assert (tmp_path / 'hf' / 'README.md').read_text() == 'mine'
    idx = torch.randint(0, TINY['vocab_size'], (1, 8))
    torch.testing.assert_close(hf_logits(tmp_path / 'hf', idx), ours(model, idx),
                               rtol=0, atol=1e-4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.export-')]


def test_a_run_folder_is_refused_as_the_export_folder_even_with_overwrite(tmp_path):
    # the export writes config.json, which a run folder holds as its own
    run, _ = save_run(tmp_path / 'run')
    (run / 'config.json').write_text('{"out_dir": "the run\'s own"}')
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for extra in ([], ['--overwrite=True']):
        with pytest.raises(ConfigError, match=r"holds a training run \(ckpt\.pt\)"):
            export_hf.main([f'--out_dir={run}', f'--to={run}', *extra])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.parametrize('kept', ['metrics.jsonl', 'run_info.json'])
def test_a_run_folder_before_its_first_checkpoint_is_refused_too(tmp_path, kept):
    run, _ = save_run(tmp_path / 'run')
    (tmp_path / 'new').mkdir()
    for name in ('config.json', kept):
        (tmp_path / 'new' / name).write_text('{"the run": "its own"}')
    with pytest.raises(ConfigError, match=fr"holds a training run \({kept}\)"):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "new"}', '--overwrite=True'])
    assert (tmp_path / 'new' / 'config.json').read_text() == '{"the run": "its own"}'


def test_a_peft_adapter_in_the_export_folder_is_refused_even_with_overwrite(tmp_path):
    """transformers loads a folder holding adapter_config.json as that adapter on its base model,
    not as the model.safetensors beside it: exporting there would leave a folder that loads as
    another model."""
    run, _ = save_run(tmp_path / 'run')
    (tmp_path / 'hf').mkdir()
    (tmp_path / 'hf' / 'adapter_config.json').write_text('{"base_model_name_or_path": "x"}')
    with pytest.raises(ConfigError, match=r"holds a PEFT adapter \(adapter_config\.json\)"):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--overwrite=True'])
    assert sorted(p.name for p in (tmp_path / 'hf').iterdir()) == ['adapter_config.json']


def test_a_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match='no checkpoint at'):
        export_hf.main([f'--out_dir={tmp_path}', f'--to={tmp_path / "hf"}'])
    (tmp_path / 'ckpt.pt').write_bytes(b'x')       # the checkpoint file given for its run folder
    with pytest.raises(ConfigError, match=f"is a file; --out_dir names the run's folder: "
                                          f"--out_dir={tmp_path}$"):
        export_hf.main([f'--out_dir={tmp_path / "ckpt.pt"}', f'--to={tmp_path / "hf"}'])


@pytest.mark.slow
def test_the_command_line_refusal_is_one_line_and_exit_2(tmp_path):
    run, _ = save_run(tmp_path / 'run', route='ffn')
    r = run_group([sys.executable, 'export_hf.py', f'--out_dir={run}', f'--to={tmp_path / "hf"}'],
                  300, cwd=REPO, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 2
    assert r.stderr.startswith('error: route=ffn') and r.stderr.count('\n') == 1, r.stderr


def test_an_export_whose_logits_differ_is_an_error(tmp_path, monkeypatch):
    run, _ = save_run(tmp_path / 'run')
    monkeypatch.setattr(export_hf, 'largest_difference', lambda model, to: (0.01, 1.0))
    with pytest.raises(RuntimeError, match='differ from nanodepth'):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])


def test_without_transformers_the_export_is_one_line_naming_its_pip_install(tmp_path,
                                                                            monkeypatch):
    run, _ = save_run(tmp_path / 'run')
    monkeypatch.setitem(sys.modules, 'transformers', None)          # `import transformers` fails
    with pytest.raises(ConfigError, match='needs transformers: pip install transformers'):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])
    assert not (tmp_path / 'hf').exists()


def test_help_lists_each_option_with_its_default_and_description(capsys):
    assert export_hf.main(['--help']) == 0
    out = capsys.readouterr().out
    assert '--dense_backbone=False' in out and 'export its dense backbone' in out
    assert 'UNDOCUMENTED' not in out


@pytest.mark.parametrize('earlier', [False, True])
def test_an_export_whose_logits_differ_leaves_the_folder_as_it_was(tmp_path, monkeypatch,
                                                                   earlier):
    # the check reads the written files before they replace anything in --to
    run, _ = save_run(tmp_path / 'run')
    if earlier:
        (tmp_path / 'hf').mkdir()
        (tmp_path / 'hf' / 'config.json').write_text('{"n_layer": 7}')
    monkeypatch.setattr(export_hf, 'largest_difference', lambda model, to: (0.01, 1.0))
    with pytest.raises(RuntimeError, match='differ from nanodepth'):
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--overwrite=True'])
    if earlier:
        assert [p.name for p in (tmp_path / 'hf').iterdir()] == ['config.json']
        assert (tmp_path / 'hf' / 'config.json').read_text() == '{"n_layer": 7}'
    else:
        assert not (tmp_path / 'hf').exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf', 'run'][1 - earlier:]


def test_a_to_that_links_to_another_filesystem_is_written_there(tmp_path, monkeypatch):
    # files move by os.replace, which cannot cross filesystems: the temporary folder must be made
    # beside the link's target, not beside the link
    run, model = save_run(tmp_path / 'run')
    other = os.path.realpath(tmp_path / 'scratch')          # stands for another filesystem
    os.makedirs(os.path.join(other, 'hf'))
    (tmp_path / 'hf').symlink_to(os.path.join(other, 'hf'))
    real = os.replace

    def replace(src, dst):
        inside = [os.path.realpath(p).startswith(other + os.sep) for p in (src, dst)]
        if inside[0] != inside[1]:
            raise OSError(errno.EXDEV, 'Invalid cross-device link')
        return real(src, dst)

    monkeypatch.setattr(export_hf.os, 'replace', replace)
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--check=False'])
    assert sorted(os.listdir(os.path.join(other, 'hf'))) == [
        'config.json', 'generation_config.json', 'model.safetensors']
    assert sorted(os.listdir(other)) == ['hf']
    idx = torch.randint(0, TINY['vocab_size'], (1, 8))
    torch.testing.assert_close(hf_logits(tmp_path / 'hf', idx), ours(model, idx),
                               rtol=0, atol=1e-4)


def test_a_to_that_links_to_a_missing_path_is_refused_before_any_work(tmp_path, monkeypatch):
    run, _ = save_run(tmp_path / 'run')
    (tmp_path / 'hf').symlink_to(tmp_path / 'gone' / 'hf')
    monkeypatch.setattr(export_hf, 'load_checkpoint', lambda *a: pytest.fail('loaded'))
    with pytest.raises(ConfigError, match=r'--to=\S+ is a link to \S+, a path that does not '
                                          'exist') as e:
        export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}'])
    assert '\n' not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf', 'run']


@pytest.mark.parametrize('exists', [True, False])
def test_a_to_whose_parent_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                        exists):
    # the temporary folder is made beside --to: a writable --to in a read-only folder is not
    # enough. Tests run as root, which ignores mode bits: os.access stands for them
    run, _ = save_run(tmp_path / 'run')
    parent = tmp_path / 'parent'
    (parent / 'hf').mkdir(parents=True) if exists else parent.mkdir()
    real = os.access
    monkeypatch.setattr(os, 'access', lambda p, mode, **kw:
                        os.path.realpath(p) != str(parent) and real(p, mode, **kw))
    monkeypatch.setattr(export_hf, 'load_checkpoint', lambda *a: pytest.fail('loaded'))
    with pytest.raises(ConfigError, match=r'--to=\S+( \(written first in a temporary folder beside '
                                          f'it\\))?: cannot write in {re.escape(str(parent))} '
                                          r'\(permission denied\)') as e:
        export_hf.main([f'--out_dir={run}', f'--to={parent / "hf"}'])
    assert '\n' not in str(e.value)
    assert [p.name for p in parent.iterdir()] == (['hf'] if exists else [])


def test_a_to_that_is_a_mount_point_is_written_through_a_temporary_folder_inside_it(
        tmp_path, monkeypatch):
    # beside a mount point is another filesystem, which os.replace cannot cross: the temporary
    # folder is made inside --to instead (a mount point and EXDEV simulated: no mount here)
    run, model = save_run(tmp_path / 'run')
    mount = os.path.realpath(tmp_path / 'hf')
    os.makedirs(mount)
    real_ismount, real_replace = os.path.ismount, os.replace

    def replace(src, dst):
        inside = [os.path.realpath(p).startswith(mount + os.sep) for p in (src, dst)]
        if inside[0] != inside[1]:
            raise OSError(errno.EXDEV, 'Invalid cross-device link')
        return real_replace(src, dst)

    monkeypatch.setattr(os.path, 'ismount', lambda p: os.path.realpath(p) == mount
                        or real_ismount(p))
    monkeypatch.setattr(os, 'replace', replace)
    # an earlier export killed mid-write left its temporary folder there: not files of the user's
    os.makedirs(os.path.join(mount, export_hf.STAGING_PREFIX + 'killed'))
    export_hf.main([f'--out_dir={run}', f'--to={tmp_path / "hf"}', '--check=False'])
    assert sorted(os.listdir(mount)) == [export_hf.STAGING_PREFIX + 'killed', 'config.json',
                                         'generation_config.json', 'model.safetensors']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf', 'run']
    idx = torch.randint(0, TINY['vocab_size'], (1, 8))
    torch.testing.assert_close(hf_logits(mount, idx), ours(model, idx), rtol=0, atol=1e-4)
