"""
route='ensemble': Mixture-of-Depths Ensemble (Luo & Specia, arXiv 2410.13077).

The last k layers' hidden states each pass their own norm N_j and the shared LM head; a router G(x)
= softmax(x·W_g) (input stop-gradient) mixes their logits per token into the prediction; a KL
distillation loss with the final layer as teacher (stop-gradient) adapts the late layers: each late
layer's own prediction (ens_distill='per_layer', the default) or the mixture's. In joint training
from scratch the teacher (ln_f) feeds nothing else, so ens_teacher_lm_weight gives it its own LM
loss. Used as parameter-cheap tuning on a frozen backbone (trainable='controller'). The norms start
as copies of ln_f (after_load), so a pretrained backbone's late layers begin read out the way its
final layer is.

Options: EnsembleOptions below (fields of model.GPTConfig).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import losses
from gates import EnsembleRouter
from routing import (LAYERS_DRAFT, Family, add_weighted, block_backward, check_at_least,
                     check_choices, first_blocks_logits, flop_costs)


@dataclass
class EnsembleOptions:
    """The family's fields of model.GPTConfig (a base of it), with their defaults."""
    ens_layers: int = 3               # the last k layers (the final one included) are mixed
    ens_router_input: str = 'final'   # router reads ln_f(final hidden state) ('final') or the mean
                                      # of the k normed states ('mean'); both stop-gradient
    ens_mix: str = 'logprob'          # mix 'logit's, 'logprob's (a geometric mixture) or 'prob's
    ens_kl: str = 'forward'           # KL(teacher ‖ mix) ('forward') or KL(mix ‖ teacher)
                                      # ('reverse')
    ens_kl_weight: float = 1.0        # λ of the distillation loss (teacher: the final layer,
                                      # stop-gradient)
    ens_distill: str = 'per_layer'    # distil each late layer's own prediction (the paper's
                                      # reading: the KL adapts the late layers), mean over the k; or
                                      # the 'mixture'
    ens_teacher_lm_weight: float = 0.0  # the teacher's own LM loss (ln_f, final layer), so that in
                                        # joint
                                      # training from scratch the teacher trains; 0: only the
                                      # mixture's


class DepthEnsemble(Family):
    Options = EnsembleOptions
    stored_before = {'ens_distill': 'mixture'}    # the mixture was distilled before the option
    resume_options = ('ens_layers', 'ens_distill')

    def check_values(self, config):
        check_at_least(config, 1, ('ens_layers',))
        check_at_least(config, 0, ('ens_kl_weight', 'ens_teacher_lm_weight'))

    def validate(self, config):
        if not 1 <= config.ens_layers <= config.n_layer:
            raise ValueError(
                f"ens_layers must be in 1..n_layer={config.n_layer}, got {config.ens_layers}"
            )
        check_choices(
            config,
            ens_router_input=('final', 'mean'),
            ens_mix=('logit', 'logprob', 'prob'),
            ens_kl=('forward', 'reverse'),
            ens_distill=('per_layer', 'mixture'),
        )

    def build(self, model):
        cfg = model.config
        model.ens_norms = nn.ModuleList(
            [nn.LayerNorm(cfg.n_embd, bias=cfg.bias) for _ in range(cfg.ens_layers)]
        )
        model.ens_router = EnsembleRouter(cfg.n_embd, cfg.ens_layers)

    def init_weights(self, model):
        nn.init.zeros_(model.ens_router.w.weight)      # a uniform mixture at the start

    def begin(self, model, ctx):
        if ctx.force != 'full':
            L = model.config.n_layer
            ctx.keep_hidden = set(range(L - model.config.ens_layers + 1, L + 1))

    def logits(self, model, x, ctx, last):
        """Σ g·logits, Σ g·log p (renormalised by the loss's log-softmax) or log Σ g·p, accumulated
        one layer at a time: never k vocabulary-sized tensors at once."""
        if ctx.force == 'full':
            return super().logits(model, x, ctx, last)
        cfg = model.config
        states = [last(ctx.hidden[d]) for d in sorted(ctx.hidden)]
        normed = [norm(h) for norm, h in zip(model.ens_norms, states)]
        r_in = (
            model.transformer.ln_f(states[-1])
            if cfg.ens_router_input == 'final'
            else torch.stack(normed).mean(0)
        )
        g = model.ens_router(r_in.detach())                              # (B, T, k), fp32
        out = None
        per_layer = model.training and cfg.ens_distill == 'per_layer' and cfg.ens_kl_weight > 0
        ctx.state = [] if per_layer else None          # each late layer's own logits, for the loss
        for j, h in enumerate(normed):
            lg, w = model.lm_head(h).float(), g[..., j:j + 1]
            if per_layer:
                ctx.state.append(lg)
            if cfg.ens_mix == 'logit':
                term = w * lg
            elif cfg.ens_mix == 'logprob':
                term = w * F.log_softmax(lg, dim=-1)
            else:
                term = F.log_softmax(lg, dim=-1) + torch.log(w.clamp_min(1e-30))
            out = (
                term
                if out is None
                else (torch.logaddexp(out, term) if cfg.ens_mix == 'prob' else out + term)
            )
        return out

    def loss(self, model, ctx, lm_loss, targets, aux):
        cfg = model.config
        teach = (
            ctx.force != 'full'
            and model.training
            and (cfg.ens_kl_weight > 0 or cfg.ens_teacher_lm_weight > 0)
        )
        if teach:                     # the teacher: the final layer through ln_f
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.ens_teacher_lm_weight > 0):
                teacher = model.lm_head(model.transformer.ln_f(ctx.final))
            if cfg.ens_teacher_lm_weight > 0:
                aux['teacher_lm_loss'] = losses.lm_loss(teacher, targets)
            teacher = teacher.detach()    # the distillation never moves the teacher
        if teach and cfg.ens_kl_weight > 0:
            students = ctx.state if cfg.ens_distill == 'per_layer' else [ctx.logits]
            aux['distill_loss'] = sum(
                losses.distill_kl(s, teacher, cfg.ens_kl, targets) for s in students
            ) / len(students)
        return add_weighted(
            lm_loss,
            aux,
            dict(distill_loss=cfg.ens_kl_weight, teacher_lm_loss=cfg.ens_teacher_lm_weight),
        )

    def is_controller_key(self, name):
        return name.startswith(('ens_norms.', 'ens_router.'))

    references = ('full',)

    def report_lines(self, r):
        return [
            f"val loss (late-layer ensemble) {r['val_loss']['loss']:.4f} | final layer alone "
            f"{r['val_loss_full']:.4f}"
        ]

    def drafts(self, config):
        return dict(earliest="the earliest ensemble layer alone: the first L−k+1 blocks, its own "
                             "norm and the LM head", layers=LAYERS_DRAFT)

    def draft_depths(self, config, name):
        return None if name == 'earliest' else super().draft_depths(config, name)

    def draft_logits(self, model, name, idx, pos, cache, depth):
        if name == 'earliest':
            first = model.config.n_layer - model.config.ens_layers + 1
            return first_blocks_logits(model, idx, pos, cache, first,
                                       head=lambda x: model.lm_head(model.ens_norms[0](x)))
        return super().draft_logits(model, name, idx, pos, cache, depth)

    def ddp_find_unused(self, config):
        return True                     # ln_f feeds only the stop-gradient teacher

    def no_gradient(self, config):
        # ln_f is the teacher's alone, which trains only through its own LM loss
        ln_f = ['transformer.ln_f.weight'] + (['transformer.ln_f.bias'] if config.bias else [])
        return ((ln_f if config.ens_teacher_lm_weight == 0 else [])
                # softmax over one layer: 1
                + (['ens_router.w.weight'] if config.ens_layers == 1 else []))

    @torch.no_grad()
    def after_load(self, model):
        for norm in model.ens_norms:
            norm.load_state_dict(model.transformer.ln_f.state_dict())

    def forward_flops(self, config, T, mode='train', full_frac=None, **options):
        """The dense body, k late-layer heads and the router (and in training, with a KL weight, the
        teacher's head)."""
        c, L, d, k = flop_costs(config, T), config.n_layer, config.n_embd, config.ens_layers
        teacher = mode == 'train' and (config.ens_kl_weight > 0 or config.ens_teacher_lm_weight > 0)
        return T * c['head'] + T * (
            L * (c['attn_proj'] + c['attn_core'] + c['full'])
            + (k - 1 + teacher) * c['head']
            + 2 * d * k
        )

    def backward_flops(self, config, T, trainable='all', adapters=None, **options):
        """The router's input is detached (weight gradient only). Controller-only: the frozen head
        computes input gradients for the trainable norms before it. Under LoRA, the input
        gradients from the first adapter up, through every late layer's head (and the teacher's,
        given its own LM loss); the norms and the router train only under 'controller+lora'."""
        c, L, d, k = flop_costs(config, T), config.n_layer, config.n_embd, config.ens_layers
        if trainable == 'all':           # (+ the teacher's head when it has an LM loss of its own)
            heads = k + (config.ens_teacher_lm_weight > 0)
            return (
                2 * T * (L * (c['attn_proj'] + c['attn_core'] + c['full']) + heads * c['head'])
                + T * 2 * d * k
            )
        controller_trains = trainable != 'lora'
        stream, total = False, 0
        for layer in range(L):
            cost, stream = block_backward(config, layer, T, c['attn_core'], stream, 1, adapters)
            total += cost
            if layer + 1 > L - k:       # a late layer's head: its input needs a gradient where
                                        # its norm trains or the stream needs one
                total += T * c['head'] * (controller_trains or stream)
        if config.ens_teacher_lm_weight > 0 and stream:
            total += T * c['head']
        return total + (T * 2 * d * k if controller_trains else 0)


FAMILY = DepthEnsemble()
