"""plots.py and eval.py's routing map: the Pareto helper and seed bands against hand computation,
every plot written for a tiny fake study (runs faked as folders of metrics), a missing matplotlib
never failing a sweep; the routing map's text layout and grid against the model's masks, the
per-class fractions against an independent recomputation, and `eval.py --routing_map` end to end on
a tiny hand-made checkpoint."""
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

import eval as ev
import plots
import sweep
from configurator import ConfigError
from data import prepare as P
from model import GPT, GPTConfig


PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


# --------------------------------------------------------------------------------------------------
# plots.py

def test_pareto_front_hand_example():
    #        0       1       2         3       4       5
    xs = [1.0,    2.0,    3.0,      2.0,    4.0,    5.0]
    ys = [3.0,    2.0,    2.5,      4.0,    1.0,    1.0]
    # 2 is dominated by 1; 3 by 0 and 1; 5 by 4 (equal loss, more cost); 0, 1, 4 trade off
    assert plots.pareto_front(xs, ys) == [0, 1, 4]
    # maximising x (TLOps saved): negate it. 2 is dominated by 1 (less saved, higher loss); the
    # order is by increasing -x, i.e. most saved first
    saved, loss = [0.1, 0.3, 0.2, 0.5], [2.0, 2.1, 2.2, 2.5]
    assert plots.pareto_front([-x for x in saved], loss) == [3, 1, 0]
    # identical points dominate neither
    assert plots.pareto_front([1.0, 1.0], [2.0, 2.0]) == [0, 1]


def fake_study(root, arms=(('routed', 0.0, True), ('dense', 0.3, False)), seeds=(1, 2)):
    """A finished study's folders: train records every 10 iterations, evals every 20, a summary."""
    for arm, shift, routed in arms:
        for s in seeds:
            d = root / arm / f'seed{s}'
            d.mkdir(parents=True)
            recs = []
            for it in range(10, 50, 10):
                r = dict(
                    type='train',
                    iter=it,
                    lm_loss=3 - it / 40 + shift + 0.1 * s,
                    ctrl_grad_norm=0.1 * s * it,
                )
                if routed:
                    r.update(full_frac=[0.5, 0.4 + 0.01 * s], tlops_saved=0.2 + 0.01 * s)
                recs.append(r)
            for it in (0, 20, 40):
                recs.append(dict(type='eval', iter=it, val_loss=2.5 - it / 80 + shift + 0.1 * s,
                                 val_full_frac=[0.45, 0.5] if routed else None))
            recs.append(
                dict(
                    type='summary',
                    iter=40,
                    avg_lm=2.5 + shift,
                    flops_proxy=1.5 - shift + 0.01 * s,
                    wall_s=1.0,
                )
            )
            (d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in recs))
            (d / 'config.json').write_text(json.dumps(dict(max_iters=40)))


def test_seed_band_and_arm_points_match_hand_computation(tmp_path):
    fake_study(tmp_path)
    runs = plots.find_runs(str(tmp_path))
    assert list(runs) == ['dense', 'routed'] and list(runs['routed']) == [1, 2]
    iters, mean, lo, hi = plots.seed_band(runs['routed'], 'train', 'lm_loss')
    assert iters.tolist() == [10, 20, 30, 40]
    assert mean == pytest.approx([3 - it / 40 + 0.15 for it in iters])
    assert lo == pytest.approx([3 - it / 40 + 0.1 for it in iters]) and hi == pytest.approx(
        [3 - it / 40 + 0.2 for it in iters]
    )
    # per-layer lists
    _, mean, _, _ = plots.seed_band(runs['routed'], 'train', 'full_frac')
    assert mean.shape == (4, 2) and mean[:, 1] == pytest.approx([0.415] * 4)
    assert plots.seed_band(runs['dense'], 'train', 'full_frac') is None
    points = plots.arm_points(runs, 'flops_proxy')
    # x: flops_proxy 1.51, 1.52; y: final val loss 2.0 + 0.1·s; sample std (ddof=1), as sweep.py's
    # summary: |a - b| / sqrt(2) for two seeds
    assert points['routed'] == pytest.approx((1.515, 0.01 / 2**0.5, 2.15, 0.1 / 2**0.5))
    # dense never logs it
    assert set(plots.arm_points(runs, 'tlops_saved')) == {'routed'}


def test_figures_curves_leave_out_an_eval_only_runs_records(tmp_path):
    """An eval-only run of a seed's checkpoint appends an eval (and a summary) at the checkpoint's
    iteration: the figures' val curves keep the training's eval there, as run_metrics does."""
    fake_study(tmp_path)
    runs = plots.find_runs(str(tmp_path))
    before = plots.seed_band(runs['routed'], 'eval', 'val_loss')
    with open(os.path.join(runs['routed'][1], 'metrics.jsonl'), 'a') as f:
        for r in (dict(type='eval', iter=40, val_loss=9.0, val_full_frac=[0.9, 0.9]),
                  dict(type='summary', iter=40, avg_lm=9.0)):
            f.write(json.dumps(dict(r, eval_only=True)) + '\n')
    for key in ('val_loss', 'val_full_frac'):
        after = plots.seed_band(runs['routed'], 'eval', key)
        want = before if key == 'val_loss' else None
        if want is not None:
            assert all(np.array_equal(a, b) for a, b in zip(after, want)), (key, after)
        else:
            assert after[1][-1].tolist() == [0.45, 0.5], after


@pytest.mark.parametrize("seeds", [(1, 2, 3), (1,)])
def test_arm_points_spread_is_the_sweep_summarys_std(tmp_path, seeds):
    """A figure's error bars and the summary table give the same std over seeds (the sample std;
    0 for a single seed, where the summary has no spread to give)."""
    fake_study(tmp_path, seeds=seeds)
    runs = plots.find_runs(str(tmp_path))
    results = {(arm, s): plots.run_metrics(d)
               for arm, dirs in runs.items() for s, d in dirs.items()}
    table = sweep.summarize(dict(arms={'routed': [], 'dense': []}, seeds=list(seeds),
                                 reference='dense'), results)['table']
    for arm in ('routed', 'dense'):
        x_mean, x_std, y_mean, y_std = plots.arm_points(runs, 'flops_proxy')[arm]
        assert (x_mean, x_std) == pytest.approx((table[arm]['flops_proxy']['mean'],
                                                 table[arm]['flops_proxy']['std']), abs=1e-12)
        assert (y_mean, y_std) == pytest.approx((table[arm]['final_val_loss']['mean'],
                                                 table[arm]['final_val_loss']['std']), abs=1e-12)
    # final val loss 2.0 + 0.1·s (routed): the sample std of 2.1, 2.2, 2.3 is 0.1; one seed: 0
    _, _, _, y_std = plots.arm_points(runs, 'flops_proxy')['routed']
    assert y_std == pytest.approx(0.1 if len(seeds) == 3 else 0.0, abs=1e-12)


def test_write_plots_for_a_tiny_fake_study(tmp_path):
    pytest.importorskip('matplotlib')
    fake_study(tmp_path)
    written = plots.write_plots(str(tmp_path))
    names = [
        'loss_curves.png',
        'pareto_flops.png',
        'pareto_tlops.png',
        'grad_norms.png',
        'full_frac.png',
    ]
    assert written == [str(tmp_path / 'plots' / n) for n in names]
    for path in written:
        data = open(path, 'rb').read()
        assert len(data) > 5000 and data.startswith(PNG_MAGIC)


def test_sweep_plots_after_its_summary_and_no_plots_skips(tmp_path):
    pytest.importorskip('matplotlib')
    fake_study(tmp_path / 'out')
    (tmp_path / 'cfg.py').write_text('max_iters = 40\n')       # what the runs were made with
    study = tmp_path / 'study.py'
    study.write_text(f"base = {str(tmp_path / 'cfg.py')!r}\nout_root = {str(tmp_path / 'out')!r}\n"
                     "seeds = [1, 2]\narms = {'routed': [], 'dense': []}\nreference = 'dense'\n")
    assert sweep.main([str(study), '--summarize_only', '--no_plots']) == 0
    assert (tmp_path / 'out' / 'summary.json').exists() and not (
        tmp_path / 'out' / 'plots'
    ).exists()
    assert sweep.main([str(study), '--summarize_only']) == 0
    assert len(os.listdir(tmp_path / 'out' / 'plots')) == 5


def test_missing_matplotlib_skips_plots_with_one_line(tmp_path, monkeypatch, capsys):
    fake_study(tmp_path)
    # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    assert plots.pyplot() is None
    assert plots.write_plots(str(tmp_path)) == []
    out = capsys.readouterr().out
    assert out.strip() == plots.SKIPPED and 'pip install matplotlib' in out
    assert not (tmp_path / 'plots').exists()


def test_cli_refuses_a_folder_without_runs(tmp_path):
    """An out_root with no <arm>/seed<s>/metrics.jsonl (a typo, a study not run yet): one line and
    exit 2 rather than 'plots skipped' and exit 0; nothing written."""
    (tmp_path / 'arm' / 'seed1').mkdir(parents=True)       # a run folder without its metrics
    with pytest.raises(ConfigError, match=f"^{tmp_path} holds no runs"):
        plots.main([str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['arm']


def test_cli_says_what_is_wrong_with_its_argument(tmp_path):
    """A missing folder, a file, an option or a second argument: one line saying which, with the
    usage."""
    (tmp_path / 'a.txt').write_text('')
    for argv, says in (([str(tmp_path / 'nope')], 'does not exist'),
                       ([str(tmp_path / 'a.txt')], 'is a file, not a folder'),
                       (['--out_root=x'], 'takes no options (--out_root=x)'),
                       ([str(tmp_path), str(tmp_path)], 'takes one folder, got 2 arguments')):
        with pytest.raises(ConfigError, match=re.escape(says) + '.*usage: python plots.py'):
            plots.main(argv)


def test_cli_refuses_a_file_where_the_plots_folder_goes(tmp_path):
    """OUT_ROOT/plots a file: one line naming it, before any plot, and the file kept."""
    fake_study(tmp_path)
    (tmp_path / 'plots').write_text('kept')
    with pytest.raises(ConfigError, match=r"plots is a file, where the plots' folder goes"):
        plots.main([str(tmp_path)])
    assert (tmp_path / 'plots').read_text() == 'kept'


@pytest.mark.parametrize('name,text', [('config.json', '{bad'), ('run_info.json', '{bad'),
                                       ('config.json', '[1, 2]')])
def test_a_damaged_run_file_is_one_line_naming_it(tmp_path, name, text):
    fake_study(tmp_path)
    bad = tmp_path / 'dense' / 'seed1' / name
    bad.write_text(text)
    with pytest.raises(ConfigError, match=f"{bad} is not a JSON object") as e:
        plots.run_metrics(str(bad.parent))
    assert '\n' not in str(e.value)


def test_records_and_summaries_that_are_not_json_objects_are_left_out(tmp_path):
    """A metrics line that is JSON but no record is dropped, as resume drops it; a summary.json
    that is no sweep summary orders nothing."""
    fake_study(tmp_path)
    metrics = tmp_path / 'dense' / 'seed1' / 'metrics.jsonl'
    want = plots.read_metrics(str(metrics.parent))
    metrics.write_text(metrics.read_text() + '[1, 2]\n"x"\nnull\n')
    assert plots.read_metrics(str(metrics.parent)) == want
    for summary in ('[1]', '{"table": "dense"}'):
        (tmp_path / 'summary.json').write_text(summary)
        assert list(plots.find_runs(str(tmp_path))) == ['dense', 'routed']


# --------------------------------------------------------------------------------------------------
# routing maps (eval.py)

def tiny_model(seed=0):
    """3 layers, FFN routing at layers 0 and 2 only (layer 1 is not routed), random gate."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        block_size=16,
        vocab_size=12,
        n_layer=3,
        n_head=2,
        n_embd=16,
        route='ffn',
        ffn_gate='random',
        ffn_layers='0,2',
        ffn_cheap_rank=2,
        ffn_gate_hidden=8,
        ffn_budget=0.5,
    )
    return GPT(cfg)


def test_routing_map_text_has_a_row_per_layer_and_a_column_per_token():
    model = tiny_model()
    x = torch.randint(0, 12, (1, 10))
    torch.manual_seed(1)
    grid = ev.routing_map(model, x)
    # the random gate draws again: same draws
    torch.manual_seed(1)
    model.eval()
    masks = model(x)[2]['masks']
    assert grid.shape == (3, 10) and np.isnan(grid[1]).all()
    for layer in (0, 2):
        assert grid[layer].tolist() == masks[layer][0].float().tolist()
    itos = ['a', 'b', ' ', '\n', 'dd', 'e', 'f', 'g', 'h', 'i', 'j', 'k']
    tokens = ev.token_text(lambda ids: ''.join(itos[i] for i in ids), x[0].tolist())
    assert all(
        t == {' ': '␣', '\n': '\\n'}.get(itos[i], itos[i]) for t, i in zip(tokens, x[0].tolist())
    )
    lines = ev.routing_map_text(grid, tokens).splitlines()
    assert len(lines) == 1 + 3 and [ln[:2] for ln in lines[1:]] == ['L0', 'L1', 'L2']
    w = max(map(len, tokens)) + 1
    assert all(len(ln) == 5 + 10 * w for ln in lines)
    for t in range(10):
        assert lines[0][5 + t * w:5 + (t + 1) * w].strip() == tokens[t]
        cells = [ln[5 + (t + 1) * w - 1] for ln in lines[1:]]
        assert cells == ['#' if masks[0][0, t] else '.', '-', '#' if masks[2][0, t] else '.']
    wrapped = ev.routing_map_text(grid, tokens, per_line=4).split('\n\n')
    assert len(wrapped) == 3 and all(len(b.splitlines()) == 4 for b in wrapped)


def test_class_fractions_equal_a_recomputation_from_the_masks():
    model = tiny_model()
    T, classes = 8, ['easy', 'hard', 'other']
    rng = np.random.default_rng(0)
    difficulty = rng.integers(0, 3, 200).astype(np.uint8)
    batches = []
    for _ in range(2):
        starts = rng.integers(0, 200 - T - 1, 3)
        batches.append((torch.randint(0, 12, (3, T)), torch.randint(0, 12, (3, T)), starts))
    torch.manual_seed(5)
    got = ev.difficulty_fractions(model, batches, difficulty, classes)
    # replay the same random-gate draws
    torch.manual_seed(5)
    model.eval()
    full, count = {}, {}
    with torch.no_grad():
        for x, y, starts in batches:
            masks = model(x, y)[2]['masks']
            for b, s in enumerate(starts):
                for t in range(T):
                    c = classes[difficulty[s + t + 1]]        # the class of the target of position
                                                              # t
                    count[c] = count.get(c, 0) + 1
                    for layer, m in masks.items():
                        full[c, layer] = full.get((c, layer), 0) + int(m[b, t])
    assert set(got) == set(classes) and all(set(got[c]) == {0, 2} for c in classes)
    for c in classes:
        for layer in (0, 2):
            assert got[c][layer] == pytest.approx(full.get((c, layer), 0) / count[c])
    assert 'L0' in ev.class_table_text(got) and len(
        ev.class_table_text(got).splitlines()
    ) == 1 + len(classes)


def test_eval_routing_map_cli_on_a_tiny_checkpoint(tmp_path, capsys):
    data = tmp_path / 'data' / 'syn'
    P.prepare('synthetic', out_dir=data, num_tokens=20000)
    model = tiny_model()
    meta = json.loads((data / 'meta.json').read_text())
    margs = dict(model.config.__dict__, vocab_size=meta['vocab_size'], ffn_gate='mlp')
    model = GPT(GPTConfig.from_dict(margs))
    ckpt = tmp_path / 'ckpt.pt'
    torch.save(
        dict(
            model=model.state_dict(),
            model_args=margs,
            config=dict(
                dataset='syn',
                data_dir=str(tmp_path / 'data'),
                block_size=16,
                batch_size=2,
                eval_iters=2,
                calib_iters=2,
            ),
        ),
        ckpt,
    )
    assert (
        ev.main(
            [f'--ckpt={ckpt}', '--routing_map', '--json', f"--out={tmp_path / 'map.png'}"]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    val = np.fromfile(data / 'val.bin', dtype=meta['dtype'])
    assert res['ids'] == val[res['start']:res['start'] + 16].tolist()
    # single-character symbols
    assert res['tokens'] == [meta['itos'][i] for i in res['ids']]
    assert (
        len(res['map']) == 3
        and all(len(row) == 16 for row in res['map'])
        and set(res['map'][1]) == {None}
    )
    assert set(res['full_frac_by_class']) == set(meta['difficulty_classes'])
    assert ev.main([f'--ckpt={ckpt}', '--routing_map', f"--out={tmp_path / 'map.png'}"]) == 0
    text = capsys.readouterr().out
    assert sum(line.startswith(('L0', 'L1', 'L2')) for line in text.splitlines()) == 3
    assert 'structure' in text and 'hard' in text
    if res['png']:                                                 # matplotlib installed
        assert res['png'] == [str(tmp_path / 'map.png'), str(tmp_path / 'map_by_class.png')]
        assert all(open(p, 'rb').read().startswith(PNG_MAGIC) for p in res['png'])


def test_frontier_plots_for_dense_sizes_and_a_routed_arm(tmp_path):
    """Dense runs of two widths and a routed one, with train.py-style config.json files: the two
    plots on absolute FLOPs are written, with the frontier line; without a frontier they draw the
    Pareto front."""
    pytest.importorskip('matplotlib')
    fake_study(tmp_path, arms=(('small', 0.3, False), ('big', 0.0, False), ('routed', 0.1, True)))
    for arm, width, route in (('small', 16, 'none'), ('big', 32, 'none'), ('routed', 32, 'mod')):
        for s in (1, 2):
            d = tmp_path / arm / f'seed{s}'
            (d / 'config.json').write_text(
                json.dumps(
                    dict(
                        max_iters=40,
                        route=route,
                        n_layer=2,
                        n_head=2,
                        n_embd=width,
                        block_size=16,
                        vocab_size=20,
                    )
                )
            )
            recs = (d / 'metrics.jsonl').read_text().splitlines()
            summ = json.loads(recs[-1])
            summ.update(
                train_flops=1e9 * width * (0.6 if route == 'mod' else 1.0),
                eval_flops_vs_dense=0.6 if route == 'mod' else None,
            )
            (d / 'metrics.jsonl').write_text('\n'.join(recs[:-1] + [json.dumps(summ)]) + '\n')
    runs = plots.find_runs(str(tmp_path))
    pts = plots.arm_points(runs, 'eval_flops')
    assert pts['small'][0] < pts['routed'][0] < pts['big'][0]
    written = plots.write_plots(str(tmp_path), frontier=['small', 'big'])
    names = {os.path.basename(p) for p in written}
    assert {'frontier_eval_flops.png', 'frontier_train_flops.png'} <= names
    fig = plots.plot_pareto(plots.pyplot(), runs, 'eval_flops', 'x', frontier=['small', 'big'])
    assert fig.axes[0].get_xscale() == 'log' and any(
        'dense frontier' in t.get_text() for t in fig.axes[0].get_legend().get_texts()
    )
    assert isinstance(
        plots.plot_pareto(plots.pyplot(), runs, 'eval_flops', 'x', frontier=['small']), str
    )


def test_help_gives_the_purpose_and_usage_and_exits_0(tmp_path, monkeypatch, capsys):
    """--help and -h, as every script answers them: on stdout, exit 0, nothing written."""
    monkeypatch.chdir(tmp_path)
    for flag in ('--help', '-h'):
        assert plots.main([flag]) == 0
        out, err = capsys.readouterr()
        assert out.startswith('Plots of a study, as PNG files in OUT_ROOT/plots/') and err == ''
        assert 'usage: python plots.py OUT_ROOT' in out
    assert list(tmp_path.iterdir()) == []
