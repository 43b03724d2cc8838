"""
Sample from a trained nanodepth model.

    python sample.py --out_dir=out/quickstart --start="12+34=" --num_samples=3 --max_new_tokens=100

Decodes with the tokenizer recorded in the data's meta.json (char, byte, gpt2 or the synthetic
corpus's symbols), refusing a data folder that is not the checkpoint's own (its recorded tokenizer,
vocabulary and content hash), and uses the KV cache unless --use_cache=False. Routed models
decode routed (as model.eval() routes, causal per token) and print the realised full-path
fraction per routed layer.
--start=FILE:prompt.txt: the file's whole text is the prompt (as in nanoGPT).
--prompts_file=FILE: one prompt per line, decoded together as one batch of different lengths.
--speculate=K (0: off): self-speculative decoding (speculative.py), K tokens drafted at a time by
the cheap version of the model --draft names (default: the family's first; a wrong name lists
them), stopping after --draft_layers blocks where the draft has a depth (0: its default), and with
--draft_stop=P a pass drafting no further once every row's draft gives its token a probability
below P (0: off); greedy output is the plain decode's, sampled output has its distribution.
--compile=True: each cached decoding step (and with --speculate each pass's draft and verification)
through torch.compile, a CUDA graph on a GPU, where an eager routed step is bound by kernel launches
and host syncs; the first steps compile (seconds to minutes), and the tokens/s printed counts that.
--passes_per_graph=P (with --speculate, without --draft_stop): P passes chained as one function,
one graph when compiled, the host waiting once for P (on an H200, 4 chained, unrolled in one graph
then, decoded the trained exit model 2.07x faster than plain decoding, passes apart 1.28x); the
same tokens.
--start (default a newline; on the synthetic corpus, which has none, '|', a segment boundary) and
every prompt must encode to at least one token, with no character outside a char or synthetic
vocabulary. Only the tokenizer's real ids are sampled, never the padding of the model's vocabulary.
"""
import os
import time
from types import SimpleNamespace

import torch

from checkpoint import load_checkpoint, load_model
from configurator import ConfigError, asks_help, load_config, print_help, run_cli, source_group
from data import prepare as prep
from data.loader import check_checkpoint_data, load_tokenizer
from device import cli_device
from model import FAMILIES, read_stored_config
from speculative import resolve_draft

DEFAULTS = dict(
    out_dir='out/quickstart',   # the run's folder, holding ckpt.pt
    start='\n',                 # the prompt (on the synthetic corpus the default is '|'), or
                                # FILE:path for a file's text
    num_samples=3,              # samples drawn from --start
    max_new_tokens=200,         # tokens generated per sample
    temperature=0.8,            # softmax temperature (0: greedy)
    top_k=200,                  # sample among the k most likely tokens (0: all; 1: greedy)
    seed=1337,                  # the sampling RNG
    device='auto',              # 'auto', 'cpu', 'cuda' or 'cuda:N'
    use_cache=True,             # decode with the KV cache
    data_dir='',                # the folder of the run's prepared dataset ('': the run's own)
    prompts_file='',            # a text file, one prompt per line, decoded as one batch
    speculate=0,                # self-speculative decoding, K tokens drafted at a time (0: off)
    draft='',                   # the family's draft to speculate with ('': its first)
    draft_layers=0,             # blocks the draft runs, where it has a depth (0: its default)
    draft_stop=0.0,             # stop a pass's drafting below this draft probability (0: off)
    passes_per_graph=1,         # speculative passes chained as one function (one graph compiled)
    compile=False,              # compile each decoding step (a CUDA graph each on a GPU)
)
HERE = os.path.dirname(os.path.abspath(__file__))


def encode_prompt(encode, text, where):
    ids = encode(text, where)
    if not ids:
        raise ConfigError(f"{where} is empty: give at least one character to start from")
    return ids


def prompt_batch(cfg, encode, meta, block_size, dev):
    """The prompts as token ids (B, T) and their lengths: --prompts_file's lines right-padded to the
    longest (lengths: each one's), or --num_samples copies of --start (lengths None)."""
    if not cfg['prompts_file']:
        start = cfg['start']
        if start == DEFAULTS['start'] and meta.get('tokenizer') == 'synthetic':
            start = '|'                # no newline symbol there; '|' ends a segment, so a fresh one
                                       # follows
        ids = encode_prompt(encode, start, '--start')
        return torch.tensor(ids, dtype=torch.long, device=dev)[None].repeat(
            cfg['num_samples'], 1
        ), None
    prompts = [encode_prompt(encode, line, f"{cfg['prompts_file']} line {n}")
               for n, line in enumerate(cfg['prompts'].split('\n'), 1) if line.strip()]
    lengths = [len(p) for p in prompts]         # (read_prompts_file refused a file of none)
    if max(lengths) + cfg['max_new_tokens'] > block_size:
        raise ConfigError(f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens "
                          f"({cfg['max_new_tokens']}) exceeds block_size {block_size}: lower "
                          f"--max_new_tokens or shorten that prompt")
    return torch.tensor(
        [p + [0] * (max(lengths) - len(p)) for p in prompts], dtype=torch.long, device=dev
    ), lengths


def check_config(argv):
    """The options, each checked before any work; returns them (the prompts file read as text)."""
    cfg = load_config(DEFAULTS, argv)
    for key, lo in (('num_samples', 1), ('max_new_tokens', 1), ('top_k', 0), ('speculate', 0),
                    ('draft_layers', 0), ('passes_per_graph', 1)):
        if cfg[key] < lo:
            raise ConfigError(
                f"{key} must be >= {lo}, got {cfg[key]}"
                + (' (0: no top-k)' if key == 'top_k' else '')
            )
    if not cfg['temperature'] >= 0:            # also refuses NaN
        raise ConfigError(f"temperature must be >= 0 (0: greedy), got {cfg['temperature']}")
    if not cfg['speculate'] and (cfg['draft'] or cfg['draft_layers'] or cfg['draft_stop']
                                 or cfg['passes_per_graph'] > 1):
        raise ConfigError("--draft, --draft_layers, --draft_stop and --passes_per_graph choose "
                          "how --speculate=K drafts; give K >= 1 too")
    if cfg['passes_per_graph'] > 1 and cfg['draft_stop']:
        raise ConfigError("--passes_per_graph chains whole passes, --draft_stop checks each draft "
                          "step on the host: drop one of them")
    if not 0 <= cfg['draft_stop'] <= 1:         # also refuses NaN
        raise ConfigError(f"draft_stop must be in [0, 1] (0: off), got {cfg['draft_stop']}")
    if cfg['speculate'] and not cfg['use_cache']:
        raise ConfigError("--speculate needs the KV cache: leave --use_cache=False out")
    if cfg['compile'] and not cfg['use_cache']:
        raise ConfigError("--compile compiles the cached decoding step: leave --use_cache=False "
                          "out")
    if cfg['seed'] < 0:
        raise ConfigError(f"seed must be >= 0, got {cfg['seed']}")
    if cfg['prompts_file']:
        if not cfg['use_cache']:
            raise ConfigError("--prompts_file decodes prompts of different lengths with the KV "
                              "cache: leave --use_cache=False out")
        if cfg['start'] != DEFAULTS['start'] or cfg['num_samples'] != DEFAULTS['num_samples']:
            raise ConfigError("--start and --num_samples make a batch of one prompt; "
                              "--prompts_file gives the batch itself: leave them out")
        cfg['prompts'] = read_prompts_file(cfg['prompts_file'])
    if not cfg['out_dir']:
        raise ConfigError("--out_dir is empty; name the run folder that holds ckpt.pt, e.g. "
                          "--out_dir=out/quickstart")
    if os.path.isfile(cfg['out_dir']):        # e.g. the checkpoint file itself
        folder = os.path.dirname(cfg['out_dir']) or '.'
        raise ConfigError(f"--out_dir={cfg['out_dir']} is a file; --out_dir names the run's "
                          f"folder: --out_dir={folder}")
    if not cfg['prompts_file'] and not cfg['start']:
        raise ConfigError("--start is empty: give at least one character to start from")
    if cfg['start'].startswith('FILE:'):        # nanoGPT's form: the file's whole text
        cfg['start'] = read_text_file(cfg['start'][5:], f"--start={cfg['start']}", 'the prompt',
                                      'is blank: give at least one character to start from')
    if cfg['data_dir'] and not os.path.isdir(cfg['data_dir']):
        raise ConfigError(f"--data_dir={cfg['data_dir']} is not a folder; give the folder that "
                          f"holds the run's prepared dataset, or leave it out for the run's own")
    cli_device(cfg['device'])
    path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if not os.path.exists(path):               # after the options: their errors come first
        raise ConfigError(f"no checkpoint at {path}; train one first with: "
                          f"python train.py --out_dir={cfg['out_dir']}")
    return cfg


def read_text_file(path, label, what, blank):
    """The UTF-8 text of the file at path, or one ConfigError (naming it as `label`) where it is
    missing, unreadable, not UTF-8 or blank (known without the checkpoint: refused before it is
    read); `what` says what the file should hold, `blank` what a blank one lacks."""
    if not os.path.isfile(path):
        raise ConfigError(f"{label} is not a file; give a text file of {what}")
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{label} is not UTF-8 text (byte offset {e.start}); save it as UTF-8 "
                          "(e.g. iconv -f <its encoding> -t utf-8)") from None
    except OSError as e:
        raise ConfigError(f"{label} cannot be read ({e.strerror})") from None
    if not text.strip():
        raise ConfigError(f"{label} {blank}")
    return text


def read_prompts_file(path):
    return read_text_file(path, f"prompts_file {path!r}", 'one prompt per line',
                          'has no prompts: give one prompt per line')


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python sample.py [--key=value ...]',
                          [source_group('sample.py options', DEFAULTS, (__file__, 'DEFAULTS'))])
    cfg = check_config(argv)
    dev, _ = cli_device(cfg['device'])
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    ckpt = load_checkpoint(ckpt_path)
    margs, tcfg = ckpt['model_args'], ckpt['config']
    family = FAMILIES.get(margs.get('route'))
    stored = SimpleNamespace(**read_stored_config(margs))
    refusal = family.cannot_generate(stored) if family is not None else None
    if refusal:
        raise ConfigError(refusal)
    # a pass drafts within block_size, and its buffers grow with K
    if cfg['speculate'] > margs['block_size']:
        raise ConfigError(f"--speculate={cfg['speculate']} exceeds the model's block_size="
                          f"{margs['block_size']}; give K up to it")
    draft = None
    if cfg['speculate'] and family is not None:
        try:
            draft = resolve_draft(stored, family, cfg['draft'] or None, cfg['draft_layers'] or None)
        except ValueError as e:
            raise ConfigError(f"--draft/--draft_layers: {e}") from None
    folder = os.path.join(
        cfg['data_dir'] or tcfg.get('data_dir') or os.path.join(HERE, 'data'), tcfg['dataset']
    )
    try:                                        # its meta.json holds the tokenizer to decode with
        meta = prep.check_prepared(folder)
    except prep.PrepareError as e:
        hint = f"(or pass --data_dir=<the folder that holds {tcfg['dataset']}>)"
        raise ConfigError(f"{e} {hint}") from None
    # decode with the run's own tokenizer and vocabulary only: another folder's would print garbage
    check_checkpoint_data(SimpleNamespace(dataset=tcfg['dataset']), dict(meta, folder=folder), ckpt)
    encode, decode = load_tokenizer(meta)
    x, lengths = prompt_batch(cfg, encode, meta, margs['block_size'], dev)
    if cfg['speculate'] and x.size(1) + cfg['max_new_tokens'] > margs['block_size']:
        raise ConfigError(f"--speculate needs the prompt ({x.size(1)} tokens) plus max_new_tokens "
                          f"within block_size {margs['block_size']}; lower --max_new_tokens")
    model = load_model(ckpt, dev, ckpt_path).eval().decode_layout()
    torch.manual_seed(cfg['seed'])
    stats = {}
    t0 = time.time()
    # the model's vocabulary is padded (e.g. GPT-2's 50257 to 50304): a padding id has no text to
    # decode
    y = model.generate(
        x,
        cfg['max_new_tokens'],
        temperature=cfg['temperature'],
        top_k=cfg['top_k'] or None,
        use_cache=cfg['use_cache'],
        lengths=lengths,
        stats=stats,
        vocab_limit=meta['vocab_size'],
        speculate=cfg['speculate'],
        draft=draft and draft[0],
        draft_layers=draft and draft[1],
        draft_stop=cfg['draft_stop'],
        passes_per_graph=cfg['passes_per_graph'],
        compile=cfg['compile'],
    )
    dt = time.time() - t0
    for row in y:
        print(decode(row.tolist()))
        print('---------------')
    print(
        f"{len(y) * cfg['max_new_tokens'] / dt:,.0f} tokens/s ({dev}, "
        f"cache={cfg['use_cache']}, "
        f"{'compiled, ' if cfg['compile'] else ''}route={model.config.route})"
    )
    if 'full_frac' in stats:
        print(
            "realised full-path fraction per routed layer (mean over forwards): "
            + ' '.join(f"{f:.3f}" for f in stats['full_frac'])
            + (f" | TLOps saved {stats['tlops_saved']:.3f}" if 'tlops_saved' in stats else '')
        )
    if 'spec_accept_rate' in stats:
        depth = f", E={stats['spec_depth']}" if stats['spec_depth'] is not None else ''
        print(f"speculative decoding (draft {stats['spec_draft']!r}{depth}, K={cfg['speculate']}): "
              f"{stats['spec_tokens_per_pass']:.2f} tokens per verifier pass | kept per draft "
              f"position " + ' '.join('-' if r is None else f"{r:.2f}"
                                      for r in stats['spec_accept_rate'])
              + f" | draft {stats['spec_draft_s']:.2f} s, verify {stats['spec_verify_s']:.2f} s")
    return 0


if __name__ == '__main__':
    run_cli(main)
