"""Tests for eval.py: bad options are one UserError naming the field; --json prints exactly one JSON
object on stdout; a data folder without the run's corpus is refused and the command the error names
prepares it; eval.room's brackets against a hand computation."""
import io
import json
import math
import re
import shlex
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import eval as ev
from configurator import UserError
from conftest import ROUTED_TOL
from data import prepare as P
from test_ffn import BUDGETS, SETTINGS, build, ce_ref, ceil_frac, embed_ref, ffn_ref, logits_ref, \
    tokens, topk_ref

pytestmark = pytest.mark.usefixtures('one_thread')
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("arg,needle", [
    ("--eval_iters=-1", "eval_iters"), ("--calib_iters=-2", "calib_iters"),
    ("--batch_size=-4", "batch_size"),
    ("--device=bogus", "device"), pytest.param("--device=cuda", "CUDA", marks=NO_CUDA)])
def test_eval_bad_options(tmp_path, arg, needle):
    with pytest.raises(UserError, match=needle):
        ev.main([f"--ckpt={tmp_path / 'missing.pt'}", arg])


def test_eval_help_lists_options_flags_and_descriptions(tmp_path, capsys):
    """--help exits 0 before any check (no checkpoint needed), on stdout: each option as
    --key=default with its comment, the bare flags, nothing UNDOCUMENTED."""
    assert ev.main(['--help', '--ckpt', 'missing.pt']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('Evaluate a checkpoint') and err == '' and 'UNDOCUMENTED' not in out
    assert re.search(r"^  --eval_iters=0 +validation batches \(0: the run's own eval_iters\)$",
                     out, re.M)
    assert sorted(re.findall(r"^  --(\w+)=", out, re.M)) == sorted(ev.DEFAULTS)
    assert re.search(r"^  --routing_map +which path each token", out, re.M)
    assert '--routing-map' not in out and '--ckpt ' not in out


@pytest.mark.parametrize("argv,new", [
    (["--ckpt", "run/ckpt.pt", "--json"], "--ckpt=run/ckpt.pt"),
    (["--ckpt=run/ckpt.pt", "--out", "m.png", "--routing_map"], "--out=m.png"),
    (["--ckpt"], "--ckpt=VALUE"),
    (["--ckpt=run/ckpt.pt", "--routing-map"], "--routing_map")])
def test_eval_old_spellings_are_refused_naming_the_new_one(monkeypatch, capsys, argv, new):
    """One syntax in every script: `--ckpt PATH` and `--routing-map` end in one line naming
    today's spelling, exit 2, before any file is read."""
    monkeypatch.setattr('sys.argv', ['eval.py', *argv])
    with pytest.raises(SystemExit) as e:
        ev.run_cli(ev.main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith('error: ') and err.count('\n') == 1
    assert new in err


# --------------------------------------------------------------------------------------------------
# eval.py --json: stdout is exactly one JSON object

def test_eval_json_stdout_is_one_object(run, capsys):
    assert ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", "--json", f"--data_dir={run / 'data'}",
                    "--eval_iters=1", "--calib_iters=1", "--device=cpu"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)                                   # the whole of stdout
    assert res["ckpt"] == str(run / "out" / "ckpt.pt")
    # the model untrained past 2 steps: near the uniform loss ln(vocab) of the synthetic corpus
    assert 0.8 * math.log(34) < res["val_loss"]["loss"] < 1.2 * math.log(34)


def test_eval_loss_is_the_runs_own_last_eval(run, capsys):
    """eval.py with the run's own eval_iters and calibration gives the val loss train.py logged
    at the step its checkpoint holds: two processes and code paths, the same batches and
    thresholds, so the same number to float rounding."""
    assert ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", "--json", f"--data_dir={run / 'data'}",
                    "--device=cpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    lines = (run / "out" / "metrics.jsonl").read_text().splitlines()
    last = [r for r in map(json.loads, lines) if r["type"] == "eval"][-1]
    assert last["iter"] == 2
    assert res["val_loss"]["loss"] == pytest.approx(last["val_loss"], rel=1e-6)


@pytest.mark.parametrize("flag", [[], ["--room"], ["--routing_map"]])
def test_eval_runs_its_passes_at_the_dtype_asked(run, tmp_path, monkeypatch, capsys, flag):
    """--dtype=bfloat16 evaluates under bfloat16 autocast (each report's passes), not float32."""
    seen = []

    def spying(fn):         # records the precision context each pass runs under
        def spy(*a, **k):
            seen.extend(getattr(v, 'fast_dtype', None) for v in (*a, *k.values())
                        if hasattr(v, '__enter__'))
            return fn(*a, **k)
        return spy
    monkeypatch.setattr(ev, 'evaluate', spying(ev.evaluate))
    monkeypatch.setattr(ev, 'routing_map', spying(ev.routing_map))
    out = ["--json", f"--out={tmp_path / 'map.png'}"] if flag == ["--routing_map"] else ["--json"]
    assert ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", f"--data_dir={run / 'data'}",
                    "--eval_iters=1", "--calib_iters=1", "--device=cpu", "--dtype=bfloat16",
                    *flag, *out]) == 0
    capsys.readouterr()
    assert seen and set(seen) == {torch.bfloat16}, seen


def test_eval_prepares_no_data_and_its_suggested_prepare_works(run, tmp_path, capsys):
    """A data folder without the run's corpus is refused, nothing is written there, and the command
    the error names prepares exactly what eval then accepts."""
    ckpt = str(run / "out" / "ckpt.pt")
    args = [f"--ckpt={ckpt}", "--json", "--eval_iters=1", "--calib_iters=1", "--device=cpu"]
    with pytest.raises(UserError, match="is not a folder"):
        ev.main(args + [f"--data_dir={tmp_path / 'missing'}"])
    assert not (tmp_path / "missing").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError) as e:
        ev.main(args + [f"--data_dir={empty}"])
    assert list(empty.iterdir()) == []                     # nothing prepared, nothing written
    command = str(e.value).split("run: ", 1)[1]
    words = shlex.split(command)
    assert words[:3] == ["python", "data/prepare.py", "synthetic"], command
    assert P.main(words[2:]) == 0                          # the suggested command, as written
    capsys.readouterr()
    assert ev.main(args + [f"--data_dir={empty}"]) == 0
    fresh = json.loads(capsys.readouterr().out)["val_loss"]["loss"]
    assert ev.main(args + [f"--data_dir={run / 'data'}"]) == 0     # the corpus the run trained on
    assert fresh == json.loads(capsys.readouterr().out)["val_loss"]["loss"]


# --------------------------------------------------------------------------------------------------
# eval.room: the brackets a study's room is measured with

@settings(**SETTINGS)
@given(seed=st.integers(0, 999), B=st.integers(1, 3), T=st.integers(2, 12), budget=BUDGETS)
def test_room_brackets_match_a_hand_computation(seed, B, T, budget):
    """eval.room's all-full, all-cheap and oracle losses from the blocks' submodules by hand (one
    controlled layer, so the oracle's top-k of U_t = CE(cheap) − CE(full) is the whole decision),
    and the model's config is the trained one afterwards."""
    model = build(seed, n_layer=1, ffn_gate='mlp', ffn_budget=float(budget)).eval()
    idx, tgt = tokens(seed, B, T), tokens(seed + 1, B, T)
    out = ev.room(model, [(idx, tgt)])
    with torch.no_grad():
        x = embed_ref(model, idx)
        block = model.transformer.h[0]
        x = x + block.attn(block.ln_1(x))
        ce = {
            a: ce_ref(logits_ref(model, x + ffn_ref(block, x, a)), tgt) for a in ('full', 'cheap')
        }
        mask = topk_ref(ce['cheap'] - ce['full'], ceil_frac(budget, T))
    assert out['full'] == pytest.approx(
        ce['full'].mean().item(), rel=ROUTED_TOL["rtol"], abs=ROUTED_TOL["atol"]
    )
    assert out['cheap'] == pytest.approx(
        ce['cheap'].mean().item(), rel=ROUTED_TOL["rtol"], abs=ROUTED_TOL["atol"]
    )
    assert out['room'] == pytest.approx(out['cheap'] - out['full'])
    assert out['oracle'] == pytest.approx(
        torch.where(mask, ce['full'], ce['cheap']).mean().item(),
        rel=ROUTED_TOL["rtol"],
        abs=ROUTED_TOL["atol"],
    )
    assert out['oracle_full_frac'] == [pytest.approx(ceil_frac(budget, T) / T)]
    assert out['gate_room'] == pytest.approx(out['random'] - out['oracle'])
    assert model.config.ffn_gate == 'mlp' and not model.training


def test_eval_loss_is_the_mean_over_batches_that_count_a_target():
    """A batch whose targets are all -1 (a task's window that holds no whole problem) has no loss:
    the eval loss is the mean over the other batches, not NaN nor lowered by a 0."""
    model = build(0, n_layer=2, ffn_gate='mlp', ffn_budget=0.5).eval()
    batches = [(tokens(s, 2, 8), tokens(s + 1, 2, 8)) for s in range(2)]
    empty = (tokens(5, 2, 8), torch.full((2, 8), -1))
    assert ev.evaluate(model, batches + [empty])['loss'] == ev.evaluate(model, batches)['loss']


# --------------------------------------------------------------------------------------------------
# progress bars over eval.py's passes: on a terminal only, never changing a number

class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_eval_passes_draw_bars_only_on_a_terminal_and_give_the_same_numbers(monkeypatch, capsys):
    pytest.importorskip('tqdm')
    model = build(0, n_layer=2, ffn_gate='mlp', ffn_budget=0.5).eval()
    batches = [(tokens(s, 2, 8), tokens(s + 1, 2, 8)) for s in range(3)]
    diff = np.arange(40, dtype=np.uint8) % 2
    by_class = [(x, y, [0, 20]) for x, y in batches]
    plain = (ev.room(model, batches, quiet=False),
             ev.difficulty_fractions(model, by_class, diff, ['even', 'odd'], quiet=False))
    assert capsys.readouterr().err == ''                    # captured: not a terminal
    monkeypatch.setattr(sys, 'stdout', FakeTTY())
    monkeypatch.setattr(sys, 'stderr', FakeTTY())
    drawn = (ev.room(model, batches, quiet=False),
             ev.difficulty_fractions(model, by_class, diff, ['even', 'odd'], quiet=False))
    assert drawn == plain
    err = sys.stderr.getvalue()
    for desc in ('val loss, forced full', 'val loss, forced cheap', 'val loss, random routing',
                 'val loss, oracle routing', 'by class'):
        assert f'{desc}:   0%' in err and '0/3' in err, desc
    assert sys.stdout.getvalue() == ''
    sys.stderr.truncate(0)
    assert ev.room(model, batches) == plain[0] and sys.stderr.getvalue() == ''   # quiet by default


def test_eval_json_on_a_terminal_is_the_same_object_with_a_bar_beside_it(run, monkeypatch):
    pytest.importorskip('tqdm')
    args = [f"--ckpt={run / 'out' / 'ckpt.pt'}", "--json", f"--data_dir={run / 'data'}",
            "--eval_iters=2", "--calib_iters=1", "--device=cpu"]
    results = {}
    for quiet in ('False', 'True'):
        monkeypatch.setattr(sys, 'stdout', FakeTTY())
        monkeypatch.setattr(sys, 'stderr', FakeTTY())
        assert ev.main(args + [f'--quiet={quiet}']) == 0
        results[quiet] = json.loads(sys.stdout.getvalue())     # the whole of stdout
        assert ('val loss:   0%' in sys.stderr.getvalue()) == (quiet == 'False')
    assert results['False'] == results['True']


@pytest.mark.parametrize('name', ['map.png', 'map_by_class.png'])
def test_routing_map_replaces_an_earlier_png_only(tmp_path, name):
    """A file that is not a PNG image where a routing map goes (a misnamed note, a run's file) is
    refused before any work and kept; an earlier map (a PNG) may be replaced."""
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'not read by the option checks')
    argv = [f'--ckpt={ckpt}', '--routing_map', f"--out={tmp_path / 'map.png'}", '--device=cpu']
    (tmp_path / name).write_text('my notes')
    with pytest.raises(UserError, match=rf"{name} exists and is not a PNG image"):
        ev.parse_args(argv)
    assert (tmp_path / name).read_text() == 'my notes'
    (tmp_path / name).write_bytes(b'\x89PNG\r\n\x1a\n' + bytes(16))
    assert ev.parse_args(argv)[0]['out'] == str(tmp_path / 'map.png')


def test_routing_map_refuses_a_folder_where_its_per_class_png_goes(tmp_path):
    """--routing_map writes <out>_by_class.png after <out>: a folder there is refused before any
    work, not met after the first PNG is written."""
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'not read by the option checks')
    (tmp_path / 'map_by_class.png').mkdir()
    with pytest.raises(UserError, match=r"map_by_class.png, where the per-class PNG goes, is a "
                                        r"folder") as e:
        ev.parse_args([f'--ckpt={ckpt}', '--routing_map', f"--out={tmp_path / 'map.png'}",
                       '--device=cpu'])
    assert '\n' not in str(e.value) and not (tmp_path / 'map.png').exists()
