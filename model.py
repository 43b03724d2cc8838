"""
The nanodepth GPT: a pre-LN decoder-only transformer, nanoGPT-style, built so that every block can be
routed per token.

A `Block` exposes its two residual updates separately, `attn_update(x, pos, cache)` and
`ffn_update(x)`, so a routing family can run them on a subset of tokens, scale them, or replace the FFN
with a cheap one without rewriting the block. Attention takes explicit token positions `pos` (B, T):
RoPE rotates by them and the causal mask compares them, so a gathered subset of tokens still attends in
its real causal order at its real positions, and a KV cache can hold slots that were never written.

    from model import GPT, GPTConfig
    logits, loss = model(idx, targets)[:2]    # third element: dict of loss terms and routing stats
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import flops as flops_lib
import losses
from gates import (GATES, EnsembleRouter, HaltingRouter, JEPAGate, MembershipPredictor, MLPGate, ModRouter, capacity,
                   straight_through, topk_mask)


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False        # bias in Linear and LayerNorm (GPT-2 checkpoints need True)
    pos: str = 'learned'      # 'learned' absolute position embeddings, or 'rope'
    rope_base: float = 10000.0
    gelu: str = 'none'        # GELU approximation: 'none' (exact) or 'tanh' (what GPT-2 checkpoints use)
    # routing family: 'none' (dense); 'ffn' (cheap-vs-full FFN per token at controlled layers); 'halt'
    # (TSA: a halting router after every block but the last scales the next block's updates); 'mod'
    # (Mixture-of-Depths: top-k tokens run the routed blocks, the rest skip them); 'exit' (exit heads
    # with deep supervision, per-token early exit at eval); 'ensemble' (late layers' logits mixed by a router)
    route: str = 'none'
    gate: str = 'mlp'         # 'mlp' (G1), 'jepa' (G3), 'random', 'static_full', 'static_cheap', 'oracle'
    budget: float = 0.5       # fraction of tokens per sequence on the full path: ceil(budget·T) in training
                              # (route='mod': the capacity, 0.125 in the paper)
    controlled_layers: str = 'auto'   # routed layers: 'all', 'every_other' (1, 3, 5, ...), a list such as
                                      # '0,2,5', or 'auto' (ffn: all, mod: every_other as in the paper)
    cheap_rank: int = 32      # rank of the cheap low-rank FFN
    gate_hidden: int = 64     # hidden width of gate / predictor MLPs
    gate_grad: str = 'ste'    # how the LM loss reaches the gate: 'ste' straight-through, 'scale' MoD-style, 'none'
    infer_rule: str = 'threshold'     # causal eval decision: 'threshold' on the gate score, or 'predictor'
    jepa_latent: int = 32     # G3 latent size
    jepa_outcome: str = 'delta'       # G3 outcome projected by the fixed target: 'delta' (FFN update) or 'hidden'
    jepa_readout: str = 'distance'    # G3 score: 'distance' between the two forecasts, or 'linear'
    # auxiliary losses of the ffn family: a weight of 0 means that computation does not run
    util_weight: float = 0.0          # utility regression onto oracle labels
    rank_weight: float = 0.0          # pairwise rank supervision from oracle labels
    rank_kind: str = 'logistic'       # 'logistic' or 'margin'
    rank_margin: float = 0.1
    rank_pairs: int = 256             # pairs sampled per sequence
    oracle_policy: str = 'off'        # labels: 'off' (later layers all full, the paper) or 'on' (gate policy)
    jepa_weight: float = 1.0          # λ_JEPA (G3 only)
    predictor_weight: float = 1.0     # BCE of the membership predictor (infer_rule='predictor' only)
    mimic_weight: float = 0.0         # cheap FFN imitates the full FFN
    # route='halt' (TSA, SPEC §2)
    halt_lambda: float = 0.001        # depth regulariser λ on the mean active fraction
    halt_tau: float = 0.5             # eval: a token skips block l+1 where p_l > halt_tau
    halt_soft_eval: bool = False      # eval with the soft (1 − p) scaling instead of hard skipping
    halt_hard: str = 'scaled'         # hard eval: kept tokens add (1 − p)·Δ as in training, or 'binary': Δ
    # route='mod' (SPEC §3): causal eval by infer_rule 'threshold' (router trained with BCE on top-k
    # membership, route iff σ(r) > 0.5) or 'predictor' (stop-gradient MLP, weight predictor_weight)
    router_bce_weight: float = 1.0
    # route='exit' (SPEC §4)
    exit_layers: str = 'auto'         # exits after d blocks: 'auto' {2, n/2, 3n/4}, 'every' (1..n-1), or '1,3'
    exit_head: str = 'shared'         # 'shared' final norm + LM head (LayerSkip), or 'own' norm + projection
    exit_schedule: str = 'layerskip'  # exit-loss weights: 'uniform', 'calm' (∝ d), 'layerskip' (∝ Σ_{i≤d} i),
                                      # or 'mean' (mean CE over exits and final layer: TSA's baseline)
    exit_weight: float = 1.0          # Σ_d α_d (not used by 'mean')
    exit_rotation: int = 0            # rotational curriculum: only exits with d % R == step % R; 0 = all
    layer_dropout: float = 0.0        # LayerSkip p_max: block l skipped per sequence w.p. p_max·(2^{l/(L-1)} − 1)
    exit_conf: str = 'softmax'        # eval confidence: 'softmax' (max prob), 'margin' (top-1 − top-2),
                                      # 'saturation' (cosine of the hidden state to the previous layer's)
    exit_threshold: float = 0.9       # a token exits at the first exit whose confidence ≥ this
    # route='ensemble' (SPEC §5)
    ens_layers: int = 3               # the last k layers (the final one included) are mixed
    ens_router_input: str = 'final'   # router reads ln_f(final hidden state) ('final') or the mean of the
                                      # k normed states ('mean'); both stop-gradient
    ens_mix: str = 'logprob'          # mix 'logit's, 'logprob's (a geometric mixture) or 'prob's
    ens_kl: str = 'forward'           # KL(teacher ‖ mix) ('forward') or KL(mix ‖ teacher) ('reverse')
    ens_kl_weight: float = 1.0        # λ of the distillation loss (teacher: the final layer, stop-gradient)

    def __post_init__(self):
        for key in ('block_size', 'n_layer', 'n_head', 'n_embd', 'cheap_rank', 'gate_hidden', 'jepa_latent',
                    'rank_pairs', 'ens_layers'):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0 (0: from the data), got {self.vocab_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for key in ('util_weight', 'rank_weight', 'rank_margin', 'jepa_weight', 'predictor_weight', 'mimic_weight',
                    'halt_lambda', 'router_bce_weight', 'exit_weight', 'ens_kl_weight', 'exit_rotation'):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.pos not in ('learned', 'rope'):
            raise ValueError(f"pos must be 'learned' or 'rope', got {self.pos!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2:
            raise ValueError("rope needs an even head dimension (n_embd // n_head)")
        choices = dict(route=ROUTES, gate=GATES, gate_grad=('ste', 'scale', 'none'),
                       infer_rule=('threshold', 'predictor'), jepa_outcome=('delta', 'hidden'),
                       jepa_readout=('distance', 'linear'), rank_kind=('logistic', 'margin'),
                       oracle_policy=('off', 'on'), halt_hard=('scaled', 'binary'),
                       exit_head=('shared', 'own'), exit_schedule=('uniform', 'calm', 'layerskip', 'mean'),
                       exit_conf=('softmax', 'margin', 'saturation'), ens_router_input=('final', 'mean'),
                       ens_mix=('logit', 'logprob', 'prob'), ens_kl=('forward', 'reverse'))
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.route == 'halt' and self.n_layer < 2:
            raise ValueError("route='halt' needs n_layer >= 2 (block 0 is the stem that always runs)")
        if not 0.0 <= self.halt_tau <= 1.0:
            raise ValueError(f"halt_tau must be in [0, 1], got {self.halt_tau}")
        if self.route == 'mod' and self.gate not in ('mlp', 'random'):
            raise ValueError(f"route='mod' routes by its linear router (gate='mlp') or at random (gate='random'), "
                             f"got gate={self.gate!r}")
        if self.route == 'exit' and self.n_layer < 2:
            raise ValueError("route='exit' needs n_layer >= 2 (an exit sits below the last layer)")
        if not 0.0 <= self.layer_dropout < 1.0:
            raise ValueError(f"layer_dropout must be in [0, 1), got {self.layer_dropout}")
        if self.layer_dropout > 0 and self.route not in ('none', 'exit'):
            raise ValueError(f"layer_dropout is LayerSkip's (route='exit' or 'none'), not for route={self.route!r}")
        if self.route == 'ensemble' and not 1 <= self.ens_layers <= self.n_layer:
            raise ValueError(f"ens_layers must be in 1..n_layer={self.n_layer}, got {self.ens_layers}")
        _check_some_controlled(self)    # validates the layer lists
        if self.route == 'exit':
            exit_depths(self)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


ROUTES = ('none', 'ffn', 'halt', 'mod', 'exit', 'ensemble')


def controlled_layer_ids(config):
    """Indices of the routed layers: whose FFN is routed (route='ffn') or whose whole block is
    (route='mod'); empty for the other families."""
    if config.route not in ('ffn', 'mod'):
        return []
    L, spec = config.n_layer, str(config.controlled_layers)
    if spec == 'auto':
        spec = 'all' if config.route == 'ffn' else 'every_other'
    if spec == 'all':
        return list(range(L))
    if spec == 'every_other':
        return list(range(1, L, 2))        # may be empty for L = 1: GPTConfig refuses that
    try:
        ids = sorted({int(t) for t in spec.replace(' ', '').split(',') if t})
    except ValueError:
        raise ValueError(f"controlled_layers must be 'auto', 'all', 'every_other' or e.g. '0,2,5', got {spec!r}") from None
    if not ids or ids[0] < 0 or ids[-1] >= L:
        raise ValueError(f"controlled_layers {spec!r} must name layers in 0..{L - 1}")
    return ids


def exit_depths(config):
    """route='exit': the depths d (exit after d blocks, 1 <= d < n_layer) that have an exit head."""
    L, spec = config.n_layer, str(config.exit_layers)
    if spec == 'auto':                 # the seed blog's {2, n/2, 3n/4}, kept below the last layer
        return sorted({d for d in (2, L // 2, (3 * L) // 4) if 1 <= d < L})
    if spec == 'every':
        return list(range(1, L))
    try:
        ds = sorted({int(t) for t in spec.replace(' ', '').split(',') if t})
    except ValueError:
        ds = []
    if not ds or ds[0] < 1 or ds[-1] >= L:
        raise ValueError(f"exit_layers must be 'auto', 'every' or depths in 1..{L - 1} such as '1,3', got {spec!r}")
    return ds


def _check_some_controlled(config):
    if config.route in ('ffn', 'mod') and not controlled_layer_ids(config):
        raise ValueError(f"controlled_layers={config.controlled_layers!r} routes no layer of a "
                         f"{config.n_layer}-layer model")


class RouteCtx:
    """What one forward pass asks of the routed blocks, and what they leave behind.
    force: None (gates decide), 'full' or 'cheap' for every controlled layer.
    calibrate: (eval) set each layer's threshold to hit the budget on this batch, in layer order.
    collect: record scores, masks and loss terms (off for the oracle's counterfactual passes).
    sparse: (eval) run the expensive path on the selected tokens only (gather, compute, scatter), or
    masked-dense (every path on every token, mixed by the mask: the reference sparse must equal)."""

    def __init__(self, force=None, calibrate=False, collect=True, keep_mid=(), oracle=None, sparse=True):
        self.force, self.calibrate, self.collect, self.sparse = force, calibrate, collect, sparse
        self.keep_mid, self.mid = set(keep_mid), {}
        self.oracle = oracle              # gate='oracle': fn(layer, x_mid) -> utility (B, T)
        self.scores, self.masks, self.terms = {}, {}, {}
        self.keep_hidden, self.hidden = set(), {}      # states after d blocks (exit losses, ensemble)
        self.exited, self.exit_out = None, None        # route='exit' eval: who exited, own heads' logits

    def add(self, name, value):
        self.terms[name] = self.terms.get(name, 0.0) + value


# ----------------------------------------------------------------------------------------------------
# attention, with positions and an optional KV cache

class KVCache:
    """Per-layer K/V slots for batched decoding. Slot s of a row holds the token at absolute position s
    (so prompts of different lengths and tokens that skip a layer just leave slots empty); `kpos` is
    the position a slot holds, or -1 while empty. Shapes are static (max_len slots), so decoding steps
    all look alike to torch.compile / CUDA graphs."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        hd = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, max_len, hd)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.kpos = torch.full((config.n_layer, batch_size, max_len), -1, dtype=torch.long, device=device)
        self.max_len = max_len

    def write(self, layer, k, v, pos, valid=None):
        """k, v: (B, H, T, hd) for tokens at positions pos (B, T), distinct within a row; where valid
        (B, T) is False (a token that skips this layer) the slot is marked empty. Returns this
        layer's full K, V, kpos."""
        b = torch.arange(k.size(0), device=k.device)[:, None]
        self.k[layer][b, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][b, :, pos] = v.transpose(1, 2).to(self.v.dtype)
        self.kpos[layer][b, pos] = pos if valid is None else torch.where(valid, pos, -1)
        return self.k[layer], self.v[layer], self.kpos[layer]


def rope_rotate(x, pos, base):
    """Rotary embedding of x (B, H, T, hd) at absolute positions pos (B, T), half-split convention."""
    hd = x.size(-1)
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos[:, None, :, None].float() * inv_freq          # (B, 1, T, hd/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.layer = config.n_head, config.dropout, layer
        self.rope_base = config.rope_base if config.pos == 'rope' else None

    def forward(self, x, pos=None, cache=None, valid=None):
        """x (B, T, C). pos (B, T) absolute positions, or None for 0..T-1. With a cache, the new K/V
        are written into it and the queries attend over every filled slot at a position <= their own.
        valid (B, T) bool, optional: only these tokens are keys (and written to the cache); the others
        are padding or tokens that skip this layer, whose outputs the caller drops."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.rope_base is not None:
            p = pos if pos is not None else torch.arange(T, device=x.device).expand(B, T)
            q, k = rope_rotate(q, p, self.rope_base), rope_rotate(k, p, self.rope_base)
        drop = self.dropout if self.training else 0.0
        if cache is None and pos is None and valid is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            if pos is None:
                pos = torch.arange(T, device=x.device).expand(B, T)
            if cache is not None:
                k, v, kpos = cache.write(self.layer, k, v, pos, valid)
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                kpos = pos if valid is None else torch.where(valid, pos, -1)
            mask = (kpos[:, None, None, :] >= 0) & (kpos[:, None, None, :] <= pos[:, None, :, None])
            if valid is not None:       # dropped query rows attend anywhere: no empty row, so no NaN
                mask = mask | ~valid[:, None, :, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = config.gelu

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class CheapMLP(nn.Module):
    """The cheap path: a low-rank FFN, d -> rank -> d."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.cheap_rank, bias=config.bias)
        self.c_proj = nn.Linear(config.cheap_rank, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = config.gelu

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


def split_apply(x, mask, fn_true, fn_false=None):
    """Sparse execution: fn_true on the tokens of x (B, T, C) where mask (B, T), fn_false (or zeros) on
    the rest, each on a gathered (N, C) batch, scattered back into (B, T, C). Batched over the whole
    batch; the one host sync is the count of selected tokens, which causal decisions make data-dependent."""
    flat, m = x.reshape(-1, x.size(-1)), mask.reshape(-1)
    idx_t, idx_f = m.nonzero().squeeze(1), (~m).nonzero().squeeze(1)
    y_t = fn_true(flat.index_select(0, idx_t))
    out = y_t.new_zeros(flat.shape[:1] + y_t.shape[1:])
    out.index_copy_(0, idx_t, y_t)
    if fn_false is not None:
        out.index_copy_(0, idx_f, fn_false(flat.index_select(0, idx_f)).to(out.dtype))
    return out.view(*x.shape[:-1], -1)


def gather_rows(x, idx):
    """x (B, T, ...) at per-row indices idx (B, k) -> (B, k, ...)."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


class Block(nn.Module):
    """Pre-LN block. The two residual updates are separate methods so routing code can gather, scale
    or replace either one per token; `forward` is the dense composition."""

    def __init__(self, config, layer):
        super().__init__()
        self.layer = layer
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.cfg = config
        self.mod = config.route == 'mod' and layer in controlled_layer_ids(config)
        if self.mod:                        # route='mod': a scalar router decides who runs this block
            self.router = ModRouter(config.n_embd) if config.gate == 'mlp' else None
            self.predictor = (MembershipPredictor(config.n_embd, config.gate_hidden)
                              if config.infer_rule == 'predictor' and self.router is not None else None)
        self.routed = config.route == 'ffn' and layer in controlled_layer_ids(config)
        if self.routed:                     # route='ffn': a cheap FFN beside the full one, and a gate
            self.cheap = CheapMLP(config)
            self.gate = (MLPGate(config.n_embd, config.gate_hidden) if config.gate == 'mlp' else
                         JEPAGate(config.n_embd, config.gate_hidden, config.jepa_latent, config.jepa_readout,
                                  seed=1000 + layer) if config.gate == 'jepa' else None)
            self.predictor = (MembershipPredictor(config.n_embd, config.gate_hidden)
                              if config.infer_rule == 'predictor' and self.gate is not None else None)
            self.register_buffer('tau', torch.zeros(()))   # calibrated threshold of the causal score

    def attn_update(self, x, pos=None, cache=None, valid=None):
        return self.attn(self.ln_1(x), pos, cache, valid)

    def ffn_update(self, x):
        return self.mlp(self.ln_2(x))

    def delta(self, x, pos=None, cache=None, valid=None):
        """f(x) = block(x) − x, the whole block's residual update."""
        a = self.attn_update(x, pos, cache, valid)
        return a + self.ffn_update(x + a)

    def forward(self, x, pos=None, cache=None, ctx=None):
        if self.mod:
            return self.mod_forward(x, pos, cache, ctx or RouteCtx())
        x = x + self.attn_update(x, pos, cache)
        if not self.routed:
            return x + self.ffn_update(x)
        return x + self.routed_ffn_update(x, ctx or RouteCtx())

    def mod_forward(self, x, pos, cache, ctx):
        """Mixture-of-Depths (SPEC §3): the selected tokens get x + σ(r)·f(x̃), f the whole block run on
        the selected tokens only, attending among themselves at their real positions; the others pass
        unchanged and write no K/V here. Training: top-k of r at capacity ceil(budget·T) of the actual
        length T, gathered in their original order (static shapes). Eval (causal): selected where
        σ(r) > 0.5, or where the membership predictor says so; run sparsely (gathered, padded to the
        longest row) or masked-dense (ctx.sparse=False, the reference). force='full': the dense block."""
        cfg, B, T = self.cfg, x.size(0), x.size(1)
        if ctx.force == 'full':             # the dense block, summed in the dense block's order
            x = x + self.attn_update(x, pos, cache)
            return x + self.ffn_update(x)
        if ctx.force == 'cheap':
            return x
        if pos is None:
            pos = torch.arange(T, device=x.device).expand(B, T)
        r = self.router(x) if self.router is not None else None
        if self.training:
            k = capacity(cfg.budget, T)
            sel = (r.detach() if r is not None else torch.rand(B, T, device=x.device)).topk(k, dim=-1).indices
            sel = sel.sort(dim=-1).values               # causal order among the selected = original order
            mask = torch.zeros(B, T, dtype=torch.bool, device=x.device).scatter(1, sel, True)
            xs = gather_rows(x, sel)
            f = self.delta(xs, gather_rows(pos, sel))
            w = torch.sigmoid(r.gather(1, sel))[..., None] if r is not None else 1.0
            out = x.scatter(1, sel[..., None].expand_as(xs), (xs + w * f).to(x.dtype))   # replace, not add
            if ctx.collect and r is not None:
                if self.predictor is not None and cfg.predictor_weight > 0:
                    ctx.add('pred_loss', losses.membership_bce(self.predictor(x), mask))
                elif self.predictor is None and cfg.router_bce_weight > 0:
                    ctx.add('router_loss', losses.membership_bce(r, mask))
        else:
            if r is None:
                mask = torch.rand(B, T, device=x.device) < cfg.budget
            else:
                mask = (self.predictor(x) if self.predictor is not None else r) > 0     # σ(·) > 0.5
                if ctx.collect:           # agreement of the causal decision with top-k (non-causal)
                    ctx.add('mod_acc', (mask == topk_mask(r, capacity(cfg.budget, T))).float().mean()
                            / len(controlled_layer_ids(cfg)))
            out = self.mod_sparse(x, pos, cache, mask, r) if ctx.sparse else self.mod_masked(x, pos, cache, mask, r)
        if ctx.collect:
            ctx.masks[self.layer] = mask
            if r is not None:
                ctx.scores[self.layer] = r
        return out

    def mod_masked(self, x, pos, cache, mask, r):
        """The reference: the block on every token, keys restricted to the selected, result masked."""
        w = torch.sigmoid(r)[..., None] if r is not None else 1.0
        return x + torch.where(mask[..., None], w * self.delta(x, pos, cache, valid=mask), 0.0).to(x.dtype)

    def mod_sparse(self, x, pos, cache, mask, r):
        """Each row's selected tokens gathered first in original order, padded to the longest row."""
        counts = mask.sum(1)
        kmax = int(counts.max())                    # host sync: causal decisions make the count data-dependent
        if kmax == 0:
            return x
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :kmax]
        valid = torch.arange(kmax, device=x.device) < counts[:, None]
        xs = gather_rows(x, order)
        w = torch.sigmoid(r.gather(1, order))[..., None] if r is not None else 1.0
        new = torch.where(valid[..., None], xs + w * self.delta(xs, gather_rows(pos, order), cache, valid), xs)
        return x.scatter(1, order[..., None].expand_as(xs), new.to(x.dtype))

    def routed_ffn_update(self, x, ctx):
        """Full FFN for the tokens the decision selects, cheap FFN for the rest. Both paths run densely
        and are mixed by the mask (training, and the masked reference for sparse execution)."""
        cfg, l = self.cfg, self.layer
        if l in ctx.keep_mid:
            ctx.mid[l] = x.detach()
        h = self.ln_2(x)
        force = ctx.force or {'static_full': 'full', 'static_cheap': 'cheap'}.get(cfg.gate)
        if force == 'full':
            return self.mlp(h)
        if force == 'cheap':
            return self.cheap(h)
        B, T = h.shape[:2]
        causal = not self.training
        sparse = causal and ctx.sparse
        full, cheap = (None, None) if sparse else (self.mlp(h), self.cheap(h))
        score, preds = None, None
        if cfg.gate == 'random':
            mask = (torch.rand(B, T, device=h.device) < cfg.budget if causal else
                    topk_mask(torch.rand(B, T, device=h.device), capacity(cfg.budget, T)))
        elif cfg.gate == 'oracle':           # analysis only: peeks at the targets, so never causal
            mask = topk_mask(ctx.oracle(l, x), capacity(cfg.budget, T))
        else:
            if cfg.gate == 'jepa':
                preds = self.gate.predict(h)
                score = self.gate.score(*preds)
            else:
                score = self.gate(h)
            if causal:
                rule_score = self.predictor(h) if self.predictor is not None else score
                if ctx.calibrate:       # threshold = the (1 − budget) quantile of this batch's scores
                    flat = rule_score.detach().flatten()
                    n_cheap = flat.numel() - round(cfg.budget * flat.numel())
                    self.tau.fill_(flat.kthvalue(n_cheap).values if n_cheap > 0 else float('-inf'))
                mask = rule_score > self.tau
            else:
                mask = topk_mask(score.detach(), capacity(cfg.budget, T))
        if sparse:                      # each path on its own tokens only
            update = split_apply(h, mask, self.mlp, self.cheap)
            if score is not None and cfg.gate_grad == 'scale':
                update = update * torch.where(mask, torch.sigmoid(score), 1.0)[..., None]
        elif score is not None and cfg.gate_grad == 'scale':       # MoD: x + σ(s)·full on the selected path
            update = torch.where(mask[..., None], torch.sigmoid(score)[..., None] * full, cheap)
        elif score is not None and cfg.gate_grad == 'ste' and self.training:
            w = straight_through(mask, score)[..., None]
            update = w * full + (1 - w) * cheap
        else:
            update = torch.where(mask[..., None], full, cheap)
        if ctx.collect:
            ctx.masks[l] = mask
            if score is not None:
                ctx.scores[l] = score
            if self.training:
                self.collect_losses(ctx, x, h, full, cheap, mask, preds)
        return update

    def collect_losses(self, ctx, x, h, full, cheap, mask, preds):
        cfg = self.cfg
        if preds is not None:           # collapse monitor (A1): spread of the forecasts across tokens
            ctx.add('jepa_pred_std', torch.cat(preds, -1).detach().flatten(0, 1).std(0, correction=0).mean()
                    / len(controlled_layer_ids(cfg)))
        if preds is not None and cfg.jepa_weight > 0:
            outcomes = (full, cheap) if cfg.jepa_outcome == 'delta' else (x + full, x + cheap)
            ctx.add('jepa_loss', losses.jepa_alignment(preds, [self.gate.target_of(o) for o in outcomes]))
        if self.predictor is not None and cfg.predictor_weight > 0:
            ctx.add('pred_loss', losses.membership_bce(self.predictor(h), mask))
        if cfg.mimic_weight > 0:
            ctx.add('mimic_loss', losses.cheap_mimic(cheap, full))


class ExitHead(nn.Module):
    """An exit's own norm and projection to the vocabulary (route='exit', exit_head='own')."""

    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x):
        return self.proj(self.ln(x))


def is_controller_key(name):
    """Parameters and buffers of the routing controller rather than the backbone: gates, routers,
    predictors, thresholds, halting routers, own exit heads, the ensemble's norms and router. A stage-2
    run loads the backbone from a checkpoint and starts these fresh; trainable='controller' trains these."""
    return (any(f in name for f in ('.gate.', '.predictor.', '.router.')) or name.endswith('.tau')
            or name.startswith(('halt.', 'exit_heads.', 'ens_norms.', 'ens_router.')))


def layer_dropout_prob(config, layer):
    """LayerSkip's rate for block `layer`: p_max·D(l), D(l) = exp(l·ln2/(L−1)) − 1 (0 at the first
    block, p_max at the last); the time schedule S(t) is constant 1 here."""
    L = config.n_layer
    return config.layer_dropout * (math.exp(layer * math.log(2) / (L - 1)) - 1) if L > 1 else 0.0


# ----------------------------------------------------------------------------------------------------

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight   # tied embeddings
        # route='halt': router l (after block l, l = 0..L-2) gates block l+1; block 0 is the stem
        self.halt = (nn.ModuleList([HaltingRouter(config.n_embd) for _ in range(config.n_layer - 1)])
                     if config.route == 'halt' else None)
        # route='exit': exit after d blocks for d in exit_ids, sharing ln_f + lm_head or with own heads
        self.exit_ids = exit_depths(config) if config.route == 'exit' else []
        self.exit_heads = (nn.ModuleDict({str(d): ExitHead(config) for d in self.exit_ids})
                           if config.route == 'exit' and config.exit_head == 'own' else None)
        # route='ensemble': a norm per late layer (the shared lm_head after it) and the mixing router
        ens = config.route == 'ensemble'
        self.ens_norms = (nn.ModuleList([nn.LayerNorm(config.n_embd, bias=config.bias)
                                         for _ in range(config.ens_layers)]) if ens else None)
        self.ens_router = EnsembleRouter(config.n_embd, config.ens_layers) if ens else None
        self.apply(self._init_weights)
        for name, p in self.named_parameters():             # scaled init of residual projections (GPT-2)
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for router in self.halt or ():                      # TSA: b2 = −1 (after the generic init above)
            nn.init.constant_(router.out.bias, -1.0)
        if self.ens_router is not None:                     # a uniform mixture at the start
            nn.init.zeros_(self.ens_router.w.weight)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.transformer.wpe is not None:
            n -= self.transformer.wpe.weight.numel()
        return n

    def embed(self, idx, pos=None):
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:
            x = x + (self.transformer.wpe(pos) if pos is not None
                     else self.transformer.wpe(torch.arange(idx.size(1), device=idx.device)))
        return self.transformer.drop(x)

    def forward(self, idx, targets=None, pos=None, cache=None, last_only=None, force=None,
                oracle_layers=(), calibrate=False, sparse=True, exits=None):
        """idx (B, T) token ids. Returns (logits, loss, aux): logits for every position when targets
        are given (or last_only=False), else for the last position only; loss is the total training
        loss (LM + weighted auxiliary terms); aux holds the separate terms and routing statistics as
        tensors (no host sync): 'lm_loss', '<name>_loss', 'full_frac' (one entry per routed layer),
        'masks' {layer: (B, T) bool or float, 1 = full path / block runs}, 'tlops_saved' (families
        that skip blocks).
        force: 'full' / 'cheap' overrides every gate ('full' = the dense model). oracle_layers:
        controlled layers that get oracle utility labels this step (util/rank losses). calibrate:
        (eval) set thresholds on this batch. sparse: (eval) gather/scatter execution, or masked-dense
        (False). exits: (route='exit', training) the exit depths whose losses count this step (the
        curriculum; None = all)."""
        cfg = self.config
        oracle = None
        if cfg.route == 'ffn' and cfg.gate == 'oracle' and force is None:
            if targets is None:
                raise ValueError("gate='oracle' routes by utility labels, which need targets")
            oracle = lambda l, x_mid: self.fork_utility(l, x_mid, targets, pos, later='full')
        on_policy = cfg.oracle_policy == 'on' and bool(oracle_layers)
        ctx = RouteCtx(force=force, calibrate=calibrate, keep_mid=oracle_layers if on_policy else (), oracle=oracle,
                       sparse=sparse)
        ensemble = cfg.route == 'ensemble' and force != 'full'
        exit_losses = cfg.route == 'exit' and self.training and targets is not None and force is None
        if ensemble:
            ctx.keep_hidden = set(range(cfg.n_layer - cfg.ens_layers + 1, cfg.n_layer + 1))
        elif exit_losses:
            ctx.keep_hidden = set(self.exit_ids if exits is None else exits)
        x = self.run_blocks(self.embed(idx, pos), pos, cache, ctx)
        if last_only is None:
            last_only = targets is None
        last = (lambda t: t[:, [-1]]) if last_only else (lambda t: t)
        aux = dict(ctx.terms)
        if ensemble:
            logits = self.ensemble_logits(ctx.hidden, last)
        else:
            logits = self.lm_head(self.transformer.ln_f(last(x)))
        if ctx.exit_out is not None:        # own exit heads: an exited token's logits are its exit's
            logits = torch.where(last(ctx.exited)[..., None], last(ctx.exit_out), logits)
        loss = None
        if ctx.masks:
            aux['full_frac'] = torch.stack([ctx.masks[l].float().mean() for l in sorted(ctx.masks)])
            aux['masks'] = ctx.masks
            if cfg.route in ('halt', 'mod', 'exit'):     # token-layer operations skipped
                ran = aux['full_frac'].sum() + (cfg.n_layer - len(ctx.masks))
                aux['tlops_saved'] = 1 - ran / cfg.n_layer
            if self.halt is not None:     # TSA's active fraction α
                aux['alpha'] = aux['full_frac'].mean()
        if targets is not None:
            loss = losses.lm_loss(logits, targets)
            aux['lm_loss'] = loss.detach()
            if oracle_layers and (cfg.util_weight > 0 or cfg.rank_weight > 0):
                self.oracle_losses(ctx, tuple(oracle_layers), idx, targets, pos, aux)
            if 'halt_active' in aux:      # TSA depth regulariser: λ · mean active fraction
                aux['depth_loss'] = aux['halt_active']
            if exit_losses:
                loss = self.exit_losses(ctx.hidden, targets, loss, aux)
            if ensemble and self.training and cfg.ens_kl_weight > 0:
                with torch.no_grad():     # the teacher: the final layer through ln_f, stop-gradient
                    teacher = self.lm_head(self.transformer.ln_f(x))
                aux['distill_loss'] = losses.distill_kl(logits, teacher, cfg.ens_kl)
            weights = dict(util_loss=cfg.util_weight, rank_loss=cfg.rank_weight, jepa_loss=cfg.jepa_weight,
                           pred_loss=cfg.predictor_weight, mimic_loss=cfg.mimic_weight, depth_loss=cfg.halt_lambda,
                           router_loss=cfg.router_bce_weight, exit_loss=1.0, distill_loss=cfg.ens_kl_weight)
            for name, w in weights.items():
                if name in aux:
                    loss = loss + w * aux[name]
        for k, v in aux.items():
            if torch.is_tensor(v) and k not in ('masks', 'lm_loss'):
                aux[k] = v.detach() if k in ('full_frac', 'jepa_pred_std', 'utility_mean', 'alpha',
                                             'tlops_saved', 'halt_active', 'mod_acc', 'exit_ce') else v
        return logits, loss, aux

    def run_blocks(self, x, pos, cache, ctx, start=0):
        if self.halt is not None:
            return self.run_halting(x, pos, cache, ctx)
        if self.exit_ids and not self.training and ctx.force != 'full':
            return self.run_exits(x, pos, cache, ctx)
        for l, block in enumerate(self.transformer.h[start:], start):
            p = layer_dropout_prob(self.config, l) if self.training else 0.0
            if p > 0:                   # LayerSkip layer dropout: whole sequences skip block l
                keep = torch.rand(x.size(0), 1, 1, device=x.device) >= p
                x = torch.where(keep, block(x, pos, cache, ctx), x)
            else:
                x = block(x, pos, cache, ctx)
            if l + 1 in ctx.keep_hidden:
                ctx.hidden[l + 1] = x
        return x

    # ------------------------------------------------------------------------------------------------
    # route='exit' and route='ensemble'

    def exit_logits(self, d, x):
        return self.exit_heads[str(d)](x) if self.exit_heads is not None else self.lm_head(self.transformer.ln_f(x))

    def active_exits(self, step):
        """The exits whose losses count at training step `step`: all, or under the rotational
        curriculum (exit_rotation = R > 0) those with d % R == step % R."""
        R = self.config.exit_rotation
        return tuple(self.exit_ids) if R <= 0 else tuple(d for d in self.exit_ids if d % R == step % R)

    def exit_losses(self, hidden, targets, final_loss, aux):
        """L = L_n + Σ_d α_d·L_d over this step's exits (schedule 'mean': the plain mean of all)."""
        cfg = self.config
        depths = sorted(hidden)
        w = losses.exit_loss_weights(depths, cfg.n_layer, cfg.exit_schedule, cfg.exit_weight)
        ce = [losses.lm_loss(self.exit_logits(d, hidden[d]), targets) for d in depths]
        aux['exit_loss'] = sum(w[d] * c for d, c in zip(depths, ce)) if ce else final_loss.new_zeros(())
        if ce:
            aux['exit_ce'] = torch.stack(ce)
        return final_loss * w[cfg.n_layer]

    def run_exits(self, x, pos, cache, ctx):
        """CALM-style early exit (eval, causal per token): after block d-1 for each exit depth d, a
        still-running token whose confidence is >= exit_threshold exits. Its hidden state is then
        copied upward unchanged, and every higher layer still computes its own K/V from that copy, so
        later tokens attend to it as they would to any token. Sparse: the FFN and the exit heads run
        on the still-running tokens only (attention runs on all: their K/V are needed)."""
        cfg = self.config
        done = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        for l, block in enumerate(self.transformer.h):
            running = ~done
            x_before = x
            if ctx.sparse:
                y = x + block.attn_update(x, pos, cache)
                y = y + split_apply(y, running, block.ffn_update)
            else:
                y = block(x, pos, cache)
            x = torch.where(done[..., None], x, y)
            if ctx.collect:
                ctx.masks[l] = running
            d = l + 1
            if d not in self.exit_ids:
                continue
            head = lambda t: self.exit_logits(d, t)
            lg = split_apply(x, running, head) if ctx.sparse else head(x)
            if cfg.exit_conf == 'saturation':
                conf = F.cosine_similarity(x.float(), x_before.float(), dim=-1)
            else:
                top = F.softmax(lg.float(), dim=-1).topk(2, dim=-1).values
                conf = top[..., 0] if cfg.exit_conf == 'softmax' else top[..., 0] - top[..., 1]
            newly = running & (conf >= cfg.exit_threshold)
            if self.exit_heads is not None:
                ctx.exit_out = lg if ctx.exit_out is None else torch.where(newly[..., None], lg, ctx.exit_out)
            done = done | newly
        ctx.exited = done
        return x

    def ensemble_logits(self, hidden, last):
        """Mixture-of-Depths Ensemble: the last k layers' states, each through its own norm and the
        shared lm_head, mixed per token by G = softmax(x·W_g) (router input stop-gradient) in the
        space ens_mix names: Σ g·logits, Σ g·log p (a geometric mixture, renormalised by the loss's
        log-softmax) or log Σ g·p (an arithmetic mixture)."""
        cfg = self.config
        states = [last(hidden[d]) for d in sorted(hidden)]
        normed = [norm(h) for norm, h in zip(self.ens_norms, states)]
        r_in = self.transformer.ln_f(states[-1]) if cfg.ens_router_input == 'final' else torch.stack(normed).mean(0)
        g = self.ens_router(r_in.detach())                              # (B, T, k), fp32
        out = None                      # accumulated one layer at a time: never k vocab-sized tensors at once
        for j, h in enumerate(normed):
            lg, w = self.lm_head(h).float(), g[..., j:j + 1]
            if cfg.ens_mix == 'logit':
                term = w * lg
            elif cfg.ens_mix == 'logprob':
                term = w * F.log_softmax(lg, dim=-1)
            else:
                term = F.log_softmax(lg, dim=-1) + torch.log(w.clamp_min(1e-30))
            out = term if out is None else (torch.logaddexp(out, term) if cfg.ens_mix == 'prob' else out + term)
        return out

    def run_halting(self, x, pos, cache, ctx):
        """TSA: p_l = r_l(h) after block l; block l+1 adds (1 − p_l)·Δattn and (1 − p_l)·Δffn. In eval
        (hard, causal per token) a token skips both updates where p_l > halt_tau, and the others add
        (1 − p_l)·Δ as in training (halt_hard='scaled') or the whole Δ ('binary'); a skipped token's K/V
        are still computed, so later tokens attend to it as in training; sparse eval runs the FFN on
        the kept tokens only. force='full' keeps every update whole (the dense model)."""
        cfg, blocks = self.config, self.transformer.h
        x = blocks[0](x, pos, cache)
        for l, router in enumerate(self.halt):
            p = router(x)
            if ctx.force == 'full':
                keep = active = torch.ones_like(p)
            elif self.training or cfg.halt_soft_eval:
                keep = active = 1 - p
            else:                       # skip where p > τ; kept tokens as trained ('scaled') or whole
                active = (p <= cfg.halt_tau).to(p.dtype)
                keep = active * (1 - p) if cfg.halt_hard == 'scaled' else active
            block = blocks[l + 1]
            x = x + keep[..., None] * block.attn_update(x, pos, cache)
            if not self.training and ctx.sparse and ctx.force != 'full' and not cfg.halt_soft_eval:
                x = x + keep[..., None] * split_apply(x, active > 0, block.ffn_update)   # FFN on kept tokens only
            else:
                x = x + keep[..., None] * block.ffn_update(x)
            if ctx.collect:             # α's per-token share: 1 − p (soft) or not-skipped (hard)
                ctx.masks[l + 1] = active.detach()
                ctx.add('halt_active', (1 - p).mean() / len(self.halt))    # α of the soft router
        return x

    # ------------------------------------------------------------------------------------------------
    # oracle utility labels (route='ffn')

    @contextmanager
    def no_dropout(self):
        """Dropout off (routing stays in training mode): the two forks of an oracle label must differ
        only in the action at l, not in their dropout masks."""
        mods = [m for m in self.modules() if isinstance(m, (nn.Dropout, CausalSelfAttention)) and m.training]
        for m in mods:
            m.training = False
        try:
            yield
        finally:
            for m in mods:
                m.training = True

    @torch.no_grad()
    def fork_utility(self, l, x_mid, targets, pos, later, ce_full=None):
        """U_t at controlled layer l from the state x_mid (after layer l's attention): per-token CE with
        the cheap FFN at l minus with the full FFN at l; the later layers all full (later='full') or
        following the current gate policy (later='policy'). ce_full, when known, skips that fork."""
        block = self.transformer.h[l]
        ce = {'full': ce_full, 'cheap': None}
        with self.no_dropout():
            h = block.ln_2(x_mid)
            for action in ('full', 'cheap'):
                if ce[action] is None:
                    update = block.mlp(h) if action == 'full' else block.cheap(h)
                    sub = RouteCtx(force='full' if later == 'full' else None, collect=False)
                    x = self.run_blocks(x_mid + update, pos, None, sub, start=l + 1)
                    ce[action] = losses.per_token_ce(self.lm_head(self.transformer.ln_f(x)), targets)
        return losses.oracle_utility(ce['cheap'], ce['full'])

    def oracle_losses(self, ctx, layers, idx, targets, pos, aux):
        """util/rank losses at the sampled controlled layers. Off-policy (the paper): one no-grad
        all-full pass gives CE(all full) and the state at each l, and one suffix pass per layer forks
        it with the cheap FFN at l. On-policy: both forks start from this pass's own state at l and
        the later layers follow the current gates."""
        cfg = self.config
        for l in layers:
            if l not in ctx.scores:
                raise ValueError(f"oracle_layers names layer {l}, which has no trainable gate score")
        if cfg.oracle_policy == 'off':
            with torch.no_grad(), self.no_dropout():
                full_ctx = RouteCtx(force='full', collect=False, keep_mid=layers)
                x = self.run_blocks(self.embed(idx, pos), pos, None, full_ctx)
                ce_full = losses.per_token_ce(self.lm_head(self.transformer.ln_f(x)), targets)
        for l in layers:
            if cfg.oracle_policy == 'on':
                U = self.fork_utility(l, ctx.mid[l], targets, pos, later='policy')
            else:
                U = self.fork_utility(l, full_ctx.mid[l], targets, pos, later='full', ce_full=ce_full)
            score = ctx.scores[l]
            if cfg.util_weight > 0:
                aux['util_loss'] = aux.get('util_loss', 0.0) + losses.utility_regression(score, U) / len(layers)
            if cfg.rank_weight > 0:
                aux['rank_loss'] = aux.get('rank_loss', 0.0) + losses.pairwise_rank(
                    score, U, cfg.rank_pairs, cfg.rank_kind, cfg.rank_margin) / len(layers)
            aux['utility_mean'] = aux.get('utility_mean', 0.0) + U.mean() / len(layers)

    def controller_parameters(self):
        """The parameters controller-only training updates (is_controller_key): gates, routers,
        predictors, own exit heads, ensemble norms and router; not the cheap FFNs (backbone)."""
        return [p for n, p in self.named_parameters() if is_controller_key(n)]

    @torch.no_grad()
    def calibrate(self, idx):
        """Set every controlled layer's causal threshold so that, on idx (held-out batches), the
        realised full-path fraction equals the budget; layers are calibrated in order, each under the
        already-calibrated decisions of the layers below it. Returns the realised fractions."""
        if self.config.route != 'ffn' or self.config.gate not in ('mlp', 'jepa'):
            return None                    # no score to threshold
        was_training = self.training
        self.eval()
        aux = self(idx, last_only=True, calibrate=True)[2]
        self.train(was_training)
        return aux.get('full_frac')

    def crop_block_size(self, block_size):
        """Shrink the context (e.g. GPT-2's 1024) to a smaller block_size; learned positions are cut."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if self.transformer.wpe is not None:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    # ------------------------------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, lengths=None, stats=None,
                 vocab_limit=None):
        """Sample max_new_tokens continuations of idx (B, T), routed as model.eval() routes. With
        use_cache, the prompt is prefilled once and each new token costs one single-position forward;
        once the sequence outgrows block_size the context is cropped as in nanoGPT, which shifts every
        position, so the remaining tokens are computed by full recomputation on the cropped window
        (identical to use_cache=False by construction).
        lengths: prompts of different lengths, right-padded in idx (B, max len), row b's prompt being
        idx[b, :lengths[b]]: each row continues at its own positions (the cache slots the padding
        wrote are emptied after the prefill); returns a list of 1-D tensors. Needs the cache and
        max(lengths) + max_new_tokens <= block_size.
        stats: a dict to fill with the mean realised full-path fraction per routed layer over every
        forward ('full_frac') and the mean TLOps saved ('tlops_saved'), where the family has them.
        vocab_limit: sample only ids < vocab_limit (the tokenizer's real vocabulary; the model's is
        padded, and a padding id has no text)."""
        bs = self.config.block_size
        record = (lambda aux: [stats.setdefault(k, []).append(aux[k].float()) for k in ('full_frac', 'tlops_saved')
                               if k in aux]) if stats is not None else (lambda aux: None)
        if lengths is not None:
            idx = self.generate_ragged(idx, list(lengths), max_new_tokens, temperature, top_k, record, vocab_limit)
        else:
            cache = None
            for _ in range(max_new_tokens):
                T = idx.size(1)
                if use_cache and T <= bs:
                    if cache is None:
                        cache = KVCache(self.config, idx.size(0), bs, idx.device, self.lm_head.weight.dtype)
                        start = 0
                    else:
                        start = T - 1
                    pos = torch.arange(start, T, device=idx.device).expand(idx.size(0), -1)
                    logits, _, aux = self(idx[:, start:], pos=pos, cache=cache)
                else:
                    logits, _, aux = self(idx[:, -bs:])
                record(aux)
                idx = torch.cat((idx, self.sample_next(logits[:, -1, :], temperature, top_k, vocab_limit)), dim=1)
        if stats:
            for k in [k for k in ('full_frac', 'tlops_saved') if k in stats]:
                stats[k] = torch.stack(stats[k]).mean(0).tolist()
        return idx

    def generate_ragged(self, idx, lengths, max_new_tokens, temperature, top_k, record, vocab_limit=None):
        B, dev = idx.size(0), idx.device
        if len(lengths) != B or min(lengths) < 1 or max(lengths) > idx.size(1):
            raise ValueError(f"lengths {lengths} must give 1..{idx.size(1)} prompt tokens for each of {B} rows")
        if max(lengths) + max_new_tokens > self.config.block_size:
            raise ValueError(f"the longest prompt ({max(lengths)}) plus {max_new_tokens} new tokens exceeds "
                             f"block_size {self.config.block_size}")
        cache = KVCache(self.config, B, self.config.block_size, dev, self.lm_head.weight.dtype)
        n = torch.tensor(lengths, device=dev)
        T = idx.size(1)
        logits, _, aux = self(idx, pos=torch.arange(T, device=dev).expand(B, T), cache=cache, last_only=False)
        record(aux)
        slot = torch.arange(cache.max_len, device=dev)[None, :]
        cache.kpos[:, (slot >= n[:, None]) & (slot < T)] = -1           # forget what the padding wrote
        logits = logits[torch.arange(B, device=dev), n - 1]
        out = torch.zeros(B, max(lengths) + max_new_tokens, dtype=idx.dtype, device=dev)
        out[:, :T] = idx
        for step in range(max_new_tokens):
            nxt = self.sample_next(logits, temperature, top_k, vocab_limit)
            out[torch.arange(B, device=dev), n + step] = nxt[:, 0]
            if step + 1 < max_new_tokens:
                logits, _, aux = self(nxt, pos=(n + step)[:, None], cache=cache)
                record(aux)
                logits = logits[:, -1]
        return [out[b, :lengths[b] + max_new_tokens] for b in range(B)]

    @staticmethod
    def sample_next(logits, temperature, top_k, vocab_limit=None):
        if vocab_limit is not None:       # ids are column indices, so dropping the padded columns excludes them
            logits = logits[:, :vocab_limit]
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float('inf')
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)

    # ------------------------------------------------------------------------------------------------
    # training helpers

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, params=None):
        """AdamW with decay on matrices only; `params` restricts training to a subset (e.g. the
        controller in controller-only training). Fused where the device supports it."""
        params = [p for p in (params if params is not None else self.parameters()) if p.requires_grad]
        seen, uniq = set(), []
        for p in params:                                   # tied weights appear once
            if id(p) not in seen:
                seen.add(id(p))
                uniq.append(p)
        groups = [{'params': [p for p in uniq if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in uniq if p.dim() < 2], 'weight_decay': 0.0}]
        fused = device_type in ('cuda', 'cpu')
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self, seq_len=None, training=True):
        """Analytic FLOPs per token of a training-mode forward (training=False) or a whole joint
        training step (True) at sequence length seq_len (default block_size), routing included."""
        T = seq_len or self.config.block_size
        if training:
            return flops_lib.train_step_flops(self.config, T)['total'] / T
        return flops_lib.forward_flops(self.config, T, mode='train') / T

    def estimate_mfu(self, tokens_per_s, device, dtype, seq_len=None):
        """Model FLOPs utilisation against the peak of the device in use (None when unknown, e.g. CPU)."""
        peak = flops_lib.peak_flops(device, dtype)
        if peak is None:
            return None
        return self.flops_per_token(seq_len, training=True) * tokens_per_s / peak

    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path, override_args=None):
        """Load HF GPT-2 weights ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local directory
        saved by transformers). Needs the `transformers` package; HF's Conv1D stores weights
        transposed relative to nn.Linear, hence the transposes."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError as e:
            raise ImportError("init_from=gpt2* needs `pip install transformers`") from e
        hf = GPT2LMHeadModel.from_pretrained(name_or_path)
        c = hf.config
        args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                    block_size=c.n_positions, bias=True, pos='learned', dropout=0.0,
                    gelu='tanh' if c.activation_function in ('gelu_new', 'gelu_pytorch_tanh') else 'none')
        args.update(override_args or {})
        model = cls(GPTConfig(**args))
        sd, sd_hf = model.state_dict(), hf.state_dict()
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        keys = [k for k in sd_hf if not k.endswith(('.attn.masked_bias', '.attn.bias'))]
        fresh = lambda k: '.cheap.' in k or is_controller_key(k)      # routing modules keep their init
        missing = {k for k in sd if not k.endswith('.attn.bias') and not fresh(k)} - set(keys)
        if missing:
            raise ValueError(f"from_pretrained: no HF weights for {sorted(missing)}")
        with torch.no_grad():
            for k in keys:
                src = sd_hf[k].t() if k.endswith(transposed) else sd_hf[k]
                if src.shape != sd[k].shape:
                    raise ValueError(f"from_pretrained: shape mismatch for {k}: {tuple(src.shape)} vs {tuple(sd[k].shape)}")
                sd[k].copy_(src)
        model.init_ensemble_norms()
        return model

    @torch.no_grad()
    def init_ensemble_norms(self):
        """Start every ensemble norm as a copy of ln_f, so a pretrained backbone's late layers begin
        read out the way its final layer is (call after loading backbone weights)."""
        for norm in self.ens_norms or ():
            norm.load_state_dict(self.transformer.ln_f.state_dict())
