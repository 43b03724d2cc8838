"""
FLOPs accounting and device peaks.

Conventions (the same as torch.utils.flop_counter.FlopCounterMode, which the tests compare against):
a matmul of (m×k)·(k×n) costs 2·m·k·n; attention costs QKᵀ plus AV over the full T×T score matrix
(4·T²·d per layer and sequence; the causal half is not subtracted, as no kernel skips it exactly);
element-wise ops, norms, softmax and embedding lookups are not counted. A backward pass costs twice
its forward for every matmul whose weight and input both need gradients.
"""
import re

import torch

from gates import capacity
from model import controlled_layer_ids
from route_exit import exit_depths


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


# ----------------------------------------------------------------------------------------------------
# routed models (route='ffn'): forward and training-step FLOPs for a given realised routing

def _costs(config, T):
    """Forward FLOPs per token of each piece of a layer (attention core counted at length T)."""
    d, gh, lat = config.n_embd, config.gate_hidden, config.jepa_latent
    return dict(
        attn_proj=2 * d * 3 * d + 2 * d * d, attn_core=4 * T * d, full=2 * 2 * d * 4 * d,
        cheap=2 * 2 * d * config.cheap_rank, head=2 * d * config.vocab_size,
        halt_fc=2 * d * max(16, d // 4), halt_out=2 * max(16, d // 4),
        gate_fc=2 * d * gh, gate_out=2 * gh * (lat if config.gate == 'jepa' else 1),
        gate_read=2 * lat if (config.gate == 'jepa' and config.jepa_readout == 'linear') else 0,
        jepa_target=2 * d * lat, pred_fc=2 * d * gh, pred_out=2 * gh)


def _gate_kind(config, layer):
    if layer not in controlled_layer_ids(config):
        return None
    return config.gate


def forward_flops(config, T, mode='train', full_frac=None, exits=None):
    """Forward FLOPs of one sequence of length T.
    mode 'train': training forward, both paths dense and mixed by the mask, plus training-only heads
                  (JEPA targets, membership predictor); oracle passes are counted by oracle_flops.
    mode 'eval':  causal forward with both paths dense (the masked reference).
    mode 'policy': a no-grad pass under training decisions without loss heads (on-policy oracle).
    mode 'sparse': the full FFN only on a fraction full_frac (a float or one per controlled layer)
                  of the tokens and the cheap FFN on the rest, as sparse execution does.
    route 'mod', 'exit', 'ensemble': see family_forward_flops (exits: the exit depths trained)."""
    if config.route in ('mod', 'exit', 'ensemble'):
        return family_forward_flops(config, T, mode, full_frac, exits)
    c, L = _costs(config, T), config.n_layer
    total = c['head']
    ctrl_i = 0
    for layer in range(L):
        total += c['attn_proj'] + c['attn_core']
        if config.route == 'halt' and layer > 0:      # TSA: the router before it; sparse skips the FFN
            total += c['halt_fc'] + c['halt_out']
            if mode == 'sparse':
                f = full_frac[layer - 1] if isinstance(full_frac, (list, tuple)) else full_frac
                total += f * c['full']
                continue
        kind = _gate_kind(config, layer)
        if kind is None or kind == 'static_full':
            total += c['full']
            continue
        if kind == 'static_cheap':
            total += c['cheap']
            continue
        if mode == 'sparse':
            f = full_frac[ctrl_i] if isinstance(full_frac, (list, tuple)) else full_frac
            total += f * c['full'] + (1 - f) * c['cheap']
        else:
            total += c['full'] + c['cheap']
        ctrl_i += 1
        if kind in ('mlp', 'jepa'):
            n_out = 2 if kind == 'jepa' else 1            # JEPA forecasts both actions
            total += c['gate_fc'] + n_out * c['gate_out'] + c['gate_read']
            if kind == 'jepa' and mode == 'train' and config.jepa_weight > 0:
                total += 2 * c['jepa_target']
            if config.infer_rule == 'predictor' and (mode in ('eval', 'sparse') or
                                                     (mode == 'train' and config.predictor_weight > 0)):
                total += c['pred_fc'] + c['pred_out']
        elif kind == 'oracle':        # both actions again, then two all-full suffixes, per layer
            total += c['full'] + c['cheap'] + 2 * _suffix(config, layer, c)
    return T * total


def _frac(full_frac, i):
    return full_frac[i] if isinstance(full_frac, (list, tuple)) else full_frac


def family_forward_flops(config, T, mode='train', full_frac=None, exits=None):
    """Forward FLOPs of one sequence for route 'mod', 'exit' and 'ensemble' (modes as forward_flops).
    mod:      a routed layer costs its router on every token, then the whole block on n tokens with
              attention among them (4·n²·d): n = ceil(budget·T) in training, T masked-dense ('eval'),
              and in 'sparse' n = full_frac·T per routed layer, where full_frac is the padded row
              length over T (sparse execution pads every row to the longest).
    exit:     the dense body plus every exit head on every token ('eval'), the trained exits
              ('train', all unless `exits` names them), or ('sparse', full_frac one per layer = the
              fraction of tokens still running into block l) the FFN of block l and the head at d on
              the running tokens only.
    ensemble: the dense body, k late-layer heads and the router (and in training, with a KL weight,
              the teacher's head)."""
    c, L, d = _costs(config, T), config.n_layer, config.n_embd
    attn = c['attn_proj'] + c['attn_core']
    total = T * c['head']
    if config.route == 'mod':
        ids, router = controlled_layer_ids(config), config.gate == 'mlp'
        for l in range(L):
            if l not in ids:
                total += T * (attn + c['full'])
                continue
            n = capacity(config.budget, T) if mode in ('train', 'policy') else \
                _frac(full_frac, ids.index(l)) * T if mode == 'sparse' else T
            total += T * 2 * d * router + n * (c['attn_proj'] + c['full']) + 4 * n * n * d
            if router and config.infer_rule == 'predictor' and (mode != 'train' or config.predictor_weight > 0):
                total += T * (c['pred_fc'] + c['pred_out'])
        return total
    if config.route == 'exit':
        all_exits = exit_depths(config)
        heads = all_exits if (mode != 'train' or exits is None) else exits
        for l in range(L):
            f = _frac(full_frac, l) if mode == 'sparse' else 1.0
            total += T * (attn + f * c['full'])
            if l + 1 in heads:
                total += f * T * c['head']
        return total
    k = config.ens_layers
    teacher = mode == 'train' and config.ens_kl_weight > 0
    return total + T * (L * (attn + c['full']) + (k - 1 + teacher) * c['head'] + 2 * d * k)


def family_train_step_flops(config, T, trainable='all', exits=None):
    """Backward FLOPs of one training step (one sequence) for 'mod', 'exit', 'ensemble', counted the
    way autograd runs them: a matmul costs 2x its forward when its input and weight both need
    gradients, 1x when only one does. trainable 'all' or 'controller' (routers / own exit heads /
    ensemble norms and router, on a frozen backbone)."""
    c, L, d = _costs(config, T), config.n_layer, config.n_embd
    joint = trainable == 'all'
    w = 2 if joint else 1
    if config.route == 'mod':
        ids, router = controlled_layer_ids(config), config.gate == 'mlp'
        stream, bwd = joint, 0
        for l in range(L):
            n = capacity(config.budget, T) if l in ids else T
            if stream:                  # the block (on its n tokens) needs input grads at least
                bwd += n * w * (c['attn_proj'] + c['full']) + 2 * 4 * n * n * d
            if l in ids and router:     # r = wᵀx: weight grad, and input grad once x needs one
                bwd += T * 2 * d * (2 if stream else 1)
                if config.infer_rule == 'predictor' and config.predictor_weight > 0:
                    bwd += T * (c['pred_fc'] + 2 * c['pred_out'])      # its input is detached
                stream = True           # σ(r) multiplies the update from here on
        return bwd + (T * w * c['head'] if stream else 0)
    if config.route == 'exit':
        trained = exit_depths(config) if exits is None else exits
        if joint:
            return 2 * family_forward_flops(config, T, 'train', exits=exits)
        # own heads only: the trainable norm before each projection makes it 2x
        return 2 * len(trained) * T * c['head'] if config.exit_head == 'own' else 0
    k = config.ens_layers                # ensemble: the router's input is detached (weight grad only)
    if joint:
        return 2 * T * (L * (c['attn_proj'] + c['attn_core'] + c['full']) + k * c['head']) + T * 2 * d * k
    return T * k * c['head'] + T * 2 * d * k        # frozen head, trainable norms before it: input grads


def _last_layers_step_flops(config, T):
    """trainable='last_layers' on a dense model: the last k = ens_layers blocks train, all 2x (their
    first op, ln_1, has trainable weights, so even the first c_attn needs its input gradient); the
    frozen (tied) LM head computes its input gradient only."""
    if config.route != 'none':
        raise ValueError("trainable='last_layers' is the dense fine-tuning baseline (route='none')")
    c, k = _costs(config, T), config.ens_layers
    fwd = dense_forward_flops(config, T)
    layer = 2 * (c['attn_proj'] + c['full']) + 2 * c['attn_core']
    bwd = T * (k * layer + c['head'])
    return dict(forward=fwd, backward=bwd, oracle=0, total=fwd + bwd)


def _suffix(config, l, c):
    """Per-token FLOPs of layers l+1.. all full, plus the LM head."""
    return (config.n_layer - 1 - l) * (c['attn_proj'] + c['attn_core'] + c['full']) + c['head']


def oracle_flops(config, T, layers):
    """No-grad FLOPs per sequence of the oracle labels at the sampled controlled layers.
    Off-policy: one all-full forward, then per layer the cheap FFN at l and an all-full suffix.
    On-policy: per layer, both actions at l and two suffixes routed by the gates (masked dense)."""
    if not layers:
        return 0
    c = _costs(config, T)
    if config.oracle_policy == 'off':
        return dense_forward_flops(config, T) + T * sum(c['cheap'] + _suffix(config, l, c) for l in layers)
    per_layer_train = [0] * config.n_layer
    for layer in range(config.n_layer):
        one = forward_flops(_single_layer(config, layer), T, mode='policy') / T
        per_layer_train[layer] = one
    total = 0
    for l in layers:
        suffix = sum(per_layer_train[l + 1:]) + c['head']
        total += c['full'] + c['cheap'] + 2 * suffix
    return T * total


def _single_layer(config, layer):
    """A copy of config reduced to layer `layer` alone, with the head zeroed (for per-layer costs)."""
    from dataclasses import replace
    routed = layer in controlled_layer_ids(config)
    return replace(config, n_layer=1, vocab_size=0, controlled_layers='0' if routed else 'all',
                   route=config.route if routed else 'none')


def train_step_flops(config, T, trainable='all', oracle_layers=(), exits=None):
    """FLOPs of one training step on one sequence: forward, backward and oracle passes, counted the
    way autograd runs them. trainable='all' (joint) or 'controller' (frozen backbone: the backward
    computes activation gradients only, and nothing below the first gate in the LM-loss graph).
    exits: route='exit', the exit depths trained this step (None = all)."""
    if trainable == 'last_layers':
        return _last_layers_step_flops(config, T)
    if config.route in ('mod', 'exit', 'ensemble'):
        fwd = family_forward_flops(config, T, 'train', exits=exits)
        bwd = family_train_step_flops(config, T, trainable, exits)
        return dict(forward=fwd, backward=bwd, oracle=0, total=fwd + bwd)
    c, L = _costs(config, T), config.n_layer
    fwd = forward_flops(config, T, mode='train')
    joint = trainable == 'all'
    aux_on_score = config.util_weight > 0 or config.rank_weight > 0
    stream = joint                      # does the residual stream entering this layer need a gradient?
    bwd = 0
    for layer in range(L):
        kind = _gate_kind(config, layer)
        w = 2 if joint else 1           # backbone matmuls: input grad (+ weight grad when trainable)
        if config.route == 'halt' and layer > 0:      # TSA: x + keep·Δattn(x), then + keep·Δffn(·)
            bwd += (2 if stream else 1) * c['halt_fc'] + 2 * c['halt_out']      # the router is trainable
            if stream:                  # Δattn reads x: a gradient only if x already needs one
                bwd += w * c['attn_proj'] + 2 * c['attn_core']
            bwd += w * c['full']        # the FFN reads x + keep·Δattn, which depends on trainable p
            stream = True
            continue
        if stream:
            bwd += w * c['attn_proj'] + 2 * c['attn_core']
        if kind in (None, 'static_full'):
            bwd += w * c['full'] if stream else 0
            continue
        if kind == 'static_cheap':
            bwd += w * c['cheap'] if stream else 0
            continue
        if stream:
            bwd += w * (c['full'] + c['cheap'])
        if kind not in ('mlp', 'jepa'):
            continue
        score_in_graph = config.gate_grad != 'none' or (aux_on_score and layer in oracle_layers)
        preds_in_graph = score_in_graph or (kind == 'jepa' and config.jepa_weight > 0)
        n_out = 2 if kind == 'jepa' else 1
        if preds_in_graph:              # gate weights always trainable; its input needs grad only if the stream does
            bwd += (2 if stream else 1) * c['gate_fc'] + 2 * n_out * c['gate_out']
        if score_in_graph:
            bwd += 2 * c['gate_read']
        if config.infer_rule == 'predictor' and config.predictor_weight > 0:
            bwd += c['pred_fc'] + 2 * c['pred_out']        # its input is detached
        if config.gate_grad != 'none':
            stream = True               # the mixed update now depends on trainable gate weights
    if stream:
        bwd += (2 if joint else 1) * c['head']
    bwd *= T
    orc = oracle_flops(config, T, oracle_layers)
    return dict(forward=fwd, backward=bwd, oracle=orc, total=fwd + bwd + orc)


def flops_proxy(config, T, oracle_layers=(), exits=None):
    """The paper's training FLOPs proxy of one step relative to a full-only step, reconstructed as
    (3 x training forward + oracle forwards) / (3 x dense forward): a step counts as three forwards
    whatever is frozen, and the oracle passes as forwards (they run without gradients)."""
    return (3 * forward_flops(config, T, mode='train', exits=exits) + oracle_flops(config, T, oracle_layers)) / \
        (3 * dense_forward_flops(config, T))


def flops_per_token(config, seq_len=None, training=True):
    """Analytic FLOPs per token of a training-mode forward (training=False) or a whole joint
    training step (True) at sequence length seq_len (default block_size), routing included."""
    T = seq_len or config.block_size
    if training:
        return train_step_flops(config, T)['total'] / T
    return forward_flops(config, T, mode='train') / T


def estimate_mfu(config, tokens_per_s, device, dtype, seq_len=None):
    """Model FLOPs utilisation against the peak of the device in use (None when unknown, e.g. CPU)."""
    peak = peak_flops(device, dtype)
    if peak is None:
        return None
    return flops_per_token(config, seq_len, training=True) * tokens_per_s / peak


def main(argv):
    """python flops.py CONFIG [--key=value ...]: the training-FLOPs breakdown of a routed config, for G1
    and G3 with util/rank on and off, averaged over the uniformly sampled oracle layer."""
    import json
    import os
    from dataclasses import fields, replace

    from configurator import ConfigError, declared_defaults, load_config
    from model import GPTConfig
    here = os.path.dirname(os.path.abspath(__file__))
    # train.py's config keys, read from its source: train.py imports this module, so not the other way
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    defaults.update(declared_defaults(os.path.join(here, 'train.py')))
    cfg = load_config(defaults, argv)
    vocab = cfg['vocab_size']
    meta = os.path.join(cfg['data_dir'] or os.path.join(here, 'data'), cfg['dataset'], 'meta.json')
    if not vocab:
        vocab = json.load(open(meta))['vocab_size'] if os.path.exists(meta) else 50304
    try:
        base = GPTConfig(**{**{f.name: cfg[f.name] for f in fields(GPTConfig)}, 'vocab_size': vocab})
    except ValueError as e:          # a bad model field: a UserError, as in train.model_config
        raise ConfigError(str(e)) from None
    T, dense = base.block_size, dense_forward_flops(base, base.block_size)
    ids = controlled_layer_ids(base)
    print(f"{argv[0] if argv else 'defaults'} (vocab {vocab}, T={T}, {len(ids)} controlled layers, "
          f"trainable={cfg['trainable']})")
    print('| gate | util/rank | training forward / dense forward | oracle passes (dense forwards) '
          '| flops_proxy | exact step / dense joint step |')
    for gate in ('mlp', 'jepa'):
        for on in (True, False):
            c = replace(base, gate=gate, util_weight=1.0 if on else 0.0, rank_weight=1.0 if on else 0.0)
            layer_sets = [(l,) for l in ids] if on else [()]
            avg = lambda f: sum(f(ls) for ls in layer_sets) / len(layer_sets)
            print(f"| {'G1' if gate == 'mlp' else 'G3'} | {'on' if on else 'off'} "
                  f"| {forward_flops(c, T, mode='train') / dense:.3f} "
                  f"| {avg(lambda ls: oracle_flops(c, T, ls)) / dense:.3f} "
                  f"| {avg(lambda ls: flops_proxy(c, T, ls)):.3f} "
                  f"| {avg(lambda ls: train_step_flops(c, T, cfg['trainable'], ls)['total']) / (3 * dense):.3f} |")
    return 0


if __name__ == '__main__':
    import sys
    sys.exit(main(sys.argv[1:]))
