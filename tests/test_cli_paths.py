"""What the scripts write and what they say when they cannot: every output path is checked before
any work (a folder that cannot be created or written, an empty --out_dir=, --out naming a folder);
errors name the true cause and a fix, and each suggested command is run here to show it does what it
says; bad input that used to end in a traceback (a non-UTF-8 prompts file, GPT-2 weights out of
reach, a config file that exits) is one line; eval and sample refuse data that is not the
checkpoint's, and only training prepares data; eval --room says what a family cannot report.

One tiny synthetic run is trained once per module (a train.py subprocess); everything else runs
in-process through main(argv)."""
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_group  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import bench  # noqa: E402
import checkpoint  # noqa: E402
import configurator  # noqa: E402
import eval as ev  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError, UserError  # noqa: E402
from data import prepare as P  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TINY = ["--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--calib_iters=1", "--batch_size=2",
        "--block_size=16", "--n_layer=1", "--n_embd=32", "--n_head=2", "--device=cpu"]
# a folder no user can create files in, root included (mode bits do not stop root)
UNWRITABLE = "/proc/nanodepth-no-such-folder"
LINUX = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


def run_py(args, timeout=300, **kw):
    """A script in its own process group, ended with all it started on every path."""
    return run_group([sys.executable, *map(str, args)], timeout, cwd=REPO,
                     env=kw.pop("env", ENV), **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-iteration ffn run on a small synthetic corpus (seed 1) in its own data_dir."""
    root = tmp_path_factory.mktemp("run")
    P.prepare("synthetic", out_dir=root / "data" / "synthetic", num_tokens=20000, seed=1)
    r = run_py(["train.py", *TINY, f"--out_dir={root / 'out'}", f"--data_dir={root / 'data'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


# --------------------------------------------------------------------------------------------------
# output paths, checked before any work

@LINUX
@pytest.mark.parametrize("path, needle", [
    ("", "empty"), ("{file}", "is a file"), ("{file}/sub", "cannot be created"),
    (UNWRITABLE, "cannot write"), (UNWRITABLE + "/a/b", "cannot write")])
def test_writable_folder_refuses_what_cannot_hold_files(tmp_path, path, needle):
    (tmp_path / "f").write_text("x")
    path = path.format(file=tmp_path / "f")
    with pytest.raises(ConfigError, match=needle) as e:
        configurator.writable_folder(path, "out_dir")
    assert "\n" not in str(e.value) and "--out_dir" in str(e.value)
    assert files_under(tmp_path) == ["f"]                  # the probe leaves nothing behind


def test_writable_folder_accepts_a_new_nested_folder_and_creates_nothing(tmp_path):
    configurator.writable_folder(str(tmp_path / "a" / "b"), "out_dir")
    configurator.writable_file(str(tmp_path / "c" / "map.png"), "out", suffix=".png")
    assert files_under(tmp_path) == []


def test_writable_folder_honours_mode_bits_for_other_users(tmp_path, monkeypatch):
    """What a non-root user meets: os.access says no, so no write is attempted."""
    monkeypatch.setattr(configurator.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="permission denied"):
        configurator.writable_folder(str(tmp_path / "x"), "out_dir")


@pytest.mark.parametrize("path, needle", [
    ("{dir}", "is a folder"), ("{dir}/map", "must end in .png"), ("", "empty"),
    ("{file}/map.png", "cannot be created")])
def test_writable_file_refuses_folders_and_missing_suffixes(tmp_path, path, needle):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=needle):
        path = path.format(dir=tmp_path, file=tmp_path / "f")
        configurator.writable_file(path, "out", suffix=".png")


@LINUX
@pytest.mark.parametrize("out_dir", ["", "{file}/run", UNWRITABLE, "{file}"])
@pytest.mark.parametrize("resume", [False, True])
def test_train_refuses_an_unwritable_out_dir_before_any_work(tmp_path, out_dir, resume):
    (tmp_path / "f").write_text("x")
    data = tmp_path / "data"
    argv = [*TINY, f"--out_dir={out_dir.format(file=tmp_path / 'f')}", f"--data_dir={data}"]
    with pytest.raises(UserError, match="out_dir") as e:
        train.main(argv + ["--init_from=resume"] * resume)
    assert "\n" not in str(e.value)
    assert not data.exists()                       # nothing prepared: refused before any work


def test_a_resume_without_a_checkpoint_is_refused_before_preparing_data(tmp_path):
    """--init_from=resume into a folder with no ckpt.pt: one line naming it, before the missing
    synthetic corpus is prepared (nothing written under data_dir)."""
    data, out = tmp_path / "data", tmp_path / "out"
    with pytest.raises(UserError) as e:
        train.main([*TINY, f"--out_dir={out}", f"--data_dir={data}", "--init_from=resume"])
    assert str(e.value) == (f"init_from=resume but there is no checkpoint at {out / 'ckpt.pt'}; "
                            f"start the run afresh (with --overwrite=True if {out} holds its "
                            "other files)")
    assert not data.exists() and not out.exists()


@LINUX
def test_train_refuses_an_unwritable_data_folder_it_would_prepare(tmp_path):
    with pytest.raises(UserError, match="data_dir"):
        train.main([*TINY, f"--out_dir={tmp_path / 'out'}", f"--data_dir={UNWRITABLE}"])
    assert files_under(tmp_path) == []


def test_empty_dataset_is_refused_without_sending_the_user_into_the_data_package(tmp_path):
    with pytest.raises(UserError, match="not a dataset name") as e:
        train.main([*TINY, f"--out_dir={tmp_path / 'out'}", "--dataset="])
    assert "prepare.py" not in str(e.value)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("out, needle", [
    ("{dir}", "is a folder"), ("{dir}/map", "must end in .png"),
    ("{file}/map.png", "cannot be created")])
def test_eval_routing_map_out_is_checked_before_the_work(run, tmp_path, out, needle):
    (tmp_path / "f").write_text("x")
    out = out.format(dir=tmp_path, file=tmp_path / "f")
    with pytest.raises(UserError, match=needle):
        ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", "--routing_map", f"--out={out}",
                 f"--data_dir={run / 'data'}", "--device=cpu"])
    assert files_under(tmp_path) == ["f"]


def test_eval_routing_map_out_in_a_new_folder_is_written_there(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "maps" / "m.png"
    assert ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", "--routing_map", f"--out={png}",
                    f"--data_dir={run / 'data'}", "--device=cpu", "--eval_iters=1",
                    "--calib_iters=1"]) == 0
    assert png.is_file() and png.stat().st_size > 1000
    assert not (tmp_path / "maps.png").exists()


@pytest.mark.parametrize("out, needle", [("{dir}", "is a folder"), ("{dir}/b.txt", "must end in "
                                                                                   ".json"),
                                         ("{file}/b.json", "cannot be created")])
def test_bench_out_is_checked_before_the_work(tmp_path, monkeypatch, out, needle):
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(bench, "bench", lambda cfg: pytest.fail("ran before refusing --out"))
    with pytest.raises(UserError, match=needle):
        bench.main([f"--out={out.format(dir=tmp_path, file=tmp_path / 'f')}", "--device=cpu"])
    assert files_under(tmp_path) == ["f"]


def test_prepare_refuses_a_file_or_empty_out_dir_before_building(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    monkeypatch.setitem(P.BUILDERS, "synthetic", lambda a: pytest.fail("built before refusing "
                                                                       "--out_dir"))
    for out_dir, needle in ((str(tmp_path / "f"), "is a file"), ("", "is empty")):
        assert P.main(["synthetic", f"--out_dir={out_dir}"]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    assert files_under(tmp_path) == ["f"]


# --------------------------------------------------------------------------------------------------
# errors name the true cause, and the suggested command works

def test_unreadable_checkpoint_is_not_called_corrupt(run, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint.torch, "load", denied)
    with pytest.raises(UserError) as e:
        checkpoint.load_checkpoint(str(run / "out" / "ckpt.pt"))
    assert "cannot be read by this user" in str(e.value) and "corrupt" not in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_checkpoint_file_as_non_root(run, tmp_path):
    ck = tmp_path / "ckpt.pt"
    shutil.copy(run / "out" / "ckpt.pt", ck)
    ck.chmod(0)
    with pytest.raises(UserError, match="cannot be read by this user"):
        checkpoint.load_checkpoint(str(ck))


def test_permission_error_while_saving_does_not_say_free_space(tmp_path, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint.torch, "save", denied)
    with pytest.raises(UserError) as e:
        checkpoint.save_checkpoint(str(tmp_path / "ckpt.pt"), {})
    assert "not writable" in str(e.value) and "free some space" not in str(e.value)
    assert files_under(tmp_path) == []


def test_full_disk_while_saving_says_free_space(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(UserError, match="free some space"):
        checkpoint.save_checkpoint(str(tmp_path / "ckpt.pt"), {})


def test_non_utf8_fineweb_input_suggests_a_command_that_prepares_it(tmp_path, monkeypatch, capsys):
    src = tmp_path / "latin1.txt"
    src.write_bytes("caf\xe9 au lait, ".encode("latin-1") * 200)
    monkeypatch.setattr(P, "DATA_DIR", tmp_path / "data")       # the command's default folder
    assert P.main(["fineweb_edu", f"--input={src}", f"--out_dir={tmp_path / 'fw'}"]) == 2
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err and "--tokenizer byte" not in err
    words = shlex.split(err.split("prepare it as bytes: ", 1)[1].strip())
    assert words[:3] == ["python", "data/prepare.py", "text"]
    assert P.main(words[2:]) == 0                              # as suggested
    meta = P.verify_checksums(tmp_path / "data" / "text")
    assert meta["tokenizer"] == "byte"
    assert meta["train_tokens"] + meta["val_tokens"] == src.stat().st_size


def test_copied_data_folder_hint_reprepares_the_copy_not_the_original(tmp_path):
    original, copy = tmp_path / "orig" / "synthetic", tmp_path / "copy" / "synthetic"
    P.prepare("synthetic", out_dir=original, num_tokens=2000, seed=3)
    shutil.copytree(original, copy)
    before = {p.name: p.stat().st_mtime_ns for p in original.iterdir()}
    val = copy / "val.bin"
    val.write_bytes(bytes(len(val.read_bytes())))              # same size, other bytes
    with pytest.raises(P.PrepareError) as e:
        P.verify_checksums(copy)
    words = shlex.split(str(e.value).split("run: ", 1)[1])
    assert f"--out_dir={copy}" in words and "--num_tokens=2000" in words and "--seed=3" in words
    assert P.main(words[2:]) == 0
    P.verify_checksums(copy)                                    # the copy is whole again
    assert {p.name: p.stat().st_mtime_ns for p in original.iterdir()} == before


def test_sample_out_dir_naming_the_checkpoint_suggests_its_folder(run, capsys):
    with pytest.raises(UserError) as e:
        sample.main([f"--out_dir={run / 'out' / 'ckpt.pt'}", "--device=cpu"])
    msg = str(e.value)
    assert "train.py" not in msg
    suggested = msg.rsplit(" ", 1)[1]
    assert suggested == f"--out_dir={run / 'out'}"
    assert sample.main([suggested, "--device=cpu", "--num_samples=1", "--max_new_tokens=3",
                        f"--data_dir={run / 'data'}"]) == 0


def test_init_from_a_run_folder_is_not_read_as_gpt2(run, tmp_path):
    with pytest.raises(UserError) as e:
        train.main([*TINY, f"--init_from={run / 'out'}", f"--out_dir={tmp_path / 'b'}",
                    f"--data_dir={run / 'data'}"])
    msg = str(e.value)
    assert "run folder, not a GPT-2 directory" in msg and not (tmp_path / "b").exists()
    weights = f"--init_from={run / 'out' / 'ckpt.pt'}"
    resume = f"--out_dir={run / 'out'} --init_from=resume"
    assert weights in msg and resume in msg
    checkpoint.check_init_from(weights.split("=", 1)[1])        # both suggestions are accepted
    cfg, _ = train.read_config([*TINY, *resume.split(), f"--data_dir={run / 'data'}"])
    train.check_out_dir(cfg)


# --------------------------------------------------------------------------------------------------
# bad input that used to end in a traceback

def test_non_utf8_prompts_file_is_one_line(run, tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"12+\xff\xfe=\n")
    with pytest.raises(UserError, match="not UTF-8") as e:
        sample.main([f"--out_dir={run / 'out'}", f"--prompts_file={bad}", "--device=cpu"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body", ["import sys\nsys.exit(0)\n", "batch_size = 4\nexit(5)\n",
                                  "raise SystemExit\n"])
def test_config_file_that_exits_is_an_error_naming_it(tmp_path, body):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(body)
    with pytest.raises(UserError, match=f"config file {cfg}, line .*exits") as e:
        train.main([str(cfg), f"--out_dir={tmp_path / 'out'}"])
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_config_file_that_exits_exits_2_in_a_process(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("exit(0)\n")
    r = run_py(["train.py", str(cfg), f"--out_dir={tmp_path / 'out'}"], timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(cfg) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_gpt2_weights_out_of_reach_say_where_they_were_looked_for(tmp_path):
    pytest.importorskip("transformers")
    code = ("import sys; sys.path.insert(0, '.'); from configurator import run_cli; from model "
            "import GPT\n"
            "run_cli(lambda argv: GPT.from_pretrained('gpt2'))")
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = run_py(["-c", code], timeout=120, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(tmp_path / "hf" / "hub") in r.stderr and "--init_from=gpt2_local" in r.stderr


# --------------------------------------------------------------------------------------------------
# data identity: eval and sample use the checkpoint's own data only

def test_sample_and_eval_refuse_another_corpus(run, tmp_path):
    other = tmp_path / "data" / "synthetic"
    P.prepare("synthetic", out_dir=other, num_tokens=20000, seed=2)      # same name, other content
    with pytest.raises(UserError, match="differs from the checkpoint's data") as e:
        sample.main([f"--out_dir={run / 'out'}", f"--data_dir={tmp_path / 'data'}", "--device=cpu"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="differs from the checkpoint's data"):
        ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", f"--data_dir={tmp_path / 'data'}",
                 "--device=cpu"])


def test_checkpoint_records_its_data_identity(run):
    ck = torch.load(run / "out" / "ckpt.pt", weights_only=False)
    meta = json.loads((run / "data" / "synthetic" / "meta.json").read_text())
    assert ck["data_meta"]["tokenizer"] == "synthetic"
    assert ck["data_meta"]["vocab_size"] == meta["vocab_size"]
    assert ck["data_meta"]["train_sha256"] == meta["files"]["train.bin"]["sha256"]


# --------------------------------------------------------------------------------------------------
# what a family cannot report

def test_room_of_a_halt_checkpoint_says_it_does_not_apply(run, tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                          route="halt"))
    ck = tmp_path / "ckpt.pt"
    torch.save(dict(model=model.state_dict(), model_args=dict(model.config.__dict__),
                    config=dict(dataset="synthetic", data_dir=str(run / "data"), block_size=16,
                                batch_size=2, eval_iters=1, route="halt")), ck)
    assert ev.main([f"--ckpt={ck}", "--room", "--json", "--device=cpu"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert "route=halt" in res["room"]["not_applicable"]
    assert "route=halt" in res["gate_room"]["not_applicable"]
    notes = [line for line in err.splitlines() if "not applicable" in line]
    assert len(notes) == 2 and notes[0].startswith("note: room: not applicable: route=halt")


def test_room_of_an_ffn_checkpoint_is_a_number(run, capsys):
    assert ev.main([f"--ckpt={run / 'out' / 'ckpt.pt'}", "--room", "--json", "--device=cpu",
                    "--eval_iters=1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["room"] == pytest.approx(res["cheap"] - res["full"])
    assert isinstance(res["gate_room"], float)
