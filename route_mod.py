"""
route='mod': Mixture-of-Depths (Raposo et al., arXiv 2404.02258): top-k block routing.

A routed block has a scalar linear router r = wᵀx. The selected tokens get x + σ(r)·f(x̃), f the
whole block run on the selected tokens only, attending among themselves at their real positions
(RoPE and the causal mask see real positions); the others pass unchanged and write no K/V at that
block. Training: top-k of r at capacity ceil(budget·T) of the actual length T (static shapes),
gathered in original order. Eval (causal): selected where σ(r) > 0.5 (the router trained with BCE on
top-k membership) or where a stop-gradient membership predictor says so. σ(r) rather than the raw r
multiplies the update: a raw logit multiplied into the residual can blow up.

Options: ModOptions below (fields of model.GPTConfig).
"""
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import losses
from gates import MembershipPredictor, ModRouter, capacity, random_mask, topk_mask
from routed_rows import matmul_dtype, mlp_rows, prefix_linear, sort_by_mask
from packed_attention import packed_causal_attention
from routing import (
    BLOCK_PROJECTIONS,
    LAYERS_DRAFT,
    Family,
    adapter_flops,
    add_weighted,
    block_backward,
    check_at_least,
    check_fraction,
    cheap_path_logits,
    exec_path,
    flop_costs,
    gather_rows,
    layer_ids,
    split_apply,
    tlops_saved,
)


@dataclass
class ModOptions:
    """The family's fields of model.GPTConfig (a base of it), with their defaults."""
    mod_router: str = 'learned'       # 'learned' (a linear router per routed block) or 'random'
    mod_capacity: float = 0.5         # fraction of tokens per sequence that run a routed block:
                                      # ceil(c·T) in training (0.125 in the paper)
    mod_layers: str = 'auto'          # routed blocks, as ffn_layers; 'auto' = every_other, as in
                                      # the paper
    mod_infer_rule: str = 'threshold' # causal eval: 'threshold' (router trained with BCE on top-k
                                      # membership, route iff σ(r) > 0.5) or 'predictor' (a
                                      # stop-gradient MLP)
    mod_predictor_weight: float = 1.0 # BCE of the membership predictor (mod_infer_rule='predictor'
                                      # only)
    mod_predictor_hidden: int = 64    # hidden width of the predictor
    mod_bce_weight: float = 1.0       # BCE of the router on top-k membership
                                      # (mod_infer_rule='threshold')


class MixtureOfDepths(Family):
    Options = ModOptions
    budget_field = 'mod_capacity'
    layers_option, resume_options = (
        'mod_layers',
        ('mod_router', 'mod_infer_rule', 'mod_predictor_hidden'),
    )
    spelled_options = ('mod_layers',)   # 'auto' and 'every_other' are the same layers
    logged_stats = ('tlops_saved',)
    eval_stats = ('tlops_saved', 'mod_acc')     # mod_acc: the causal rule's agreement with top-k

    def check_values(self, config):
        check_at_least(config, 1, ('mod_predictor_hidden',))
        check_at_least(config, 0, ('mod_predictor_weight', 'mod_bce_weight'))
        check_fraction(config, 'mod_capacity')

    def validate(self, config):
        if config.mod_router not in ('learned', 'random'):
            raise ValueError(
                f"mod_router must be 'learned' (a linear router per routed block) or 'random', "
                f"got {config.mod_router!r}"
            )
        if config.mod_infer_rule not in ('threshold', 'predictor'):
            raise ValueError(
                f"mod_infer_rule must be 'threshold' or 'predictor', got {config.mod_infer_rule!r}"
            )
        if not self.routed_layers(config):
            raise ValueError(f"mod_layers={config.mod_layers!r} routes no layer of a "
                             f"{config.n_layer}-layer model")

    def routed_layers(self, config):
        return layer_ids(config, 'mod_layers', default='every_other')

    def build_block(self, block, config, layer):
        if layer not in self.routed_layers(config):
            return
        block.router = ModRouter(config.n_embd) if config.mod_router == 'learned' else None
        block.predictor = (
            MembershipPredictor(config.n_embd, config.mod_predictor_hidden)
            if config.mod_infer_rule == 'predictor' and block.router is not None
            else None
        )

    def run_blocks(self, model, x, pos, cache, ctx, start=0):
        for block in model.transformer.h[start:]:
            x = (
                mod_block(block, model.config, x, pos, cache, ctx)
                if hasattr(block, 'router')
                else block(x, pos, cache)
            )
        return x

    def loss(self, model, ctx, lm_loss, targets, aux):
        cfg = model.config
        return add_weighted(
            lm_loss, aux, dict(pred_loss=cfg.mod_predictor_weight, router_loss=cfg.mod_bce_weight)
        )

    def stats(self, model, ctx, aux):
        super().stats(model, ctx, aux)
        if ctx.masks:
            aux['tlops_saved'] = tlops_saved(aux['full_frac'], model.config.n_layer)

    def is_controller_key(self, name):
        return '.router.' in name or '.predictor.' in name

    references, by_class = ('full', 'cheap'), True

    def executed_fracs(self, masks, path='compact'):
        """Compact sparse execution pads every row to the longest: the fraction it really runs (in
        float64, so that it equals count / T exactly as a Python float and rounds to the same
        float32). The static paths' packed block (mod_packed) pads nothing: its matmuls run the
        selected rows only on 'grouped_mm' and 'triton' (the mean fraction: None), its attention
        Σ n_b² scores with varlen_attn (the formula's B·mean² is a lower bound of that). The
        reference path computes every row (static shapes, saving nothing): 1 at every layer."""
        if path != 'compact':
            return super().executed_fracs(masks, path)
        return torch.stack([m.sum(1).max().double() / m.size(1) for _, m in sorted(masks.items())])

    def option_meaning(self, config, key):
        return self.routed_layers(config) if key == 'mod_layers' else getattr(config, key)

    def bench_config(self, config, b):
        # at random: an untrained router's σ(r) > 0.5 rule would not hold the capacity
        return replace(self.with_budget(config, b), mod_router='random')

    def drafts(self, config):
        return dict(skip="every routed block skipped (force='cheap'): the unrouted blocks alone",
                    layers=LAYERS_DRAFT)

    def draft_depths(self, config, name):
        return None if name == 'skip' else super().draft_depths(config, name)

    def draft_logits(self, model, name, idx, pos, cache, depth):
        if name == 'skip':
            return cheap_path_logits(model, idx, pos, cache)
        return super().draft_logits(model, name, idx, pos, cache, depth)

    def ddp_find_unused(self, config):
        return config.mod_infer_rule == 'predictor' and config.mod_predictor_weight == 0

    def forward_flops(self, config, T, mode='train', full_frac=None, **options):
        """A routed layer costs its router on every token, then the whole block on n tokens with
        attention among them (4·n²·d): n = ceil(budget·T) in training, T masked-dense ('eval'), and
        in 'sparse' n = full_frac·T per routed layer, where full_frac is the padded row length over
        T (sparse execution pads every row to the longest)."""
        c, L, d = mod_costs(config, T), config.n_layer, config.n_embd
        ids, router = self.routed_layers(config), config.mod_router == 'learned'
        total = T * c['head']
        for l in range(L):
            if l not in ids:
                total += T * (c['attn_proj'] + c['attn_core'] + c['full'])
                continue
            f = full_frac[ids.index(l)] if isinstance(full_frac, (list, tuple)) else full_frac
            n = (
                capacity(config.mod_capacity, T)
                if mode in ('train', 'policy')
                else f * T
                if mode == 'sparse'
                else T
            )
            total += T * 2 * d * router + n * (c['attn_proj'] + c['full']) + 4 * n * n * d
            if (
                router
                and config.mod_infer_rule == 'predictor'
                and (mode != 'train' or config.mod_predictor_weight > 0)
            ):
                total += T * (c['pred_fc'] + c['pred_out'])
        return total

    def backward_flops(self, config, T, trainable='all', adapters=None, **options):
        """Controller-only: the router's weight gradient, and the blocks' input gradients from the
        first router up (σ(r) multiplies the update from there on). Under LoRA, the blocks' input
        gradients from the first adapter up too, and the routers' weights train only under
        'controller+lora'."""
        c, L, d = mod_costs(config, T), config.n_layer, config.n_embd
        joint = trainable == 'all'
        w, routers_train = (2 if joint else 1), trainable != 'lora'
        ids, router = self.routed_layers(config), config.mod_router == 'learned'
        stream, bwd = joint, 0
        for l in range(L):
            n = capacity(config.mod_capacity, T) if l in ids else T
            cost, out = block_backward(config, l, n, 4 * n * d, stream, w, adapters)
            bwd += cost
            if l in ids and router:     # r = wᵀx: weight grad where it trains, input grad where x
                bwd += T * 2 * d * (routers_train + stream)                   # needs one
                if (routers_train and config.mod_infer_rule == 'predictor'
                        and config.mod_predictor_weight > 0):
                    bwd += T * (c['pred_fc'] + 2 * c['pred_out'])      # its input is detached
            # σ(r) multiplies the update from here on, where r needs a gradient
            stream = out or (l in ids and router and (routers_train or stream))
        return bwd + (T * w * c['head'] if stream else 0)

    def adapter_forward_flops(self, config, T, adapters, **options):
        """A routed block's adapters run on its capacity's tokens."""
        ids = self.routed_layers(config)
        return sum(adapter_flops(config, adapters, layer, BLOCK_PROJECTIONS,
                                 capacity(config.mod_capacity, T) if layer in ids else T)
                   for layer in range(config.n_layer))


def mod_costs(config, T):
    """routing.flop_costs plus the membership predictor, per token."""
    d, p = config.n_embd, config.mod_predictor_hidden
    return dict(flop_costs(config, T), pred_fc=2 * d * p, pred_out=2 * p)


def mod_block(block, cfg, x, pos, cache, ctx):
    """One routed block (see the module docstring); force='full' runs the dense block, in the dense
    block's order of sums, and force='cheap' skips it for every token."""
    B, T = x.shape[:2]
    if ctx.force == 'full':
        return block(x, pos, cache)
    if ctx.force == 'cheap':
        return x
    if pos is None:                 # the selected tokens attend at their real positions
        pos = torch.arange(T, device=x.device).expand(B, T)
    r = block.router(x) if block.router is not None else None
    if block.training:
        k = capacity(cfg.mod_capacity, T)
        sel = (
            (r.detach() if r is not None else torch.rand(B, T, device=x.device))
            .topk(k, dim=-1)
            .indices
        )
        sel = sel.sort(dim=-1).values               # causal order among the selected = original
                                                    # order
        mask = torch.zeros(B, T, dtype=torch.bool, device=x.device).scatter(1, sel, True)
        xs = gather_rows(x, sel)
        f = block.delta(xs, gather_rows(pos, sel))
        w = torch.sigmoid(r.gather(1, sel))[..., None] if r is not None else 1.0
        # replace, not add
        out = x.scatter(1, sel[..., None].expand_as(xs), (xs + w * f).to(x.dtype))
        if ctx.collect and r is not None:
            if block.predictor is not None and cfg.mod_predictor_weight > 0:
                ctx.add('pred_loss', losses.membership_bce(block.predictor(x), mask))
            elif block.predictor is None and cfg.mod_bce_weight > 0:
                ctx.add('router_loss', losses.membership_bce(r, mask))
    else:
        if r is None:
            mask = random_mask(B, T, cfg.mod_capacity, True, x.device)
        else:
            decider = block.predictor(x) if block.predictor is not None else r
            mask = decider > 0                                                     # σ(·) > 0.5
            if ctx.collect:
                ctx.margins[block.layer] = decider.detach()
            if ctx.collect:           # agreement of the causal decision with top-k (non-causal)
                topk = topk_mask(r, capacity(cfg.mod_capacity, T))
                ctx.add('mod_acc', (mask == topk).float().mean()
                        / len(layer_ids(cfg, 'mod_layers', default='every_other')))
        if not ctx.sparse:
            out = mod_masked(block, x, pos, cache, mask, r)
        elif (path := exec_path(x, ctx.exec_mode)) != 'compact':
            out = mod_packed(block, x, pos, cache, mask, r, path)
        else:
            out = mod_sparse(block, x, pos, cache, mask, r)
    if ctx.collect:
        ctx.masks[block.layer] = mask
        if r is not None:
            ctx.scores[block.layer] = r
    return out


def mod_masked(block, x, pos, cache, mask, r):
    """The reference: the block on every token, keys restricted to the selected, result masked."""
    w = torch.sigmoid(r)[..., None] if r is not None else 1.0
    return x + torch.where(mask[..., None], w * block.delta(x, pos, cache, valid=mask), 0.0).to(
        x.dtype
    )


def mod_static(block, x, pos, cache, mask, r, path):
    """Sparse eval at static shapes with a KV cache (mod_packed runs without one): attention over
    the full T with only the selected tokens as keys (so they attend among themselves at their real
    positions, as when gathered), the FFN on the selected rows only (rows_apply), the update added
    where selected; no count leaves the device."""
    w = torch.sigmoid(r)[..., None] if r is not None else 1.0
    a = block.attn_update(x, pos, cache, valid=mask)
    f = split_apply(block.ln_2(x + a), mask, block.mlp, mode=path)
    return x + torch.where(mask[..., None], w * (a + f), 0.0).to(x.dtype)


def mod_packed(block, x, pos, cache, mask, r, path):
    """Sparse eval at static shapes on the selected tokens only, attention included: every
    sequence's selected tokens packed first, contiguously across the batch, in original order
    (routed_rows.sort_by_mask; the count, per-sequence counts and offsets stay on the device); ln_1,
    QKV and the output projection on the packed prefix (routed_rows.prefix_linear on `path`), causal
    attention among each sequence's selected tokens at their real positions (RoPE rotates by them)
    by packed_attention, then ln_2 and the FFN on the prefix (routed_rows.mlp_rows), σ(r)·update
    added, and the rows scattered back. With a KV cache (decoding, cached prefill) it is mod_static:
    the cache needs a write at every position, and a token that skips the block writes no K/V."""
    if cache is not None:
        return mod_static(block, x, pos, cache, mask, r, path)
    B, T, C = x.shape
    N, attn = B * T, block.attn
    flat = x.reshape(N, C)
    order, count = sort_by_mask(mask.flatten())
    xs, seq_id = flat.index_select(0, order), order // T
    pos_p = pos.reshape(N).index_select(0, order)
    cu_seq = F.pad(mask.sum(1).cumsum(0), (1, 0))
    rows = (torch.arange(N, device=x.device) < count)[:, None]     # the packed tokens
    qkv = prefix_linear(block.ln_1(xs), count, attn.c_attn.weight, attn.c_attn.bias, path)
    q, k, v = (t.reshape(N, attn.n_head, C // attn.n_head) for t in qkv.split(C, dim=1))
    q, k = (attn.rotate(t.transpose(0, 1)[None], pos_p[None])[0].transpose(0, 1) for t in (q, k))
    y = packed_causal_attention(q, k, v, seq_id, pos_p, count, cu_seq, T)
    a = prefix_linear(y.reshape(N, C), count, attn.c_proj.weight, attn.c_proj.bias, path)
    f = mlp_rows(block.ln_2(xs + a), torch.arange(N, device=x.device), 0, count, block.mlp,
                 torch.zeros(N, C, dtype=matmul_dtype(xs), device=x.device), path)
    w = torch.sigmoid(r.reshape(N).index_select(0, order))[:, None] if r is not None else 1.0
    # the rows past count (garbage on some paths) keep their input
    new = xs + torch.where(rows, w * (a + f), 0.0).to(x.dtype)
    return flat.index_copy(0, order, new).view(B, T, C)


def mod_sparse(block, x, pos, cache, mask, r):
    """Each row's selected tokens gathered first in original order, padded to the longest row."""
    counts = mask.sum(1)
    kmax = int(counts.max())                    # host sync: causal decisions make the count
                                                # data-dependent
    if kmax == 0:
        return x
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :kmax]
    valid = torch.arange(kmax, device=x.device) < counts[:, None]
    xs = gather_rows(x, order)
    w = torch.sigmoid(r.gather(1, order))[..., None] if r is not None else 1.0
    new = torch.where(
        valid[..., None], xs + w * block.delta(xs, gather_rows(pos, order), cache, valid), xs
    )
    return x.scatter(1, order[..., None].expand_as(xs), new.to(x.dtype))


FAMILY = MixtureOfDepths()
