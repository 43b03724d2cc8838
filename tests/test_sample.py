"""Tests for sample.py: sampling never emits a padding id of the model's vocabulary, prompts the
vocabulary cannot encode are refused naming the characters (and the prompts file's line), and bad
options are one UserError naming the field, before the checkpoint is looked at.

The char-level checkpoint is made in-process; the synthetic one is conftest's `run`."""
import json
import re

import pytest
import torch

import sample
from configurator import UserError
from data import prepare as P
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures('one_thread')
TEXT = "the quick brown fox jumps over the lazy dog. " * 80     # 28 characters, no newline
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


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


def test_sample_start_from_a_file_is_that_text(char_run, tmp_path, capsys):
    """--start=FILE:path (nanoGPT's form) starts from the file's whole text: greedily, the same
    samples as that text given as --start."""
    (tmp_path / "prompt.txt").write_text("the lazy")
    outs = []
    for start in (f"--start=FILE:{tmp_path / 'prompt.txt'}", "--start=the lazy"):
        assert sample.main([f"--out_dir={char_run / 'out'}", start, "--num_samples=1",
                            "--max_new_tokens=6", "--temperature=0", "--device=cpu"]) == 0
        outs.append(capsys.readouterr().out.splitlines()[0])
    assert outs[0] == outs[1] and outs[0].startswith("the lazy") and len(outs[0]) == 14


@pytest.mark.parametrize("text,needle", [(None, "is not a file; give a text file of the prompt"),
                                         (" \n", "is blank: give at least one character")])
def test_sample_start_from_a_missing_or_blank_file_is_refused_before_the_checkpoint(tmp_path,
                                                                                   text, needle):
    path = tmp_path / "prompt.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError, match=re.escape(f"--start=FILE:{path} {needle}")):
        sample.main([f"--out_dir={tmp_path}", f"--start=FILE:{path}"])


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


def test_sample_prompts_past_block_size_name_the_fix(char_run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the\nthe lazy\n")          # 8 + 10 new tokens > block_size 16
    with pytest.raises(UserError, match=r"longest prompt \(8 tokens\) plus max_new_tokens \(10\) "
                                        r"exceeds block_size 16: lower --max_new_tokens"):
        sample.main([*sample_args(char_run, f"--prompts_file={prompts}"), "--max_new_tokens=10"])


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
# bad options: one UserError naming the field, before any work

@pytest.mark.parametrize("arg,needle", [
    ("--temperature=-0.5", "temperature"), ("--temperature=nan", "temperature"),
    ("--max_new_tokens=0", "max_new_tokens"), ("--max_new_tokens=-3", "max_new_tokens"),
    ("--top_k=-1", "top_k"), ("--num_samples=0", "num_samples"),
    ("--draft_stop=0.5", "draft_stop"), ("--draft_stop=-0.1", "draft_stop"),
    ("--passes_per_graph=0", "passes_per_graph must be >= 1"),
    ("--passes_per_graph=2", "give K >= 1 too"),
    ("--speculate=2 --passes_per_graph=2 --draft_stop=0.5", "drop one of them"),
    ("--prompts_file=/nonexistent/prompts.txt", "prompts_file"), ("--device=bogus", "device"),
    ("--device=mps", "device"), pytest.param("--device=cuda", "CUDA", marks=NO_CUDA)])
def test_sample_bad_options(tmp_path, arg, needle):
    # out_dir holds no checkpoint: the option must be refused before the checkpoint is looked at
    with pytest.raises(UserError, match=needle):
        sample.main([f"--out_dir={tmp_path}", *arg.split()])


def test_sample_prompts_file_without_a_prompt_is_refused_before_the_checkpoint(tmp_path):
    # blank lines are no prompts: out_dir holds no checkpoint, so the file is refused first
    (tmp_path / "prompts.txt").write_text("\n   \n\n")
    with pytest.raises(UserError, match=r"prompts\.txt' has no prompts: give one prompt per line"):
        sample.main([f"--out_dir={tmp_path}", f"--prompts_file={tmp_path / 'prompts.txt'}"])


@pytest.mark.parametrize("extra,needle", [
    ("--use_cache=False", "--prompts_file decodes prompts of different lengths with the KV cache"),
    ("--start=abc", "--start and --num_samples make a batch of one prompt"),
    ("--num_samples=2", "--start and --num_samples make a batch of one prompt")])
def test_sample_prompts_file_refuses_options_it_would_ignore(tmp_path, extra, needle):
    # a batch of different lengths decodes with the cache alone, from the file's prompts alone
    (tmp_path / "prompts.txt").write_text("ab\n")
    with pytest.raises(UserError, match=needle):
        sample.main([f"--out_dir={tmp_path}", f"--prompts_file={tmp_path / 'prompts.txt'}", extra])


def test_sample_help_lists_options_with_defaults_and_descriptions(capsys):
    """--help exits 0 before any check (no run needed), on stdout: every option as --key=default
    with its comment, nothing UNDOCUMENTED."""
    assert sample.main(['--help', '--out_dir=missing']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('Sample from a trained') and err == '' and 'UNDOCUMENTED' not in out
    assert "  --temperature=0.8                 softmax temperature (0: greedy)" in out.splitlines()
    assert "--start='\\n'" in out
    assert [line.split('=')[0][4:] for line in out.splitlines()
            if line.startswith('  --')] == list(sample.DEFAULTS)
