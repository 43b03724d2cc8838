"""
Oracle utility labels of the ffn family (route_ffn.py), and their FLOPs: how much the full FFN at a
controlled layer l is worth to a token, measured by forking the forward pass,

    U_t = CE_t(cheap FFN at l) − CE_t(full FFN at l).

Three switches, each an option of the family:
- what is switched (ffn_oracle_label): 'token', only the token whose label is computed, every other
  token keeps its own action at l (the label of a per-token decision); or 'sequence', every token of
  the sequence at once, so CE_t also moves with the paths of t's prefix.
- where the forks start (ffn_oracle_start): the all-full state below l (the paper), or this pass's
  routed one, where the other tokens also keep their routed action at l.
- what runs after l (ffn_oracle_policy): every later layer full ('off', the paper), or the gates'
  own training decisions ('on').

The 'token' labels of all T tokens cost two suffix passes per layer (as 'sequence' labels do, except
from the all-full state with later layers full, where those reuse the all-full pass and need one): a
base suffix, and a switched one in which token t attends to the base stream's keys and values before
t and its own at t. With the causal mask that is exactly T separate forks, each switching one token:
only positions >= t see token t's switch, and CE_t is read at t. With later layers following the
gates, every fork keeps the decisions the gates took on the base suffix (training top-k is not
causal, so a fork that decided again could move other tokens' decisions too); 'sequence' labels
decide again in each fork. At l itself the full action is the unscaled full FFN, with either kind.
"""
from dataclasses import replace

import torch
import torch.nn as nn

import losses
from gates import capacity, topk_mask
from routing import BLOCK_PROJECTIONS, Family, RouteCtx, adapter_flops_per_layer, training_flags


def no_dropout(model):
    """Dropout off (routing stays in training mode): the two forks of a label must differ only in
    the action at l, not in their dropout masks. nn.Dropout layers, and attention, whose dropout
    probability is a float attribute."""
    return training_flags([m for m in model.modules() if isinstance(m, nn.Dropout)
                           or isinstance(getattr(m, 'dropout', None), float)], False)


def oracle_start(cfg):
    """Where the forks start: 'full' or 'routed' ('auto': the paper's pairing with the policy)."""
    if cfg.ffn_oracle_start != 'auto':
        return cfg.ffn_oracle_start
    return 'full' if cfg.ffn_oracle_policy == 'off' else 'routed'


def ce_of(model, x, targets):
    return losses.per_token_ce(model.lm_head(model.transformer.ln_f(x)), targets)


@torch.no_grad()
def fork_utility(model, l, x_mid, targets, pos, later, ce_full=None):
    """'sequence' labels at controlled layer l from the state x_mid (after layer l's attention):
    every token cheap at l minus every token full at l; the later layers all full (later='full') or
    following the current gate policy (later='policy'). ce_full, when known, skips that fork."""
    block = model.transformer.h[l]
    ce = {'full': ce_full, 'cheap': None}
    with no_dropout(model):
        h = block.ln_2(x_mid)
        for action in ('full', 'cheap'):
            if ce[action] is None:
                update = block.mlp(h) if action == 'full' else block.cheap(h)
                sub = RouteCtx(force='full' if later == 'full' else None, collect=False)
                ce[action] = ce_of(
                    model,
                    model.family.run_blocks(model, x_mid + update, pos, None, sub, start=l + 1),
                    targets,
                )
    return losses.oracle_utility(ce['cheap'], ce['full'])


def switched_attention(attn, h_base, h_own, pos):
    """Causal attention of the base stream, and of the switched one, in which token t's query sees
    the base stream's keys and values before t and its own at t: each token as if it alone had been
    switched. Explicit matmuls (no fused kernel takes a separate diagonal); labels run without
    dropout."""
    B, T, C = h_own.shape
    (qb, kb, vb), (qo, ko, vo) = attn.heads(h_base, pos), attn.heads(h_own, pos)
    p = pos if pos is not None else torch.arange(T, device=h_own.device).expand(B, T)
    scale = 1.0 / (C // attn.n_head) ** 0.5
    later = p[:, None, None, :] > p[:, None, :, None]                  # key after the query
    eye = torch.eye(T, dtype=torch.bool, device=h_own.device)
    wb = torch.softmax(
        (qb @ kb.transpose(-2, -1) * scale).masked_fill(later, float('-inf')), dim=-1
    )
    so = (qo @ kb.transpose(-2, -1) * scale).masked_fill(later | eye, float('-inf'))
    wo = torch.softmax(torch.where(eye, (qo * ko).sum(-1, keepdim=True) * scale, so), dim=-1)
    yb, yo = wb @ vb, wo.masked_fill(eye, 0.0) @ vb + wo.diagonal(dim1=-2, dim2=-1)[..., None] * vo
    return (attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)) for y in (yb, yo))


def gate_score(block, cfg, h):
    return block.gate(h)


def held_ffn(block, cfg, h, mask, score):
    """A later routed layer's training-mode update under a given decision (full where mask), with
    'scale' as σ(score) of this stream's own gate score."""
    full, cheap = block.mlp(h), block.cheap(h)
    if cfg.ffn_gate_grad == 'scale':
        full = torch.sigmoid(score)[..., None] * full
    return torch.where(mask[..., None], full, cheap)


@torch.no_grad()
def token_fork_utility(model, l, x_mid, base_full, targets, pos, later):
    """'token' labels at controlled layer l from x_mid (after layer l's attention): each token t
    switched alone from its base action at l (base_full, (B, T) bool: full where True) to the other
    one. The base suffix runs the later layers all full or, on-policy, by the gates' top-k on the
    base stream; the switched stream keeps those decisions, so only token t's action at l differs
    between its forks."""
    cfg, blocks = model.config, model.transformer.h
    with no_dropout(model):
        h = blocks[l].ln_2(x_mid)
        full, cheap, m = blocks[l].mlp(h), blocks[l].cheap(h), base_full[..., None]
        xb, xo = x_mid + torch.where(m, full, cheap), x_mid + torch.where(m, cheap, full)
        for block in blocks[l + 1:]:
            ab, ao = switched_attention(block.attn, block.ln_1(xb), block.ln_1(xo), pos)
            xb, xo = xb + ab, xo + ao
            hb, ho = block.ln_2(xb), block.ln_2(xo)
            if later == 'full' or not hasattr(block, 'cheap'):
                xb, xo = xb + block.mlp(hb), xo + block.mlp(ho)
                continue
            # both scored, as two forwards
            sb, so = gate_score(block, cfg, hb), gate_score(block, cfg, ho)
            mask = topk_mask(sb, capacity(cfg.ffn_budget, hb.size(1)))
            xb, xo = (
                xb + held_ffn(block, cfg, hb, mask, sb),
                xo + held_ffn(block, cfg, ho, mask, so),
            )
        ce_base, ce_own = ce_of(model, xb, targets), ce_of(model, xo, targets)
    return losses.oracle_utility(
        torch.where(base_full, ce_own, ce_base), torch.where(base_full, ce_base, ce_own)
    )


def oracle_losses(model, ctx, layers, targets, aux):
    """util/rank losses at the sampled controlled layers, from labels forked as the three switches
    say (the all-full start is one no-grad all-full pass; all full after it with 'sequence' labels
    reuses that pass's CE as the full fork's). With ffn_aux_grad='own' the losses score the gate's
    detached input again, so their gradient trains that gate alone."""
    cfg, pos = model.config, ctx.pos
    for l in layers:
        if l not in ctx.scores:
            raise ValueError(f"oracle_layers names layer {l}, which has no trainable gate score")
    later = 'full' if cfg.ffn_oracle_policy == 'off' else 'policy'
    token, from_full = cfg.ffn_oracle_label == 'token', oracle_start(cfg) == 'full'
    from route_ffn import FFNState      # not at the top: route_ffn imports this module
    mids, ce_full = ctx.state.mid, None
    if from_full:
        with torch.no_grad(), no_dropout(model):
            full_ctx = RouteCtx(force='full', collect=False, state=FFNState(keep_mid=set(layers)))
            x = model.family.run_blocks(model, model.embed(ctx.idx, pos), pos, None, full_ctx)
            if later == 'full' and not token:
                ce_full = ce_of(model, x, targets)
        mids = full_ctx.state.mid
    labelled = targets != -1            # a task's prompt positions have no CE, so no label
    for l in layers:
        if token:
            base = torch.ones_like(ctx.masks[l]) if from_full else ctx.masks[l]
            U = token_fork_utility(model, l, mids[l], base, targets, pos, later)
        else:
            U = fork_utility(model, l, mids[l], targets, pos, later=later, ce_full=ce_full)
        score, terms = ctx.scores[l], {}
        if cfg.ffn_aux_grad == 'own':
            score = gate_score(model.transformer.h[l], cfg, ctx.state.gate_in[l])
        if cfg.ffn_util_weight > 0:
            terms['util_loss'] = losses.utility_regression(score, U, labelled)
        if cfg.ffn_rank_weight > 0:
            terms['rank_loss'] = losses.pairwise_rank(
                score, U, cfg.ffn_rank_pairs, cfg.ffn_rank_kind, cfg.ffn_rank_margin,
                valid=labelled,
            )
        mean_U = (U * labelled).sum() / labelled.sum().clamp(min=1)
        # means over the sampled layers
        for name, value in dict(terms, utility_mean=mean_U).items():
            aux[name] = aux.get(name, 0.0) + value / len(layers)


def suffix_flops(config, l, c):
    """Per-token FLOPs of layers l+1.. all full, plus the LM head."""
    return (config.n_layer - 1 - l) * (c['attn_proj'] + c['attn_core'] + c['full']) + c['head']


def oracle_flops(family, config, T, c, oracle_layers, adapters=None):
    """The labels at the sampled layers, without gradients: from the all-full state, one all-full
    forward first (its CE too when 'sequence' labels run all full after it); then per layer both
    actions at l and two suffixes (the switched one's attention costs what a causal one does), all
    full or routed by the gates (masked dense), except that 'sequence' labels all full from the
    all-full state reuse that forward's CE: the cheap action and one suffix. LoRA adapters
    (routing.Adapters) run wherever their projections do (every block's, full or routed)."""
    if not oracle_layers:
        return 0
    lora = adapter_flops_per_layer(config, adapters, BLOCK_PROJECTIONS, 1)
    lora_mlp = adapter_flops_per_layer(config, adapters, BLOCK_PROJECTIONS[2:], 1)
    later_full, from_full = config.ffn_oracle_policy == 'off', oracle_start(config) == 'full'
    reuse = from_full and later_full and config.ffn_oracle_label == 'sequence'
    total = (
        (Family.forward_flops(family, config, T) / T - (0 if reuse else c['head']) + sum(lora))
        if from_full
        else 0
    )
    if later_full:
        suffix = [suffix_flops(config, l, c) for l in range(config.n_layer)]
    else:
        ids, per_layer = family.routed_layers(config), [0] * config.n_layer
        for layer in range(config.n_layer):
            # this layer alone with a zero-width head: routed as trained, or a dense layer
            one = replace(
                config, n_layer=1, vocab_size=0, ffn_layers='0' if layer in ids else 'all'
            )
            per_layer[layer] = (family.forward_flops(one, T, mode='policy') if layer in ids else
                                Family.forward_flops(family, one, T, mode='policy')) / T
        suffix = [sum(per_layer[l + 1:]) + c['head'] for l in range(config.n_layer)]
    suffix = [s + sum(lora[l + 1:]) for l, s in enumerate(suffix)]
    for l in oracle_layers:
        total += (c['cheap'] + suffix[l] if reuse
                  else c['full'] + lora_mlp[l] + c['cheap'] + 2 * suffix[l])
    return T * total
