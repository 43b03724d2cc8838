"""
Self-speculative decoding timed beside plain decoding (bench.py --speculate=1,2,4,8).

    python bench.py --init_from=out/exit_shakespeare --speculate=1,2,4,8 --json
    python bench.py config/bench_cpu.py --route=exit --speculate=2,4 --draft=exit --json

The model is a trained run's (--init_from=<run folder> or its ckpt.pt: checkpoint.load_model),
or, without --init_from, a random one of the config's shape (its acceptance rates mean
nothing, its costs do); a model option given beside --init_from with a value the run does not
have is refused (the run is timed as trained). Per decode batch b (decode_batches) and K:
greedy decode (or, with --temperature=T > 0, sampling at T: a drafted token is kept with
probability min(1, p/q)) of decode_tokens = N tokens from b decode_prompt-token prompts (64
when 0), decode alone (generate of 1 + N tokens minus generate of 1, back to back in each
repeat: the prefill and the first token are not counted), median of bench_steps repeats after
bench_warmup (at least one), with the spread of each side and bench.py's NOISY flag; plain
decoding (model.generate) and each K take turns in every repeat. The prompts are windows of
the run's validation split where --init_from names a run whose data is prepared here (how
often a draft is kept depends on text like the model's own), else random tokens;
`prompt_source` says which. --compile=True compiles both sides' steps: plain decoding's decode
step and each pass's draft and verification (a CUDA graph each on a GPU; `compiled` in the
JSON). Most compiling (and CUDA-graph recording) falls in the warm-up rounds; a shape first
met late (the pass that enters a new cache bucket, a last short window) may be recorded in a
timed repeat, which the median mostly hides. plain_warmup_s and warmup_s: the seconds of each
side's warm-up rounds, compiling included (a cold compile of a chained variant can take
minutes on a GPU machine: size a run's time limit by them). Each decode batch's rows are
handed to bench.py as soon as they are timed, which prints them and writes them to
x.partial.json beside --out=x.json (complete: false), x.json itself once the last batch is
done.

Per row: plain and speculative tokens/s and ms, speedup = plain_ms / spec_ms (= spec tokens/s over
plain tokens/s), and, pooled over the timed decodes (bench.py's repeats: sampled decodes differ),
the share of rows that kept each draft position (accept_rate, position 1..K; None for a position
no pass drafted), tokens_per_pass (tokens per verifier pass and row, 1..K+1: the mean accepted
length plus the verifier's own), passes (verifier passes per decode, their mean), the draft/verify
split per pass, and the speedup Leviathan et al. ("Fast Inference from Transformers via
Speculative Decoding", arXiv 2211.17192) predict from the acceptance rate and the measured costs:

    alpha     = S / (S + 1 - r_K)     S = r_1 + .. + r_K, r_j = accept_rate[j]: the maximum-
                                      likelihood per-token acceptance if each draft is kept with
                                      probability alpha independently (passes kept S drafts and
                                      stopped early in a share 1 - r_K of them)
    predicted = (1 - alpha^(K+1)) / (1 - alpha) * plain_step / (K * draft_step + verify_pass)

with plain_step = plain_ms / N, draft_step = the draft's time per drafted token and verify_pass the
verifier's time per pass (its parallel forward and the acceptance rule), both measured by
speculative.generate. What the prediction leaves out (the bookkeeping between passes, the shorter
last pass) is the gap to the measured speedup. With --draft_stop > 0 (speculative.generate's
draft_stop) a pass drafts any number of tokens up to K, which the formula does not model: alpha
and predicted_speedup are None there.

With --one_graph=True each pass's draft and verification run as one function
(speculative.whole_pass; one graph a pass with --compile=True), timed whole: pass_ms, and no
draft/verify split or prediction (None); the passes apart wait between draft and verification
for their split, so the two differ by that wait too. --passes_per_graph=P > 1 (implies
--one_graph) chains P such passes in one function while the rows still need them
(speculative.generate's passes_per_graph: one graph and one host round trip for P passes with
--compile=True), timed likewise; a list (--passes_per_graph=1,2,4) times each in the same process,
a row per batch, K and P, against the same plain decode. calls: the pass functions a decode called
(host round trips; two a pass apart, one a pass whole, one for P chained), and pass_ms is over the
passes run (a chained pass after every row was done included).

With --profile=True, on CUDA, each side decodes once more under torch.profiler: plain_device_ms and
spec_device_ms are the GPU's busy time in a decode alone (its kernels' and copies' durations
summed), and *_device_share that time over the side's timed median; the rest of the decode's time
the GPU waited for the host (launches, syncs, Python). Elsewhere they are None.
"""
import json
import os
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

import train
from checkpoint import load_checkpoint, load_model
from configurator import ConfigError, given_keys
from data.loader import dataset_folder
from device import autocast_context, resolve_device_dtype
from model import FAMILIES, GPT, GPTConfig
import speculative

SPECULATE_DEFAULTS = dict(
    speculate='',           # comma-separated draft lengths K, e.g. 1,2,4,8 ('': no speculation)
    draft='',               # the family's draft to time ('': its default)
    draft_layers=0,         # where the draft has a depth: blocks it runs (0: its default)
    draft_stop=0.0,         # stop a pass's drafting below this draft probability (0: off)
    temperature=0.0,        # both sides sample at this temperature (0: greedy)
    one_graph=False,        # each pass's draft and verification as one function (one graph a
                            # pass with --compile; its draft/verify split is then not measured)
    passes_per_graph='1',   # P > 1: P whole passes chained in one function (implies one_graph);
                            # a list such as 1,4 times each
)


def positive_ints(cfg, key, what):
    """The integers >= 1 of a comma-separated option (--speculate=1,2,4,8); ConfigError naming
    `what` they must be otherwise."""
    try:
        values = [int(s) for s in str(cfg[key]).split(',') if s.strip()]
    except ValueError:
        values = [0]
    if not values or min(values) < 1 or max(values) >= 2**63:     # torch takes 64-bit sizes
        raise ConfigError(f"{key} must be {what}, got {cfg[key]!r}")
    return values


def draft_lengths(cfg):
    """The K of --speculate=1,2,4,8."""
    return positive_ints(cfg, 'speculate', "draft lengths K >= 1 such as '1,2,4,8'")


def chain_lengths(cfg):
    """The P of --passes_per_graph=1,4."""
    return positive_ints(cfg, 'passes_per_graph', "passes per function >= 1 such as '1' or '1,4' "
                         "(1: a pass at a time)")


def checkpoint_file(init_from):
    """The ckpt.pt of --init_from (a run folder or the file itself), or None for 'scratch'."""
    if init_from in ('', 'scratch'):
        return None
    path = os.path.join(init_from, 'ckpt.pt') if os.path.isdir(init_from) else init_from
    if not os.path.isfile(path):
        raise ConfigError(f"init_from={init_from}: no checkpoint at {path}; give a run folder "
                          "that holds ckpt.pt (--init_from=out/<run>) or leave it out for a random "
                          "model")
    return path


def prompt_tokens(cfg):
    return cfg['decode_prompt'] or 64


def check_options(cfg, argv):
    """Refuse, before any work, what --speculate cannot time: K < 1, another mode beside it, a draft
    or depth the family lacks, a model that cannot generate, or a prompt plus decode_tokens past the
    model's block_size. Returns the model config, or None without --speculate."""
    given = given_keys(argv)
    if not cfg['speculate']:
        for key in ('draft', 'draft_layers', 'draft_stop', 'temperature', 'one_graph',
                    'passes_per_graph'):
            if key in given:
                raise ConfigError(f"--{key} is an option of --speculate=K; add "
                                  f"--speculate=1,2,4,8 or drop --{key}")
        return None
    draft_lengths(cfg)
    for key in ('budgets', 'suite', 'decode_vs_hf'):
        if cfg[key]:
            raise ConfigError(f"--speculate times decoding alone; drop --{key} (or --speculate)")
    if not cfg['temperature'] >= 0:
        raise ConfigError(f"temperature must be >= 0 (0: greedy), got {cfg['temperature']}")
    if cfg['draft_layers'] < 0:
        raise ConfigError(f"draft_layers must be >= 0 (0: the draft's default), got "
                          f"{cfg['draft_layers']}")
    if not 0 <= cfg['draft_stop'] <= 1:         # also refuses NaN
        raise ConfigError(f"draft_stop must be in [0, 1] (0: off), got {cfg['draft_stop']}")
    chained = max(chain_lengths(cfg)) > 1
    whole = '--one_graph' if cfg['one_graph'] else '--passes_per_graph' if chained else None
    if whole and cfg['draft_stop']:
        raise ConfigError(f"{whole} drafts whole passes, --draft_stop a step at a time: "
                          "drop one of them")
    path = checkpoint_file(cfg['init_from'])
    trained = load_checkpoint(path, mmap=True)['model_args'] if path else None
    for key in sorted(given & set(trained or ())):
        if cfg[key] != trained[key]:    # the run's model is timed as trained: its own value holds
            raise ConfigError(f"--{key}={cfg[key]}: the run {cfg['init_from']} has "
                              f"{key}={trained[key]!r} and is timed as trained; drop --{key}")
    mcfg = (GPTConfig.from_dict(trained) if path
            else train.model_config(SimpleNamespace(**cfg), vocab_size=cfg['vocab_size'] or 50304))
    family = FAMILIES[mcfg.route]
    refusal = family.cannot_generate(mcfg)
    if refusal:
        raise ConfigError(refusal)
    try:
        speculative.resolve_draft(mcfg, family, cfg['draft'] or None, cfg['draft_layers'] or None)
    except ValueError as e:
        raise ConfigError(f"--draft/--draft_layers: {e}") from None
    K = max(draft_lengths(cfg))
    if K > mcfg.block_size:         # a pass drafts within block_size; its buffers grow with K
        raise ConfigError(f"speculate={cfg['speculate']}: K={K} exceeds the model's block_size="
                          f"{mcfg.block_size}; give draft lengths up to it")
    n = prompt_tokens(cfg)
    if n + 1 + cfg['decode_tokens'] > mcfg.block_size:
        raise ConfigError(f"a {n}-token prompt plus 1 + decode_tokens={cfg['decode_tokens']} "
                          f"exceeds the model's block_size={mcfg.block_size}; lower decode_tokens "
                          "or decode_prompt")
    return mcfg


def decode_prompts(run_cfg, vocab_size, b, n, g):
    """(b x n prompts, their source): seeded windows of the val.bin of the run whose config is
    run_cfg ({} without --init_from) when that run's data folder is here, else random tokens."""
    source = 'random tokens'
    if run_cfg.get('dataset'):
        folder = dataset_folder(SimpleNamespace(dataset=run_cfg['dataset'],
                                                data_dir=run_cfg.get('data_dir', '')))
        val, meta = os.path.join(folder, 'val.bin'), os.path.join(folder, 'meta.json')
        if os.path.isfile(val) and os.path.isfile(meta):
            with open(meta) as f:
                dtype = np.uint32 if json.load(f).get('dtype') == 'uint32' else np.uint16
            data = np.memmap(val, dtype=dtype, mode='r')
            starts = torch.randint(0, len(data) - n, (b,), generator=g).tolist()
            rows = np.stack([data[s:s + n].astype(np.int64) for s in starts])
            return torch.from_numpy(rows), f"{run_cfg['dataset']} val.bin"
        # (said where it is read: a trained draft agrees less on random tokens)
        source += f": no {val} or {meta} here (python data/prepare.py {run_cfg['dataset']})"
    return torch.randint(0, vocab_size, (b, n), generator=g), source


def load_bench_model(cfg, dev):
    """The trained model of --init_from, or a random one of the config's shape; eval mode."""
    path = checkpoint_file(cfg['init_from'])
    if path:
        return load_model(load_checkpoint(path), dev, path).eval()
    torch.manual_seed(cfg['seed'])
    mcfg = train.model_config(SimpleNamespace(**cfg), vocab_size=cfg['vocab_size'] or 50304)
    return GPT(mcfg).to(dev).eval()


def decode_timings(runs, N, cfg, dev, timed_from=lambda: None):
    """({name: bench.Timing of decode alone}, {name: seconds of its warm-up}) for runs
    {name: run(new)}: run(1 + N) minus run(1) (prefill and first token), every run back to back in
    each of bench_steps repeats after bench_warmup untimed rounds (at least one), so a slow spell of
    the machine hits them alike. A run's warm-up seconds are its untimed rounds', compiling and
    graph recording included. timed_from() is called between the two."""
    from bench import Timing, timed
    warmup = dict.fromkeys(runs, 0.0)
    for _ in range(max(1, cfg['bench_warmup'])):
        for name, run in runs.items():
            warmup[name] += timed(partial(run, 1 + N), 1, 0, dev) + timed(partial(run, 1), 1, 0,
                                                                              dev)
    timed_from()
    times = {name: [] for name in runs}
    for _ in range(max(1, cfg['bench_steps'])):
        for name, run in runs.items():
            long, short = timed(partial(run, 1 + N), 1, 0, dev), timed(partial(run, 1), 1, 0, dev)
            times[name].append(long - short)
    return {name: Timing(t) for name, t in times.items()}, warmup


def device_ms(run, new, dev):
    """The GPU's busy time (ms) over one call run(new): the durations of the kernels and copies
    torch.profiler records on CUDA summed (a CUDA graph's kernels each count), None off CUDA."""
    if dev.type != 'cuda':
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(new)
        speculative.sync(dev)
    # (a user annotation's span on the GPU is not work: torch's own tables leave it out too)
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3


def device_busy(run, N, dev):
    """The GPU's busy time (ms) in a decode of N tokens alone (run(1 + N) minus run(1), as timed),
    None off CUDA."""
    long, short = device_ms(run, 1 + N, dev), device_ms(run, 1, dev)
    return None if long is None else long - short


def speculative_run(model, prompt, K, draft, decodes, compile=False, temperature=0.0,
                    draft_stop=0.0, one_graph=False, passes_per_graph=1):
    """run(new): speculative generate of new tokens at temperature (0: greedy); a run of more than
    one token appends its figures to the list decodes."""
    def run(new):
        stats = {} if new > 1 else None
        # speculative.generate itself: model.generate(..., stats=) would also record the routing
        # statistics per token, which the plain run it is timed against does not
        speculative.generate(model, prompt, new, K, draft[0], draft[1], temperature=temperature,
                             stats=stats, compile=compile, draft_stop=draft_stop,
                             one_graph=one_graph, passes_per_graph=passes_per_graph)
        if stats is not None:
            decodes.append(stats)
    return run


def pooled(decodes):
    """The figures of several speculative decodes (their stats dicts) pooled: the acceptance per
    position and the tokens per pass from the summed counts, the draft/verify seconds and steps
    summed, passes per decode. Greedy decodes of one prompt all agree, so pooling changes nothing
    but the timing's noise; sampled ones differ, and one decode's figures would be few passes'."""
    total = {k: sum(d[k] for d in decodes) for k in (
        'spec_passes', 'spec_draft_steps', 'spec_draft_s', 'spec_verify_s', 'spec_made',
        'spec_row_passes', 'spec_passes_run', 'spec_calls')}
    total['spec_one_graph'] = decodes[0].get('spec_one_graph', False)
    total['spec_passes_per_graph'] = decodes[0].get('spec_passes_per_graph', 1)
    drafted = [sum(c) for c in zip(*(d['spec_drafted'] for d in decodes))]
    kept = [sum(c) for c in zip(*(d['spec_kept'] for d in decodes))]
    return dict(total, spec_draft=decodes[0]['spec_draft'], spec_depth=decodes[0]['spec_depth'],
                spec_draft_stop=decodes[0]['spec_draft_stop'], decodes=len(decodes),
                spec_accept_rate=[k / d if d else None for k, d in zip(kept, drafted)],
                spec_tokens_per_pass=total['spec_made'] / max(1, total['spec_row_passes']))


def predicted_speedup(accept_rate, plain_step_s, draft_pass_s, verify_pass_s):
    """(alpha, speedup) of the formula in the module docstring for a pass of K = len(accept_rate)
    drafts (as its cost is), alpha over the positions some pass drafted (an eager decode of few
    tokens may never draft the last ones: their rate is None)."""
    K = len(accept_rate)
    accept_rate = [r for r in accept_rate if r is not None]
    if not accept_rate:
        return 0.0, plain_step_s / max(draft_pass_s + verify_pass_s, 1e-12)
    kept, stopped = sum(accept_rate), 1 - accept_rate[-1]
    alpha = kept / (kept + stopped) if kept + stopped > 0 else 1.0
    tokens = K + 1 if alpha >= 1 else (1 - alpha ** (K + 1)) / (1 - alpha)
    return alpha, tokens * plain_step_s / max(draft_pass_s + verify_pass_s, 1e-12)


def nonzero(seconds):
    return seconds if seconds else 1e-12


def speculate_row(model, b, K, plain_s, spec_s, stats, N):
    """One row: batch b, draft length K; plain_s and spec_s the Timings of decoding N tokens, stats
    the timed decodes' figures pooled."""
    from bench import noise
    passes = max(1, stats['spec_passes_run'])      # (= spec_passes unless chained past the end)
    draft_pass, verify_pass = stats['spec_draft_s'] / passes, stats['spec_verify_s'] / passes
    rates = stats['spec_accept_rate'][:K]
    # the prediction's pass drafts all K: eager decodes draft fewer in their last passes
    draft_step = stats['spec_draft_s'] / max(1, stats['spec_draft_steps'])
    alpha, predicted = predicted_speedup(rates, plain_s / N, K * draft_step, verify_pass)
    if stats['spec_draft_stop']:    # passes of any length up to K: the formula does not hold
        alpha = predicted = None
    whole = stats['spec_one_graph']     # one function a pass: no draft/verify split measured
    return dict(
        route=model.config.route, batch=b, K=K, draft=stats['spec_draft'],
        draft_layers=stats['spec_depth'], draft_stop=stats['spec_draft_stop'],
        # no clamping: a median difference <= 0 (noise larger than the decode) shows as such,
        # flagged NOISY, and the ratios stay exactly each other's
        plain_tokens_per_s=b * N / nonzero(plain_s), spec_tokens_per_s=b * N / nonzero(spec_s),
        plain_ms=plain_s * 1e3, spec_ms=spec_s * 1e3, speedup=plain_s / nonzero(spec_s),
        accept_rate=rates, tokens_per_pass=stats['spec_tokens_per_pass'],
        mean_accepted=stats['spec_tokens_per_pass'] - 1,
        passes=stats['spec_passes'] / stats['decodes'],
        calls=stats['spec_calls'] / stats['decodes'],
        plain_ms_per_step=plain_s / N * 1e3, one_graph=whole,
        passes_per_graph=stats['spec_passes_per_graph'],
        pass_ms=(draft_pass + verify_pass) * 1e3,
        draft_ms_per_pass=None if whole else draft_pass * 1e3,
        verify_ms_per_pass=None if whole else verify_pass * 1e3,
        draft_share=None if whole else draft_pass / max(draft_pass + verify_pass, 1e-12),
        alpha=alpha, predicted_speedup=None if whole else predicted, **noise(plain_s, spec_s),
    )


def bench_speculative(cfg, batch_done=lambda res, rows: None, warmed_up=lambda: None):
    """Plain and speculative decode per decode batch and K (see the module docstring).
    batch_done(result so far, the batch's rows) is called as each decode batch's rows are done,
    the result marked complete=False while batches remain: a run stopped later keeps them (and
    one stopped after the last batch's, while it saves its compiled code, has its whole result).
    warmed_up() is called after each batch's warm-up rounds (everything compiled)."""
    dev, dt = resolve_device_dtype(SimpleNamespace(**cfg))
    autocast = autocast_context(dev, dt)
    model = load_bench_model(cfg, dev)
    draft = speculative.resolve_draft(model.config, model.family, cfg['draft'] or None,
                                      cfg['draft_layers'] or None)
    g = torch.Generator().manual_seed(cfg['seed'])
    path = checkpoint_file(cfg['init_from'])
    run_cfg = (load_checkpoint(path, mmap=True).get('config') or {}) if path else {}
    n, N = prompt_tokens(cfg), cfg['decode_tokens']
    rows, ks, ps = [], draft_lengths(cfg), chain_lengths(cfg)
    batches = [int(s) for s in str(cfg['decode_batches']).split(',') if s.strip()]
    for i, b in enumerate(batches):
        prompt, source = decode_prompts(run_cfg, model.config.vocab_size, b, n, g)
        prompt = prompt.to(dev)
        temp, decodes = cfg['temperature'], {(K, P): [] for K in ks for P in ps}
        runs = {0: partial(model.generate, prompt, temperature=temp, compile=cfg['compile']),
                **{(K, P): speculative_run(model, prompt, K, draft, decodes[K, P], cfg['compile'],
                                           temp, cfg['draft_stop'], cfg['one_graph'], P)
                   for K, P in decodes}}
        with autocast:      # the figures of the timed decodes only (no compiling, no warm-up)
            secs, warmup = decode_timings(
                runs, N, cfg, dev, lambda: [warmed_up(), *(d.clear() for d in decodes.values())])
        more = [dict(speculate_row(model, b, K, secs[0], secs[K, P], pooled(decodes[K, P]), N),
                     plain_warmup_s=warmup[0], warmup_s=warmup[K, P])
                for K, P in decodes]
        if cfg['profile']:          # once more a side, warm: how busy the GPU was
            with autocast:
                busy = {key: device_busy(run, N, dev) for key, run in runs.items()}
            for r in more:
                spec = r['K'], r['passes_per_graph']
                for side, key, ms in (('plain', 0, r['plain_ms']), ('spec', spec, r['spec_ms'])):
                    r[f'{side}_device_ms'] = busy[key]
                    r[f'{side}_device_share'] = None if busy[key] is None else busy[key] / ms
        rows += more
        batch_done(result(cfg, model, dev, dt, n, N, source, rows,
                          complete=i == len(batches) - 1), more)
    return result(cfg, model, dev, dt, n, N, source, rows, complete=True)


def result(cfg, model, dev, dt, n, N, source, rows, complete):
    """The JSON result of bench_speculative over rows; complete=False while batches remain."""
    return dict(
        kind='speculative', route=model.config.route, init_from=cfg['init_from'],
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu', dtype=dt,
        torch=torch.__version__, **train.code_version(), threads=torch.get_num_threads(),
        n_layer=model.config.n_layer, n_embd=model.config.n_embd,
        block_size=model.config.block_size, vocab_size=model.config.vocab_size,
        prompt_tokens=n, decode_tokens=N, repeats=max(1, cfg['bench_steps']),
        temperature=cfg['temperature'],
        timing=(f"{sampling(cfg['temperature'])}, decode alone (generate of 1 + N tokens minus "
                "generate of 1)"),
        prompt_source=source, compiled=bool(cfg['compile']), complete=complete, rows=list(rows),
    )


def sampling(temperature):
    """How both sides pick tokens, in words (the JSON's timing and the printed header)."""
    return f'sampled (temperature {temperature:g})' if temperature else 'greedy'


def split_ms(r):
    """The table's draft / verify ms per pass, or a pass's whole ms where it ran as one."""
    if r.get('one_graph'):
        chained = r.get('passes_per_graph', 1)
        return f"{r['pass_ms']:.1f} whole" + (f", {chained} a graph" if chained > 1 else '')
    return f"{r['draft_ms_per_pass']:.1f} / {r['verify_ms_per_pass']:.1f}"


def print_speculative(res):
    print_header(res)
    print_rows(res['rows'])
    print_footer(res)


def print_header(res):
    print(f"self-speculative decode, route={res['route']} {res['n_layer']}L d{res['n_embd']} "
          f"{res['dtype']} on {res['device']} ({res['threads']} threads), "
          f"{res['prompt_tokens']}-token prompts ({res['prompt_source']}), "
          f"{res['decode_tokens']} {sampling(res.get('temperature'))} tokens, decode alone"
          f"{', compiled steps' if res.get('compiled') else ''}")
    print('| batch | K | draft | plain tok/s | spec tok/s | speedup | predicted | tokens/pass '
          '| kept per position | draft / verify (or whole) ms per pass | spread plain / spec '
          '| warm-up s plain / spec |')
    print('|---|---|---|---|---|---|---|---|---|---|---|---|')


def print_rows(rows):
    for r in rows:
        depth = f" E={r['draft_layers']}" if r['draft_layers'] is not None else ''
        kept = ' '.join('-' if a is None else f'{a:.2f}' for a in r['accept_rate'])
        predicted = '-' if r['predicted_speedup'] is None else f"{r['predicted_speedup']:.2f}"
        print(f"| {r['batch']} | {r['K']} | {r['draft']}{depth} | {r['plain_tokens_per_s']:.1f} | "
              f"{r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f} | {predicted} "
              f"| {r['tokens_per_pass']:.2f} | {kept} "
              f"| {split_ms(r)} "
              f"| {r['spreads'][0]:.0%} / {r['spreads'][1]:.0%}{' NOISY' if r['noisy'] else ''} "
              f"| {r['plain_warmup_s']:.1f} / {r['warmup_s']:.1f} |", flush=True)


def print_footer(res):
    busy = [r for r in res['rows'] if 'spec_device_ms' in r]
    if any(r['spec_device_ms'] is None for r in busy):
        print('GPU busy: measured on CUDA only')
    for r in (r for r in busy if r['spec_device_ms'] is not None):
        chained = f", {r['passes_per_graph']} passes a graph" if r['passes_per_graph'] > 1 else ''
        print(f"GPU busy, batch {r['batch']}, K {r['K']}{chained}: " + '; '.join(
            f"{side} {r[f'{side}_device_ms']:.2f} of {r[f'{side}_ms']:.2f} ms "
            f"({r[f'{side}_device_share']:.0%})" for side in ('plain', 'spec')))
    from bench import noise_note
    print(noise_note(res['rows']))
