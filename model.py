"""
The nanodepth GPT: a pre-LN decoder-only transformer, nanoGPT-style, built so that every block can
be routed per token.

A `Block` exposes its two residual updates separately, `attn_update(x, pos, cache)` and
`ffn_update(x)`, so a routing family can run them on a subset of tokens, scale them, or replace the
FFN with a cheap one without rewriting the block. Attention takes explicit token positions `pos` (B,
T): RoPE rotates by them and the causal mask compares them, so a gathered subset of tokens still
attends in its real causal order at its real positions, and a KV cache can hold slots that were
never written.

How a forward is routed is the business of the model's routing family (`config.route`), looked up in
FAMILIES below; each family lives in its own file (route_ffn.py, route_mod.py, ...) and implements
the contract of routing.Family (its docstring). This file knows no family but by its name in ROUTES.

    from model import GPT, GPTConfig
    logits, loss = model(idx, targets)[:2]    # third element: dict of loss terms and routing stats
"""
import importlib
import math
import os
import re
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import losses
import speculative
from configurator import RENAMED, ConfigError, hf_hub_cache
from routing import MLP, Dense, RouteCtx, training_flags

# the routing families, by config.route: route_<name>.py defines each, as its FAMILY (a subclass
# of routing.Family, whose Options become fields of GPTConfig). Adding one = its file and its name
# here (docs/new_family.md).
# An old option name two families share means, under a third route, the earlier family's option.
ROUTES = ('ffn', 'mod', 'halt', 'exit', 'ensemble')
DECODE_GRAPHS = 64      # graphs a compiled decoding step may need (GPT.compiled)
FAMILIES = {'none': Dense(), **{r: importlib.import_module(f'route_{r}').FAMILY for r in ROUTES}}


@dataclass
class GPTConfig(*[f.Options for f in reversed(FAMILIES.values()) if f.Options is not None]):
    """The dense model's fields below; each routing family's options (<route>_*) are the fields of
    its Options dataclass, declared in its own file and a base of this class. fields() lists the
    bases' first, the last base's first (so the families' in registry order), then these."""
    block_size: int = 128     # context length in tokens
    vocab_size: int = 64      # rows of the embedding and LM head
    n_layer: int = 4          # transformer blocks
    n_head: int = 4           # attention heads (n_embd must divide into them)
    n_embd: int = 128         # width of the residual stream
    dropout: float = 0.0      # dropout probability (0 for pretraining)
    bias: bool = False        # bias in Linear and LayerNorm (GPT-2 checkpoints need True)
    pos: str = 'learned'      # 'learned' absolute position embeddings, or 'rope'
    rope_base: float = 10000.0  # RoPE frequency base (pos='rope' only)
    gelu: str = 'none'        # GELU approximation: 'none' (exact) or 'tanh' (what GPT-2 checkpoints
                              # use)
    route: str = 'none'       # the routing family, a key of FAMILIES ('none': the dense model)
    layer_dropout: float = 0.0  # LayerSkip p_max: block l skipped per sequence w.p.
                                # p_max·(2^{l/(L-1)} − 1)

    def __post_init__(self):
        for key in ('block_size', 'n_layer', 'n_head', 'n_embd'):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0 (0: from the data), got {self.vocab_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.pos not in ('learned', 'rope'):
            raise ValueError(f"pos must be 'learned' or 'rope', got {self.pos!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2:
            raise ValueError("rope needs an even head dimension (n_embd // n_head)")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be > 0, got {self.rope_base}")
        if self.gelu not in ('none', 'tanh'):
            raise ValueError(f"gelu must be 'none' or 'tanh', got {self.gelu!r}")
        if self.route not in FAMILIES:
            raise ValueError(f"route must be one of {tuple(FAMILIES)}, got {self.route!r}")
        for family in FAMILIES.values():        # every family's own ranges, whatever the route
            family.check_values(self)
        if not 0.0 <= self.layer_dropout < 1.0:
            raise ValueError(f"layer_dropout must be in [0, 1), got {self.layer_dropout}")
        # the blocks are routed
        if self.layer_dropout > 0 and 'layer_dropout' not in FAMILIES[self.route].options:
            readers = ' or '.join(
                repr(r) for r, f in FAMILIES.items() if 'layer_dropout' in f.options
            )
            raise ValueError(
                f"layer_dropout is LayerSkip's (route={readers}), not for route={self.route!r}"
            )
        FAMILIES[self.route].validate(self)

    @classmethod
    def from_dict(cls, d):
        """From a stored dict (a checkpoint's model_args, a run's config.json), read by
        read_stored_config; keys that are not fields are dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in read_stored_config(d).items() if k in names})


def read_stored_config(d):
    """A copy of a stored config dict (model_args, config.json) as it ran: options its route added
    since it was written, whose default now differs from what the code did, get that behaviour (the
    family's stored_before). One holding an option's name from before the family prefixes (RENAMED)
    is refused: those names are no longer read."""
    old = [k for k in d if k in RENAMED]
    if old:
        raise ConfigError("a stored config (checkpoint or config.json) holds old option names: "
                          + ', '.join(f"{k} (now {RENAMED[k]})" for k in old)
                          + "; rename those keys in its model_args and config, or read it with "
                          "a version from before the old names were retired")
    out = dict(d)
    for key, value in getattr(FAMILIES.get(d.get('route')), 'stored_before', {}).items():
        out.setdefault(key, value)
    return out


def controlled_layer_ids(config):
    """The layers whose decisions the routing family makes (routed FFNs or routed blocks)."""
    return FAMILIES[config.route].routed_layers(config)


def is_controller_key(name):
    """Parameters and buffers of a routing controller rather than the backbone, of any family (each
    says which are its own: Family.is_controller_key): a stage-2 run loads the backbone from a
    checkpoint and starts these fresh; trainable='controller' trains these."""
    return any(family.is_controller_key(name) for family in FAMILIES.values())


def is_draft_key(name):
    """Parameters only a family's draft uses (Family.is_draft_key), of any family: a stage-2 run
    starts them fresh; trainable='draft' trains them."""
    return any(family.is_draft_key(name) for family in FAMILIES.values())


# --------------------------------------------------------------------------------------------------
# attention, with positions and an optional KV cache

class KVCache:
    """Per-layer K/V slots for batched decoding. Slot s of a row holds the token at absolute
    position s (so prompts of different lengths and tokens that skip a layer just leave slots
    empty); `kpos` is the position a slot holds, or -1 while empty. Shapes are static (max_len
    slots), so decoding steps all look alike to torch.compile / CUDA graphs. A forward attends over
    the first `attend_len` slots only (all of them unless attend_to says fewer hold anything)."""

    MIN_ATTEND = 64             # the smallest attended length: shorter buckets save nothing

    def __init__(self, config, batch_size, max_len, device, dtype):
        hd = config.n_embd // config.n_head
        shape = (batch_size, config.n_head, max_len, hd)
        # one tensor per layer, not one stacked: a compiled step writes a whole graph input in
        # place, where a write into a view of one (self.k[layer]) is copied whole, every layer
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.kpos = torch.full(
            (config.n_layer, batch_size, max_len), -1, dtype=torch.long, device=device
        )
        self.rows = torch.arange(batch_size, device=device)[:, None]   # (B, 1): row b of a write
        self.max_len = self.attend_len = max_len

    @classmethod
    def bucket(cls, n, max_len):
        """The attended length for positions < n: the smallest power of two >= n, at least
        MIN_ATTEND, at most max_len. A handful of static lengths, so a compiled step has one graph
        per bucket and a step costs attention over about the filled slots, not all of them."""
        return min(max_len, max(cls.MIN_ATTEND, 1 << (n - 1).bit_length()))

    def attend_to(self, n):
        """The next forwards write and read positions < n only (the caller knows n on the host:
        no sync), so they attend over bucket(n) slots."""
        self.attend_len = self.bucket(n, self.max_len)

    def write(self, layer, k, v, pos, valid=None):
        """k, v: (B, H, T, hd) for tokens at positions pos (B, T), B the cache's batch size (row b
        writes the cache's row b), positions distinct within a row; where valid (B, T) is False (a
        token that skips this layer) the slot is marked empty. Returns this layer's K, V, kpos over
        the attended slots."""
        # an index_put_ (row b, every head, slot pos[b, t]) that torch.compile keeps in place; a
        # scatter_ was compiled into a copy of the layer's whole slab per write
        # (a cast and each view is an operator call, paid per layer and step: only what is needed)
        k_all, v_all, kpos = self.k[layer], self.v[layer], self.kpos[layer]
        if k.dtype != k_all.dtype:
            k, v = k.to(k_all.dtype), v.to(v_all.dtype)
        k_all[self.rows, :, pos] = k.transpose(1, 2)
        v_all[self.rows, :, pos] = v.transpose(1, 2)
        kpos.scatter_(1, pos, pos if valid is None else torch.where(valid, pos, -1))
        n = self.attend_len
        return k_all[:, :, :n], v_all[:, :, :n], kpos[:, :n]


def rope_rotate(x, pos, base):
    """Rotary embedding of x (B, H, T, hd) at absolute positions pos (B, T), half-split
    convention."""
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

    def heads(self, x, pos=None):
        """q, k, v (B, n_head, T, head size) of x (B, T, C), q and k rotated at pos with rotary
        positions."""
        B, T, C = x.size()
        # one view and one permute (the same strides as three splits, views and transposes): a
        # decoding step costs its operator count at small widths
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(
            2, 0, 3, 1, 4).unbind(0)
        if self.rope_base is not None:
            p = pos if pos is not None else torch.arange(T, device=x.device).expand(B, T)
            q, k = rope_rotate(q, p, self.rope_base), rope_rotate(k, p, self.rope_base)
        return q, k, v

    def rotate(self, t, pos):
        """t (B, n_head, T, head size) rotated at positions pos (B, T) with rotary positions; t
        itself with learned ones (added to the embeddings)."""
        return t if self.rope_base is None else rope_rotate(t, pos, self.rope_base)

    def write_kv(self, x, pos, cache):
        """Only the K/V a forward with `cache` writes for x (B, T, C) at positions pos (B, T), or
        None for 0..T-1: for tokens whose update is dropped but whom later tokens attend to."""
        if pos is None:
            pos = torch.arange(x.size(1), device=x.device).expand(x.shape[:2])
        _, k, v = self.heads(x, pos)
        cache.write(self.layer, k, v, pos)

    def forward(self, x, pos=None, cache=None, valid=None):
        """x (B, T, C). pos (B, T) absolute positions (a row per row of x), or None for 0..T-1.
        With a cache (of batch size B), the new K/V are written into it and the queries attend over
        every filled slot at a position <= their own. valid (B, T) bool, optional: only these
        tokens are keys (and written to the cache); the others are padding or tokens that skip this
        layer, whose outputs the caller drops."""
        B, T, C = x.size()
        q, k, v = self.heads(x, pos)
        drop = self.dropout if self.training else 0.0
        if cache is None and pos is None and valid is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            if pos is None:
                pos = torch.arange(T, device=x.device).expand(B, T)
            if cache is not None:
                k, v, kpos = cache.write(self.layer, k, v, pos, valid)
                if k.dtype != q.dtype:
                    k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                kpos = pos if valid is None else torch.where(valid, pos, -1)
            kpos = kpos.view(B, 1, 1, -1)
            mask = (kpos >= 0) & (kpos <= pos.view(B, 1, T, 1))
            if valid is not None:       # dropped query rows attend anywhere: no empty row, so no
                                        # NaN
                mask = mask | ~valid[:, None, :, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        y = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return self.resid_dropout(y) if self.training else y      # eval: no dropout call to pay


class Block(nn.Module):
    """Pre-LN block. The two residual updates are separate methods so routing code can gather, scale
    or replace either one per token; `forward` is the dense composition. The routing family may add
    its own modules to a block (Family.build_block)."""

    def __init__(self, config, layer):
        super().__init__()
        self.layer = layer
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        FAMILIES[config.route].build_block(self, config, layer)

    def attn_update(self, x, pos=None, cache=None, valid=None):
        return self.attn(self.ln_1(x), pos, cache, valid)

    def ffn_update(self, x):
        return self.mlp(self.ln_2(x))

    def delta(self, x, pos=None, cache=None, valid=None):
        """f(x) = block(x) − x, the whole block's residual update."""
        a = self.attn_update(x, pos, cache, valid)
        return a + self.ffn_update(x + a)

    def write_kv(self, x, pos=None, cache=None):
        """What the block leaves behind for a token whose update is dropped: its K/V in the cache
        (nothing without one)."""
        if cache is not None:
            self.attn.write_kv(self.ln_1(x), pos, cache)

    def forward(self, x, pos=None, cache=None):
        # the class's methods: under FSDP the instance's are wrapped to gather the block's weights
        # (sharding.py), which forward, itself wrapped, has gathered already
        x = x + Block.attn_update(self, x, pos, cache)
        return x + Block.ffn_update(self, x)


# --------------------------------------------------------------------------------------------------


def allow_graphs(count):
    """Raise torch.compile's recompile limit (graphs kept per compiled function, 8 by default) to at
    least `count`: a step compiled with static shapes makes one graph per shape it meets."""
    import torch._dynamo as dynamo     # (a bare `import torch._dynamo` would make torch local)
    name = 'recompile_limit' if hasattr(dynamo.config, 'recompile_limit') else 'cache_size_limit'
    setattr(dynamo.config, name, max(getattr(dynamo.config, name), count))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.family = FAMILIES[config.route]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight   # tied embeddings
        self.family.build(self)                             # the family's model-level modules
        self.apply(self._init_weights)
        for name, p in self.named_parameters():             # scaled init of residual projections
                                                            # (GPT-2)
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.family.init_weights(self)
        self.exec_mode = None           # sparse eval: None (by device), 'static' or a path
                                        # (routing.exec_path)

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
            raise ValueError(
                f"sequence length {idx.size(1)} exceeds block_size {self.config.block_size}"
            )
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:
            x = x + (self.transformer.wpe(pos) if pos is not None
                     else self.transformer.wpe(torch.arange(idx.size(1), device=idx.device)))
        return self.transformer.drop(x) if self.training else x

    def forward(
        self,
        idx,
        targets=None,
        pos=None,
        cache=None,
        last_only=None,
        force=None,
        calibrate=False,
        sparse=True,
        exec_mode=None,
        **options,
    ):
        """idx (B, T) token ids. Returns (logits, loss, aux): logits for every position when targets
        are given (or last_only=False), else for the last position only; loss is the total training
        loss (LM + the family's weighted terms); aux holds the separate terms and routing statistics
        as tensors (no host sync): 'lm_loss', 'lm_counted' (whether any target is not −1: else
        lm_loss is 0 by definition, not a measured loss), '<name>_loss', 'full_frac' (per routed
        layer), 'masks'
        {layer: (B, T), 1 = full path / block runs}, 'margins' {layer: (B, T), each causal
        decision's gate score minus its threshold: > 0 full path}, 'tlops_saved'. force,
        calibrate, sparse, exec_mode (None: self.exec_mode) and the family's per-step options
        (Family.step_options) are what this forward asks of the routing family: routing.RouteCtx
        says what each means."""
        ctx = RouteCtx(
            force=force,
            calibrate=calibrate,
            sparse=sparse,
            targets=targets,
            idx=idx,
            pos=pos,
            options=options,
            exec_mode=exec_mode if exec_mode is not None else self.exec_mode,
        )
        self.family.begin(self, ctx)
        ctx.final = x = self.family.run_blocks(self, self.embed(idx, pos), pos, cache, ctx)
        last = (
            (lambda t: t[:, [-1]])
            if (targets is None if last_only is None else last_only)
            else (lambda t: t)
        )
        ctx.logits = logits = self.family.logits(self, x, ctx, last)
        aux, loss = dict(ctx.terms), None
        self.family.stats(self, ctx, aux)
        if targets is not None:
            loss = losses.lm_loss(logits, targets)
            aux['lm_loss'] = loss.detach()
            aux['lm_counted'] = targets.ne(-1).any()
            loss = self.family.loss(self, ctx, loss, targets, aux)
        for k, v in aux.items():            # statistics carry no graph; loss terms do
            if torch.is_tensor(v) and not k.endswith('_loss'):
                aux[k] = v.detach()
        return logits, loss, aux

    def mode(self, training):
        """Temporarily train() or eval(): every module's mode is restored afterwards (also on
        error)."""
        return training_flags(list(self.modules()), training)

    def controller_parameters(self):
        """The parameters controller-only training updates: the family's controller, not the
        backbone."""
        return [p for n, p in self.named_parameters() if self.family.is_controller_key(n)]

    def calibrate(self, idx):
        """Set the family's causal thresholds on held-out batches idx, where it has any; returns the
        realised full-path fractions (None otherwise)."""
        return self.family.calibrate(self, idx)

    def crop_block_size(self, block_size):
        """Shrink the context (e.g. GPT-2's 1024) to a smaller block_size; learned positions are
        cut."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if self.transformer.wpe is not None:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    # ----------------------------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(
        self,
        idx,
        max_new_tokens,
        temperature=1.0,
        top_k=None,
        use_cache=True,
        lengths=None,
        stats=None,
        vocab_limit=None,
        compile=False,
        speculate=0,
        draft=None,
        draft_layers=None,
        draft_stop=0.0,
        passes_per_graph=1,
    ):
        """Sample max_new_tokens continuations of idx (B, T), routed as model.eval() routes. With
        use_cache, the prompt is prefilled once and each new token costs one single-position
        forward; once the sequence outgrows block_size the context is cropped as in nanoGPT, which
        shifts every position, so the remaining tokens are computed by full recomputation on the
        cropped window (identical to use_cache=False by construction). lengths: prompts of different
        lengths, right-padded in idx (B, max len), row b's prompt being idx[b, :lengths[b]]: each
        row continues at its own positions (the cache slots the padding wrote are emptied after the
        prefill); returns a list of 1-D tensors. Needs the cache and max(lengths) + max_new_tokens
        <= block_size. stats: a dict to fill with the mean realised full-path fraction per routed
        layer over every forward ('full_frac') and the mean TLOps saved ('tlops_saved'), where the
        family has them (a padded prefill's over its real tokens). vocab_limit: sample only ids <
        vocab_limit (the tokenizer's real vocabulary; the model's is padded, and a padding id has
        no text). compile: run each cached
        decoding step (decode_step) through torch.compile(fullgraph=True), captured as a CUDA graph
        on CUDA (GPT.compiled), and with speculate each pass's draft and verification (their
        sampling too); the prefill and plain decoding's sampling stay eager. speculate=K > 0:
        self-speculative decoding (speculative.py), K tokens at a time from the family's draft
        `draft` (None: its default) stopping after `draft_layers` blocks where it has a depth (None:
        its default), and with draft_stop > 0 a pass drafting fewer where the draft is unsure
        (speculative.generate); the same output distribution, greedy the same tokens; needs the
        cache and the prompt plus max_new_tokens within block_size; stats also gets its acceptance
        figures. passes_per_graph=P > 1 (without draft_stop): P passes chained as one function,
        one graph when compiled, with one host round trip for P (speculative.chained_passes); the
        same tokens. draft, draft_layers, draft_stop and passes_per_graph without speculate are
        refused.
        top_k=1 is greedy decoding, as temperature=0: an argmax (the first of tied tokens), with no
        softmax and no random draw."""
        speculative.check_decoding(max_new_tokens, temperature, top_k)
        if top_k == 1:
            temperature = 0
        if not speculate:               # how speculation drafts: nothing for plain decoding to use
            for key, value, off in (('draft', draft, (None, '')),
                                    ('draft_layers', draft_layers, (None, 0)),
                                    ('draft_stop', draft_stop, (0,)),
                                    ('passes_per_graph', passes_per_graph, (1,))):
                if value not in off:
                    raise ValueError(f"{key}={value!r} needs speculate=K >= 1 (0: plain "
                                     "decoding)")
        if lengths is not None:
            if not use_cache:
                raise ValueError("lengths (prompts of different lengths) needs use_cache=True")
            lengths = [int(n) for n in lengths]         # a list or a tensor of lengths
        bs = self.config.block_size
        if stats is not None:           # a dict filled by an earlier call: this call's figures
            for k in [k for k in stats if k in ('full_frac', 'tlops_saved') or
                      k.startswith('spec_')]:
                stats.pop(k)
        record = (
            (
                lambda aux: [
                    stats.setdefault(k, []).append(aux[k].float())
                    for k in ('full_frac', 'tlops_saved')
                    if k in aux
                ]
            )
            if stats is not None
            else (lambda aux: None)
        )
        if speculate:
            if not use_cache:
                raise ValueError("speculate needs use_cache=True")
            idx = speculative.generate(
                self, idx, max_new_tokens, speculate, draft, draft_layers, temperature, top_k,
                lengths, record if stats is not None else None, vocab_limit, stats,
                compile=compile, draft_stop=draft_stop, passes_per_graph=passes_per_graph,
            )
        elif lengths is not None:
            idx = self.generate_ragged(
                idx, lengths, max_new_tokens, temperature, top_k,
                record if stats is not None else None, vocab_limit, compile
            )
        else:
            cache, step = None, self.decode_step_fn(idx.device, compile)
            for _ in range(max_new_tokens):
                B, T = idx.shape
                # nxt (set at the end of the previous step), not a view of idx: same strides every
                # step
                if use_cache and T <= bs and cache is not None:
                    step_pos = torch.full((B, 1), T - 1, device=idx.device)
                    cache.attend_to(T)
                    logits, aux = step(nxt, step_pos, cache, stats is not None)  # noqa: F821
                elif use_cache and T <= bs:
                    cache = self.new_cache(B, idx.device, compile)
                    cache.attend_to(T)
                    logits, _, aux = self(
                        idx, pos=torch.arange(T, device=idx.device).expand(B, T), cache=cache
                    )
                    logits = logits[:, -1, :]
                else:
                    logits, _, aux = self(idx[:, -bs:])
                    logits = logits[:, -1, :]
                record(aux)
                nxt = self.sample_next(logits, temperature, top_k, vocab_limit)
                idx = torch.cat((idx, nxt), dim=1)
        if stats:
            for k in [k for k in ('full_frac', 'tlops_saved') if k in stats]:
                stats[k] = torch.stack(stats[k]).mean(0).tolist()
        return idx

    def decode_step(self, tok, pos, cache, routing_stats=True):
        """One cached decoding step: tok (B, 1) ids at absolute positions pos (B, 1), a device
        tensor (per row: ragged batches), attending over and writing into cache. Returns the
        next-token logits (B, V) and the step's routing statistics ({} unless routing_stats:
        compiled on CUDA, each tensor a step returns costs the host a copy). Static shapes and no
        host sync (under torch.compile sparse eval runs a static path), so every step is the same
        graph."""
        logits, _, aux = self(tok, pos=pos, cache=cache)
        keys = ('full_frac', 'tlops_saved') if routing_stats else ()
        return logits[:, -1], {k: aux[k] for k in keys if k in aux}

    def decode_step_fn(self, device, compile):
        """decode_step, eager or compiled (GPT.compiled)."""
        return self.compiled(self.decode_step, device) if compile else self.decode_step

    @staticmethod
    def compiled(step, device):
        """step(*arguments) -> tensors (nested in tuples and dicts) through
        torch.compile(fullgraph=True, dynamic=False): one graph per input shape and attended bucket
        (batch sizes, buckets and a speculative pass's window lengths: more than torch's default
        recompile limit of 8, so the limit is raised to DECODE_GRAPHS). Random numbers come from
        torch's own generator, as eagerly ('fallback_random'): inductor's draws a float64
        torch.rand as a float32 one, whose coarser steps would change which tokens a speculative
        pass's sampling can draw. On CUDA it is captured as a CUDA graph ('triton.cudagraphs', what
        mode='reduce-overhead' sets), whose outputs the next replay overwrites: they are cloned
        before anyone keeps them."""
        allow_graphs(DECODE_GRAPHS)
        options = {'fallback_random': True}
        if device.type != 'cuda':
            return torch.compile(step, fullgraph=True, dynamic=False, options=options)
        graphed = torch.compile(step, fullgraph=True, dynamic=False,
                                options={**options, 'triton.cudagraphs': True})

        def run(*args):
            torch.compiler.cudagraph_mark_step_begin()
            return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, graphed(*args))
        return run

    def decode_layout(self):
        """Store every Linear weight column-major (its transpose contiguous, as transformers' GPT-2
        stores its Conv1D weights) on the CPU: the same values, shapes and state_dict, but MKL
        multiplies a few rows by it without transposing it first. At the GPT-2 124M shape the LM
        head runs 1.3× faster for one row and 1.8× for eight, the blocks' projections 1.0–1.1× and
        1.3–1.4× (the small 768×768 one slower at eight rows); decoding, against transformers'
        GPT-2, went 1.08× faster at batch 1 and 1.28× at batch 8
        (results/cpu_2026-11-26/decode_layout/). Training works in either layout. Elsewhere (a GPU:
        unmeasured) it leaves the model as it is. Returns the model."""
        if next(self.parameters()).device.type == 'cpu':
            with torch.no_grad():
                for m in self.modules():
                    if isinstance(m, nn.Linear) and m.weight.is_contiguous():
                        m.weight.data = m.weight.data.t().contiguous().t()
        return self

    def new_cache(self, batch_size, device, compile=False):
        """An empty KV cache of block_size slots. A CUDA graph writes into the cache in place at the
        addresses it was captured with, so compiled decoding on CUDA gets one cache per batch size,
        at static addresses, emptied and reused by every later decoding: the graph is captured
        once."""
        dtype = self.lm_head.weight.dtype
        if not (compile and device.type == 'cuda'):
            return KVCache(self.config, batch_size, self.config.block_size, device, dtype)
        caches = self.__dict__.setdefault('graph_caches', {})
        cache = caches.get((batch_size, device, dtype))
        if cache is None:
            cache = caches[batch_size, device, dtype] = KVCache(
                self.config, batch_size, self.config.block_size, device, dtype
            )
            for t in (*cache.k, *cache.v, cache.kpos, cache.rows):
                torch._dynamo.mark_static_address(t)
        cache.kpos.fill_(-1)            # empty: slots whose kpos is -1 are never read
        cache.attend_len = cache.max_len
        return cache

    def generate_ragged(
        self, idx, lengths, max_new_tokens, temperature, top_k, record, vocab_limit=None,
        compile=False,
    ):
        """generate's decoding of right-padded prompts of `lengths`; record(aux) gets the routing
        statistics of the prefill and of each step (None: nobody reads them)."""
        B, dev = idx.size(0), idx.device
        routing_stats, record = record is not None, record or (lambda aux: None)
        if len(lengths) != B or min(lengths) < 1 or max(lengths) > idx.size(1):
            raise ValueError(
                f"lengths {lengths} must give 1..{idx.size(1)} prompt tokens for each of {B} rows"
            )
        if max(lengths) + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"the longest prompt ({max(lengths)}) plus {max_new_tokens} new tokens exceeds "
                f"block_size {self.config.block_size}"
            )
        idx = idx[:, :max(lengths)]     # columns past the longest prompt hold padding alone
        step = self.decode_step_fn(dev, compile)
        cache = self.new_cache(B, dev, compile)
        n = torch.tensor(lengths, device=dev)
        T = idx.size(1)
        cache.attend_to(T)
        logits, _, aux = self(
            idx, pos=torch.arange(T, device=dev).expand(B, T), cache=cache, last_only=False
        )
        if routing_stats:
            record(self.real_token_stats(aux, lengths))
        slot = torch.arange(cache.max_len, device=dev)[None, :]
        # forget what the padding wrote
        cache.kpos.masked_fill_((slot >= n[:, None]) & (slot < T), -1)
        logits = logits[torch.arange(B, device=dev), n - 1]
        out = torch.zeros(B, max(lengths) + max_new_tokens, dtype=torch.long, device=dev)
        out[:, :T] = idx
        for i in range(max_new_tokens):
            nxt = self.sample_next(logits, temperature, top_k, vocab_limit)
            out[torch.arange(B, device=dev), n + i] = nxt[:, 0]
            if i + 1 < max_new_tokens:
                cache.attend_to(max(lengths) + i + 1)
                logits, aux = step(nxt, (n + i)[:, None], cache, routing_stats)
                record(aux)
        return [out[b, :lengths[b] + max_new_tokens] for b in range(B)]

    def real_token_stats(self, aux, lengths):
        """The routing statistics of a forward over right-padded prompts of `lengths` (aux), over
        their real tokens alone: the family's own statistics of the masks at those tokens, as one
        row. The padding's decisions are no token's; a host sync, so only where they are read."""
        if 'masks' not in aux:
            return aux
        masks, dev = aux['masks'], self.lm_head.weight.device
        T = next(iter(masks.values())).size(1)
        real = torch.arange(T, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        out = {}
        self.family.stats(self, RouteCtx(masks={l: m[real][None] for l, m in masks.items()}), out)
        return out

    @staticmethod
    def sample_next(logits, temperature, top_k, vocab_limit=None):
        """The next token (B, 1) from logits (B, V), picked as speculative decoding picks (the one
        definition its exactness must match): their argmax at temperature 0, else drawn from
        speculative.next_probs. vocab_limit: ids are column indices, so dropping the padded columns
        excludes them."""
        return speculative.pick(logits, temperature, top_k, vocab_limit)[0][:, None]

    # ----------------------------------------------------------------------------------------------
    # training helpers

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, params=None):
        """AdamW with decay on matrices only; `params` restricts training to a subset (e.g. the
        controller in controller-only training). Fused where the device supports it."""
        params = [
            p for p in (params if params is not None else self.parameters()) if p.requires_grad
        ]
        seen, uniq = set(), []
        for p in params:                                   # tied weights appear once
            if id(p) not in seen:
                seen.add(id(p))
                uniq.append(p)
        groups = [{'params': [p for p in uniq if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in uniq if p.dim() < 2], 'weight_decay': 0.0}]
        fused = device_type in ('cuda', 'cpu')
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    # ----------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path, override_args=None):
        """Load HF GPT-2 weights ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local
        directory saved by transformers). Needs the `transformers` package; HF's Conv1D stores
        weights transposed relative to nn.Linear, hence the transposes."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise ConfigError(f"init_from={name_or_path} needs the transformers package: "
                              f"pip install transformers") from None
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_path)
        except (OSError, ValueError) as e:       # no local copy and no network, or not GPT-2 files
            cache = hf_hub_cache()
            where = (f"the folder {name_or_path}" if os.path.isdir(name_or_path) else
                     f"the Hugging Face cache {cache}, then huggingface.co")
            raise ConfigError(
                f"init_from={name_or_path}: no GPT-2 weights could be loaded (looked in {where}: "
                f"{str(e).splitlines()[0][:160]}); on a machine with network run python -c \"from "
                f"transformers import GPT2LMHeadModel as M; M.from_pretrained('{name_or_path}')"
                f".save_pretrained('gpt2_local')\", copy gpt2_local here and pass "
                f"--init_from=gpt2_local") from None
        c = hf.config
        args = dict(
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_embd=c.n_embd,
            vocab_size=c.vocab_size,
            block_size=c.n_positions,
            bias=True,
            pos='learned',
            dropout=0.0,
            gelu='tanh' if c.activation_function in ('gelu_new', 'gelu_pytorch_tanh') else 'none',
        )
        args.update(override_args or {})
        model = cls(GPTConfig(**args))
        sd, sd_hf = model.state_dict(), hf.state_dict()
        transposed = (
            'attn.c_attn.weight',
            'attn.c_proj.weight',
            'mlp.c_fc.weight',
            'mlp.c_proj.weight',
        )
        keys = [k for k in sd_hf if not k.endswith(('.attn.masked_bias', '.attn.bias'))]
        dense = re.compile(r'(lm_head|transformer\.(wte|wpe|ln_f|h\.\d+\.(ln_1|attn|ln_2|mlp)))\.')
        # the family's modules keep their init
        missing = {k for k in sd if dense.match(k)} - set(keys)
        if missing:
            raise ValueError(f"from_pretrained: no HF weights for {sorted(missing)}")
        with torch.no_grad():
            for k in keys:
                src = sd_hf[k].t() if k.endswith(transposed) else sd_hf[k]
                if src.shape != sd[k].shape:
                    raise ValueError(
                        f"from_pretrained: shape mismatch for {k}: {tuple(src.shape)} vs "
                        f"{tuple(sd[k].shape)}"
                    )
                sd[k].copy_(src)
        model.family.after_load(model)
        return model
