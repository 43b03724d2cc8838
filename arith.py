"""
Exact-match accuracy on a prepared task with answers (python data/prepare.py arith): each problem's
greedy answer, generated until the newline that ends an answer, compared with the true one.

    python arith.py --ckpt=out/arith/ckpt.pt [--split=test] [--limit=0] [--json]
    python arith.py --ckpt=out/backbone/ckpt.pt --dataset=arith_sc    # a backbone, zero-shot

prints {"accuracy", "correct", "n", "split", "ckpt"}. The data must be the run's own (the
checkpoint's dataset and data_dir, or --data_dir), as for eval.py, or --dataset: a task prepared
in the run's vocabulary (data/prepare.py arith --vocab_from=<the run's data>). A split's problems
are read back from its token file and loss mask: a prompt is a run of mask-0 tokens, its answer the
run of mask-1 tokens after it (the last of which is the newline), so the scorer needs no tokenizer
of its own and works on char and GPT-2 BPE data alike.

    from arith import split_problems, exact_match
    probs = split_problems(meta, 'test')            # [(prompt ids, answer ids)]
    exact_match(model, probs, decode)['accuracy']   # decode: data.loader.load_tokenizer(meta)[1]
"""
import json
import os
from types import SimpleNamespace

import numpy as np
import torch

from checkpoint import load_checkpoint, load_model
from configurator import (ConfigError, asks_help, declared_defaults, load_config, print_help,
                          refuse_spaced_values, require_checkpoint_file, run_cli, source_group)
from data.loader import (VOCAB_IDENTITY, check_checkpoint_data, check_data, load_dataset_meta,
                         load_tokenizer)
from device import cli_device
from model import FAMILIES, read_stored_config

HERE = os.path.dirname(os.path.abspath(__file__))


def split_problems(meta, split='test'):
    """[(prompt ids, answer ids)] of a split of a task with a loss mask, in file order."""
    folder = meta['folder']
    ids = np.fromfile(os.path.join(folder, f'{split}.bin'), dtype=meta['dtype']).astype(np.int64)
    mask = np.fromfile(os.path.join(folder, f'{split}_loss_mask.bin'), dtype=np.uint8)
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1       # where a run begins
    runs = np.split(ids, edges)
    first_is_prompt = mask[0] == 0
    runs = runs if first_is_prompt else runs[1:]
    return [(runs[i].tolist(), runs[i + 1].tolist()) for i in range(0, len(runs) - 1, 2)]


def fitting_batches(problems, batch_size, block_size):
    """Consecutive problems, at most batch_size at a time, a batch closed early where its longest
    prompt plus its longest answer would outgrow block_size: ragged generation decodes a whole
    batch within one block, so two problems that each fit may not fit together."""
    batch, prompt, answer = [], 0, 0
    for p, a in problems:
        if batch and (len(batch) == batch_size
                      or max(prompt, len(p)) + max(answer, len(a)) > block_size):
            yield batch
            batch, prompt, answer = [], 0, 0
        batch.append((p, a))
        prompt, answer = max(prompt, len(p)), max(answer, len(a))
    if batch:
        yield batch


@torch.no_grad()
def exact_match(model, problems, decode, batch_size=64, vocab_limit=None, device='cpu'):
    """The share of problems whose greedy answer, up to and including the first newline (each
    answer's own last token), decodes to the true answer's text. A model generates as many tokens
    as the longest true answer of its batch: enough to tell a longer or shorter answer apart.
    Returns {'accuracy', 'correct', 'n'}."""
    block_size = model.config.block_size
    for p, a in problems:
        if len(p) + len(a) > block_size:
            raise ConfigError(f"a problem with a prompt of {len(p)} tokens and an answer of "
                              f"{len(a)} does not fit the model's block_size {block_size}; score "
                              f"a model of a longer block or a task of shorter problems")
    training = model.training
    model.eval()
    correct = 0
    try:
        for batch in fitting_batches(problems, batch_size, block_size):
            lengths = [len(p) for p, _ in batch]
            x = torch.zeros(len(batch), max(lengths), dtype=torch.long, device=device)
            for row, (p, _) in enumerate(batch):
                x[row, :len(p)] = torch.tensor(p)
            new = max(len(a) for _, a in batch)
            out = model.generate(x, new, temperature=0.0, lengths=lengths, vocab_limit=vocab_limit)
            for (p, answer), seq in zip(batch, out):
                said = seq[len(p):].tolist()
                stop = answer[-1]
                said = said[:said.index(stop) + 1] if stop in said else said
                correct += decode(said) == decode(answer)
    finally:
        model.train(training)
    return dict(accuracy=correct / max(1, len(problems)), correct=correct, n=len(problems))


DEFAULTS = dict(
    ckpt='',                # the checkpoint file, e.g. out/arith/ckpt.pt
    split='test',           # the problems scored: 'test' or 'val'
    limit=0,                # score the first N problems only (0: all of them)
    batch_size=64,          # problems decoded together
    device='auto',          # 'auto', 'cpu', 'cuda' or 'cuda:N'
    data_dir='',            # the folder holding the run's prepared dataset ('': the run's own)
    dataset='',             # another prepared task in the run's vocabulary (a backbone scored
                            # zero-shot; '': the run's own)
)
FLAGS = {'--json': 'print one JSON object instead of the text'}


def parse_args(argv):
    as_json = '--json' in argv
    argv = [a for a in argv if a not in FLAGS]
    refuse_spaced_values(argv, DEFAULTS)     # one syntax in every script: --key=value
    args = load_config(DEFAULTS, argv)
    require_checkpoint_file(args['ckpt'])
    if args['split'] not in ('val', 'test'):
        raise ConfigError(f"--split must be val or test, got {args['split']!r}")
    if args['limit'] < 0 or args['batch_size'] < 1:
        raise ConfigError("--limit must be >= 0 (0: every problem) and --batch_size >= 1")
    if args['data_dir'] and not os.path.isdir(args['data_dir']):
        raise ConfigError(f"--data_dir={args['data_dir']} is not a folder; give the folder that "
                          "holds the prepared task (arith.py prepares no data)")
    cli_device(args['device'])
    return args, as_json


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python arith.py --ckpt=PATH [--key=value ...] [--json]',
                          [source_group('arith.py options', DEFAULTS, (__file__, 'DEFAULTS'))],
                          flags=FLAGS)
    args, as_json = parse_args(argv)
    dev, _ = cli_device(args['device'])
    ck = load_checkpoint(args['ckpt'])
    cfg = SimpleNamespace(**{**declared_defaults(os.path.join(HERE, 'train.py')),
                             **read_stored_config(ck['config'])})
    cfg.data_dir = args['data_dir'] or cfg.data_dir
    cfg.dataset = args['dataset'] or cfg.dataset
    meta = load_dataset_meta(cfg, master=True, prepare_missing=False)   # only training prepares
    # another task: only its token ids must mean what they meant in training
    check_checkpoint_data(cfg, meta, ck, keys=VOCAB_IDENTITY if args['dataset'] else None)
    # intact, as eval.py checks: a token id past the vocabulary would crash the model, and a changed
    # loss mask would silently score other problems
    check_data(cfg, meta, ck, skip_option=False)
    if not meta.get('loss_mask') or f"{args['split']}.bin" not in meta['files']:
        raise ConfigError(f"data/{cfg.dataset} has no {args['split']} problems with answers; "
                          f"exact match needs a task such as python data/prepare.py arith")
    family = FAMILIES[ck['model_args'].get('route', 'none')]
    refusal = family.cannot_generate(SimpleNamespace(**read_stored_config(ck['model_args'])))
    if refusal:
        raise ConfigError(refusal)
    problems = split_problems(meta, args['split'])
    problems = problems[:args['limit']] if args['limit'] else problems
    model = load_model(ck, dev, args['ckpt'])
    res = exact_match(model, problems, load_tokenizer(meta)[1], args['batch_size'],
                      vocab_limit=meta['vocab_size'], device=dev)
    res.update(split=args['split'], ckpt=args['ckpt'])
    print(json.dumps(res) if as_json else
          f"exact match on {res['n']} {args['split']} problems: {res['accuracy']:.4f} "
          f"({res['correct']} correct)")
    return 0


if __name__ == '__main__':
    run_cli(main)
