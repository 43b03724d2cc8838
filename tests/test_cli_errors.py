"""The scripts' command-line errors: sample.py, eval.py, bench.py and sweep.py refuse bad options,
corrupt checkpoints and unknown prompt characters with one UserError line (exit 2) before any work;
sampling never emits a padding id of the model's vocabulary; eval.py --json prints exactly one JSON
object on stdout even when it prepares the synthetic corpus; sweep.py exits 1 when runs fail, after
its summary.

One tiny synthetic run is trained once per module (a train.py subprocess); the char-level
checkpoints are made in-process. Everything else calls main(argv) in-process, except one subprocess
test per script."""
import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import bench  # noqa: E402
import eval as ev  # noqa: E402
import sample  # noqa: E402
import sweep  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from configurator import UserError  # noqa: E402
from conftest import run_group  # noqa: E402
from data import prepare as P  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TEXT = "the quick brown fox jumps over the lazy dog. " * 80     # 28 characters, no newline
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run_py(script, args, timeout=180):
    return run_group([sys.executable, script, *args], timeout, cwd=REPO, env=ENV)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-iteration routed run on the synthetic corpus (prepared into its own data_dir)."""
    root = tmp_path_factory.mktemp("run")
    r = run_py(
        "train.py",
        [
            "--max_iters=2",
            "--eval_interval=2",
            "--eval_iters=1",
            "--batch_size=2",
            "--block_size=16",
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--device=cpu",
            f"--out_dir={root / 'out'}",
            f"--data_dir={root / 'data'}",
        ],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def padded_model(vocab_size=64, real=28, block_size=16):
    """A model whose logits favour the padded ids >= real whatever the input: ln_f returns its bias
    (all ones), so the logit of id i is the sum of its lm_head row: n_embd for padded ids, about 0
    for real ones."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16, bias=True
        )
    )
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[:real] *= 0.01
        model.lm_head.weight[real:] = 1.0
    return model.eval()


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A char-level dataset of 28 characters and a checkpoint of padded_model (vocabulary 64) for
    it."""
    root = tmp_path_factory.mktemp("char")
    (root / "tiny.txt").write_text(TEXT)
    meta = P.prepare(
        "text", out_dir=root / "data" / "txt", input=str(root / "tiny.txt"), tokenizer="char"
    )
    model = padded_model(real=meta["vocab_size"])
    (root / "out").mkdir()
    torch.save(
        dict(
            model=model.state_dict(),
            model_args=dict(model.config.__dict__),
            config=dict(dataset="txt", data_dir=str(root / "data")),
        ),
        root / "out" / "ckpt.pt",
    )
    return root


# --------------------------------------------------------------------------------------------------
# padded ids never reach a decoder

@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("temperature,top_k", [(0, None), (1.0, None), (0.8, 5), (2.0, 100)])
def test_generate_never_samples_padded_ids(ragged, temperature, top_k):
    model, limit = padded_model(real=28), 28
    idx = torch.randint(0, limit, (3, 5))
    lengths = [5, 2, 4] if ragged else None
    torch.manual_seed(0)
    free = model.generate(idx, 8, temperature=temperature, top_k=top_k, lengths=lengths)
    assert any(int(row.max()) >= limit for row in free)          # the model does favour padded ids
    torch.manual_seed(0)
    out = model.generate(
        idx, 8, temperature=temperature, top_k=top_k, lengths=lengths, vocab_limit=limit
    )
    rows = out if ragged else list(out)
    assert [len(r) for r in rows] == ([13, 10, 12] if ragged else [13] * 3)
    assert all(int(r.max()) < limit for r in rows)


@pytest.mark.parametrize("extra", [["--temperature=0"], [], ["--use_cache=False", "--top_k=3"]])
def test_sample_decodes_only_real_ids(char_run, capsys, extra):
    chars = set(json.loads((char_run / "data" / "txt" / "meta.json").read_text())["chars"])
    assert (
        sample.main(
            [
                f"--out_dir={char_run / 'out'}",
                "--start=the",
                "--num_samples=2",
                "--max_new_tokens=8",
                "--device=cpu",
                *extra,
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    texts = [lines[0], lines[2]]
    assert lines[1] == lines[3] == "---------------"
    assert all(len(t) == 11 and set(t) <= chars for t in texts), texts


def test_sample_prompts_file_decodes_only_real_ids(char_run, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the\n\nlazy dog\n")
    assert (
        sample.main(
            [
                f"--out_dir={char_run / 'out'}",
                f"--prompts_file={prompts}",
                "--max_new_tokens=4",
                "--device=cpu",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0].startswith("the")
        and len(lines[0]) == 7
        and lines[2].startswith("lazy dog")
        and len(lines[2]) == 12
    )


# --------------------------------------------------------------------------------------------------
# prompts the vocabulary cannot encode

def sample_args(char_run, *extra):
    return [f"--out_dir={char_run / 'out'}", "--max_new_tokens=4", "--device=cpu", *extra]


def test_sample_unknown_start_characters_are_refused(char_run):
    with pytest.raises(UserError) as e:
        sample.main(sample_args(char_run, "--start=the QUICK fox!"))
    msg = str(e.value)
    assert "--start" in msg and "'Q', 'U', 'I', 'C', 'K' and 1 more" in msg, msg
    assert "the char vocabulary has 28 characters" in msg and "\n" not in msg


def test_sample_default_start_needs_a_newline_in_a_char_vocabulary(char_run):
    # the default start is a newline, which this vocabulary lacks: an error, not a silent token 0
    with pytest.raises(UserError, match=r"--start has characters outside the vocabulary: '\\n'"):
        sample.main(sample_args(char_run))


def test_sample_empty_start_is_refused(char_run):
    with pytest.raises(UserError, match="--start is empty"):
        sample.main(sample_args(char_run, "--start="))


def test_sample_unknown_prompts_file_characters_name_the_line(char_run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the\n\nlazy Dog\n")
    with pytest.raises(UserError, match=r"prompts.txt line 3 has characters outside the "
                                        r"vocabulary: 'D'"):
        sample.main(sample_args(char_run, f"--prompts_file={prompts}"))


def test_sample_synthetic_unknown_symbols_and_default_start(run, capsys):
    args = [f"--out_dir={run / 'out'}", "--max_new_tokens=5", "--num_samples=1", "--device=cpu"]
    with pytest.raises(UserError, match=r"'x', 'y'.*the synthetic vocabulary has 34 symbols: 0 1 "
                                        r"2"):
        sample.main([*args, "--start=A3xy"])
    # the default newline is no synthetic symbol: it starts at a segment boundary '|'
    assert sample.main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first[0] == "|" and len(first) == 6 and set(first) <= set(P.SYMBOLS), first


# --------------------------------------------------------------------------------------------------
# bad options and checkpoints: one UserError naming the field, before any work

@pytest.mark.parametrize("arg,needle", [
    ("--temperature=-0.5", "temperature"), ("--temperature=nan", "temperature"),
    ("--max_new_tokens=0", "max_new_tokens"), ("--max_new_tokens=-3", "max_new_tokens"),
    ("--top_k=-1", "top_k"), ("--num_samples=0", "num_samples"),
    ("--prompts_file=/nonexistent/prompts.txt", "prompts_file"), ("--device=bogus", "device"),
    ("--device=mps", "device"), pytest.param("--device=cuda", "CUDA", marks=NO_CUDA)])
def test_sample_bad_options(tmp_path, arg, needle):
    # out_dir holds no checkpoint: the option must be refused before the checkpoint is looked at
    with pytest.raises(UserError, match=needle):
        sample.main([f"--out_dir={tmp_path}", arg])


@pytest.mark.parametrize("arg,needle", [
    ("--eval_iters=-1", "eval_iters"), ("--calib_iters=-2", "calib_iters"), ("--batch_size=-4", "batch_size"),
    ("--device=bogus", "device"), pytest.param("--device=cuda", "CUDA", marks=NO_CUDA)])
def test_eval_bad_options(tmp_path, arg, needle):
    with pytest.raises(UserError, match=needle):
        ev.main([f"--ckpt={tmp_path / 'missing.pt'}", arg])


def corrupt(src, dst, kind):
    data = src.read_bytes()
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[:len(data) // 2] if kind == "truncated" else os.urandom(4096))
    return dst


@pytest.mark.parametrize("kind", ["truncated", "random"])
def test_corrupt_checkpoint_is_a_one_line_error(run, tmp_path, kind):
    bad = corrupt(run / "out" / "ckpt.pt", tmp_path / "out" / "ckpt.pt", kind)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        sample.main([f"--out_dir={tmp_path / 'out'}", "--device=cpu"])
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ev.main([f"--ckpt={bad}", "--device=cpu"])


@pytest.mark.parametrize("arg,needle", [
    ("--bench_steps=0", "bench_steps"), ("--bench_warmup=-1", "bench_warmup"), ("--block_size=0", "block_size"),
    ("--batch_size=0", "batch_size"), ("--decode_tokens=0", "decode_tokens"),
    ("--budgets=a,b", "budgets"), ("--decode_batches=1,x", "decode_batches"), ("--decode_batches=0", "decode_batches"),
    ("--prefill_shapes=8by512", "prefill_shapes"), ("--prefill_shapes=0x16", "prefill_shapes"),
    ("--budgets=0", "budgets"), ("--budgets=1.0,1.5", "budgets"), ("--budgets=nan", "budgets"),
    ("--device=bogus", "device"), pytest.param("--device=cuda", "CUDA", marks=NO_CUDA)])
def test_bench_bad_options(arg, needle):
    with pytest.raises(UserError, match=needle):
        bench.main(
            [
                "--n_layer=1",
                "--n_head=2",
                "--n_embd=32",
                "--block_size=32",
                "--vocab_size=50",
                "--decode_tokens=4",
                arg,
            ]
        )


@pytest.mark.parametrize("args", [
    ["--decode_tokens=32"],                                   # a 1-token prompt + 32 new tokens >
                                                              # 32
    ["--decode_tokens=40"],
    ["--route=ffn", "--budgets=0.5", "--prefill_shapes=1x16", "--decode_tokens=8", "--decode_prompt=25"]])
def test_bench_refuses_decode_past_block_size(args):
    # past block_size generate recomputes the cropped window: that is no KV-cached decode to report
    with pytest.raises(UserError, match=r"decode_tokens=\d+ .*block_size=32"):
        bench.main(
            [
                "--n_layer=1",
                "--n_head=2",
                "--n_embd=32",
                "--block_size=32",
                "--vocab_size=50",
                *args,
            ]
        )


# --------------------------------------------------------------------------------------------------
# eval.py --json: stdout is exactly one JSON object

def test_eval_json_stdout_is_one_object(run, capsys):
    assert ev.main(["--ckpt", str(run / "out" / "ckpt.pt"), "--json", f"--data_dir={run / 'data'}",
                    "--eval_iters=1", "--calib_iters=1", "--device=cpu"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)                                   # the whole of stdout
    assert res["val_loss"]["loss"] > 0 and res["ckpt"] == str(run / "out" / "ckpt.pt")


def test_eval_prepares_no_data_and_its_suggested_prepare_works(run, tmp_path, capsys):
    """A data folder without the run's corpus is refused, nothing is written there, and the command
    the error names prepares exactly what eval then accepts."""
    ckpt = str(run / "out" / "ckpt.pt")
    args = ["--ckpt", ckpt, "--json", "--eval_iters=1", "--calib_iters=1", "--device=cpu"]
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
    assert json.loads(capsys.readouterr().out)["val_loss"]["loss"] > 0


# --------------------------------------------------------------------------------------------------
# sweep.py: failed runs exit 1 after the summary; bad input is a UserError

FAKE_TRAIN = textwrap.dedent("""
    # A stand-in for train.py: a finished one-iteration run, or exit 3 with --fail=1.
    import json, os, sys
    args = dict(a[2:].split('=', 1) for a in sys.argv[2:])
    if args.get('fail') == '1':
        print('boom')
        sys.exit(3)
    os.makedirs(args['out_dir'], exist_ok=True)
    json.dump(dict(max_iters=1), open(os.path.join(args['out_dir'], 'config.json'), 'w'))
    with open(os.path.join(args['out_dir'], 'metrics.jsonl'), 'w') as f:
        f.write(json.dumps(dict(type='train', iter=1, lm_loss=2.0)) + '\\n')
        f.write(json.dumps(dict(type='summary', iter=1, avg_lm=2.0)) + '\\n')
""")


def study_file(tmp_path, text=None):
    path = tmp_path / "study.py"
    path.write_text(text if text is not None else
                    f"base = 'cfg.py'\nout_root = {str(tmp_path / 'study')!r}\nseeds = [1]\n"
                    f"arms = {{'A': [], 'B': ['--fail=1']}}\n")
    return str(path)


def test_sweep_exits_1_after_the_summary_when_runs_fail(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN", str(tmp_path / "fake_train.py"))
    monkeypatch.setattr(sweep, "check_configs", lambda runs, made_later: None)  # no train.py keys
    assert sweep.main([study_file(tmp_path), "--no_plots"]) == 1
    summary = json.loads((tmp_path / "study" / "summary.json").read_text())
    assert summary["table"]["A"]["avg_lm"]["per_seed"] == [2.0] and summary["table"]["B"]["avg_lm"][
        "per_seed"
    ] == [None]
    err = capsys.readouterr().err
    log = tmp_path / "study" / "B" / "seed1.log"
    assert "1 of 2 runs failed" in err and str(log) in err and "boom" in log.read_text()


@pytest.mark.parametrize("argv,text,needle", [
    (["--jobz=2"], None, "--jobz"),
    (["--jobs=two"], None, "--jobs"),
    (["--jobs=0"], None, "--jobs"),
    ([], "base = 'cfg.py'\narms = {'A': []}\n", "seeds, out_root"),
    ([], "base = 'cfg.py'\nout_root = 'x'\nseeds = [1]\narms = {'A': []}\nreference = "
         "'Z'\n", "'Z'"),
    ([], "arms = {'A': [\n", "line"),
    ([], "arms = undefined_name\n", "NameError")])
def test_sweep_bad_input(tmp_path, argv, text, needle):
    with pytest.raises(UserError, match=needle):
        sweep.main([study_file(tmp_path, text), *argv])


def test_sweep_missing_study_file(tmp_path):
    with pytest.raises(UserError, match="study file not found"):
        sweep.main([str(tmp_path / "missing_study.py")])


# --------------------------------------------------------------------------------------------------
# each script from the shell: exit 2 and one 'error: ' line on stderr

@pytest.mark.parametrize("script,args,needle", [
    ("sample.py", ["--temperature=-1"], "temperature"),
    ("eval.py", ["--ckpt=CORRUPT", "--device=cpu"], "truncated or corrupt"),
    ("bench.py", ["--budgets=a,b"], "budgets"),
    ("sweep.py", ["STUDY", "--jobz=2"], "--jobz"),
    ("flops.py", ["--n_layers=3"], "n_layer"),
    ("plots.py", ["NO_SUCH_STUDY"], "OUT_ROOT")])
def test_cli_exit_code_and_one_line(run, tmp_path, script, args, needle):
    bad, study = (
        corrupt(run / "out" / "ckpt.pt", tmp_path / "ckpt.pt", "random"),
        study_file(tmp_path),
    )
    args = [a.replace("CORRUPT", str(bad)).replace("STUDY", study) for a in args]
    r = run_py(script, args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr and r.stdout == ""
