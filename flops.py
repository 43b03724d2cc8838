"""
FLOPs accounting and device peaks.

Conventions (the same as torch.utils.flop_counter.FlopCounterMode, which the tests compare against):
a matmul of (m×k)·(k×n) costs 2·m·k·n; attention costs QKᵀ plus AV over the full T×T score matrix
(4·T²·d per layer and sequence; the causal half is not subtracted, as no kernel skips it exactly);
element-wise ops, norms, softmax and embedding lookups are not counted. A backward pass costs twice
its forward for every matmul whose weight and input both need gradients.

Each routing family's terms are hooks of its Family (forward_flops, backward_flops, oracle_flops, in
its route_*.py); this module keeps the dense model's, sums a family's into a training step and the
paper's proxy, and holds the device peaks and MFU.
"""
import os
import re
import sys

import torch

from lora import DEFAULT_TARGETS
from model import FAMILIES, controlled_layer_ids
from routing import LORA_MODES, adapters_of, flop_costs


def dense_forward_flops(config, T):
    """Forward FLOPs of the dense model on one sequence of length T (logits at every position)."""
    d, L, V = config.n_embd, config.n_layer, config.vocab_size
    per_layer = 2 * T * d * 3 * d + 4 * T * T * d + 2 * T * d * d + 2 * 2 * T * d * 4 * d
    return L * per_layer + 2 * T * d * V


# Dense (no structured sparsity) tensor-core peaks in FLOP/s from the vendors' datasheets, by device
# name fragment and dtype. 'float32' means plain FP32 unless TF32 matmuls are enabled (then 'tf32').
# The first matching fragment wins, so specific names come before general ones.
PEAK_FLOPS = [
    ('H100 PCIe', {'bfloat16': 756e12, 'float16': 756e12, 'tf32': 378e12, 'float32': 51.2e12}),
    # the NVL cards (PCIe, 350-600 W) clock lower than the SXM parts whose names they contain
    ('H100 NVL', {'bfloat16': 835.5e12, 'float16': 835.5e12, 'tf32': 417.5e12, 'float32': 60e12}),
    ('H200 NVL', {'bfloat16': 835.5e12, 'float16': 835.5e12, 'tf32': 417.5e12, 'float32': 60e12}),
    ('H100', {'bfloat16': 989.4e12, 'float16': 989.4e12, 'tf32': 494.7e12, 'float32': 66.9e12}),
    ('H200', {'bfloat16': 989.4e12, 'float16': 989.4e12, 'tf32': 494.7e12, 'float32': 66.9e12}),
    ('A100', {'bfloat16': 312e12, 'float16': 312e12, 'tf32': 156e12, 'float32': 19.5e12}),
    ('L4', {'bfloat16': 121e12, 'float16': 121e12, 'tf32': 60e12, 'float32': 30.3e12}),
    ('A10', {'bfloat16': 125e12, 'float16': 125e12, 'tf32': 62.5e12, 'float32': 31.2e12}),
    ('V100', {'float16': 125e12, 'float32': 15.7e12}),   # no bf16 tensor cores on V100
]


def peak_flops(device, dtype):
    """Peak FLOP/s of `device` (a torch.device or string) computing in `dtype` (str or torch.dtype),
    or None when unknown (every CPU, an unlisted GPU, or a dtype the GPU has no fast path for)."""
    device = torch.device(device)
    if device.type != 'cuda' or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    dt = str(dtype).replace('torch.', '')
    if dt == 'float32' and torch.backends.cuda.matmul.allow_tf32:
        dt = 'tf32'
    for fragment, table in PEAK_FLOPS:
        if re.search(rf'\b{re.escape(fragment)}\b', name):     # whole words: 'L4' is not 'L40S'
            return table.get(dt)
    return None


# --------------------------------------------------------------------------------------------------
# routed models: each family's analytic terms live in its file (Family.forward_flops,
# backward_flops, oracle_flops); these sum them for the family of config.route

def family_of(config):
    """The routing family of config, whose hooks hold its FLOPs terms."""
    return FAMILIES[config.route]


def forward_flops(config, T, mode='train', full_frac=None, **options):
    """Forward FLOPs of one sequence of length T.
    mode 'train': training forward, training-only heads included; no-grad passes beside it are
                  counted by oracle_flops.
    mode 'eval':  causal forward, masked-dense (every path on every token: the reference).
    mode 'policy': a no-grad pass under training decisions without loss heads (on-policy oracle).
    mode 'sparse': sparse execution at the realised fractions full_frac (a float or one per routed
                  layer), e.g. the full FFN on that fraction of the tokens and the cheap FFN on
                  the rest; path='compact' where it runs on that path (halt and exit then run no
                  block that no token runs).
    options: the family's step options (Family.step_options), and path. The terms: its
    forward_flops. Sparse execution on path='reference' computes every path on every row: it
    costs what 'eval' does, whatever the fractions."""
    if mode == 'sparse' and options.get('path') == 'reference':
        mode, full_frac = 'eval', None
    return family_of(config).forward_flops(config, T, mode, full_frac, **options)


def _last_layers_step_flops(config, T):
    """trainable='last_layers' on a dense model: the last k blocks train (k: the option
    Family.last_layers_option names), all 2x (their first op, ln_1, has trainable weights, so even
    the first c_attn needs its input gradient); the frozen (tied) LM head computes its input
    gradient only."""
    family = family_of(config)
    if family.routes:
        raise ValueError("trainable='last_layers' is the dense fine-tuning baseline (route='none')")
    c, k = flop_costs(config, T), getattr(config, family.last_layers_option)
    fwd = dense_forward_flops(config, T)
    layer = 2 * (c['attn_proj'] + c['full']) + 2 * c['attn_core']
    bwd = T * (k * layer + c['head'])
    return dict(forward=fwd, backward=bwd, oracle=0, total=fwd + bwd)


def lora_options(run):
    """train_step_flops' LoRA keywords from a training config (train.py's keys: a dict or a
    namespace; a key it lacks takes train.py's default)."""
    run = run if isinstance(run, dict) else vars(run)
    return {k: run.get(k, default) for k, default in LORA_DEFAULTS.items()}


def oracle_flops(config, T, **options):
    """No-grad FLOPs per sequence that a training step runs beside its forward and backward at these
    step options (the ffn family's oracle labels)."""
    return family_of(config).oracle_flops(config, T, **options)


LORA_DEFAULTS = dict(lora_rank=8, lora_targets=DEFAULT_TARGETS)     # train.py's


def train_step_flops(config, T, trainable='all', lora_rank=LORA_DEFAULTS['lora_rank'],
                     lora_targets=LORA_DEFAULTS['lora_targets'], **options):
    """FLOPs of one training step on one sequence: forward, backward and oracle passes, counted the
    way autograd runs them. trainable='all' (joint), 'controller' (frozen backbone: the backward
    computes activation gradients only, and nothing below the first router in the loss graph),
    'lora' or 'controller+lora' (frozen backbone with LoRA adapters of lora_rank on the block
    projections lora_targets names, as lora.apply_lora puts them: their matmuls, and the input
    gradients from the first one up) or 'last_layers' (the dense fine-tuning baseline). options:
    the family's step options."""
    if trainable == 'last_layers':
        return _last_layers_step_flops(config, T)
    family = family_of(config)
    fwd = family.forward_flops(config, T, 'train', **options)
    adapters = None
    if trainable in LORA_MODES:
        adapters = adapters_of(config, lora_rank, lora_targets)
        fwd += family.adapter_forward_flops(config, T, adapters, **options)
    bwd = family.backward_flops(config, T, trainable, adapters=adapters, **options)
    orc = family.oracle_flops(config, T, adapters=adapters, **options)
    return dict(forward=fwd, backward=bwd, oracle=orc, total=fwd + bwd + orc)


def flops_proxy(config, T, **options):
    """The paper's training FLOPs proxy of one step relative to a full-only step, reconstructed as
    (3 x training forward + oracle forwards) / (3 x dense forward): a step counts as three forwards
    whatever is frozen, and the oracle passes as forwards (they run without gradients)."""
    fwd = family_of(config).forward_flops(config, T, 'train', **options)
    return (3 * fwd + oracle_flops(config, T, **options)) / (3 * dense_forward_flops(config, T))


def flops_per_token(config, seq_len=None, training=True):
    """Analytic FLOPs per token of a training-mode forward (training=False) or a whole joint
    training step (True) at sequence length seq_len (default block_size), routing included."""
    T = seq_len or config.block_size
    if training:
        return train_step_flops(config, T)['total'] / T
    return forward_flops(config, T, mode='train') / T


def estimate_mfu(config, tokens_per_s, device, dtype, seq_len=None):
    """Model FLOPs utilisation against the peak of the device in use (None when unknown, e.g.
    CPU)."""
    peak = peak_flops(device, dtype)
    if peak is None:
        return None
    return flops_per_token(config, seq_len, training=True) * tokens_per_s / peak


def main(argv):
    """The training-FLOPs breakdown of a config (python flops.py CONFIG [--key=value ...]).
    route=ffn: for G1 and G3 with util/rank on and off, averaged over the uniformly sampled oracle
    layer; route=exit with a rotational curriculum: one row averaged over the R steps of its
    rotation; any other route: one row, the config as it is. A bench.py config's model is costed too
    (its own keys are inert here); a study file is refused with the command that costs one of its
    runs."""
    import json
    import os
    from dataclasses import fields, replace

    from bench import BENCH_DEFAULTS
    from configurator import ConfigError, asks_help, declared_defaults, load_config, print_help
    from model import GPTConfig
    if asks_help(argv):
        import train
        return print_help(main.__doc__, 'python flops.py [CONFIG.py] [--key=value ...] '
                          "(bench.py's keys are accepted and ignored)", train.help_groups())
    here = os.path.dirname(os.path.abspath(__file__))
    refuse_study_files(argv)
    # train.py's config keys, read from its source: train.py imports this module, so not the other
    # way
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    defaults.update(declared_defaults(os.path.join(here, 'train.py')), **BENCH_DEFAULTS)
    cfg = load_config(defaults, argv)
    vocab = cfg['vocab_size']
    meta = os.path.join(cfg['data_dir'] or os.path.join(here, 'data'), cfg['dataset'], 'meta.json')
    if not vocab and os.path.exists(meta):
        vocab = json.load(open(meta))['vocab_size']
    elif not vocab:     # the FLOPs of the LM head and embedding depend on it: say what was assumed
        vocab = 50304
        print(f"note: no {meta}: vocab_size taken as 50304 (GPT-2's, padded); prepare the data "
              f"(python data/prepare.py {cfg['dataset']}) or give --vocab_size", file=sys.stderr)
    try:
        model_fields = {f.name: cfg[f.name] for f in fields(GPTConfig)}
        base = GPTConfig(**{**model_fields, 'vocab_size': vocab})
    except ValueError as e:          # a bad model field: a UserError, as in train.model_config
        raise ConfigError(str(e)) from None
    T, dense = base.block_size, dense_forward_flops(base, base.block_size)
    ids = controlled_layer_ids(base)
    print(f"{argv[0] if argv else 'defaults'} (route {base.route}, vocab {vocab}, T={T}, "
          f"{len(ids)} controlled layers, trainable={cfg['trainable']})")
    print('| gate | util/rank | training forward / dense forward | oracle passes (dense forwards) '
          '| flops_proxy | exact step / dense joint step |')
    if base.route == 'ffn' and ids:
        # util/rank on: one oracle layer per step, uniformly sampled among the controlled layers
        # (none under trainable='draft', which freezes the gates the labels train)
        oracle = cfg['trainable'] != 'draft'
        variants = [(replace(base, ffn_gate=gate, ffn_util_weight=1.0 if on else 0.0,
                             ffn_rank_weight=1.0 if on else 0.0), 'G1' if gate == 'mlp' else 'G3',
                     'on' if on else 'off',
                     [dict(oracle_layers=(l,)) for l in ids] if on and oracle
                     else [dict(oracle_layers=())])
                    for gate in ('mlp', 'jepa') for on in (True, False)]
    elif base.route == 'exit' and base.exit_rotation > 0:
        # the rotational curriculum trains other exits at each of R steps in turn (train.py counts
        # each step at its own exits): the mean over R steps
        from train_checks import shape_only_model
        model = shape_only_model(base)
        variants = [(base, '—', '—', [family_of(base).step_options(model, step)
                                      for step in range(base.exit_rotation)])]
    else:     # no FFN gates to vary (another family, or the dense model): the config as it is
        variants = [(base, '—', '—', [{}])]
    for c, gate, util, option_sets in variants:
        avg = lambda f: sum(f(o) for o in option_sets) / len(option_sets)
        step = avg(lambda o: train_step_flops(c, T, cfg['trainable'], **lora_options(cfg),
                                              **o)['total'])
        print(f"| {gate} | {util} "
              f"| {avg(lambda o: forward_flops(c, T, mode='train', **o)) / dense:.3f} "
              f"| {avg(lambda o: oracle_flops(c, T, **o)) / dense:.3f} "
              f"| {avg(lambda o: flops_proxy(c, T, **o)):.3f} "
              f"| {step / (3 * dense):.3f} |")
    return 0


def refuse_study_files(argv):
    """A study file (sweep.py's: base, arms) is no train config: name the command that costs its
    reference arm's first run instead of an unknown-key error."""
    import shlex
    from configurator import ConfigError
    for arg in argv:
        if not (arg.endswith('.py') and os.path.isfile(arg)):
            continue
        ns = {}
        try:
            with open(arg) as f:
                exec(compile(f.read(), arg, 'exec'), ns)
        except Exception:        # load_config reports a broken file with its line
            continue
        if 'base' in ns and isinstance(ns.get('arms'), dict) and ns['arms']:
            arms = ns['arms']
            arm = ns.get('reference') if ns.get('reference') in arms else next(iter(arms))
            seed = str((ns.get('seeds') or [1])[0])
            run = [ns['base'], *ns.get('overrides', []), *arms[arm]]
            run = [a.replace('{seed}', seed) for a in run]
            raise ConfigError(f"{arg} is a study file (python sweep.py {arg}), not a train config; "
                              f"cost its arm {arm!r} with: python flops.py {shlex.join(run)}")


if __name__ == '__main__':
    from configurator import run_cli
    run_cli(main)
