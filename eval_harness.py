"""
Score a checkpoint on lm-evaluation-harness tasks (pip install lm_eval): the harness's
loglikelihood, loglikelihood_rolling and generate_until requests answered by the model under the
causal routing of model.eval(), with the realised budget (full-path fraction per routed layer over
every token the model ran) printed beside the scores.

    python eval_harness.py --ckpt=out/arith/ckpt.pt --tasks=nanodepth_arith --device=cpu
    python eval_harness.py --ckpt=out/arith/ckpt.pt --tasks=nanodepth_arith_choice --limit=20

prints one JSON object {"results", "n_samples", "routing", "tasks", "ckpt"} (and writes it to --out
when given). The tasks of tasks/ in this repository (nanodepth_arith: greedy answers, exact match;
nanodepth_arith_choice: the true answer among four by loglikelihood; nanodepth_arith_ppl: the
problems' rolling loglikelihood) run offline; the harness's own tasks (hellaswag, lambada_openai,
...) download their data, where the network allows. The tokenizer is the run's (its data's
meta.json: char, byte or GPT-2 BPE), so the data folder must be there as for eval.py; its train
split calibrates the causal thresholds first, as eval.py does (--calib_iters).

Within Python, lm_eval's own entry points take the model once this module registers it:

    import eval_harness, lm_eval
    eval_harness.register()        # the harness model 'nanodepth'
    lm_eval.simple_evaluate(model='nanodepth', model_args='ckpt=out/arith/ckpt.pt', tasks=[...])

The arithmetic itself needs no lm_eval: Scorer(model, encode, decode, ...).loglikelihood([(context,
continuation), ...]) -> [(logprob, is_greedy)], .loglikelihood_rolling([text]) -> [logprob],
.generate_until([(context, {'until': [...], 'max_gen_toks': N})]) -> [text], .routing() -> the
realised budget so far.
"""
import importlib.util
import json
import os
import sys
from contextlib import redirect_stdout
from dataclasses import fields
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from checkpoint import load_checkpoint, load_model
from configurator import (ConfigError, UserError, asks_help, declared_defaults, load_config,
                          print_help, refuse_spaced_values, replaceable_result,
                          require_checkpoint_file, run_cli, source_group, writable_file)
from data.loader import check_checkpoint_data, load_dataset_meta, load_tokenizer, open_splits
from device import cli_device
from files import write_whole
from model import GPTConfig, read_stored_config

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS_DIR = os.path.join(HERE, 'tasks')
GPT2_EOT = 50256
NEEDS_LM_EVAL = "error: eval_harness.py needs lm_eval: pip install lm_eval"

DEFAULTS = dict(
    ckpt='',                # the checkpoint file, e.g. out/arith/ckpt.pt
    tasks='',               # comma-separated task names, e.g. nanodepth_arith or hellaswag
    include_path='',        # a folder of extra task YAMLs, besides this repository's tasks/
    num_fewshot=-1,         # examples put before each question (-1: each task's own number)
    limit=0,                # score the first N documents of each task only (0: all of them)
    batch_size=16,          # sequences per forward
    calib_iters=0,          # train-split batches calibrating the causal thresholds (0: the run's)
    device='auto',          # 'auto', 'cpu', 'cuda' or 'cuda:N'
    data_dir='',            # the folder holding the run's prepared dataset ('': the run's own)
    out='',                 # also write the JSON object to this file ('': print it only; new, or an
                            # earlier result of this script)
)


# --------------------------------------------------------------------------------------------------
# the computation, with no lm_eval: token windows, their log-probabilities, generation


def score_windows(tokens, first, block_size):
    """The windows that score tokens[first:] (first >= 1: every scored token has one before it),
    each token predicted once: [(inputs, targets)], inputs at most
    block_size tokens whose last len(targets) positions predict targets. A window predicts up to
    block_size tokens and sees the block_size tokens (or all there are) before the last one it
    predicts, as lm-evaluation-harness's rolling windows do (so a later window's first target
    may see as little as one token); a text within one block is one window, one forward."""
    assert 1 <= first <= len(tokens), (first, len(tokens))
    out = []
    for a in range(first, len(tokens), block_size):
        b = min(len(tokens), a + block_size)           # this window predicts tokens[a:b]
        out.append((tokens[max(0, b - 1 - block_size):b - 1], tokens[a:b]))
    return out


def prefix_token(meta, encode):
    """The token a text is conditioned on when nothing precedes it: GPT-2's <|endoftext|>, else
    the newline where the vocabulary has one (documents are lines), else id 0."""
    if meta.get('tokenizer') == 'gpt2':
        return GPT2_EOT
    try:
        ids = encode('\n')
    except ConfigError:
        return 0
    return ids[0] if len(ids) == 1 else 0


class Scorer:
    """lm-evaluation-harness's three requests answered by `model` in eval mode (causal routing).
    encode / decode: the run's tokenizer (data.loader.load_tokenizer); vocab_limit: the
    tokenizer's vocabulary (the model's is padded: argmax and sampling skip the padding ids);
    prefix_id: prefix_token(); eos_id: the tokenizer's end-of-text token, where it has one, at
    which generation stops whatever the request's stop strings (as the harness's own models do).
    Every forward's routing decisions on real (unpadded) positions add to the realised full-path
    fraction routing() reports."""

    def __init__(self, model, encode, decode, vocab_limit, prefix_id, batch_size=16, device='cpu',
                 eos_id=None):
        self.model, self.encode, self.decode = model, encode, decode
        self.vocab_limit, self.prefix_id = vocab_limit, prefix_id
        self.eos_text = None if eos_id is None else decode([eos_id])
        self.batch_size, self.device = batch_size, device
        self.block_size = model.config.block_size
        self.full_sums, self.tokens_run, self.generate_fracs = {}, 0, []
        refusal = model.family.cannot_generate(model.config)
        if refusal:             # e.g. an oracle gate routes by the targets, which scoring lacks
            raise UserError(refusal)

    def pair_tokens(self, context, continuation):
        """(context ids, continuation ids) as the harness's own models split a pair: encoded whole
        and cut where the context's own encoding ends (a BPE merge across the seam stays in the
        continuation), the context's trailing whitespace (spaces and newlines alike: the harness's
        str.rstrip()) moved to the continuation. An empty context is the prefix token."""
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        if not stripped:
            return [self.prefix_id], self.encode(continuation, "a request's continuation")
        whole = self.encode(stripped + continuation, "a request's text")
        n = len(self.encode(stripped, "a request's context"))
        return whole[:n], whole[n:]

    @torch.no_grad()
    def score(self, sequences):
        """[(sum of log p(token | the tokens before it), every token the argmax)] of tokens[first:]
        for each (tokens, first) in sequences; a sequence longer than the block is scored in
        score_windows' windows, summed back. Windows of similar length share a forward
        (right-padded: causal attention and causal routing keep padding out of real positions)."""
        jobs = [(i, inputs, targets) for i, (tokens, first) in enumerate(sequences)
                for inputs, targets in score_windows(tokens, first, self.block_size)]
        jobs.sort(key=lambda job: -len(job[1]))
        logprob, greedy = [0.0] * len(sequences), [True] * len(sequences)
        with self.model.mode(training=False):
            for k in range(0, len(jobs), self.batch_size):
                batch = jobs[k:k + self.batch_size]
                for (i, _, _), (lp, top) in zip(batch, self.forward(batch)):
                    logprob[i] += lp
                    greedy[i] = greedy[i] and top
        return list(zip(logprob, greedy))

    def forward(self, batch):
        """One forward of right-padded inputs: [(sum log p of targets, all argmax)] per row."""
        lengths = [len(inputs) for _, inputs, _ in batch]
        x = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        for row, (_, inputs, _) in enumerate(batch):
            x[row, :len(inputs)] = torch.tensor(inputs)
        logits, _, aux = self.model(x.to(self.device), last_only=False)
        logp = F.log_softmax(logits.float(), dim=-1)
        out = []
        for row, ((_, _, targets), n) in enumerate(zip(batch, lengths)):
            at = torch.arange(n - len(targets), n, device=logp.device)
            want = torch.tensor(targets, device=logp.device)
            lp = logp[row, at].gather(-1, want[:, None]).sum()
            top = logp[row, at, :self.vocab_limit].argmax(-1)
            out.append((float(lp), bool((top == want).all())))
        self.count_routing(aux.get('masks', {}), lengths)
        return out

    def count_routing(self, masks, lengths):
        """Add each routed layer's full-path decisions on the real positions to the running sums."""
        valid = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
        for row, n in enumerate(lengths):
            valid[row, :n] = True
        for layer, m in masks.items():
            on = m.float().cpu()[valid].sum()
            self.full_sums[int(layer)] = self.full_sums.get(int(layer), 0.0) + float(on)
        self.tokens_run += sum(lengths)

    # the harness's requests

    def loglikelihood(self, pairs):
        """[(log p(continuation | context), whether greedy decoding gives the continuation)] for
        [(context, continuation)] strings."""
        sequences = []
        for context, continuation in pairs:
            ctx, cont = self.pair_tokens(context, continuation)
            sequences.append((ctx + cont, len(ctx)))
        return self.score(sequences)

    def loglikelihood_rolling(self, texts):
        """[log p(text | the prefix token)] for each text, over rolling windows of the block."""
        ids = [[self.prefix_id] + self.encode(t, "a request's text") for t in texts]
        return [lp for lp, _ in self.score([(tokens, 1) for tokens in ids])]

    @torch.no_grad()
    def generate_until(self, requests, chunk=32):
        """[text generated after context until the first of gen_kwargs['until'] or the
        end-of-text token (cut before it) or max_gen_toks tokens (default 256)] for
        [(context, gen_kwargs)]; greedy unless do_sample with a temperature > 0. Generated `chunk`
        tokens at a time, stopping once a stop string appears."""
        out = []
        for context, kwargs in requests:
            until = kwargs.get('until') or []
            until = [until] if isinstance(until, str) else list(until)
            until += [self.eos_text] if self.eos_text else []
            budget = int(kwargs.get('max_gen_toks', 256))
            temperature = float(kwargs.get('temperature', 0.0)) if kwargs.get('do_sample') else 0.0
            ids = self.encode(context, "a request's context") if context else [self.prefix_id]
            new = []
            while len(new) < budget:
                prompt = (ids + new)[-self.block_size:]   # the model sees one block at most
                stats = {}
                x = torch.tensor([prompt], device=self.device)
                step = min(chunk, budget - len(new))
                seq = self.model.generate(x, step, temperature=temperature, stats=stats,
                                          vocab_limit=self.vocab_limit)
                new += seq[0, len(prompt):].tolist()
                if stats.get('full_frac') is not None:
                    self.generate_fracs.append(stats['full_frac'])
                text = self.decode(new)
                if any(s in text for s in until):
                    break
            text = self.decode(new)
            cuts = [text.index(s) for s in until if s in text]
            out.append(text[:min(cuts)] if cuts else text)
        return out

    def routing(self):
        """The realised budget so far: per routed layer the full-path fraction over every real
        position the scoring forwards ran (and its mean), the budget the config asks for, and
        generation's full-path fraction per layer: the mean over its model.generate calls (each
        one chunk of a request, weighted alike) of each call's mean over its forwards."""
        model = self.model
        layers = sorted(self.full_sums)
        per_layer = [self.full_sums[l] / max(1, self.tokens_run) for l in layers]
        gen = (torch.tensor(self.generate_fracs).mean(0).tolist()
               if self.generate_fracs else None)
        return dict(route=model.config.route, budget=model.family.budget(model.config),
                    layers=layers, full_frac=per_layer or None,
                    full_frac_mean=sum(per_layer) / len(per_layer) if per_layer else None,
                    tokens_scored=self.tokens_run, generate_full_frac=gen)


# --------------------------------------------------------------------------------------------------
# a checkpoint as a Scorer, and the harness's model class


def load_scorer(ckpt, device='auto', data_dir='', calib_iters=0, batch_size=16):
    """The Scorer of a checkpoint file: its model on device with the causal thresholds calibrated
    on calib_iters train-split batches (0: the run's own number), as eval.py does, and the
    tokenizer of its data (the run's own, checked as eval.py checks it). Notes go to stderr."""
    dev, _ = cli_device(device)
    ck = load_checkpoint(ckpt)
    with redirect_stdout(sys.stderr):
        cfg = SimpleNamespace(**{**{f.name: f.default for f in fields(GPTConfig)},
                                 **declared_defaults(os.path.join(HERE, 'train.py')),
                                 **read_stored_config(ck['config'])})
        cfg.data_dir = data_dir or cfg.data_dir
        meta = load_dataset_meta(cfg, master=True, prepare_missing=False)   # only training prepares
        check_checkpoint_data(cfg, meta, ck)      # the tokenizer must be the run's
        model = load_model(ck, dev, ckpt)
        refusal = model.family.cannot_generate(model.config)
        if refusal:
            raise UserError(refusal)
        train, _ = open_splits(meta, cfg.block_size, cfg.batch_size, cfg.seed, dev)
        torch.manual_seed(cfg.eval_seed)
        calib = [train.fetch(s)[0]
                 for s in train.eval_batches(calib_iters or cfg.calib_iters, 3, cfg.eval_seed)]
        model.calibrate(torch.cat(calib))           # a no-op for gates without scores
    encode, decode = load_tokenizer(meta)
    return Scorer(model.eval(), encode, decode, meta['vocab_size'], prefix_token(meta, encode),
                  batch_size, dev, eos_id=GPT2_EOT if meta.get('tokenizer') == 'gpt2' else None)


def harness_batch_size(batch_size):
    """The Scorer's batch size for the harness model's batch_size: a positive integer (an int or
    its digits), or 'auto' (lm_eval's 'auto:N' too) or None (lm_eval's create_from_arg_obj
    passes an unset one on): 16, since no memory probe is run. Anything else is a one-line
    ValueError, before a checkpoint loads."""
    if batch_size is None:
        return 16
    if isinstance(batch_size, str):
        text = batch_size.strip()
        auto = text.removeprefix('auto:')
        if text == 'auto' or (auto != text and auto.isdecimal() and int(auto) > 0):
            return 16
        if text.isdecimal() and int(text) > 0:      # (isdigit would pass '²', which int refuses)
            return int(text)
    elif isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return batch_size
    raise ValueError(f"batch_size must be a positive integer or 'auto' (lm_eval's 'auto:N' "
                     f"too), not {batch_size!r}")


HARNESS_MODEL = []          # the lm_eval model class, made and registered once


def register():
    """Make and register lm_eval's model 'nanodepth' (a Scorer behind lm_eval's LM interface);
    returns its class. model_args: ckpt (required), data_dir, calib_iters, and the harness's own
    batch_size and device."""
    if HARNESS_MODEL:
        return HARNESS_MODEL[0]
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    @register_model('nanodepth')
    class NanodepthLM(LM):
        def __init__(self, ckpt='', scorer=None, data_dir='', calib_iters=0, batch_size=16,
                     device='auto', **_):
            super().__init__()
            size = harness_batch_size(batch_size)
            if scorer is None and not ckpt:
                raise UserError("model 'nanodepth' needs model_args ckpt=PATH (a checkpoint file)")
            if scorer is None:
                scorer = load_scorer(ckpt, device or 'auto', data_dir, int(calib_iters), size)
            self.scorer = scorer

        def loglikelihood(self, requests, disable_tqdm=False):
            return self.scorer.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm=False):
            return self.scorer.generate_until([r.args for r in requests])

    HARNESS_MODEL.append(NanodepthLM)
    return NanodepthLM


def evaluate_tasks(scorer, tasks, include_path='', num_fewshot=None, limit=None):
    """lm_eval.simple_evaluate of the tasks (names; this repository's tasks/ and include_path
    searched besides the harness's own) with scorer as the model: {"results", "n_samples",
    "routing"}, the routing over these tasks' forwards."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=[TASKS_DIR] + ([include_path] if include_path else []))
    res = lm_eval.simple_evaluate(model=register()(scorer=scorer), tasks=list(tasks),
                                  num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                  log_samples=False, bootstrap_iters=0)
    return dict(results=res['results'], n_samples=res.get('n-samples'), routing=scorer.routing())


# --------------------------------------------------------------------------------------------------
# the command line


def parse_args(argv):
    """The options, checked before any work; lm_eval must be importable."""
    refuse_spaced_values(argv, DEFAULTS)     # one syntax in every script: --key=value
    args = load_config(DEFAULTS, argv)
    require_checkpoint_file(args['ckpt'])
    if not [t for t in args['tasks'].split(',') if t.strip()]:
        raise ConfigError("--tasks must name tasks, comma-separated, e.g. --tasks=nanodepth_arith")
    if args['num_fewshot'] < -1 or args['limit'] < 0 or args['batch_size'] < 1:
        raise ConfigError("--num_fewshot must be >= 0 (-1: each task's own), --limit >= 0 "
                          "(0: every document) and --batch_size >= 1")
    if args['calib_iters'] < 0:
        raise ConfigError("--calib_iters must be >= 1, or 0 for the checkpoint's own value")
    if args['include_path'] and not os.path.isdir(args['include_path']):
        raise ConfigError(f"--include_path={args['include_path']} is not a folder; give the "
                          "folder holding the task YAMLs")
    if args['data_dir'] and not os.path.isdir(args['data_dir']):
        raise ConfigError(f"--data_dir={args['data_dir']} is not a folder; give the folder that "
                          "holds the run's prepared dataset")
    if args['out']:
        writable_file(args['out'], 'out', suffix='.json')
        replaceable_result(args['out'], 'out', 'eval_harness.py',
                           lambda res: {'tasks', 'ckpt'} <= res.keys())
    cli_device(args['device'])
    return args


def known_tasks(names, include_path):
    """Refuse task names lm_eval does not know (before the checkpoint loads)."""
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=[TASKS_DIR] + ([include_path] if include_path else []))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        local = sorted(n for n in manager.all_tasks if n.startswith('nanodepth_'))
        raise ConfigError(f"--tasks: lm_eval knows no task {', '.join(unknown)}; this "
                          f"repository's are {', '.join(local)} (python -m lm_eval ls tasks "
                          "lists the harness's)")


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python eval_harness.py --ckpt=PATH --tasks=NAME[,NAME...] '
                          '[--key=value ...]',
                          [source_group('eval_harness.py options', DEFAULTS,
                                        (__file__, 'DEFAULTS'))])
    args = parse_args(argv)
    if importlib.util.find_spec('lm_eval') is None:
        print(NEEDS_LM_EVAL, file=sys.stderr)
        return 2
    names = [t.strip() for t in args['tasks'].split(',') if t.strip()]
    known_tasks(names, args['include_path'])
    scorer = load_scorer(args['ckpt'], args['device'], args['data_dir'], args['calib_iters'],
                         args['batch_size'])
    with redirect_stdout(sys.stderr):       # stdout holds exactly the one JSON object
        res = evaluate_tasks(scorer, names, args['include_path'],
                             None if args['num_fewshot'] < 0 else args['num_fewshot'],
                             args['limit'] or None)
    res.update(tasks=names, ckpt=args['ckpt'])
    text = json.dumps(res, indent=2, default=str)
    if args['out']:
        write_whole(args['out'], lambda f: f.write(text + '\n'))
    print(text)
    return 0


if __name__ == '__main__':
    run_cli(main)
