"""The scripts' command-line errors: a corrupt checkpoint is one UserError line for sample.py and
eval.py; bench.py and sweep.py refuse bad options with one UserError line (exit 2) before any work;
sweep.py exits 1 when runs fail, after its summary; every script, run from the shell, exits 2 with
one 'error: ' line. (Each script's own option checks: test_sample.py, test_eval.py.)

The tiny synthetic run is conftest's `run` (a train.py subprocess, once per pytest run). Everything
else calls main(argv) in-process, except one subprocess test per script."""
import json
import os
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

pytestmark = pytest.mark.usefixtures('one_thread')
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


# --------------------------------------------------------------------------------------------------
# bad options and checkpoints: one UserError naming the field, before any work

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


def test_misfitting_weights_are_one_line_naming_the_file(run, tmp_path):
    """A checkpoint that loads but whose weights are not its model's (here saved from a compiled
    model: '_orig_mod.' prefixes) is one line naming the file in sample.py and eval.py."""
    ckpt = torch.load(run / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    ckpt["model"] = {"_orig_mod." + k: v for k, v in ckpt["model"].items()}
    bad = tmp_path / "out" / "ckpt.pt"
    bad.parent.mkdir()
    torch.save(ckpt, bad)
    with pytest.raises(CheckpointError, match="weights do not fit") as e:
        sample.main([f"--out_dir={bad.parent}", "--device=cpu", "--max_new_tokens=2"])
    assert str(e.value).startswith(f"checkpoint {bad}:") and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=f"checkpoint {bad}: its weights do not fit"):
        ev.main([f"--ckpt={bad}", "--device=cpu"])


@pytest.mark.parametrize("arg,needle", [
    ("--bench_steps=0", "bench_steps"), ("--bench_warmup=-1", "bench_warmup"),
    ("--block_size=0", "block_size"), ("--batch_size=0", "batch_size"),
    ("--decode_tokens=0", "decode_tokens"), ("--budgets=a,b", "budgets"),
    ("--decode_batches=1,x", "decode_batches"), ("--decode_batches=0", "decode_batches"),
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


BENCH_TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=50",
              "--decode_tokens=4", "--bench_steps=1", "--bench_warmup=0", "--decode_batches=1",
              "--device=cpu"]


def test_bench_out_replaces_only_an_earlier_bench_result(tmp_path, capsys):
    """--out names where the result goes: a run's config.json or a dataset's meta.json given there
    by mistake is refused before any work and left as it was; an earlier result is replaced."""
    for name, text in [("config.json", '{"n_layer": 4}'), ("meta.json", '{"files": {}}'),
                       ("notes.json", "not json"), ("list.json", "[1, 2]")]:
        other = tmp_path / name
        other.write_text(text)
        with pytest.raises(UserError, match=f"^--out={other} holds a file that is not a "
                                            "result of bench.py"):
            bench.main([*BENCH_TINY, f"--out={other}"])
        assert other.read_text() == text
    out = tmp_path / "bench.json"
    bench.main([*BENCH_TINY, f"--out={out}"])
    first = json.loads(out.read_text())
    bench.main([*BENCH_TINY, "--seed=2", f"--out={out}"])
    assert json.loads(out.read_text())["command"] != first["command"]
    capsys.readouterr()


def test_eval_harness_out_replaces_only_an_earlier_harness_result(tmp_path):
    """eval_harness.py's --out check runs before lm_eval is needed (parse_args)."""
    import eval_harness
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"x")
    base = [f"--ckpt={ckpt}", "--tasks=nanodepth_arith", "--device=cpu"]
    meta = tmp_path / "meta.json"
    meta.write_text('{"files": {}}')
    with pytest.raises(UserError, match="is not a result of eval_harness.py"):
        eval_harness.parse_args([*base, f"--out={meta}"])
    earlier = tmp_path / "harness.json"
    earlier.write_text('{"results": {}, "tasks": ["nanodepth_arith"], "ckpt": "x"}')
    assert eval_harness.parse_args([*base, f"--out={earlier}"])["out"] == str(earlier)


@pytest.mark.parametrize("args,message", [
    (["--decode_batches=,"], "decode_batches must be batch sizes >= 1 such as '1,8', got ','"),
    (["--decode_batches="], "decode_batches must be batch sizes >= 1 such as '1,8', got ''"),
    (["--decode_vs_hf=True", "--decode_batches=,"],
     "decode_batches must be batch sizes >= 1 such as '1,8', got ','"),
    (["--budgets=,"], "budgets must be full-path fractions in (0, 1] such as '1.0,0.5' ('': no "
                      "routed timings), got ','"),
    (["--budgets=1.0", "--prefill_shapes=,"],
     "prefill_shapes must be BxT with B, T >= 1 such as '8x512' (BxT), got ','"),
    (["--prefill_shapes=,"],
     "prefill_shapes must be BxT with B, T >= 1 such as '8x512' (BxT), got ','"),
    (["--speculate=,"], "speculate must be draft lengths K >= 1 such as '1,2,4,8', got ','"),
    (["--speculate=2", "--passes_per_graph=,"],
     "passes_per_graph must be passes per function >= 1 such as '1' or '1,4' (1: a pass at a "
     "time), got ','"),
])
def test_bench_refuses_an_empty_list(args, message, monkeypatch):
    """A list option that holds no value (',') is refused with one line naming it and an example,
    before any timing, rather than timing nothing of its kind."""
    for timing in ("bench", "bench_routed", "bench_decode_vs_hf"):
        monkeypatch.setattr(bench, timing, lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(bench.bench_speculative, "bench_speculative",
                        lambda *a, **k: pytest.fail("timed"))
    with pytest.raises(UserError) as e:
        bench.main(["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32",
                    "--vocab_size=50", "--decode_tokens=4", *args])
    assert str(e.value) == message


def test_bench_empty_decode_batches_exits_2_from_the_shell():
    r = run_group([sys.executable, "bench.py", "--decode_batches=,"], 120, cwd=REPO, env=ENV)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "error: decode_batches must be batch sizes >= 1 such as '1,8', got ','\n"
    assert r.stdout == ""


@pytest.mark.parametrize("args", [
    ["--decode_tokens=32"],                                   # a 1-token prompt + 32 new tokens >
                                                              # 32
    ["--decode_tokens=40"],
    ["--route=ffn", "--budgets=0.5", "--prefill_shapes=1x16", "--decode_tokens=8",
     "--decode_prompt=25"]])
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
    monkeypatch.setattr(sweep, "check_configs", lambda *args, **kw: None)  # no train.py keys
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
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(UserError, match=f"^study file {tmp_path / 'folder.py'} is a folder; "):
        sweep.main([str(tmp_path / "folder.py")])


def test_a_config_file_that_is_a_folder_is_named_as_one(tmp_path):
    from configurator import load_config
    with pytest.raises(UserError, match="config file not found"):
        load_config({'x': 1}, [str(tmp_path / "missing.py")])
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(UserError, match=f"^config file {tmp_path / 'folder.py'} is a folder; "):
        load_config({'x': 1}, [str(tmp_path / "folder.py")])


# --------------------------------------------------------------------------------------------------
# each script from the shell: exit 2 and one 'error: ' line on stderr

@pytest.mark.parametrize("script,args,needle", [
    ("train.py", ["--batch_size=-1"], "batch_size"),
    ("sample.py", ["--temperature=-1"], "temperature"),
    ("train.py", ["--batch_size=100000000", "--data_dir=DATA", "--out_dir=out"],
     "batch_size=100000000: one batch's logits alone"),
    ("eval.py", ["--ckpt=CORRUPT", "--device=cpu"], "truncated or corrupt"),
    ("eval.py", ["--ckpt=CKPT", "--device=cpu", "--batch_size=100000000"], "lower --batch_size"),
    ("bench.py", ["--budgets=a,b"], "budgets"),
    ("sweep.py", ["STUDY", "--jobz=2"], "--jobz"),
    ("flops.py", ["--n_layers=3"], "n_layer"),
    ("plots.py", ["NO_SUCH_STUDY"], "OUT_ROOT"),
    ("data/prepare.py", ["synthetic", "--seed=abc"], "seed"),
    ("data/prepare.py", ["nosuch"], "unknown dataset 'nosuch'")])
def test_cli_exit_code_and_one_line(run, tmp_path, script, args, needle):
    """From the shell, in a folder of its own: exit 2, one 'error: ' line naming the option, nothing
    on stdout, nothing written."""
    bad, study = (
        corrupt(run / "out" / "ckpt.pt", tmp_path / "ckpt.pt", "random"),
        study_file(tmp_path),
    )
    args = [a.replace("CORRUPT", str(bad)).replace("STUDY", study)
            .replace("CKPT", str(run / "out" / "ckpt.pt")).replace("DATA", str(run / "data"))
            for a in args]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = run_group([sys.executable, str(REPO / script), *args], 180, cwd=cwd, env=ENV)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr and r.stdout == "" and os.listdir(cwd) == []


def test_running_out_of_memory_is_one_line_and_exit_1(run):
    """A request no machine holds (10^12 samples: 8 TB of token ids) fails its first allocation:
    one 'error: out of memory' line and exit 1, not torch's traceback."""
    r = run_group([sys.executable, str(REPO / "sample.py"), f"--out_dir={run / 'out'}",
                   "--device=cpu", f"--num_samples={10**12}"], 180, cwd=REPO, env=ENV)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: out of memory (RuntimeError: can't allocate memory: ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_only_an_allocation_failure_is_taken_for_running_out_of_memory(monkeypatch, capsys):
    from configurator import out_of_memory, run_cli
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79 GiB total)")
    assert out_of_memory(cuda).startswith("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert out_of_memory(MemoryError()) == "MemoryError"
    assert out_of_memory(RuntimeError("shape mismatch")) == ""
    monkeypatch.setattr(sys, "argv", ["x.py"])
    for error, code in ((cuda, 1), (MemoryError("numpy"), 1)):
        def main(argv, error=error):
            raise error
        with pytest.raises(SystemExit) as e:
            run_cli(main)
        assert e.value.code == code
        assert capsys.readouterr().err.startswith("error: out of memory (")
    with pytest.raises(RuntimeError, match="shape mismatch"):     # any other error is a bug: shown
        run_cli(lambda argv: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
