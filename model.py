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
from gates import GATES, HaltingRouter, JEPAGate, MembershipPredictor, MLPGate, capacity, straight_through, topk_mask


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
    # routing family: 'none' (dense), 'ffn' (cheap-vs-full FFN per token at controlled layers) or
    # 'halt' (TSA: a halting router after every block but the last scales the next block's updates)
    route: str = 'none'
    gate: str = 'mlp'         # 'mlp' (G1), 'jepa' (G3), 'random', 'static_full', 'static_cheap', 'oracle'
    budget: float = 0.5       # fraction of tokens per sequence on the full path: ceil(budget·T) in training
    controlled_layers: str = 'all'    # 'all', 'every_other' (1, 3, 5, ...) or a list such as '0,2,5'
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

    def __post_init__(self):
        if self.pos not in ('learned', 'rope'):
            raise ValueError(f"pos must be 'learned' or 'rope', got {self.pos!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2:
            raise ValueError("rope needs an even head dimension (n_embd // n_head)")
        choices = dict(route=('none', 'ffn', 'halt'), gate=GATES, gate_grad=('ste', 'scale', 'none'),
                       infer_rule=('threshold', 'predictor'), jepa_outcome=('delta', 'hidden'),
                       jepa_readout=('distance', 'linear'), rank_kind=('logistic', 'margin'),
                       oracle_policy=('off', 'on'), halt_hard=('scaled', 'binary'))
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.route == 'halt' and self.n_layer < 2:
            raise ValueError("route='halt' needs n_layer >= 2 (block 0 is the stem that always runs)")
        if not 0.0 <= self.halt_tau <= 1.0:
            raise ValueError(f"halt_tau must be in [0, 1], got {self.halt_tau}")
        _check_some_controlled(self)    # validates the layer list

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def controlled_layer_ids(config):
    """Indices of the layers whose FFN is routed (empty for route='none')."""
    if config.route != 'ffn':
        return []
    L, spec = config.n_layer, str(config.controlled_layers)
    if spec == 'all':
        return list(range(L))
    if spec == 'every_other':
        return list(range(1, L, 2))        # may be empty for L = 1: GPTConfig refuses that
    try:
        ids = sorted({int(t) for t in spec.replace(' ', '').split(',') if t})
    except ValueError:
        raise ValueError(f"controlled_layers must be 'all', 'every_other' or e.g. '0,2,5', got {spec!r}") from None
    if not ids or ids[0] < 0 or ids[-1] >= L:
        raise ValueError(f"controlled_layers {spec!r} must name layers in 0..{L - 1}")
    return ids


def _check_some_controlled(config):
    if config.route == 'ffn' and not controlled_layer_ids(config):
        raise ValueError(f"controlled_layers={config.controlled_layers!r} routes no layer of a "
                         f"{config.n_layer}-layer model")


class RouteCtx:
    """What one forward pass asks of the routed blocks, and what they leave behind.
    force: None (gates decide), 'full' or 'cheap' for every controlled layer.
    calibrate: (eval) set each layer's threshold to hit the budget on this batch, in layer order.
    collect: record scores, masks and loss terms (off for the oracle's counterfactual passes)."""

    def __init__(self, force=None, calibrate=False, collect=True, keep_mid=(), oracle=None):
        self.force, self.calibrate, self.collect = force, calibrate, collect
        self.keep_mid, self.mid = set(keep_mid), {}
        self.oracle = oracle              # gate='oracle': fn(layer, x_mid) -> utility (B, T)
        self.scores, self.masks, self.terms = {}, {}, {}

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

    def write(self, layer, k, v, pos):
        """k, v: (B, H, T, hd) for tokens at positions pos (B, T); returns this layer's full K, V, kpos."""
        b = torch.arange(k.size(0), device=k.device)[:, None]
        self.k[layer][b, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][b, :, pos] = v.transpose(1, 2).to(self.v.dtype)
        self.kpos[layer][b, pos] = pos
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

    def forward(self, x, pos=None, cache=None):
        """x (B, T, C). pos (B, T) absolute positions, or None for 0..T-1. With a cache, the new K/V
        are written into it and the queries attend over every filled slot at a position <= their own."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.rope_base is not None:
            p = pos if pos is not None else torch.arange(T, device=x.device).expand(B, T)
            q, k = rope_rotate(q, p, self.rope_base), rope_rotate(k, p, self.rope_base)
        drop = self.dropout if self.training else 0.0
        if cache is None and pos is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            if pos is None:
                pos = torch.arange(T, device=x.device).expand(B, T)
            if cache is not None:
                k, v, kpos = cache.write(self.layer, k, v, pos)
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                kpos = pos
            mask = (kpos[:, None, None, :] >= 0) & (kpos[:, None, None, :] <= pos[:, None, :, None])
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
        self.routed = layer in controlled_layer_ids(config)
        if self.routed:                     # route='ffn': a cheap FFN beside the full one, and a gate
            self.cfg = config
            self.cheap = CheapMLP(config)
            self.gate = (MLPGate(config.n_embd, config.gate_hidden) if config.gate == 'mlp' else
                         JEPAGate(config.n_embd, config.gate_hidden, config.jepa_latent, config.jepa_readout,
                                  seed=1000 + layer) if config.gate == 'jepa' else None)
            self.predictor = (MembershipPredictor(config.n_embd, config.gate_hidden)
                              if config.infer_rule == 'predictor' and self.gate is not None else None)
            self.register_buffer('tau', torch.zeros(()))   # calibrated threshold of the causal score

    def attn_update(self, x, pos=None, cache=None):
        return self.attn(self.ln_1(x), pos, cache)

    def ffn_update(self, x):
        return self.mlp(self.ln_2(x))

    def forward(self, x, pos=None, cache=None, ctx=None):
        x = x + self.attn_update(x, pos, cache)
        if not self.routed:
            return x + self.ffn_update(x)
        return x + self.routed_ffn_update(x, ctx or RouteCtx())

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
        full, cheap = self.mlp(h), self.cheap(h)
        B, T = h.shape[:2]
        causal = not self.training
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
        if score is not None and cfg.gate_grad == 'scale':       # MoD: x + σ(s)·full on the selected path
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
        self.apply(self._init_weights)
        for name, p in self.named_parameters():             # scaled init of residual projections (GPT-2)
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for router in self.halt or ():                      # TSA: b2 = −1 (after the generic init above)
            nn.init.constant_(router.out.bias, -1.0)

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
                oracle_layers=(), calibrate=False):
        """idx (B, T) token ids. Returns (logits, loss, aux): logits for every position when targets
        are given (or last_only=False), else for the last position only; loss is the total training
        loss (LM + weighted auxiliary terms); aux holds the separate terms and routing statistics as
        tensors (no host sync): 'lm_loss', '<name>_loss', 'full_frac' (one entry per controlled layer),
        'masks' {layer: (B, T) bool}.
        force: 'full' / 'cheap' overrides every gate. oracle_layers: controlled layers that get oracle
        utility labels this step (util/rank losses). calibrate: (eval) set thresholds on this batch."""
        cfg = self.config
        oracle = None
        if cfg.route == 'ffn' and cfg.gate == 'oracle' and force is None:
            if targets is None:
                raise ValueError("gate='oracle' routes by utility labels, which need targets")
            oracle = lambda l, x_mid: self.fork_utility(l, x_mid, targets, pos, later='full')
        on_policy = cfg.oracle_policy == 'on' and bool(oracle_layers)
        ctx = RouteCtx(force=force, calibrate=calibrate, keep_mid=oracle_layers if on_policy else (), oracle=oracle)
        x = self.run_blocks(self.embed(idx, pos), pos, cache, ctx)
        x = self.transformer.ln_f(x)
        if last_only is None:
            last_only = targets is None
        logits = self.lm_head(x[:, [-1], :] if last_only else x)
        loss, aux = None, dict(ctx.terms)
        if ctx.masks:
            aux['full_frac'] = torch.stack([ctx.masks[l].float().mean() for l in sorted(ctx.masks)])
            aux['masks'] = ctx.masks
            if self.halt is not None:     # TSA's metrics: active fraction α and TLOps saved
                alpha = aux['full_frac'].mean()
                aux['alpha'] = alpha
                aux['tlops_saved'] = 1 - (1 + (cfg.n_layer - 1) * alpha) / cfg.n_layer
        if targets is not None:
            loss = losses.lm_loss(logits, targets)
            aux['lm_loss'] = loss.detach()
            if oracle_layers and (cfg.util_weight > 0 or cfg.rank_weight > 0):
                self.oracle_losses(ctx, tuple(oracle_layers), idx, targets, pos, aux)
            if 'halt_active' in aux:      # TSA depth regulariser: λ · mean active fraction
                aux['depth_loss'] = aux['halt_active']
            weights = dict(util_loss=cfg.util_weight, rank_loss=cfg.rank_weight, jepa_loss=cfg.jepa_weight,
                           pred_loss=cfg.predictor_weight, mimic_loss=cfg.mimic_weight, depth_loss=cfg.halt_lambda)
            for name, w in weights.items():
                if name in aux:
                    loss = loss + w * aux[name]
        for k, v in aux.items():
            if torch.is_tensor(v) and k not in ('masks', 'lm_loss'):
                aux[k] = v.detach() if k in ('full_frac', 'jepa_pred_std', 'utility_mean', 'alpha',
                                             'tlops_saved', 'halt_active') else v
        return logits, loss, aux

    def run_blocks(self, x, pos, cache, ctx, start=0):
        if self.halt is not None:
            return self.run_halting(x, pos, cache, ctx)
        for block in self.transformer.h[start:]:
            x = block(x, pos, cache, ctx)
        return x

    def run_halting(self, x, pos, cache, ctx):
        """TSA: p_l = r_l(h) after block l; block l+1 adds (1 − p_l)·Δattn and (1 − p_l)·Δffn. In eval
        (hard, causal per token) a token skips both updates where p_l > halt_tau, and the others add
        (1 − p_l)·Δ as in training (halt_hard='scaled') or the whole Δ ('binary'); a skipped token's K/V
        are still computed, so later tokens attend to it as in training. force='full' keeps every
        update whole (the dense model)."""
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
        """The parameters controller-only training updates: gates and predictors (not the cheap FFNs,
        which belong to the backbone)."""
        return [p for n, p in self.named_parameters() if '.gate.' in n or '.predictor.' in n or n.startswith('halt.')]

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
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Sample max_new_tokens continuations of idx (B, T). With use_cache, the prompt is prefilled
        once and each new token costs one single-position forward; once the sequence outgrows
        block_size the context is cropped as in nanoGPT, which shifts every position, so the
        remaining tokens are computed by full recomputation on the cropped window (identical to
        use_cache=False by construction)."""
        bs = self.config.block_size
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
                logits = self(idx[:, start:], pos=pos, cache=cache)[0]
            else:
                logits = self(idx[:, -bs:])[0]
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('inf')
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx

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
        fresh = ('.cheap.', '.gate.', '.predictor.', 'halt.')    # routing modules keep their init
        missing = {k for k in sd if not k.endswith(('.attn.bias', '.tau')) and not any(f in k for f in fresh)} - set(keys)
        if missing:
            raise ValueError(f"from_pretrained: no HF weights for {sorted(missing)}")
        with torch.no_grad():
            for k in keys:
                src = sd_hf[k].t() if k.endswith(transposed) else sd_hf[k]
                if src.shape != sd[k].shape:
                    raise ValueError(f"from_pretrained: shape mismatch for {k}: {tuple(src.shape)} vs {tuple(sd[k].shape)}")
                sd[k].copy_(src)
        return model
