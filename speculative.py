"""
Self-speculative decoding (LayerSkip, arXiv 2404.16710; Draft & Verify, arXiv 2309.08168): a cheap
version of the same model, the draft, proposes K tokens one at a time; the model itself, the
verifier, scores all K (and the token before them) in ONE cached forward, keeps the longest prefix
it agrees with and adds one token of its own. Each family names its drafts (routing.Family.drafts:
the first E blocks and an exit's head, every routed FFN cheap, every routed block skipped, ...).

What is exact. Greedy (temperature 0): the output is token for token the plain routed decode of the
model, because every token that is kept is the verifier's argmax given the kept prefix, and the
verifier routes each token of its window as plain decoding routes it (every family's decisions are
causal per token: a token's path depends on its prefix alone). Sampling: the rejection rule of
Leviathan et al. ("Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192):
draft token x, drawn from the draft's q, is kept with probability min(1, p(x)/q(x)), p the
verifier's distribution (the same temperature, top_k and vocabulary limit as plain sampling);
at the first rejection the next token is drawn from norm(max(0, p − q)), and after K kept ones from
p. Each token then has exactly plain sampling's distribution.

The KV cache. Draft and verifier share the verifier's cache: slot s of a row holds position s. Of
a row of n tokens the cache holds the first n − 1 (the last, pending, is the verifier's latest
pick). The draft writes slots n − 1 .. n + K − 2 as it goes; they are emptied (kpos = −1) before the
verifier writes slots n − 1 .. n + K − 1, and once a drafted tokens are kept, the slots of the
rejected positions, n + a onwards, are emptied in every layer. So the verifier always sees exactly
plain decoding's cache, and the draft reads the verifier's K/V of the accepted prefix: where it
computes what the verifier computes (the first E blocks of the dense model and of the halt draft,
the blocks of the ensemble's earliest layer; of the exit draft, for tokens that did not exit at a
depth d <= E - 2) it reuses them instead of recomputing. A row that is done runs along with the
others, its cache as it finished (near block_size its last slots are kept aside and put back).

    y = model.generate(idx, 64, temperature=0, speculate=4)         # the family's default draft
    y = model.generate(idx, 64, speculate=4, draft='layers', draft_layers=3)
"""
import time

import torch
import torch.nn.functional as F

from routed_rows import version_tuple
from routing import RouteCtx


def resolve_draft(config, family, draft=None, depth=None):
    """(draft name, its depth E or None) for the family of `config`: `draft` None is the family's
    default, `depth` None the draft's default. ValueError (one line naming the drafts or depths
    there are) otherwise."""
    drafts = family.drafts(config)
    name = next(iter(drafts)) if draft in (None, '') else draft
    if name not in drafts:
        listed = '; '.join(f"'{k}': {v}" for k, v in drafts.items())
        raise ValueError(
            f"draft {draft!r} is not one of route={config.route!r}'s drafts ({listed})"
        )
    depths = family.draft_depths(config, name)
    if depths is None:
        if depth not in (None, 0):
            raise ValueError(f"draft {name!r} has no depth; leave draft_layers out (or 0)")
        return name, None
    allowed, default = depths
    if depth in (None, 0):
        return name, default
    if depth not in allowed:
        raise ValueError(f"draft_layers={depth} is not a depth draft {name!r} can stop at: one of "
                         f"{allowed}")
    return name, depth


def next_probs(logits, temperature, top_k, vocab_limit=None):
    """The distribution GPT.sample_next draws from, (..., V'), V' = vocab_limit or V (a slice to
    None keeps every column). In float32, and each row's largest logit subtracted before the
    division: a logit over a small temperature (half precision's, or any over a subnormal one)
    overflows to inf, and a softmax over two infs is NaN; shifted, the largest is 0 and the
    others at most 0, -inf where they underflow. top_k None or 0: every token."""
    logits = logits[..., :vocab_limit].float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[..., [-1]], -float('inf'))
    return F.softmax(logits, dim=-1)


def draw(probs):
    """One token per row, (B,), from the distributions probs (B, V): the first token whose
    cumulative probability (summed in float64) exceeds u times the row's total, u uniform in
    [0, 1). torch.multinomial(probs, 1)'s distribution from one random number per row instead of
    one per token, whose cost (about 1 ms per row over GPT-2's 50,257 ids on the CPU, 7 ms at 8
    rows) is a sizeable share of a decoding step's. A token of probability 0 is never drawn: past
    the total (by rounding) the last token of positive probability is taken."""
    c = probs.double().cumsum(-1)
    total = c[:, -1:].contiguous()
    u = torch.rand(total.shape, dtype=c.dtype, device=c.device) * total
    last = torch.searchsorted(c, total)                  # the last token of positive probability
    return torch.minimum(torch.searchsorted(c, u, right=True), last)[:, 0]


def drafted_prob(logits, tok, q, vocab_limit):
    """(B,): the probability the draft gave the token tok it drafted: under q where it sampled,
    under the softmax of its logits (temperature 1) where it was greedy (q None)."""
    if q is None:
        lg = logits[..., :vocab_limit]
        q = F.softmax(lg.float(), dim=-1)
    return q.gather(-1, tok[:, None])[:, 0]


def check_decoding(max_new_tokens, temperature, top_k):
    """ValueError for what no decoding can take: a negative token count, a negative or NaN
    temperature (a negative one favours the least likely tokens), a negative top_k."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: every token), got {top_k}")


def pick(logits, temperature, top_k, vocab_limit):
    """(token (B,), its distribution (B, V') or None when greedy)."""
    if temperature == 0:
        lg = logits[..., :vocab_limit]
        return lg.argmax(-1), None
    q = next_probs(logits, temperature, top_k, vocab_limit)
    return draw(q), q


def accept(draft, q, logits, temperature, top_k, vocab_limit):
    """Leviathan et al.'s rule for a batch: draft (B, k) tokens drawn from q (B, k, V') (None:
    greedy), the verifier's logits (B, k + 1, V). Returns (a (B,): the drafted tokens kept, t (B,):
    the verifier's next token after them)."""
    B, k = draft.shape
    rows = torch.arange(B, device=draft.device)
    if temperature == 0:
        lg = logits[..., :vocab_limit]
        best = lg.argmax(-1)                                            # (B, k + 1)
        a = (best[:, :k] == draft).int().cumprod(1).sum(1)
        return a, best[rows, a]
    p = next_probs(logits, temperature, top_k, vocab_limit)             # (B, k + 1, V')
    q = p.new_zeros(B, 0, p.size(-1)) if q is None else q               # k = 0: nothing drafted
    px = p[:, :k].gather(-1, draft[..., None])[..., 0]
    qx = q.gather(-1, draft[..., None])[..., 0]                          # > 0: x was drawn from q
    kept = torch.rand(B, k, device=draft.device) * qx < px               # u < p(x) / q(x)
    a = kept.int().cumprod(1).sum(1)
    # the residual norm(max(0, p − q)) at the first rejection; after k kept tokens q is 0: p itself
    qa = torch.cat([q, q.new_zeros(B, 1, q.size(-1))], 1)[rows, a]
    pa = p[rows, a]
    resid = (pa - qa).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), pa)     # (p = q: never rejected)
    return a, draw(resid)


def draft_step(model, name, depth, tok, pos, cache):
    """The draft's next-token logits (B, V) for tokens tok (B, 1) at positions pos (B, 1)."""
    return model.family.draft_logits(model, name, tok, pos, cache, depth)[:, -1]


def draft_pass(model, name, depth, tok, base, cache, k, temperature, top_k, vocab_limit,
               keep_logits=False):
    """k draft steps from the pending tokens tok (B,) at positions base (B,), each picking its token
    as plain decoding picks: (window (B, k + 1): tok and the k drafted tokens, q (B, k, V'): their
    draft distributions (None when greedy or k = 0), the last step's logits (B, V) where
    keep_logits, else None: compiled on CUDA, every output is one more copy a pass)."""
    window, q, logits = [tok], [], None
    for j in range(k):
        logits = draft_step(model, name, depth, tok[:, None], (base + j)[:, None], cache)
        tok, qj = pick(logits, temperature, top_k, vocab_limit)
        window.append(tok)
        q.append(qj)
    return (torch.stack(window, 1), torch.stack(q, 1) if q and q[0] is not None else None,
            logits if keep_logits else None)


def verify_pass(model, window, q, base_active, cache, temperature, top_k, vocab_limit,
                keep_logits, routing=None):
    """The verifier's pass over window (B, k + 1) at positions base .. base + k (base_active (2, B):
    each row's base, and 1 where it still decodes): the draft's K/V emptied, the window scored in
    one forward, the rejection rule applied and the rejected positions' slots emptied again
    (an active row's from base + a + 1, the new pending token's included; a finished row's from
    base).
    Returns (a (B,): the drafted tokens kept, tok (B,): the verifier's next token after them, kept
    (B, k + 1): window[1:a + 1] then tok, the verifier's logits (B, k + 1, V) where keep_logits
    (else None), its routing over the window where routing names it (else None): routing =
    (mask layers, margin layers), the keys of the forward's aux['masks'] and aux['margins'] to
    return, as one float tensor (masks then margins, B, k + 1). One tensor, not one per layer:
    compiled on CUDA each output is copied out of the graph at a host cost of its own, a suspect
    in a verification's costing 1.5-1.7 plain steps on an H200 when it returned one per layer."""
    base, active = base_active[0], base_active[1] > 0
    slot = torch.arange(cache.max_len, device=window.device)[None, :]
    cache.kpos.masked_fill_(slot >= base[:, None], -1)
    pos = base[:, None] + torch.arange(window.size(1), device=window.device)
    logits, _, aux = model(window, pos=pos, cache=cache, last_only=False)
    a, tok = accept(window[:, 1:], q, logits, temperature, top_k, vocab_limit)
    cache.kpos.masked_fill_(slot >= torch.where(active, base + a + 1, base)[:, None], -1)
    kept = torch.cat([window[:, 1:], tok[:, None]], 1).scatter(1, a[:, None], tok[:, None])
    decisions = None
    if routing is not None and (routing[0] or routing[1]):
        decisions = torch.stack([aux['masks'][l].float() for l in routing[0]]
                                + [aux['margins'][l].float() for l in routing[1]])
    return a, tok, kept, logits if keep_logits else None, decisions


def whole_pass(model, name, depth, tok, base_active, cache, k, temperature, top_k, vocab_limit,
               keep_logits, routing=None):
    """draft_pass then verify_pass as one function: compiled, one graph a pass, with no wait between
    the two and no split of their time. Returns verify_pass's outputs."""
    window, q, _ = draft_pass(model, name, depth, tok, base_active[0], cache, k, temperature, top_k,
                              vocab_limit)
    return verify_pass(model, window, q, base_active, cache, temperature, top_k, vocab_limit,
                       keep_logits, routing)


def pass_region(torch_version, mark):
    """whole_pass as chained_passes calls it: a chained call's passes are one computation repeated,
    so where torch's nested_compile_region (`mark`) exists and its regions may write their inputs
    (a pass writes the cache: torch 2.9 on; 2.8's refuses such a region when compiling) the pass is
    marked as one, compiled once and placed count times (hierarchical compilation); else (or
    eagerly) a plain call, its copies unrolled and compiled count times."""
    if mark is None or version_tuple(torch_version) < (2, 9):
        return whole_pass
    return mark(whole_pass)


repeated_pass = pass_region(torch.__version__, getattr(torch.compiler, 'nested_compile_region',
                                                       None))


def chained_passes(model, name, depth, tok, n_done, cache, k, temperature, top_k, vocab_limit,
                   keep_logits, routing, count):
    """count whole passes (whole_pass) one after the other with nothing on the host between them:
    each row's token count n advances on the device, and a row is done once n reaches its end
    (n_done (2, B): n, and that end); done rows run along from n − 1, as whole passes run them
    (the caller leaves room for count windows below block_size). Compiled, one graph for count
    passes, one host round trip in place of count; its pass compiled once (repeated_pass): at
    K = 4 the 2-core CPU's warm-up for 4 chained fell from 89 to 54 s, the tokens the same.
    Returns (the pending tokens after the last pass (B,), counts (2, count, B): per pass each row's
    kept drafted tokens a and 1 where it still decoded, kept (count, B, k + 1), the logits (count,
    B, k + 1, V) where keep_logits and the decisions (count, L, B, k + 1) where routing names them,
    else None)."""
    n, end = n_done[0], n_done[1]
    made = []
    for _ in range(count):
        active = n < end
        a, tok, kept, logits, decided = repeated_pass(
            model, name, depth, tok, torch.stack([n - 1, active.long()]), cache, k, temperature,
            top_k, vocab_limit, keep_logits, routing)
        made.append((a, active.long(), kept, logits, decided))
        n = n + torch.where(active, a + 1, 0)
    a, active, kept, logits, decided = zip(*made)
    return (tok, torch.stack([torch.stack(a), torch.stack(active)]), torch.stack(kept),
            *(None if x[0] is None else torch.stack(x) for x in (logits, decided)))


def pass_step(model, device, compile, step):
    """step (draft_pass, verify_pass, whole_pass or chained_passes), eager or compiled
    (GPT.compiled: no host sync inside, a CUDA graph on CUDA, so that a pass costs two graph
    launches whatever K, one with whole_pass, 1/P with chained_passes of P, and with draft_stop
    one per drafted token and a host sync each; one graph per
    batch size, attended bucket and k, as passes cut short by block_size draft and verify fewer
    tokens, and draft_stop drafts k = 1). Compiled steps are kept on the model, so later decodings
    reuse their graphs; each takes the model as an argument, so a copy of the model runs its own
    weights."""
    if not compile:
        return step
    steps = model.__dict__.setdefault('speculative_steps', {})
    if (str(device), step.__name__) not in steps:
        steps[str(device), step.__name__] = model.compiled(step, device)
    return steps[str(device), step.__name__]


def sync(device):
    """Wait for the device (timings of the draft/verify split)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, idx, max_new_tokens, speculate, draft=None, draft_layers=None,
             temperature=1.0, top_k=None, lengths=None, record=None, vocab_limit=None,
             stats=None, trace=None, compile=False, draft_stop=0.0, one_graph=False,
             passes_per_graph=1):
    """model.generate(..., speculate=K): max_new_tokens per row drafted K at a time (see the module
    docstring). draft_stop > 0: a pass stops drafting after a step at which, in every row still
    decoding, the draft gave the token it drafted a probability below draft_stop (greedy: its
    softmax at temperature 1; sampling: q), the adaptive draft length of Draft & Verify (Zhang et
    al., arXiv 2309.08168); one host sync per draft step. The output is the same: the verifier
    decides, whatever the draft proposes. idx (B, T), or right-padded prompts of `lengths` (then a
    list of 1-D tensors is returned, else (B, T + max_new_tokens)). record(aux): model.generate's
    statistics recorder, called as plain decoding would call it (the prefill, then one step per
    generated token fed to the verifier, with the routing decisions the verifier took for the
    tokens it kept). stats: a dict that also gets the speculation's own figures ('spec_*'). trace:
    a dict for tests, filled with 'logits' (B, max_new_tokens, V): the verifier's logits each
    token was picked from, 'masks' {layer: (B, max_new_tokens − 1)}: its routing decision for each
    generated token it was fed, 'margins' likewise: how far each decision was from flipping (a
    family's aux['margins']), 'prefill_masks' and 'prefill_margins', the final token count of each
    row 'n' (B,) and the KV 'cache'. compile: each pass's draft (its K steps and picks) and its
    verification (the forward, the acceptance rule and the cache's rollback) compiled as one graph
    each (pass_step); the prefill and the placing of the kept tokens after the last pass stay
    eager, and between passes the host reads the kept counts (one sync per pass; with stats, a
    second between draft and verification times them apart). one_graph (refused with
    draft_stop): each pass's draft and verification as one function (whole_pass), one graph a pass
    when compiled;
    stats then time the pass whole (spec_draft_s 0, spec_one_graph True). passes_per_graph=P > 1
    (implies one_graph): while the neediest row still needs P passes' tokens at the rate passes
    have made them so far (K + 1 a pass before any: the first P never outrun it), and P windows
    fit below block_size, P passes run as one function (chained_passes: one graph, one host round
    trip for P passes), the rest one at a time; the same tokens. A chained pass that runs after
    every row is done counts in spec_passes_run and in the time, not in spec_passes."""
    cfg, family, dev = model.config, model.family, idx.device
    check_decoding(max_new_tokens, temperature, top_k)
    if top_k == 1:                  # greedy, as in model.generate: an argmax, no random draw
        temperature = 0
    if not 0.0 <= draft_stop <= 1.0:
        raise ValueError(f"draft_stop must be in [0, 1] (0: off), got {draft_stop}")
    K = int(speculate)
    if not 1 <= K <= cfg.block_size:    # a pass drafts within block_size; its buffers grow with K
        raise ValueError(f"speculate must be >= 1 (0: plain decoding) and at most block_size "
                         f"{cfg.block_size}, got {speculate}")
    name, depth = resolve_draft(cfg, family, draft, draft_layers)
    B, T = idx.shape
    uniform = lengths is None
    lengths = [T] * B if uniform else list(lengths)
    if len(lengths) != B or min(lengths) < 1 or max(lengths) > T:
        raise ValueError(f"lengths {lengths} must give 1..{T} prompt tokens for each of {B} rows")
    if max(lengths) + max_new_tokens > cfg.block_size:
        raise ValueError(
            f"speculative decoding needs the longest prompt ({max(lengths)}) plus {max_new_tokens} "
            f"new tokens within block_size {cfg.block_size}"
            # (plain decoding crops the context of uniform prompts; it refuses ragged ones too)
            + ("; decode longer with speculate=0" if uniform else '')
        )
    idx = idx[:, :max(lengths)]     # columns past the longest prompt hold padding alone
    T = idx.size(1)
    recorded = record is not None
    keep_masks = recorded or trace is not None      # what nobody reads is not kept
    record = record or (lambda aux: None)
    rows = torch.arange(B, device=dev)
    cache = model.new_cache(B, dev, compile)
    P = int(passes_per_graph)
    if P < 1 or (P > 1 and draft_stop):
        raise ValueError(f"passes_per_graph must be >= 1, and 1 with draft_stop (a step at a "
                         f"time), got {passes_per_graph}")
    if one_graph and draft_stop:
        raise ValueError("one_graph drafts whole passes, draft_stop a step at a time: drop one of "
                         "them")
    one_graph = bool(one_graph) or P > 1
    if one_graph:
        whole = pass_step(model, dev, compile, whole_pass)
        chained = pass_step(model, dev, compile, chained_passes) if P > 1 else None
    else:
        draft, verify = (pass_step(model, dev, compile, f) for f in (draft_pass, verify_pass))
    # the prefill, as plain decoding runs it (uniform prompts: the last position's logits only)
    pos = torch.arange(T, device=dev).expand(B, T)
    logits, _, aux = model(idx, pos=pos, cache=cache, last_only=None if uniform else False)
    # (a padded prompt's statistics over its real tokens: the padding's decisions are no token's)
    record(model.real_token_stats(aux, lengths) if recorded and not uniform else aux)
    slot = torch.arange(cache.max_len, device=dev)[None, :]
    if not uniform:                 # forget what the padding wrote
        lens = torch.tensor(lengths, device=dev)
        cache.kpos.masked_fill_((slot >= lens[:, None]) & (slot < T), -1)
        logits = logits[rows, lens - 1]
    else:
        logits = logits[:, -1]
    new = max_new_tokens
    out = torch.zeros(B, max(lengths) + new + K + 1, dtype=torch.long, device=dev)
    out[:, :T] = idx
    tok = model.sample_next(logits, temperature, top_k, vocab_limit)[:, 0]
    out[rows, torch.tensor(lengths, device=dev)] = tok
    # per generated token: the verifier's routing decisions (to record) and, for tests, its logits
    masks = {l: torch.zeros(B, new + K + 1, device=dev) for l in aux.get('masks', {})
             if keep_masks}
    margins = {}
    if trace is not None:
        trace['prefill_masks'] = dict(aux.get('masks', {}))
        trace['prefill_margins'] = dict(aux.get('margins', {}))
        margins = {l: torch.zeros(B, new + K + 1, device=dev) for l in aux.get('margins', {})}
        picked = torch.zeros(B, new + K + 1, logits.size(-1), device=dev)
        picked[:, 0] = logits
    # the verifier's decisions each pass returns, as one tensor: only what is read
    routing = (tuple(masks), tuple(margins))
    drafted = [0] * (K + 1)         # per draft position: rows that drafted it
    kept = [0] * (K + 1)            # ... and kept it
    passes, row_passes, draft_steps, t_draft, t_verify = 0, 0, 0, 0.0, 0.0
    calls = passes_run = 0          # pass functions called (host round trips), passes run
    # tokens per row, on the host (the pass's sizes and cache bucket are host decisions: one sync
    # per pass, for the accepted counts); the last token (pending) is not in the cache yet
    n = [m + 1 for m in lengths]
    # per pass, what its kept tokens are placed with once decoding is done (no work between passes
    # but the kept counts' sync): (n before it, rows active, kept counts, verify_pass's outputs)
    log = []

    def account(active, a, k, *outputs):
        """A pass's kept counts a (B,) into the log, the counters and n."""
        nonlocal passes, row_passes, draft_steps
        log.append((list(n), active, a, *outputs))
        passes, row_passes, draft_steps = passes + 1, row_passes + sum(active), draft_steps + k
        for b in range(B):
            if active[b]:
                for j in range(1, k + 1):
                    drafted[j] += 1
                    kept[j] += j <= a[b]
                n[b] += a[b] + 1
    while True:
        active = [n[b] - lengths[b] < new for b in range(B)]
        if not any(active):
            break
        need = max(lengths[b] + new - n[b] for b in range(B) if active[b])
        rate = (sum(n) - sum(lengths) - B) / row_passes if row_passes else K + 1
        if P > 1 and need >= P * rate and max(n) - 1 + P * (K + 1) <= cfg.block_size:
            # P whole passes with each row's n advancing on the device: one host round trip
            cache.attend_to(max(n) - 1 + P * (K + 1))
            n_done = torch.tensor([n, [m + new for m in lengths]], device=dev)
            t0 = time.perf_counter()
            tok, counts, kept_t, logits, decided = chained(
                model, name, depth, tok, n_done, cache, K, temperature, top_k, vocab_limit,
                trace is not None, routing, P)
            a_p, active_p = counts.tolist()     # the one host sync of the P passes
            t_verify += time.perf_counter() - t0
            calls, passes_run = calls + 1, passes_run + P
            for p in range(P):
                if any(active_p[p]):            # (a pass after every row was done: nothing)
                    account([x > 0 for x in active_p[p]], a_p[p], K, kept_t[p],
                            *(None if x is None else x[p] for x in (logits, decided)))
            continue
        # positions n − 1 .. n − 1 + k must stay below block_size (learned position embeddings);
        # eagerly a pass drafts no more than a row still needs (it makes up to k + 1 tokens), while
        # compiled passes keep their K, so that the end of a decode compiles no new window length
        k = min(K, min(cfg.block_size - n[b] for b in range(B) if active[b]))
        if not compile:
            k = min(k, max(new - (n[b] - lengths[b]) for b in range(B) if active[b]) - 1)
        # a finished row runs along (its tokens are not kept) at its own next positions where they
        # fit, its slots emptied again after the pass: its cache stays as it finished
        base = [n[b] - 1 if active[b] else min(n[b] - 1, cfg.block_size - 1 - k)
                for b in range(B)]
        # where they do not fit (near block_size) it runs over its own last filled slots, which are
        # kept aside and put back after the pass (rare: a copy of a few slots per layer)
        slabs = (*cache.k, *cache.v, cache.kpos.transpose(0, 1))     # each (B, ·, slots, ...)
        overrun = [(b, base[b], n[b] - 1, [t[b, :, base[b]:n[b] - 1].clone() for t in slabs])
                   for b in range(B) if base[b] < n[b] - 1]
        cache.attend_to(max(base) + k + 1)      # the pass reads and writes slots below this
        base_active = torch.tensor([base, active], device=dev)
        t0 = time.perf_counter()
        if draft_stop:              # a step at a time, each checked on the host
            window, q, decoding = [tok[:, None]], [], base_active[1] > 0
            for j in range(k):
                w, qj, lg = draft(model, name, depth, tok, base_active[0] + j, cache, 1,
                                  temperature, top_k, vocab_limit, True)
                tok = w[:, 1].contiguous()      # (a strided tok would compile another graph)
                window.append(w[:, 1:])
                q.append(qj)
                if j + 1 < k and not (drafted_prob(lg, tok, None if qj is None else qj[:, 0],
                                                   vocab_limit) >= draft_stop)[decoding].any():
                    k = j + 1           # every row's draft is unsure: verify what it has
                    break
            window, q = torch.cat(window, 1), torch.cat(q, 1) if q and q[0] is not None else None
        elif not one_graph:         # (one_graph: whole() below drafts)
            window, q, _ = draft(model, name, depth, tok, base_active[0], cache, k, temperature,
                                 top_k, vocab_limit)
        if stats is not None and not one_graph:     # the draft/verify split: wait for the draft
            sync(dev)
        t1 = t0 if one_graph else time.perf_counter()     # (one_graph: the pass's time is verify's)
        if one_graph:
            a_t, tok, kept_t, logits, decided = whole(model, name, depth, tok, base_active, cache,
                                                      k, temperature, top_k, vocab_limit,
                                                      trace is not None, routing)
        else:
            a_t, tok, kept_t, logits, decided = verify(model, window, q, base_active, cache,
                                                       temperature, top_k, vocab_limit,
                                                       trace is not None, routing)
        a = a_t.tolist()            # the one host sync of the pass
        calls += 1 + (0 if one_graph else k if draft_stop else 1)     # (draft_stop: a call a step)
        passes_run += 1
        t_verify += time.perf_counter() - t1
        t_draft += t1 - t0
        account(active, a, k, kept_t, logits, decided)
        for b, start, end, kept_aside in overrun:
            for t, x in zip(slabs, kept_aside):
                t[b, :, start:end] = x
    # each kept token (window tokens 1..a and the verifier's) at positions n .. n + a of its row,
    # with the verifier's decisions (to record) and logits (for a trace) for it
    at = [(p, b, j, n0[b] + j) for p, (n0, active, a, *_) in enumerate(log)
          for b in range(B) if active[b] for j in range(a[b] + 1)]
    def placed(get):                # an item (B, k + 1, ...) of every pass, at each (p, b, j)
        xs = [get(e) for e in log]
        return torch.stack([F.pad(x, (0, 0) * (x.dim() - 2) + (0, K + 1 - x.size(1)))
                            for x in xs])[p_t, b_t, j_t]
    if at:
        p_t, b_t, j_t, at_t = torch.tensor(at, device=dev).unbind(1)
        gen = at_t - 1 - torch.tensor(lengths, device=dev)[b_t]       # generated index
        out[b_t, at_t] = placed(lambda e: e[3])
        if masks or margins:        # (masks then margins, at each kept token)
            decided = placed(lambda e: e[5].permute(1, 2, 0))
            for i, m in enumerate([*masks.values(), *margins.values()]):
                m[b_t, gen] = decided[:, i]
        if trace is not None:
            picked[b_t, gen + 1] = placed(lambda e: e[4])
    # statistics as plain decoding records them: one step per generated token fed to the verifier
    for s in range(new - 1):
        if masks:
            ctx, aux = RouteCtx(masks={l: m[:, s:s + 1] for l, m in masks.items()}), {}
            family.stats(model, ctx, aux)
            record(aux)
    if stats is not None:
        # tokens per verifier pass and row: the kept drafted ones + the verifier's own (1..K+1)
        made = sum(n) - sum(lengths) - B
        stats.update(spec_draft=name, spec_depth=depth, spec_draft_stop=draft_stop,
                     spec_passes=passes,
                     spec_draft_steps=draft_steps,
                     spec_accept_rate=[kept[j] / drafted[j] if drafted[j] else None
                                       for j in range(1, K + 1)],
                     spec_tokens_per_pass=made / max(1, row_passes),
                     spec_draft_s=t_draft, spec_verify_s=t_verify, spec_one_graph=one_graph,
                     spec_passes_per_graph=P, spec_passes_run=passes_run,
                     spec_calls=calls,
                     # the counts behind the rates, to pool over decodes (bench.py's repeats)
                     spec_kept=kept[1:], spec_drafted=drafted[1:], spec_made=made,
                     spec_row_passes=row_passes)
    if trace is not None:
        trace['logits'] = picked[:, :new]
        trace['masks'] = {l: m[:, :new - 1] for l, m in masks.items()}
        trace['margins'] = {l: m[:, :new - 1] for l, m in margins.items()}
        trace.update(n=torch.tensor(n, device=dev), cache=cache)
    ys = [out[b, :lengths[b] + new] for b in range(B)]
    return torch.stack(ys) if uniform else ys
