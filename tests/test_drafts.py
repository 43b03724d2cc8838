"""Every draft of every family (Family.drafts) computes, inside self-speculative decoding, what
docs/decoding.md's table says it computes. Greedy exactness does not show this (the verifier makes
the output exact whatever the draft proposes), so each draft's next-token logits are compared with
a forward written here from the model's modules (embeddings, LayerNorms, Linear weights, FFNs,
routers and heads; attention, RoPE and every draft's composition of them by hand).

The logits checked are those speculative.generate takes from speculative.draft_step, captured while
it decodes (several passes, ragged prompts, kept and rejected drafts). At the start of a pass the
cache holds the verifier's K/V of the row's kept prefix, positions below the pass's first position
`base`; the draft is fed the pending token at `base`, then its own picks, and its token at step j
attends over (i) those prefix K/V at the layers it runs and (ii) its own K/V at the layers it runs
of the tokens it was fed at steps <= j. The reference is that computation by hand, for the drafted
tokens of each pass, with the prefix K/V taken from two sources:

- the cache as the pass found it (every family and option set, random gates included);
- a forward over the prefix written here that routes as the verifier routes (ffn's threshold and
  predictor gates, MoD's routers, TSA's halting, CALM's early exit, the dense stack of the dense
  model and the ensemble), for the deterministic option sets, where no decision of the prefix lies
  within NEAR of flipping.

So for the dense model's `layers`, halt's `halt` and ensemble's drafts the reference is the first
E blocks recomputed over prefix and drafted tokens with no cache at all; for ffn, mod, the exit
family and every family's `layers` it is the draft path over the drafted tokens attending over the
routed verifier's K/V of the prefix (a prefix token that skipped a MoD block or took a cheap FFN,
or exited at a depth d <= E − 2, leaves the routed state's K/V at the layers above, not the draft
path's).

Tolerance: fp32, logits within TOL; the halt draft's own halting decisions equal the reference's
exactly (where the reference's router output is not within NEAR of the threshold)."""
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import speculative
from conftest import EXAMPLES, ROUTED_TOL, SETTINGS, build
from model import FAMILIES, GPTConfig

pytestmark = pytest.mark.usefixtures('one_thread')

# fp32 logits, the hand forward against the library's: conftest's tolerance for noised routed
# models (the largest difference measured here was 0.4 of rtol = atol = 1e-5)
TOL = ROUTED_TOL
NEAR = 1e-4                         # a decision whose margin is this close to 0 may flip with
                                    # rounding: not compared
N_LAYERS = (3, 4)


# option sets beside conftest.EXAMPLES': (route, option set, overrides). With an exit at every depth
# and a low threshold, prefix tokens exit at d <= E − 2, so at layers d + 1 .. E − 1 the verifier's
# K/V of them come from their copied state, not from the blocks the draft runs.
MORE = [('exit', 2, dict(exit_layers='every', exit_head='own'))]


def offered():
    """[(case id, route, option set, overrides, draft)] for every draft every family offers
    (Family.drafts) on the models this file builds."""
    sets = [(route, opt, {}) for route in FAMILIES
            for opt in range(len(EXAMPLES.get(route, [dict()])))] + MORE
    out = []
    for route, opt, more in sets:
        case = f"{route}{opt}{'+' if more else ''}"
        for n_layer in N_LAYERS:
            extra = dict(EXAMPLES.get(route, [dict()])[opt], **more)
            cfg = GPTConfig(block_size=24, vocab_size=23, n_head=2, n_embd=16, route=route,
                            n_layer=n_layer, **extra)
            out += [(f'{case}-{name}', route, opt, more, name)
                    for name in FAMILIES[route].drafts(cfg)
                    if (f'{case}-{name}', route, opt, more, name) not in out]
    return out


DRAFTS = offered()


def is_random(model):
    cfg = model.config
    return (cfg.route == 'ffn' and cfg.ffn_gate == 'random') or (
        cfg.route == 'mod' and cfg.mod_router == 'random')


# --------------------------------------------------------------------------------------------------
# the pieces, by hand

def embed(model, idx, pos):
    x = model.transformer.wte.weight[idx]
    if model.config.pos == 'learned':
        x = x + model.transformer.wpe.weight[pos]
    return x


def rotate(model, t, pos):
    """Rotary positions (half-split) of t (H, T, hd) at positions pos (T,); t itself with learned
    positions."""
    if model.config.pos != 'rope':
        return t
    hd = t.size(-1)
    freq = model.config.rope_base ** -(torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos[:, None].float() * freq
    cos, sin = ang.cos(), ang.sin()
    a, b = t[..., :hd // 2], t[..., hd // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def qkv(model, block, x, pos):
    """q, k, v (H, T, hd) of states x (T, C) entering `block`, q and k rotated."""
    attn, H = block.attn, model.config.n_head
    h = F.linear(block.ln_1(x), attn.c_attn.weight, attn.c_attn.bias)
    q, k, v = (t.view(x.size(0), H, -1).transpose(0, 1) for t in h.split(x.size(1), -1))
    return rotate(model, q, pos), rotate(model, k, pos), v


def attend(block, q, qpos, k, v, kpos):
    """Attention output (T, C), after c_proj, of queries q (H, T, hd) at qpos over keys k, v
    (H, S, hd) at kpos: each query sees the keys at positions <= its own."""
    scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], -math.inf)
    y = scores.softmax(-1) @ v
    return F.linear(y.transpose(0, 1).reshape(q.size(1), -1), block.attn.c_proj.weight,
                    block.attn.c_proj.bias)


def self_attend(model, block, x, pos, valid):
    """Causal attention of the sequence x (T, C) over itself, its keys the tokens where valid;
    also returns the K/V and positions of those keys (what a cache holds of them)."""
    q, k, v = qkv(model, block, x, pos)
    k, v, kpos = k[:, valid], v[:, valid], pos[valid]
    return attend(block, q, pos, k, v, kpos), (k, v, kpos)


def exit_head(model, d, x):
    if model.config.exit_head == 'own':
        head = model.exit_heads[str(d)]
        return F.linear(head.ln(x), head.proj.weight)
    return F.linear(model.transformer.ln_f(x), model.lm_head.weight)


# --------------------------------------------------------------------------------------------------
# the verifier's K/V of a prefix: read from the cache, or computed here as the verifier routes

def cached_context(snapshot, b, base):
    """Per layer (K, V, positions) that the cache `snapshot` (K list, V list, kpos) holds for row b
    at positions below base."""
    ks, vs, kpos = snapshot
    out = []
    for layer in range(len(ks)):
        held = (kpos[layer, b] >= 0) & (kpos[layer, b] < base)
        out.append((ks[layer][b][:, held], vs[layer][b][:, held], kpos[layer, b][held]))
    return out


def verifier_context(model, idx):
    """Per layer (K, V, positions) of prefix tokens idx (S,) at positions 0..S−1, as the routed
    model in eval mode computes them, and the smallest |margin| of its decisions (inf: none)."""
    cfg, blocks = model.config, model.transformer.h
    S = idx.size(0)
    pos = torch.arange(S)
    x, everyone, context, margin = embed(model, idx, pos), torch.ones(S, dtype=torch.bool), [], []
    done = torch.zeros(S, dtype=torch.bool)             # exit: tokens that have left
    for layer, block in enumerate(blocks):
        routed = layer in model.family.routed_layers(cfg)
        if cfg.route == 'mod' and routed:
            r = block.router(x)
            decider = block.predictor(x) if block.predictor is not None else r
            sel = decider > 0
            margin.append(decider)
            a, kv = self_attend(model, block, x, pos, sel)
            new = x + torch.sigmoid(r)[:, None] * (a + block.mlp(block.ln_2(x + a)))
            x = torch.where(sel[:, None], new, x)
        elif cfg.route == 'halt' and layer > 0:
            p = model.halt[layer - 1](x)
            if cfg.halt_soft_eval:
                keep = 1 - p
            else:
                active = (p <= cfg.halt_tau).float()
                keep = active * (1 - p) if cfg.halt_hard == 'scaled' else active
                margin.append(cfg.halt_tau - p)
            a, kv = self_attend(model, block, x, pos, everyone)
            x = x + keep[:, None] * a
            x = x + keep[:, None] * block.mlp(block.ln_2(x))
        elif cfg.route == 'exit':
            a, kv = self_attend(model, block, x, pos, everyone)
            y = x + a
            y = y + block.mlp(block.ln_2(y))
            before, x = x, torch.where(done[:, None], x, y)
            if layer + 1 in model.exit_ids:
                if cfg.exit_conf == 'saturation':
                    conf = F.cosine_similarity(x, before, dim=-1)
                else:
                    top = exit_head(model, layer + 1, x).softmax(-1).topk(2, -1).values
                    conf = top[:, 0] if cfg.exit_conf == 'softmax' else top[:, 0] - top[:, 1]
                margin.append((cfg.exit_threshold - conf)[~done])
                done = done | (conf >= cfg.exit_threshold)
        else:
            a, kv = self_attend(model, block, x, pos, everyone)
            x = x + a
            h = block.ln_2(x)
            if cfg.route == 'ffn' and routed and cfg.ffn_gate in ('static_full', 'static_cheap'):
                x = x + (block.mlp(h) if cfg.ffn_gate == 'static_full' else block.cheap(h))
            elif cfg.route == 'ffn' and routed:
                score = block.gate(h)
                decider = block.predictor(h) if block.predictor is not None else score
                sel = decider > block.tau
                margin.append(decider - block.tau)
                full = block.mlp(h)
                if cfg.ffn_gate_grad == 'scale':
                    full = torch.sigmoid(score)[:, None] * full
                x = x + torch.where(sel[:, None], full, block.cheap(h))
            else:
                x = x + block.mlp(h)
        context.append(kv)
    near = min((m.abs().min().item() for m in margin if m.numel()), default=math.inf)
    return context, near


# --------------------------------------------------------------------------------------------------
# the drafts, by hand

def draft_depth(model, name, depth):
    """How many blocks draft `name` runs."""
    cfg = model.config
    if name in ('layers', 'exit', 'halt'):
        return depth
    if name == 'earliest':
        return cfg.n_layer - cfg.ens_layers + 1
    assert name in ('cheap', 'distilled', 'skip'), f'no reference here for draft {name!r}'
    return cfg.n_layer


def draft_by_hand(model, name, depth, context, idx, pos):
    """Draft `name`'s logits (J, V) for the tokens idx (J,) a pass fed it at positions pos (J,),
    attending over context (per layer the prefix's K, V, positions) and over its own K/V of the
    earlier fed tokens; and its halting decisions {layer: (J,)} (halt only), with their margins."""
    cfg, blocks = model.config, model.transformer.h
    routed = model.family.routed_layers(cfg)
    x, decisions = embed(model, idx, pos), {}
    for layer in range(draft_depth(model, name, depth)):
        block = blocks[layer]
        k_pre, v_pre, p_pre = context[layer]
        if name == 'skip' and layer in routed:
            continue                                    # no update, no K/V
        q, k, v = qkv(model, block, x, pos)
        a = attend(block, q, pos, torch.cat([k_pre, k], 1), torch.cat([v_pre, v], 1),
                   torch.cat([p_pre, pos]))
        keep = torch.ones(())
        if name == 'halt' and layer > 0:
            p = model.halt[layer - 1](x)
            if cfg.halt_soft_eval:
                keep = 1 - p
            else:
                active = p <= cfg.halt_tau
                decisions[layer] = (active, cfg.halt_tau - p)
                keep = active.float() * (1 - p) if cfg.halt_hard == 'scaled' else active.float()
            keep = keep[:, None]
        x = x + keep * a
        ffn = block.mlp
        if layer in routed and name == 'cheap':
            ffn = block.cheap
        elif layer in routed and name == 'distilled':
            ffn = block.draft_ffn
        x = x + keep * ffn(block.ln_2(x))
    if name == 'exit':
        return exit_head(model, depth, x), decisions
    if name == 'earliest':
        return F.linear(model.ens_norms[0](x), model.lm_head.weight), decisions
    return F.linear(model.transformer.ln_f(x), model.lm_head.weight), decisions


# --------------------------------------------------------------------------------------------------
# what decoding computes

def decode_and_capture(model, name, depth, idx, lens, new, K, temperature):
    """speculative.generate's decode, recording every pass: the cache as the pass found it, and per
    draft step the tokens and positions fed to speculative.draft_step, the logits it returned and
    the halting routers' outputs (p, one (B,) per router called) inside it."""
    passes, inside, router_out = [], [False], []
    draft_step, verify_pass = speculative.draft_step, speculative.verify_pass

    def drafting(model, name, depth, tok, pos, cache):
        if not passes or passes[-1]['verified']:
            snap = ([k.clone() for k in cache.k], [v.clone() for v in cache.v], cache.kpos.clone())
            passes.append(dict(cache=snap, steps=[], verified=False))
        router_out.clear()
        inside[0] = True
        try:
            logits = draft_step(model, name, depth, tok, pos, cache)
        finally:
            inside[0] = False
        passes[-1]['steps'].append((tok[:, 0].clone(), pos[:, 0].clone(), logits.clone(),
                                    [p[:, 0].clone() for p in router_out]))
        return logits

    def verifying(*args):
        if passes:
            passes[-1]['verified'] = True
        return verify_pass(*args)

    hooks = [router.register_forward_hook(lambda m, a, out: router_out.append(out) if inside[0]
                                          else None)
             for router in getattr(model, 'halt', [])]
    try:
        with mock.patch.object(speculative, 'draft_step', drafting), \
                mock.patch.object(speculative, 'verify_pass', verifying):
            out = speculative.generate(model, idx, new, K, name, depth, temperature=temperature,
                                       lengths=lens)
    finally:
        for h in hooks:
            h.remove()
    return passes, out


@pytest.mark.parametrize('case,route,opt,more,name', DRAFTS, ids=[d[0] for d in DRAFTS])
@settings(**{**SETTINGS, 'max_examples': 6})
@given(data=st.data(), seed=st.integers(0, 999), n_layer=st.sampled_from(N_LAYERS),
       K=st.integers(1, 3), lens=st.lists(st.integers(1, 8), min_size=1, max_size=2),
       new=st.integers(3, 8), temperature=st.sampled_from([0.0, 1.0]))
def test_the_draft_computes_what_its_family_says(case, route, opt, more, name, data, seed, n_layer,
                                                 K, lens, new, temperature):
    """Each draft step's logits in decoding equal the draft's computation by hand (module
    docstring): over the verifier's K/V of the prefix as the cache held them, and, where the
    verifier's routing is deterministic, as the routed forward written here computes them."""
    model = build(route, opt, seed=seed, n_layer=n_layer, **more).eval()
    if name not in model.family.drafts(model.config):
        return                                          # (the option set offers it at one depth)
    depths = model.family.draft_depths(model.config, name)
    depth = data.draw(st.sampled_from(depths[0]), label='E') if depths else None
    idx = torch.randint(0, model.config.vocab_size, (len(lens), max(lens)),
                        generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    with torch.no_grad():
        passes, out = decode_and_capture(model, name, depth, idx, lens, new, K, temperature)
        checked = 0
        for p in passes:
            base = p['steps'][0][1]
            fed = torch.stack([s[0] for s in p['steps']], 1)       # (B, j)
            at = torch.stack([s[1] for s in p['steps']], 1)
            got = torch.stack([s[2] for s in p['steps']], 1)       # (B, j, V)
            for b in range(len(lens)):
                assert torch.equal(at[b], base[b] + torch.arange(at.size(1)))
                n = int(base[b])
                sources = [cached_context(p['cache'], b, n)]
                if not is_random(model) and n <= len(out[b]):
                    context, near = verifier_context(model, out[b][:n])
                    if near > NEAR:
                        sources.append(context)
                for context in sources:
                    want, decisions = draft_by_hand(model, name, depth, context, fed[b], at[b])
                    torch.testing.assert_close(got[b], want, **TOL)
                    for layer, (active, margin) in decisions.items():
                        # router layer − 1 gates block `layer`; the draft calls it once per step
                        drawn = torch.stack([s[3][layer - 1][b] for s in p['steps']]) <= \
                            model.config.halt_tau
                        clear = margin.abs() > NEAR
                        assert torch.equal(drawn[clear], active[clear]), (layer, b)
                    checked += 1
        assert checked                  # (new >= 3: at least one pass drafts a token)
