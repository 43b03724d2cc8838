"""
route='halt': Token-Selective Attention ("Adaptive Computation Depth via Learned Token Routing in
Transformers", arXiv 2605.05222).

Block 0 is a stem that always runs. A router after each block l = 0..L−2 gives p_l = r_l(h) in (0,
1), the probability of skipping block l+1, which then adds (1 − p_l)·Δattn and (1 − p_l)·Δffn. The
LM gradient reaches the router through that product; a depth regulariser λ·mean(1 − p) (the mean
active fraction α) pushes towards skipping. Eval (hard, causal per token): a token skips both
updates where p_l > halt_tau; kept tokens add (1 − p_l)·Δ as in training ('scaled') or the whole Δ
('binary'). A skipped token's K/V are still computed, so later tokens attend to it as in training;
sparse eval runs the FFN on the kept tokens only. force='full' keeps every update whole (the dense
model).

Options: HaltOptions below (fields of model.GPTConfig).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from gates import HaltingRouter
from routing import (LAYERS_DRAFT, Family, RouteCtx, add_weighted, attention_backward,
                     check_at_least, exec_path, flop_costs, mlp_backward, overridden, split_apply,
                     tlops_saved)


@dataclass
class HaltOptions:
    """The family's fields of model.GPTConfig (a base of it), with their defaults."""
    halt_lambda: float = 0.001        # depth regulariser λ on the mean active fraction
    halt_tau: float = 0.5             # eval: a token skips block l+1 where p_l > halt_tau
    halt_soft_eval: bool = False      # eval with the soft (1 − p) scaling instead of hard skipping
    halt_hard: str = 'scaled'         # hard eval: kept tokens add (1 − p)·Δ as in training, or
                                      # 'binary': Δ
    halt_router_bias: float = -1.0    # the routers' output bias at init (the paper's −1: p ≈ 0.27,
                                      # α ≈ 0.73)


class TokenSelectiveAttention(Family):
    Options = HaltOptions
    logged_stats = ('tlops_saved', 'alpha')
    eval_stats = ('tlops_saved',)

    def check_values(self, config):
        check_at_least(config, 0, ('halt_lambda',))

    def validate(self, config):
        if config.n_layer < 2:
            raise ValueError(
                "route='halt' needs n_layer >= 2 (block 0 is the stem that always runs)"
            )
        if not 0.0 <= config.halt_tau <= 1.0:
            raise ValueError(f"halt_tau must be in [0, 1], got {config.halt_tau}")
        if config.halt_hard not in ('scaled', 'binary'):
            raise ValueError(f"halt_hard must be 'scaled' or 'binary', got {config.halt_hard!r}")

    def build(self, model):
        # router l (after block l, l = 0..L-2) gates block l+1
        model.halt = nn.ModuleList(
            [HaltingRouter(model.config.n_embd) for _ in range(model.config.n_layer - 1)]
        )

    def init_weights(self, model):
        for router in model.halt:       # b2 (after the generic init): at −1 blocks start mostly on
            nn.init.constant_(router.out.bias, model.config.halt_router_bias)

    def run_blocks(self, model, x, pos, cache, ctx, start=0, depth=None):
        """depth E (the halt draft of speculative decoding): every token halts after block E−1."""
        cfg, blocks = model.config, model.transformer.h
        hard = not model.training and ctx.force != 'full' and not cfg.halt_soft_eval
        # eager sparse eval on the compact path, which syncs per layer anyway (free on the CPU; on
        # a GPU without a static path, one more sync per layer): a block that every token skips
        # runs only what later tokens read, the skipped tokens' K/V
        idle_skips = hard and ctx.sparse and exec_path(x, ctx.exec_mode) == 'compact'
        x = blocks[0](x, pos, cache)
        for l, router in enumerate(model.halt[:(depth or cfg.n_layer) - 1]):
            p = router(x)
            if ctx.force == 'full':
                keep = active = torch.ones_like(p)
            elif model.training or cfg.halt_soft_eval:
                keep = active = 1 - p
            else:                       # skip where p > τ; kept tokens as trained ('scaled') or
                                        # whole
                active = (p <= cfg.halt_tau).to(p.dtype)
                if ctx.collect:
                    ctx.margins[l + 1] = (cfg.halt_tau - p).detach()
                keep = active * (1 - p) if cfg.halt_hard == 'scaled' else active
            block = blocks[l + 1]
            if idle_skips and not bool(active.any()):   # x + 0·Δ would be x, exactly
                block.write_kv(x, pos, cache)
            else:
                x = x + keep[..., None] * block.attn_update(x, pos, cache)
                if hard and ctx.sparse:                  # the FFN on kept tokens only
                    x = x + keep[..., None] * split_apply(
                        block.ln_2(x), active > 0, block.mlp, mode=ctx.exec_mode
                    )
                else:
                    x = x + keep[..., None] * block.ffn_update(x)
            if ctx.collect:             # α's per-token share: 1 − p (soft) or not-skipped (hard)
                ctx.masks[l + 1] = active.detach()
                ctx.add('halt_active', (1 - p).mean() / len(model.halt))    # α of the soft router
        return x

    def drafts(self, config):
        return dict(halt="the first E blocks under the trained halting, then every token halted",
                    layers=LAYERS_DRAFT)

    def draft_logits(self, model, name, idx, pos, cache, depth):
        if name != 'halt':
            return super().draft_logits(model, name, idx, pos, cache, depth)
        ctx = RouteCtx(collect=False)
        x = self.run_blocks(model, model.embed(idx, pos), pos, cache, ctx, depth=depth)
        return model.lm_head(model.transformer.ln_f(x))

    def loss(self, model, ctx, lm_loss, targets, aux):
        if 'halt_active' in aux:        # the depth regulariser: λ · mean active fraction
            aux['depth_loss'] = aux['halt_active']
        return add_weighted(lm_loss, aux, dict(depth_loss=model.config.halt_lambda))

    def stats(self, model, ctx, aux):
        super().stats(model, ctx, aux)
        if ctx.masks:
            aux['tlops_saved'] = tlops_saved(aux['full_frac'], model.config.n_layer)
            aux['alpha'] = aux['full_frac'].mean()      # TSA's mean active fraction α

    def is_controller_key(self, name):
        return name.startswith('halt.')

    def bench_knob(self, config):                 # a token skips where p > τ (soft eval skips none)
        return None if config.halt_soft_eval else ('halt_tau', 0.0, 1.0)

    def report(self, model, batches, autocast, evaluate):
        return dict(halt=halt_report(model, batches, autocast, evaluate))

    def report_lines(self, r):
        soft = r['halt']['soft']
        lines = [f"val loss soft-gated {soft['loss']:.4f} (α {soft['alpha']:.3f}, TLOps saved "
                 f"{soft['tlops_saved']:.3f}); hard skipping where p > τ:"]
        return lines + [
            f"  {row['mode']:>6} τ={row['tau']:.2f}: val loss {row['loss']:.4f}, α "
            f"{row['alpha']:.3f}, "
            f"TLOps saved {row['tlops_saved']:.3f}"
            for row in r['halt']['hard']
        ]

    def forward_flops(self, config, T, mode='train', full_frac=None, **options):
        """Every block's attention; the router before blocks 1..L−1; sparse eval runs block l's FFN
        on the kept fraction full_frac (a float, or one per gated block) of the tokens only. On
        the compact path (options path='compact') a block no token keeps (fraction 0) runs not at
        all (Block.write_kv: with a KV cache it still projects the K/V, 2·d·3d per token, which
        this forward without one leaves out); on the static paths it runs its attention. Soft
        eval (halt_soft_eval) skips nothing: its fractions are soft shares, every block runs whole.
        """
        c, L = flop_costs(config, T), config.n_layer
        if mode == 'sparse' and config.halt_soft_eval:
            mode = 'eval'
        idle_free = mode == 'sparse' and options.get('path') == 'compact'
        router = halt_router_flops(config)
        total = c['head']
        for layer in range(L):
            f = 1.0
            if layer > 0:
                total += router
                if mode == 'sparse':
                    f = full_frac[layer - 1] if isinstance(full_frac, (list, tuple)) else full_frac
            total += (c['attn_proj'] + c['attn_core'] + f * c['full']) if f or not idle_free else 0
        return T * total

    def backward_flops(self, config, T, trainable='all', adapters=None, **options):
        """x + keep·Δattn(x), then + keep·Δffn(·): where the routers train, from router 0 on the
        stream needs a gradient even on a frozen backbone. Under LoRA, from the first adapter on
        too, and the routers train only under 'controller+lora'."""
        c, L = flop_costs(config, T), config.n_layer
        hidden = max(16, config.n_embd // 4)
        fc, out = 2 * config.n_embd * hidden, 2 * hidden        # the router's two layers
        joint = trainable == 'all'
        w = 2 if joint else 1           # backbone matmuls: input grad (+ weight grad when
                                        # trainable)
        routers_train = trainable != 'lora'
        stream = joint                  # does the residual stream entering this layer need a
                                        # gradient?
        bwd, body = 0, 0                # per token (routers, head); body: the blocks', all T
        for layer in range(L):
            keep = False                # does keep = 1 − p need a gradient?
            if layer > 0:
                if routers_train:       # weight grads, and the input's where the stream needs one
                    bwd += (2 if stream else 1) * fc + 2 * out
                elif stream:            # frozen: input grads only
                    bwd += fc + out
                keep = routers_train or stream
            attn, mid = attention_backward(config, layer, T, c['attn_core'], stream, w, adapters)
            # the FFN reads x + keep·Δattn, which depends on p where keep needs a gradient
            mlp, after = mlp_backward(config, layer, T, mid or keep, w, adapters)
            body += attn + mlp
            stream = after or keep
        if stream:
            bwd += (2 if joint else 1) * c['head']
        return bwd * T + body


def halt_router_flops(config):
    """Per token: the halting router's two layers, d -> max(16, d/4) -> 1."""
    hidden = max(16, config.n_embd // 4)
    return 2 * config.n_embd * hidden + 2 * hidden


def halt_report(model, batches, autocast, evaluate, taus=(0.3, 0.5, 0.7, 0.9)):
    """TSA: validation loss with the soft (1 − p) scaling the model was trained with, and with hard
    skipping (skip block l+1 where p_l > τ) at several τ — the comparison the paper never showed.
    Kept tokens add (1 − p)·Δ as in training ('scaled') or the whole Δ ('binary'). α is the mean
    active fraction (soft: mean 1 − p; hard: the fraction not skipped), TLOps saved 1 − (1 +
    (L−1)α)/L."""
    L = model.config.n_layer

    def row(soft, **hard):          # hard: tau and mode of hard skipping
        fields = dict(halt_tau=hard['tau'], halt_hard=hard['mode']) if hard else {}
        with overridden(model.config, halt_soft_eval=soft, **fields):
            r = evaluate(model, batches, autocast)
        alpha = float(np.mean(r['full_frac']))
        return dict(loss=r['loss'], alpha=alpha, tlops_saved=1 - (1 + (L - 1) * alpha) / L, **hard)

    return dict(
        soft=row(True),
        hard=[row(False, tau=tau, mode=mode) for mode in ('scaled', 'binary') for tau in taus],
    )


FAMILY = TokenSelectiveAttention()
