"""arith.py: a split's problems read back from its tokens and loss mask, the exact-match scorer
(1 for an oracle, 0 for a wrong model), and a few training steps on the arith task whose reported
loss is over the answer tokens only."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import arith
import eval as evaluation
import train
from checkpoint import load_checkpoint, load_model
from configurator import UserError
from data import prepare as P
from data.loader import load_tokenizer, open_splits

pytestmark = pytest.mark.usefixtures('one_thread')      # tiny ops: see conftest.py


@pytest.fixture(scope='module')
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp('arith')
    meta = P.prepare('arith', out_dir=root / 'arith', num_problems=300, digits=2)
    return root, dict(meta, folder=str(root / 'arith'))


class Answers(nn.Module):
    """A fake model that answers each prompt by evaluating it (or wrongly, off by one)."""

    def __init__(self, meta, wrong=False):
        super().__init__()
        self.encode, self.decode = load_tokenizer(meta)
        self.wrong = wrong
        self.config = SimpleNamespace(block_size=64)

    def generate(self, idx, max_new_tokens, temperature, lengths, vocab_limit=None):
        out = []
        for row, n in zip(idx, lengths):
            prompt = self.decode(row[:n].tolist())
            value = eval(prompt[:-1]) + self.wrong          # '12+34=' -> 46
            said = self.encode(f"{value}\n") + self.encode("7" * max_new_tokens)   # then babble
            out.append(torch.cat([row[:n], torch.tensor(said[:max_new_tokens])]))
        return out


def test_split_problems_are_the_prompts_and_answers(task):
    _, meta = task
    problems = arith.split_problems(meta, 'test')
    decode = load_tokenizer(meta)[1]
    assert len(problems) == meta['problems']['test'] == 30
    for prompt, answer in problems:
        p, a = decode(prompt), decode(answer)
        assert p.endswith('=') and a.endswith('\n') and eval(p[:-1]) == int(a)


def test_exact_match_is_one_for_an_oracle_and_zero_for_a_wrong_model(task):
    _, meta = task
    problems, decode = arith.split_problems(meta, 'test'), load_tokenizer(meta)[1]
    assert arith.exact_match(Answers(meta), problems, decode, batch_size=7) == dict(
        accuracy=1.0, correct=30, n=30)
    assert arith.exact_match(Answers(meta, wrong=True), problems, decode)['accuracy'] == 0.0


def greedy_alone(model, prompt, new, vocab):
    """model's greedy continuation of one prompt, each token the argmax of a full forward of all
    the tokens before it (no cache, no batch)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1, :vocab].argmax()))
    return seq[len(prompt):]


def test_exact_match_scores_problems_that_fit_the_block_alone_whatever_their_batch():
    """Problems near block_size: each fits (prompt + answer <= block_size) but a batch's longest
    prompt with another problem's longest answer would not. Every problem is scored, as one greedy
    decoding of it alone judges it; a problem that cannot fit is refused in one line."""
    from conftest import V, build
    model = build('none', n_layer=2, block_size=16).eval()
    g = torch.Generator().manual_seed(0)
    problems, want = [], 0
    for i, (p, a) in enumerate([(11, 5), (3, 13), (10, 6), (4, 12), (12, 4), (2, 14)] * 2):
        while True:              # an answer whose last token is its first of that value
            prompt = torch.randint(0, V - 1, (p,), generator=g).tolist()
            said = greedy_alone(model, prompt, a, V - 1)
            if said[-1] not in said[:-1]:
                break
        answer = said if i % 3 else said[:-1] + [(said[-1] + 1) % (V - 1)]   # a third wrong
        alone = greedy_alone(model, prompt, len(answer), V - 1)
        alone = alone[:alone.index(answer[-1]) + 1] if answer[-1] in alone else alone
        want += alone == answer
        problems.append((prompt, answer))
    decode = lambda ids: ' '.join(map(str, ids))
    for batch_size in (1, 4, 64):
        got = arith.exact_match(model, problems, decode, batch_size, vocab_limit=V - 1)
        assert got == dict(accuracy=want / 12, correct=want, n=12), batch_size
    assert want == 8                                     # the wrong third is wrong
    with pytest.raises(UserError, match=r"prompt of 3 tokens and an answer of 14 .* block_size "
                                        r"16") as e:
        arith.exact_match(model, [*problems, ([0, 1, 2], list(range(14)))], decode)
    assert '\n' not in str(e.value)


def test_a_few_training_steps_report_the_loss_over_answer_tokens(task, tmp_path, capsys):
    root, meta = task
    out = tmp_path / 'run'
    args = ['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=32', '--batch_size=4',
            '--eval_iters=2', '--eval_interval=3', '--log_interval=1', '--warmup_iters=0',
            '--device=cpu', '--route=none', '--dataset=arith', f'--data_dir={root}',
            f'--out_dir={out}', '--max_iters=3']
    assert train.main(args) == 0
    records = [json.loads(line) for line in open(out / 'metrics.jsonl')]
    logged = [r for r in records if r.get('type') == 'eval'][-1]['val_loss']
    # the same val batches, scored by hand: only the answer targets count
    ck = load_checkpoint(str(out / 'ckpt.pt'))
    model = load_model(ck, 'cpu')
    _, val = open_splits(meta, 32, 4, ck['config']['seed'], torch.device('cpu'))
    batches = [val.fetch(s) for s in val.eval_batches(2, 2, ck['config']['eval_seed'])]
    counted = sum(int((y != -1).sum()) for _, y in batches)
    assert 0.2 * 2 * 4 * 32 < counted < 0.5 * 2 * 4 * 32           # answers: ~3/8 of the tokens
    assert abs(evaluation.evaluate(model, batches)['loss'] - logged) < 1e-5
    everything = [(x, torch.cat([x[:, 1:], y[:, -1:]], 1)) for x, y in batches]   # unmasked
    everything = [(x, y.masked_fill(y == -1, 0)) for x, y in everything]
    assert abs(evaluation.evaluate(model, everything)['loss'] - logged) > 1e-3
    # and the exact-match CLI scores the checkpoint on its test problems
    capsys.readouterr()
    assert arith.main([f"--ckpt={out / 'ckpt.pt'}", '--device=cpu', '--limit=10', '--json']) == 0
    res = json.loads(capsys.readouterr().out)
    assert res['n'] == 10 and res['split'] == 'test' and 0 <= res['accuracy'] <= 1


def test_cli_refuses_data_without_answers_and_bad_options(tmp_path):
    with pytest.raises(UserError, match='--split must be val or test'):
        arith.main([f'--ckpt={__file__}', '--split=train'])
    with pytest.raises(UserError, match='is not a checkpoint file'):
        arith.main([f'--ckpt={tmp_path / "none.pt"}'])
    with pytest.raises(UserError, match="--ckpt takes its value after '=': --ckpt=x.pt"):
        arith.main(['--ckpt', 'x.pt'])


def test_help_lists_each_option_with_its_default_and_description(capsys):
    assert arith.main(['--help']) == 0
    out = capsys.readouterr().out
    assert '--limit=0' in out and 'score the first N problems only' in out
    assert '--json' in out and 'UNDOCUMENTED' not in out


def test_a_backbone_fine_tunes_on_the_task_written_in_its_vocabulary(tmp_path):
    """Starting from a checkpoint (stage 2) on other data is refused, except for a task prepared
    with --vocab_from that checkpoint's data: the same token ids, new problems."""
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('the quick brown fox & a hog: jumps ~ over x-ray dice\n' * 60)
    P.prepare('text', input=str(corpus), name='corpus', out_dir=tmp_path / 'data' / 'corpus')
    P.prepare('arith', out_dir=tmp_path / 'data' / 'task', num_problems=200, digits=2,
              vocab_from=str(tmp_path / 'data' / 'corpus'))
    P.prepare('arith', out_dir=tmp_path / 'data' / 'own', num_problems=200, digits=2)
    args = ['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=32', '--batch_size=2',
            '--eval_iters=1', '--warmup_iters=0', '--device=cpu', '--route=none',
            f'--data_dir={tmp_path / "data"}', '--max_iters=2']
    assert train.main([*args, '--dataset=corpus', f'--out_dir={tmp_path / "backbone"}']) == 0
    init = f'--init_from={tmp_path / "backbone" / "ckpt.pt"}'
    assert train.main([*args, '--dataset=task', init, '--trainable=lora',
                       f'--out_dir={tmp_path / "tuned"}']) == 0
    with pytest.raises(UserError, match="differs from the checkpoint's data"):
        train.main([*args, '--dataset=own', init, f'--out_dir={tmp_path / "refused"}'])
    assert not (tmp_path / 'refused').exists()
    # the backbone scored zero-shot on the task in its vocabulary; not on the task's own vocabulary
    score = ['--data_dir=' + str(tmp_path / 'data'), '--limit=5', '--json', '--device=cpu']
    assert arith.main([f'--ckpt={tmp_path / "backbone" / "ckpt.pt"}', '--dataset=task',
                       *score]) == 0
    with pytest.raises(UserError, match="data field 'vocab_size' differs|'tokenizer' differs"):
        arith.main([f'--ckpt={tmp_path / "backbone" / "ckpt.pt"}', '--dataset=own', *score])
    with pytest.raises(UserError, match="has no test problems"):
        arith.main([f'--ckpt={tmp_path / "backbone" / "ckpt.pt"}', *score])


def task_checkpoint(root, meta, path):
    """A hand-made checkpoint of a tiny dense model on the task in root (no training)."""
    from model import GPT, GPTConfig
    margs = dict(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=meta['vocab_size'],
                 route='none')
    torch.save(dict(model=GPT(GPTConfig(**margs)).state_dict(), model_args=margs,
                    config=dict(dataset='arith', data_dir=str(root))), path)
    return path


@pytest.mark.parametrize('damage', ['token_past_vocab', 'mask_cleared'])
def test_cli_refuses_damaged_task_data_in_one_line(task, tmp_path, damage):
    """A test split changed since it was prepared is refused by its sha256, naming the file, as
    eval.py refuses it: neither an IndexError deep in the model nor a score of 0 problems."""
    import shutil
    import numpy as np
    root, meta = task
    shutil.copytree(root / 'arith', tmp_path / 'data' / 'arith')
    folder = tmp_path / 'data' / 'arith'
    ckpt = task_checkpoint(tmp_path / 'data', meta, tmp_path / 'ckpt.pt')
    name, dtype = (('test.bin', meta['dtype']) if damage == 'token_past_vocab'
                   else ('test_loss_mask.bin', np.uint8))
    values = np.fromfile(folder / name, dtype=dtype)
    values[:] = 60000 if damage == 'token_past_vocab' else 0     # same size: only sha256 tells
    values.tofile(folder / name)
    with pytest.raises(UserError, match=f"{name} does not match its sha256") as e:
        arith.main([f'--ckpt={ckpt}', '--device=cpu', '--json'])
    assert '\n' not in str(e.value) and 'verify_data' not in str(e.value)   # not its option


def test_cli_refuses_a_data_dir_that_is_not_a_folder(task, tmp_path):
    root, meta = task
    ckpt = task_checkpoint(root, meta, tmp_path / 'ckpt.pt')
    with pytest.raises(UserError, match=r'--data_dir=.*ckpt.pt is not a folder'):
        arith.main([f'--ckpt={ckpt}', f'--data_dir={ckpt}', '--device=cpu'])
