"""
route='exit': early exits with deep supervision (auxiliary losses; LayerSkip, arXiv 2404.16710;
CALM, arXiv 2207.07061).

Exit heads after d blocks for d in exit_layers ('auto' {2, n/2, 3n/4}), sharing the final norm and
LM head (LayerSkip) or with their own norm and projection. Training: L = L_n + Σ_d α_d·L_d with
weights uniform, CALM's (∝ d), LayerSkip's (∝ Σ_{i≤l} i) or the plain mean over exits and the final
layer (TSA's baseline); a rotational curriculum trains only the exits with d % R == step % R;
LayerSkip's layer dropout skips whole blocks per sequence. Eval (CALM, causal per token): after
block d-1 a still-running token whose confidence (max softmax, top-1 − top-2 margin, or hidden-state
saturation) is >= exit_threshold exits; its state is copied upward unchanged and every higher layer
still computes its own K/V from that copy, so later tokens attend to it as to any token.

Options: ExitOptions below (fields of model.GPTConfig), and the model-wide layer_dropout.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import losses
from routing import (LAYERS_DRAFT, Family, block_backward, check_at_least, check_choices, exec_path,
                     first_blocks_logits, flop_costs, overridden, parse_layer_list, split_apply,
                     tlops_saved)


@dataclass
class ExitOptions:
    """The family's fields of model.GPTConfig (a base of it), with their defaults. LayerSkip's layer
    dropout is the model-wide layer_dropout: the dense model reads it too."""
    exit_layers: str = 'auto'         # exits after d blocks: 'auto' {2, n/2, 3n/4}, 'every'
                                      # (1..n-1), or '1,3'
    exit_head: str = 'shared'         # 'shared' final norm + LM head (LayerSkip), or 'own' norm +
                                      # projection
    exit_schedule: str = 'layerskip'  # exit-loss weights: 'uniform', 'calm' (∝ d), 'layerskip' (∝
                                      # Σ_{i≤d-1} i), or 'mean' (mean CE over exits and final layer:
                                      # TSA's baseline)
    exit_weight: float = 1.0          # Σ_d α_d (not used by 'mean')
    exit_rotation: int = 0            # rotational curriculum: only exits with d % R == step % R; 0
                                      # = all
    exit_conf: str = 'softmax'        # eval confidence: 'softmax' (max prob), 'margin' (top-1 −
                                      # top-2), 'saturation' (cosine of the hidden state to the
                                      # previous layer's)
    exit_threshold: float = 0.9       # a token exits at the first exit whose confidence ≥ this


class ExitHead(nn.Module):
    """An exit's own norm and projection to the vocabulary (exit_head='own')."""

    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x):
        return self.proj(self.ln(x))


@dataclass
class ExitState:
    """What an eval forward keeps for the family (RouteCtx.state): who exited, and with own exit
    heads the logits of the exit each token left at."""
    exited: torch.Tensor = None
    exit_out: torch.Tensor = None


class EarlyExit(Family):
    Options = ExitOptions
    reads = ('layer_dropout',)          # LayerSkip's, model-wide
    logged_stats = ('tlops_saved',)
    eval_stats = ('tlops_saved',)

    def check_values(self, config):
        check_at_least(config, 0, ('exit_weight', 'exit_rotation'))

    def validate(self, config):
        if config.n_layer < 2:
            raise ValueError("route='exit' needs n_layer >= 2 (an exit sits below the last layer)")
        check_choices(
            config,
            exit_head=('shared', 'own'),
            exit_schedule=('uniform', 'calm', 'layerskip', 'mean'),
            exit_conf=('softmax', 'margin', 'saturation'),
        )
        lowest = -1.0 if config.exit_conf == 'saturation' else 0.0    # a cosine, else probabilities
        if not config.exit_threshold >= lowest:
            raise ValueError(f"exit_threshold must be >= {lowest} for "
                             f"exit_conf={config.exit_conf!r} (its "
                             f"confidences lie in [{lowest}, 1]), got {config.exit_threshold}")
        exit_depths(config)

    def build(self, model):
        cfg = model.config
        model.exit_ids = exit_depths(cfg)
        model.exit_heads = (nn.ModuleDict({str(d): ExitHead(cfg) for d in model.exit_ids})
                            if cfg.exit_head == 'own' else None)

    def begin(self, model, ctx):
        # this step's exit losses
        if model.training and ctx.targets is not None and ctx.force is None:
            exits = ctx.options.get('exits')
            ctx.keep_hidden = set(model.exit_ids if exits is None else exits)

    def run_blocks(self, model, x, pos, cache, ctx, start=0):
        if model.training or ctx.force == 'full':
            return super().run_blocks(model, x, pos, cache, ctx, start)
        return run_exits(model, x, pos, cache, ctx)

    def logits(self, model, x, ctx, last):
        logits, state = super().logits(model, x, ctx, last), ctx.state
        if state is not None and state.exit_out is not None:    # own exit heads: the exit's logits
            logits = torch.where(last(state.exited)[..., None], last(state.exit_out), logits)
        return logits

    def loss(self, model, ctx, lm_loss, targets, aux):
        """L = L_n·w_n + Σ_d α_d·L_d over this step's exits (schedule 'mean': the plain mean of
        all)."""
        if not ctx.keep_hidden:
            return lm_loss
        cfg, hidden = model.config, ctx.hidden
        depths = sorted(hidden)
        w = losses.exit_loss_weights(depths, cfg.n_layer, cfg.exit_schedule, cfg.exit_weight)
        ce = [losses.lm_loss(exit_logits(model, d, hidden[d]), targets) for d in depths]
        aux['exit_loss'] = (
            sum(w[d] * c for d, c in zip(depths, ce)) if ce else lm_loss.new_zeros(())
        )
        if ce:
            aux['exit_ce'] = torch.stack(ce)
        return lm_loss * w[cfg.n_layer] + aux['exit_loss']

    def stats(self, model, ctx, aux):
        super().stats(model, ctx, aux)
        if ctx.masks:
            aux['tlops_saved'] = tlops_saved(aux['full_frac'], model.config.n_layer)

    def bench_knob(self, config):                 # a token exits where its confidence ≥ the
                                                  # threshold
        return ('exit_threshold', -1.0 if config.exit_conf == 'saturation' else 0.0, 1.0 + 1e-6)

    def is_controller_key(self, name):
        return name.startswith('exit_heads.')

    def step_options(self, model, step, run=None):
        """The exits whose losses count at training step `step`: all, or under the rotational
        curriculum (exit_rotation = R > 0) those with d % R == step % R."""
        R = model.config.exit_rotation
        return dict(
            exits=tuple(model.exit_ids)
            if R <= 0
            else tuple(d for d in model.exit_ids if d % R == step % R)
        )

    def drafts(self, config):
        return dict(exit="the first E blocks and exit E's head (LayerSkip); E one of the exits",
                    layers=LAYERS_DRAFT)

    def draft_depths(self, config, name):
        """The exit draft stops at an exit: by default the first at or above half the depth."""
        if name != 'exit':
            return super().draft_depths(config, name)
        ids = exit_depths(config)
        return ids, min([d for d in ids if d >= config.n_layer // 2] or ids[-1:])

    def draft_logits(self, model, name, idx, pos, cache, depth):
        if name != 'exit':
            return super().draft_logits(model, name, idx, pos, cache, depth)
        return first_blocks_logits(model, idx, pos, cache, depth,
                                   head=lambda x: exit_logits(model, depth, x))

    def ddp_find_unused(self, config):
        return config.exit_head == 'own' and config.exit_rotation > 0

    spelled_options = ('ffn_layers', 'exit_layers')
    resume_options = ('exit_layers', 'exit_head')

    def option_meaning(self, config, key):
        return exit_depths(config) if key == 'exit_layers' else super().option_meaning(config, key)

    references, by_class = ('full',), True

    def report(self, model, batches, autocast, evaluate):
        return dict(exit=exit_report(model, batches, autocast, evaluate))

    def report_lines(self, r):
        v = r['val_loss']
        lines = [
            f"val loss with early exit {v['loss']:.4f} (TLOps saved {v['tlops_saved']:.3f}) | no "
            "exit "
            f"{r['val_loss_full']:.4f} | each exit alone: "
            + ' '.join(f"d{d}:{l:.4f}" for d, l in r['exit']['per_exit_loss'].items())
        ]
        return lines + [
            f"  threshold {row['threshold']:.2f}: val loss {row['loss']:.4f}, TLOps saved "
            f"{row['tlops_saved']:.3f}"
            for row in r['exit']['thresholds']
        ]

    def forward_flops(self, config, T, mode='train', full_frac=None, exits=None, **options):
        """The dense body plus every exit head on every token ('eval'), the trained exits ('train',
        all unless `exits` names them), or ('sparse', full_frac one per layer = the fraction of
        tokens still running into block l) the FFN of block l and the head at d on the running
        tokens only. On the compact path (options path='compact'), once none runs (fraction 0),
        no block at all (Block.write_kv: with a KV cache each still projects the K/V, 2·d·3d per
        token, which this forward without one leaves out); on the static paths their attention."""
        c, L = flop_costs(config, T), config.n_layer
        all_exits = exit_depths(config)
        heads = all_exits if (mode != 'train' or exits is None) else exits
        total = T * c['head']
        for l in range(L):
            f = (
                (full_frac[l] if isinstance(full_frac, (list, tuple)) else full_frac)
                if mode == 'sparse'
                else 1.0
            )
            if not f and options.get('path') == 'compact':
                continue
            total += T * (c['attn_proj'] + c['attn_core'] + f * c['full'])
            if l + 1 in heads:
                total += f * T * c['head']
        return total

    def backward_flops(self, config, T, trainable='all', exits=None, adapters=None, **options):
        """Joint: twice the training forward. Controller-only: own exit heads only (the trainable
        norm before each projection makes it 2x); shared heads leave nothing to train. Under LoRA,
        the input gradients from the first adapter up, through every trained exit's head too."""
        if trainable == 'all':
            return 2 * self.forward_flops(config, T, 'train', exits=exits)
        c = flop_costs(config, T)
        trained = exit_depths(config) if exits is None else exits
        heads_train = config.exit_head == 'own' and trainable != 'lora'
        stream, total = False, 0
        for layer in range(config.n_layer):
            cost, stream = block_backward(config, layer, T, c['attn_core'], stream, 1, adapters)
            total += cost
            if layer + 1 in trained:
                total += T * c['head'] * (2 if heads_train else stream)
        return total + (T * c['head'] if stream else 0)


def exit_depths(config):
    """The depths d (exit after d blocks, 1 <= d < n_layer) that have an exit head."""
    L, spec = config.n_layer, str(config.exit_layers)
    if spec == 'auto':                 # {2, n/2, 3n/4}, kept below the last layer
        return sorted({d for d in (2, L // 2, (3 * L) // 4) if 1 <= d < L})
    if spec == 'every':
        return list(range(1, L))
    try:
        return parse_layer_list(spec, 1, L - 1, 'exit_layers')
    except ValueError:
        raise ValueError(
            f"exit_layers must be 'auto', 'every' or depths in 1..{L - 1} such as '1,3', got "
            f"{spec!r}"
        ) from None


def exit_logits(model, d, x):
    return (
        model.exit_heads[str(d)](x)
        if model.exit_heads is not None
        else model.lm_head(model.transformer.ln_f(x))
    )


def run_exits(model, x, pos, cache, ctx):
    """CALM-style early exit (see the module docstring). Sparse: the FFN and the exit heads run on
    the still-running tokens only (attention runs on all: their K/V are needed)."""
    cfg, state = model.config, ExitState()
    ctx.state = state
    done = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
    # eager sparse eval on the compact path, which syncs per layer anyway (free on the CPU; on a
    # GPU without a static path, one more sync per exit): once every token of the batch has
    # exited, the later blocks run only what later tokens read, the exited tokens' K/V
    idle_skips = ctx.sparse and exec_path(x, ctx.exec_mode) == 'compact'
    all_done = False
    for l, block in enumerate(model.transformer.h):
        running = ~done
        if all_done:                    # x would pass through torch.where(done, x, ·) unchanged
            block.write_kv(x, pos, cache)
            if ctx.collect:
                ctx.masks[l] = running
                if l + 1 in model.exit_ids:
                    ctx.margins[l + 1] = torch.full(x.shape[:2], -math.inf, device=x.device)
            continue
        x_before = x
        if ctx.sparse:
            y = x + block.attn_update(x, pos, cache)
            y = y + split_apply(block.ln_2(y), running, block.mlp, mode=ctx.exec_mode)
        else:
            y = block(x, pos, cache)
        x = torch.where(done[..., None], x, y)
        if ctx.collect:
            ctx.masks[l] = running
        d = l + 1
        if d not in model.exit_ids:
            continue
        head = lambda t: exit_logits(model, d, t)
        lg = split_apply(x, running, head, mode=ctx.exec_mode) if ctx.sparse else head(x)
        if cfg.exit_conf == 'saturation':
            conf = F.cosine_similarity(x.float(), x_before.float(), dim=-1)
        else:
            top = F.softmax(lg.float(), dim=-1).topk(2, dim=-1).values
            conf = top[..., 0] if cfg.exit_conf == 'softmax' else top[..., 0] - top[..., 1]
        newly = running & (conf >= cfg.exit_threshold)
        if ctx.collect:                 # block d runs for a token iff its test failed (never once
                                        # it has exited)
            ctx.margins[d] = torch.where(running, cfg.exit_threshold - conf, -math.inf).detach()
        if model.exit_heads is not None:
            state.exit_out = lg if state.exit_out is None else torch.where(newly[..., None], lg,
                                                                           state.exit_out)
        done = done | newly
        all_done = idle_skips and bool(done.all())
    state.exited = done
    return x


def exit_report(model, batches, autocast, evaluate, thresholds=(0.5, 0.7, 0.8, 0.9, 0.95, 0.99)):
    """route='exit': validation loss and TLOps saved of per-token early exit at several confidence
    thresholds (the model's exit_conf), beside the loss of each exit head read alone (every token
    leaving at that depth: the 'usable cheaper models' deep supervision promises)."""
    rows = []
    for thr in thresholds:
        with overridden(model.config, exit_threshold=thr):
            r = evaluate(model, batches, autocast)
        rows.append(
            dict(
                threshold=thr, loss=r['loss'], tlops_saved=r['tlops_saved'], running=r['full_frac']
            )
        )
    with model.mode(training=False):
        per_exit = {}
        with torch.no_grad():
            for d in model.exit_ids:
                vals = []
                for x, y in batches:
                    if not bool((y != -1).any()):      # no counted target: no loss (evaluate)
                        continue
                    with autocast:
                        h = model.embed(x)
                        for block in model.transformer.h[:d]:
                            h = block(h)
                        # the positions the LM loss counts (a task's targets -1 are not)
                        vals.append(float(losses.lm_loss(exit_logits(model, d, h), y)))
                per_exit[d] = float(np.mean(vals)) if vals else float('nan')
    return dict(thresholds=rows, per_exit_loss=per_exit)


FAMILY = EarlyExit()
