"""Self-speculative decoding (speculative.py): the KV cache it leaves is plain decoding's (rejected
positions rolled back in every layer), the routing statistics count the verifier's kept tokens
only, sampling follows the rejection rule of Leviathan et al. (arXiv 2211.17192) so the output has
plain sampling's exact distribution, and bad drafts are refused in one line. Greedy exactness for
every family is a shared promise in test_families.py."""
import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sample
import speculative
from conftest import (ROUTED_TOL, SETTINGS, assert_greedy_traces_agree, build,
                      greedy_trace, tokens)
from configurator import UserError
from model import GPT, GPTConfig
from test_families import CASES, Drawn, as_float, is_random, speculative_trace_row

pytestmark = pytest.mark.usefixtures('one_thread')
DETERMINISTIC = [c for c in CASES if not is_random(c)]


def plain_cache(model, idx, new, lengths):
    """The KV cache plain (ragged) greedy decoding leaves, and its output."""
    made = []
    orig = model.new_cache

    def new_cache(*args, **kw):
        made.append(orig(*args, **kw))
        return made[-1]
    model.new_cache = new_cache
    try:
        out = model.generate(idx, new, temperature=0, lengths=lengths)
    finally:
        del model.new_cache
    return made[0], out


@settings(**SETTINGS)
@given(case=st.sampled_from(DETERMINISTIC), seed=st.integers(0, 999), K=st.integers(1, 5),
       lens=st.lists(st.integers(1, 8), min_size=1, max_size=3), data=st.data())
def test_speculative_decoding_leaves_plain_decodings_cache(case, seed, K, lens, data):
    """After speculative decoding every rejected position is rolled back in every layer: of a row
    with n tokens the cache holds positions 0..n−2 and nothing beyond, and on the positions plain
    decoding filled it holds what plain decoding holds (the same slots filled, in every layer, and
    K/V within ROUTED_TOL), whatever the draft wrote there and whatever the verifier rejected. Rows
    may end at block_size, where a finished row's passes run over its own last slots."""
    model = build(*case, seed=seed).eval()
    new = data.draw(st.integers(1, model.config.block_size - max(lens)))
    draft = data.draw(st.sampled_from(sorted(model.family.drafts(model.config))))
    idx = tokens(seed, len(lens), max(lens))
    trace = {}
    out = speculative.generate(model, idx, new, K, draft, temperature=0, lengths=lens, trace=trace)
    cache, n = trace['cache'], trace['n']
    plain, want = plain_cache(model, idx, new, lens)
    for b, m in enumerate(lens):
        top = int(n[b]) - 1                 # positions 0..n−2 are in the cache
        assert top >= m + new - 1
        assert (cache.kpos[:, b, top:] == -1).all(), f'row {b}: rejected positions left filled'
        if not torch.equal(out[b], want[b]):
            continue                        # a near-tie flipped a token (test_families checks it)
        filled = slice(0, m + new - 1)
        assert torch.equal(cache.kpos[:, b, filled], plain.kpos[:, b, filled]), f'row {b}'
        valid = (plain.kpos[:, b, filled] >= 0)[:, :, None, None].transpose(1, 2)
        for got, ref in ((cache.k, plain.k), (cache.v, plain.v)):     # lists: one per layer
            got, ref = torch.stack(got), torch.stack(ref)
            torch.testing.assert_close(torch.where(valid, got[:, b, :, filled], 0.0),
                                       torch.where(valid, ref[:, b, :, filled], 0.0), **ROUTED_TOL)


def assert_same_decode(run0, run1, empty_slots_too=True):
    """Two speculative decodes (output, trace, stats) bitwise alike: tokens, the verifier's logits
    and decisions, each row's token count, the cache (its filled slots only where not
    empty_slots_too: an empty slot's K/V is never read) and the acceptance counts."""
    (out0, tr0, st0), (out1, tr1, st1) = run0, run1
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert torch.equal(tr0['logits'], tr1['logits']) and torch.equal(tr0['n'], tr1['n'])
    for key in ('masks', 'margins'):
        assert tr0[key].keys() == tr1[key].keys()
        assert all(torch.equal(tr0[key][l], tr1[key][l]) for l in tr0[key])
    c0, c1 = tr0['cache'], tr1['cache']
    assert torch.equal(c0.kpos, c1.kpos)
    for layer, filled in enumerate(c0.kpos >= 0):
        filled = filled | empty_slots_too
        for a, b in ((c0.k[layer], c1.k[layer]), (c0.v[layer], c1.v[layer])):
            assert torch.equal(a.transpose(1, 2)[filled], b.transpose(1, 2)[filled])
    for key in ('spec_passes', 'spec_draft_steps', 'spec_kept', 'spec_drafted', 'spec_made'):
        assert st0[key] == st1[key], key


@settings(**{**SETTINGS, 'max_examples': 25})
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), K=st.integers(1, 4),
       lens=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       temperature=st.sampled_from([0.0, 1.0]), top_k=st.sampled_from([None, 3]), data=st.data())
def test_a_pass_as_one_function_decodes_as_draft_and_verification_apart(case, seed, K, lens,
                                                                         temperature, top_k, data):
    """one_graph=True (each pass's draft and verification in one function, whole_pass) runs the
    same operations in the same order as the two apart: under one seed the same tokens, the same
    verifier logits and decisions, the same cache (bitwise), the same acceptance counts; greedy
    and sampled, routed at random or not, rows ending at block_size included."""
    model = build(*case, seed=seed).eval()
    new = data.draw(st.integers(1, model.config.block_size - max(lens)))
    draft = data.draw(st.sampled_from(sorted(model.family.drafts(model.config))))
    idx = tokens(seed, len(lens), max(lens))
    runs = []
    for one_graph in (False, True):
        torch.manual_seed(seed)
        trace, stats = {}, {}
        out = speculative.generate(model, idx, new, K, draft, temperature=temperature,
                                   top_k=top_k, lengths=lens, trace=trace, stats=stats,
                                   one_graph=one_graph)
        runs.append((out, trace, stats))
    assert_same_decode(*runs)
    assert not runs[0][2]['spec_one_graph'] and runs[1][2]['spec_one_graph']


def chained_and_not(model, idx, new, K, draft, P, seed, **kw):
    """speculative.generate whole passes one at a time and P chained, each under torch seed `seed`
    and decoding as compiled (every pass drafts K) with GPT.compiled running the steps eagerly:
    ([(output, trace, stats)] of both, the attended lengths the chained decode set)."""
    from model import KVCache
    runs, buckets = [], []
    attend_to = KVCache.attend_to

    def recording(cache, n):
        attend_to(cache, n)
        buckets.append(cache.attend_len)
    for chain in (1, P):
        trace, stats = {}, {}
        buckets.clear()
        torch.manual_seed(seed)
        with mock.patch.object(GPT, 'compiled', staticmethod(lambda step, device: step)), \
                mock.patch.object(KVCache, 'attend_to', recording):
            out = speculative.generate(model, idx, new, K, draft, trace=trace, stats=stats,
                                       compile=True, one_graph=True, passes_per_graph=chain, **kw)
        runs.append((out, trace, stats))
    return runs, list(buckets)


@settings(**{**SETTINGS, 'max_examples': 25})
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), K=st.integers(1, 4),
       P=st.integers(2, 3), lens=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       temperature=st.sampled_from([0.0, 1.0]), top_k=st.sampled_from([None, 3]),
       data=st.data())
def test_passes_chained_on_the_device_decode_as_passes_one_at_a_time(case, seed, K, P, lens,
                                                                     temperature, top_k, data):
    """passes_per_graph=P (P whole passes in one function, each row's token count advancing on the
    device, a done row running along) computes what whole passes one at a time compute: under one
    seed the same tokens, verifier logits and decisions, filled cache slots and acceptance counts,
    bitwise, greedy and sampled, routed at random or not, with rows ending at block_size; every
    chained pass but those after the last row was done is counted, and the first call chains
    wherever P windows fit and the rows need P passes of K + 1 tokens."""
    model = build(*case, seed=seed).eval()
    new = data.draw(st.integers(1, model.config.block_size - max(lens)))
    draft = data.draw(st.sampled_from(sorted(model.family.drafts(model.config))))
    idx = tokens(seed, len(lens), max(lens))
    runs, _ = chained_and_not(model, idx, new, K, draft, P, seed, temperature=temperature,
                              top_k=top_k, lengths=lens)
    assert_same_decode(*runs, empty_slots_too=False)      # (a chained pass after the last)
    apart, chained = runs[0][2], runs[1][2]
    assert apart['spec_calls'] == apart['spec_passes_run'] == apart['spec_passes']
    assert chained['spec_passes_run'] >= chained['spec_passes']
    if max(lens) + P * (K + 1) <= model.config.block_size and new - 1 >= P * (K + 1):
        assert chained['spec_calls'] < chained['spec_passes']


@pytest.mark.parametrize('version,marked', [('2.8.0+cu128', False), ('2.9.1', True),
                                             ('2.13.0+cpu', True), ('3.0.0', True)])
def test_chained_passes_mark_their_pass_where_torch_compiles_a_region_that_writes_the_cache(
        version, marked):
    """Chained passes call their pass as one nested compile region only under a torch whose
    regions may mutate their inputs (a pass writes the cache): torch 2.8 refuses such a region
    when compiling ('input mutation during higher order op tracing'), so there, as where torch
    has no such API, the pass is called plainly (unrolled when compiled)."""
    mark = mock.Mock(side_effect=lambda f: ('region', f))
    got = speculative.pass_region(version, mark)
    assert got == (('region', speculative.whole_pass) if marked else speculative.whole_pass)
    assert speculative.pass_region(version, None) is speculative.whole_pass


@pytest.mark.parametrize('case', [c for c in DETERMINISTIC if c[1] == 0])
def test_chained_passes_attend_over_every_window_they_write(case):
    """With block_size 160, prompts of 60 and 57 tokens and 60 new ones: a call of P chained
    passes attends over the bucket of its last window's end (the first call: positions up to
    60 + P(K + 1) − 1, past 64, so 128 slots, where one window fewer would fit in 64), larger
    than a pass at a time would attend over, and decodes bitwise as passes one at a time (a
    bucket too small would leave the newest K/V unseen)."""
    model = build(*case, seed=4, block_size=160).eval()
    draft = sorted(model.family.drafts(model.config))[0]
    idx = tokens(4, 2, 60)
    for P, K in ((2, 3), (3, 1)):
        runs, buckets = chained_and_not(model, idx, 60, K, draft, P, 4, temperature=0,
                                        lengths=[60, 57])
        assert_same_decode(*runs, empty_slots_too=False)
        assert buckets[0] == 128 and runs[1][2]['spec_calls'] < runs[1][2]['spec_passes']


@pytest.mark.parametrize('opt', [0, 1, 3])
def test_a_draft_writing_blocks_the_verifier_skips_leaves_no_trace(opt):
    """MoD's verifier writes no K/V where a token skips a block, and the 'layers' draft runs every
    block: the draft's K/V there must be emptied before verification (else later tokens attend to
    them). The property above, on the cases that exercise it."""
    leaves_plain = test_speculative_decoding_leaves_plain_decodings_cache.hypothesis.inner_test
    for seed in range(4):
        leaves_plain(('mod', opt), seed, 3, [5, 2], Drawn(8, 'layers'))


def test_a_finished_row_near_block_size_keeps_its_cache():
    """Row 0 ends at block_size (8 + 16 = 24) while row 1 still decodes: row 0's passes run over
    its own last slots, which must hold plain decoding's K/V afterwards. The property above, on
    that case."""
    leaves_plain = test_speculative_decoding_leaves_plain_decodings_cache.hypothesis.inner_test
    for seed in range(8):
        leaves_plain(('exit', 0), seed, 4, [8, 2], Drawn(16, 'exit'))


@settings(**SETTINGS)
@given(case=st.sampled_from([c for c in DETERMINISTIC if c[0] != 'none' and c[0] != 'ensemble']),
       seed=st.integers(0, 999), K=st.integers(1, 5), B=st.integers(1, 3), T=st.integers(1, 8),
       new=st.integers(2, 8))
def test_routing_statistics_count_the_kept_tokens_only(case, seed, K, B, T, new):
    """stats= of speculative decoding report the routing of the verifier's kept tokens, each as
    plain decoding reports its step: the realised full-path fraction per routed layer and the
    TLOps saved equal plain decoding's (the verifier's rejected tokens, and the draft's forwards,
    count for nothing). Equal up to float rounding of the means, where no near-tie flipped a
    token."""
    model = build(*case, seed=seed).eval()
    idx = tokens(seed, B, T)
    got, want = {}, {}
    a = model.generate(idx, new, temperature=0, speculate=K, stats=got)
    b = model.generate(idx, new, temperature=0, stats=want)
    if not torch.equal(a, b):
        return
    assert want.keys() <= got.keys() and 'full_frac' in want
    for key in ('full_frac', 'tlops_saved'):
        if key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert 1 <= got['spec_tokens_per_pass'] <= K + 1
    assert len(got['spec_accept_rate']) == K


def test_a_stats_dict_passed_again_holds_only_the_last_calls_figures():
    """stats= given to a speculative decode and then to a plain one ends as a fresh dict given to
    the plain one alone: its routing figures, and no speculation figures left from before."""
    model = build('exit', seed=1).eval()
    idx = tokens(1, 1, 5)
    again, fresh = {}, {}
    model.generate(idx, 8, temperature=0, speculate=3, stats=again)
    assert again['spec_passes'] >= 1 and 'full_frac' in again
    model.generate(idx, 8, temperature=0, stats=again)
    model.generate(idx, 8, temperature=0, stats=fresh)
    assert again == fresh and 'full_frac' in fresh


@pytest.mark.parametrize('speculate,lengths', [(0, None), (0, [5, 3]), (3, None), (3, [5, 3])])
def test_an_int32_prompt_decodes_as_an_int64_one(speculate, lengths):
    """Token ids as int32 (which the embedding takes too) decode to the int64 prompt's tokens, as
    int64, plain or speculative, one prompt length or several (a list of rows)."""
    model = build('exit', seed=2).eval()
    idx = tokens(2, 2, 5)
    decode = lambda prompt: model.generate(prompt, 6, temperature=0, speculate=speculate,
                                           lengths=lengths)
    want, got = decode(idx), decode(idx.int())
    want, got = ([x] if torch.is_tensor(x) else x for x in (want, got))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and torch.equal(a, b)


@settings(**SETTINGS)
@given(case=st.sampled_from(DETERMINISTIC), seed=st.integers(0, 999), K=st.integers(1, 6),
       T=st.integers(1, 8), new=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]))
def test_a_pass_drafts_no_more_than_the_row_still_needs(case, seed, K, T, new, temperature):
    """Eagerly, a single row's passes make exactly the new − 1 tokens after the prefill's (a pass
    makes up to k + 1 of them, so it drafts at most one fewer than the row still needs): no drafted
    or verified token is thrown away at the end, greedy or sampled."""
    model = build(*case, seed=seed).eval()
    stats = {}
    torch.manual_seed(seed)
    out = model.generate(tokens(seed, 1, T), new, temperature=temperature, speculate=K,
                         stats=stats)
    assert out.shape == (1, T + new)
    made = stats['spec_tokens_per_pass'] * stats['spec_passes']
    assert made == pytest.approx(new - 1), stats


@settings(**SETTINGS)
@given(case=st.sampled_from(DETERMINISTIC), seed=st.integers(0, 999), K=st.integers(1, 6),
       lens=st.lists(st.integers(1, 8), min_size=2, max_size=3), new=st.integers(2, 12),
       temperature=st.sampled_from([0.0, 1.0]))
def test_ragged_passes_draft_no_more_than_the_neediest_row_needs(case, seed, K, lens, new,
                                                                 temperature):
    """Eagerly, with rows of different prompts (and acceptances), a pass drafts no more than the
    row that still needs most: every row makes at least the new − 1 tokens after the prefill's, a
    row done early at most K more (its last pass made up to K + 1), and the row that finishes last
    exactly new − 1 (the last pass was cut to what it needed)."""
    model = build(*case, seed=seed).eval()
    trace = {}
    torch.manual_seed(seed)
    speculative.generate(model, tokens(seed, len(lens), max(lens)), new, K, temperature=temperature,
                         lengths=lens, trace=trace)
    made = [int(n) - m - 1 for n, m in zip(trace['n'], lens)]
    assert all(new - 1 <= t <= new - 1 + K for t in made), (made, new, K)
    assert min(made) == new - 1, (made, new, K)


@settings(**SETTINGS)
@given(case=st.sampled_from(DETERMINISTIC), seed=st.integers(0, 999), K=st.integers(2, 5),
       stop=st.sampled_from([0.2, 0.6, 1.0]), data=st.data())
def test_a_pass_that_stops_drafting_early_decodes_the_same(case, seed, K, stop, data):
    """draft_stop: a pass drafts fewer than K tokens once every row's draft is unsure, and greedy
    output is still each prompt's plain decode (tokens up to a near-tie, decisions, logits within
    ROUTED_TOL). At draft_stop = 1 no draft is sure enough to go on: each pass drafts one token.
    Fewer drafted tokens never means more passes per token than drafting one."""
    model = build(*case, seed=seed).eval()
    draft = data.draw(st.sampled_from(sorted(model.family.drafts(model.config))))
    lens, new = [5, 3], 9
    idx = tokens(seed, 2, 5)
    trace, stats = {}, {}
    out = speculative.generate(model, idx, new, K, draft, temperature=0, lengths=lens,
                               trace=trace, stats=stats, draft_stop=stop)
    for b, n in enumerate(lens):
        alone = as_float(greedy_trace(model, idx[b:b + 1, :n], new)[0])
        assert_greedy_traces_agree(speculative_trace_row(trace, out, b, n, new), alone, ROUTED_TOL)
    assert stats['spec_draft_stop'] == stop
    assert stats['spec_draft_steps'] <= K * stats['spec_passes']
    if stop == 1.0:
        assert stats['spec_draft_steps'] <= stats['spec_passes']
        assert stats['spec_drafted'][1:] == [0] * (K - 1)


def test_draft_stop_is_checked():
    model = build('exit').eval()
    for bad in (-0.1, 1.5, float('nan')):
        with pytest.raises(ValueError, match='draft_stop must be in'):
            speculative.generate(model, tokens(0, 1, 4), 4, 2, draft_stop=bad)


def test_one_graph_beside_draft_stop_is_refused():
    """A whole pass as one function and a draft checked a step at a time exclude each other:
    one_graph with draft_stop is refused (as passes_per_graph > 1 is), not dropped."""
    model = build('exit').eval()
    with pytest.raises(ValueError, match='one_graph drafts whole passes, draft_stop a step at'):
        speculative.generate(model, tokens(0, 1, 4), 4, 2, draft_stop=0.5, one_graph=True)
    stats = {}
    speculative.generate(model, tokens(0, 1, 4), 4, 2, draft_stop=0.5, stats=stats)
    assert stats['spec_one_graph'] is False


@pytest.mark.parametrize('stop', [0.8, 0.95])
def test_a_draft_that_stops_early_still_samples_plain_samplings_distribution(stop):
    """Sampling with draft_stop on a 3-token vocabulary: the four tokens after a prompt (the first
    from the prefill, the next three from passes of up to K = 3 drafts that stop once both rows'
    drafts give their tokens less than `stop`), over 1000 decodes of 2 rows, follow plain
    sampling's exact joint distribution (Pearson's chi-square, cells expecting < 5 samples pooled,
    below its 1e-4 quantile), while the passes drafted under 90% of the tokens they draft
    without draft_stop (0.8: about 78%, some passes stopping; 0.95: 64%, every pass stopping after
    one draft). Power: the draft's own joint distribution would exceed the quantile more than 3x
    (its expected statistic), and at 0.95 a stop that kept the draft's argmax instead of its
    sample fails."""
    V, steps, B, decodes = 3, 4, 2, 1000
    model = build('exit', seed=1, n_layer=3, vocab_size=V, block_size=10, exit_layers='1',
                  noise=0.5).eval()
    prompt = torch.tensor([[1, 2, 0]])
    name, depth = speculative.resolve_draft(model.config, model.family, 'exit')

    def verifier(rows):
        with torch.no_grad():
            return model(rows)[0][:, -1]

    def drafter(rows):                  # the draft for x_2.. (x_1 comes from the prefill)
        pos = torch.arange(rows.size(1)).expand(rows.shape)
        with torch.no_grad():
            own = model.family.draft_logits(model, name, rows, pos, None, depth)[:, -1]
        return torch.where(torch.tensor(rows.size(1) > prompt.size(1)), own, verifier(rows))
    p = exact_joint(model, prompt, steps, 1.0, None, None, verifier).flatten().double()
    q = exact_joint(model, prompt, steps, 1.0, None, None, drafter).flatten().double()
    torch.manual_seed(0)
    cells, steps_with, steps_without = [], 0, 0
    for d in range(decodes):
        stats = {}
        out = model.generate(prompt.repeat(B, 1), steps, temperature=1.0, speculate=3,
                             draft='exit', stats=stats, draft_stop=stop)[:, 3:]
        cells.append(((out[:, 0] * V + out[:, 1]) * V + out[:, 2]) * V + out[:, 3])
        steps_with += stats['spec_draft_steps']
        if d < 100:
            full = {}
            model.generate(prompt.repeat(B, 1), steps, temperature=1.0, speculate=3,
                           draft='exit', stats=full)
            steps_without += full['spec_draft_steps']
    counts = torch.bincount(torch.cat(cells), minlength=V ** steps)
    chi2, dof = pearson(counts, B * decodes * p)
    critical = chi2_critical(dof)
    assert chi2 < critical, (chi2, dof)
    assert steps_with / decodes < 0.9 * steps_without / 100, (steps_with, steps_without)
    live = p > 0
    assert float(B * decodes * ((q - p)[live] ** 2 / p[live]).sum()) > 3 * critical


# --------------------------------------------------------------------------------------------------
# sampling: the rejection rule gives plain sampling's exact distribution

def exact_joint(model, prompt, steps, temperature, top_k, vocab_limit, logits_of):
    """P(x_1..x_steps | prompt) of sampling each token from logits_of(sequence) (1, V) through
    next_probs, by enumerating every sequence: a tensor of shape (V',) * steps."""
    probs = torch.ones(())
    seqs = [prompt]
    for _ in range(steps):
        rows = torch.cat(seqs)
        p = speculative.next_probs(logits_of(rows), temperature, top_k, vocab_limit)   # (S, V')
        probs = probs[..., None] * p.view(*probs.shape, -1)
        seqs = [torch.cat([s, torch.full((1, 1), v)], 1) for s in rows.split(1) for v in
                range(p.size(-1))]
    return probs


def pearson(counts, expected, least=5.0):
    """Pearson's chi-square statistic and its degrees of freedom, the cells expecting fewer than
    `least` samples pooled into one (a cell expecting 0.01 that gets one sample would add 100:
    the statistic follows the chi-square law only where every cell expects a few)."""
    small = expected < least
    counts = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    expected = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2, int(keep.sum()) - 1


def chi2_critical(dof, z=3.719):
    """The chi-square quantile at upper tail z's normal probability (3.719: 1e-4), Wilson-Hilferty
    (within 1% of the exact quantile for dof >= 10)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize('route,draft,K,temperature,top_k,vocab_limit,chain', [
    ('none', 'layers', 2, 1.0, None, None, 1),
    ('exit', 'exit', 2, 0.7, 3, None, 1),
    ('ffn', 'cheap', 3, 1.3, None, 4, 1),
    ('mod', 'skip', 2, 1.0, None, None, 1),
    ('halt', 'halt', 2, 0.8, None, None, 1),
    ('ensemble', 'earliest', 2, 1.0, 3, None, 1),
    ('exit', 'exit', 1, 1.0, None, None, 2),
    ('halt', 'halt', 1, 0.8, None, None, 2),
])
def test_sampled_speculative_decoding_has_plain_samplings_distribution(
        route, draft, K, temperature, top_k, vocab_limit, chain):
    """On a 5-token vocabulary, N = 20000 speculative samples of the K + 2 tokens after a prompt
    (the first from the prefill, the next K + 1 from one draft of all K tokens and its
    verification: kept drafts, the residual norm(max(0, p − q)) at a rejection, the verifier's
    bonus token; after a rejection a shorter pass) follow the exact joint distribution of plain
    sampling, enumerated from the model's probabilities: Pearson's chi-square over the cells of
    non-zero probability (those expecting < 5 samples pooled) stays below its 1e-4 quantile, and no
    sample falls in a cell of probability 0 (top_k, vocab_limit). Power: sampling the tokens after
    the first from the draft instead would exceed that quantile by the stated margin (its expected
    statistic, N·Σ(q − p)²/p, is more than 3x the critical value), and the draft is neither always
    kept nor always rejected. A rule broken only after a kept draft (the residual at a rejection at
    position 2 or later) fails every case with K >= 2. chain = 2: on a 3-token vocabulary, the
    five tokens after a prompt, the four after the first starting with two passes (K = 1) chained
    in one function (passes_per_graph)."""
    (V, steps), N = ((5, K + 2) if chain == 1 else (3, 5)), 20000
    model = build(route, seed=1, n_layer=3, vocab_size=V, block_size=8, exit_layers='1',
                  noise=0.5).eval()
    prompt = torch.tensor([[1, V - 2, 0]])
    name, depth = speculative.resolve_draft(model.config, model.family, draft)

    def verifier(rows):
        with torch.no_grad():
            return model(rows)[0][:, -1]

    def drafter(rows):                  # the draft for x_2 onwards (x_1 comes from the prefill)
        pos = torch.arange(rows.size(1)).expand(rows.shape)
        with torch.no_grad():
            own = model.family.draft_logits(model, name, rows, pos, None, depth)[:, -1]
        return torch.where(torch.tensor(rows.size(1) > prompt.size(1)), own, verifier(rows))

    p = exact_joint(model, prompt, steps, temperature, top_k, vocab_limit, verifier)
    q = exact_joint(model, prompt, steps, temperature, top_k, vocab_limit, drafter)
    torch.manual_seed(0)
    stats = {}
    options = dict(temperature=temperature, top_k=top_k, vocab_limit=vocab_limit, stats=stats)
    out = (model.generate(prompt.repeat(N, 1), steps, speculate=K, draft=draft, **options)
           if chain == 1 else speculative.generate(model, prompt.repeat(N, 1), steps, K, draft,
                                                   passes_per_graph=chain, **options))[:, 3:]
    Vp = p.size(-1)
    cell = out[:, 0]
    for j in range(1, steps):
        cell = cell * Vp + out[:, j]
    counts = torch.bincount(cell, minlength=Vp ** steps)
    expected = N * p.flatten().double()
    live = expected > 0
    assert counts[~live].sum() == 0
    chi2, dof = pearson(counts[live], expected[live])
    critical = chi2_critical(dof)
    assert chi2 < critical, (chi2, critical)
    power = float(N * ((q.flatten().double() - p.flatten().double())[live] ** 2
                       / p.flatten().double()[live]).sum())
    assert power > 3 * critical, (power, critical)
    assert 0.1 < stats['spec_accept_rate'][0] < 0.95, stats
    if chain == 1:                  # every row's first pass drafted all K tokens
        assert stats['spec_drafted'][K - 1] >= N, stats
    assert (stats['spec_calls'] < stats['spec_passes']) == (chain > 1), stats


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_a_tiny_temperature_samples_the_argmax_and_a_huge_one_every_token(dtype):
    """Logits over a subnormal temperature overflow float32 unless each row's largest is taken off
    first (a softmax over two infs is NaN, and drawing from NaN failed): near 0 the distribution is
    the argmax's (split evenly between tied maxima), near infinity uniform."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -4.0], [7.0, -1.0, 7.0, 0.5]], dtype=dtype)
    for t in (1e-45, 1e-38, 1e-30):
        p = speculative.next_probs(logits, t, None)
        assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])), (t, p)
        assert speculative.draw(p)[0] == 1
    p = speculative.next_probs(logits, 1e30, 3)
    assert torch.equal(p, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 1 / 3, 1 / 3]]))


def test_draw_follows_each_rows_distribution_and_never_draws_a_zero():
    """speculative.draw on rows with zeros first, inside and last, unnormalised: 200000 draws per
    row follow the row's distribution (Pearson's chi-square below its 1e-4 quantile, with power:
    a row's draws judged against the next row's distribution exceed it many times over), no draw
    lands on a token of probability 0, and a uniform that rounds up to the total (here exactly 1)
    takes the last token of positive probability, not the zeros after it."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],
                          [0.1, 0.1, 0.1, 0.1, 0.6, 0.0],
                          [0.0, 0.0, 2.0, 0.0, 1.0, 1.0]])               # the last sums to 4
    N = 200000
    torch.manual_seed(0)
    got = speculative.draw(probs.repeat_interleave(N, 0)).view(3, N)
    p = probs / probs.sum(-1, keepdim=True)
    for row in range(3):
        counts = torch.bincount(got[row], minlength=6).double()
        assert counts[p[row] == 0].sum() == 0, row
        live = p[row] > 0
        chi2, dof = pearson(counts[live], N * p[row][live].double())
        critical = {2: 18.42, 4: 23.51}[dof]                          # chi-square's 1e-4 quantile
        assert chi2 < critical, (row, chi2)
        other = p[(row + 1) % 3]
        wrong = ((counts - N * other) ** 2 / (N * other).clamp_min(1e-9))[other > 0].sum()
        assert wrong > 100 * critical, (row, wrong)
    with mock.patch.object(torch, 'rand', lambda shape, **kw: torch.ones(shape, **kw)):
        assert speculative.draw(probs).tolist() == [4, 4, 5]


@pytest.mark.parametrize('K', [2, 3])
def test_the_rejection_rule_keeps_the_verifiers_distribution_at_every_draft_position(K):
    """speculative.accept alone, on a Markov chain over 3 tokens: the verifier's next-token
    distribution is P[previous token], the draft's Q[previous token], and passes of K drafted
    tokens run until each of N = 40000 rows has K + 1 tokens. Those first K + 1 tokens follow the
    chain P exactly (Pearson's chi-square over its 3^(K+1) cells below the 1e-4 quantile), so every
    draft position 1..K is kept or resampled as Leviathan et al.'s rule says (the end-to-end test
    above drafts one position only). Power: every position is judged thousands of times and
    rejected 15-85% of them, and tokens drawn from Q would exceed the quantile more than 3x (their
    expected statistic)."""
    V, N, L = 3, 40000, K + 1
    P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
    Q = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.3, 0.2], [0.1, 0.3, 0.6]])
    torch.manual_seed(K)
    out = torch.full((N, L + K + 1), -1)
    lens = torch.zeros(N, dtype=torch.long)
    last = torch.zeros(N, dtype=torch.long)                              # x_0 = 0
    judged, kept = torch.zeros(K), torch.zeros(K)
    while (lens < L).any():
        active = lens < L
        draft = [torch.multinomial(Q[last], 1)[:, 0]]
        for _ in range(K - 1):
            draft.append(torch.multinomial(Q[draft[-1]], 1)[:, 0])
        draft = torch.stack(draft, 1)                                    # (N, K)
        context = torch.cat([last[:, None], draft], 1)                   # each position's previous
        a, t = speculative.accept(draft, Q[context[:, :K]], P[context].log(), 1.0, None, None)
        for j in range(K):
            judged[j] += (active & (a >= j)).sum()
            kept[j] += (active & (a > j)).sum()
        new = torch.cat([draft, t[:, None]], 1)
        new[torch.arange(N), a] = t                                      # kept drafts, then t
        cols = torch.arange(K + 1)
        write = active[:, None] & (cols <= a[:, None])
        rows = torch.arange(N)[:, None].expand(N, K + 1)
        out[rows[write], (lens[:, None] + cols)[write]] = new[write]
        lens = torch.where(active, lens + a + 1, lens)
        last = torch.where(active, t, last)
    cell = torch.zeros(N, dtype=torch.long)
    for j in range(L):
        cell = cell * V + out[:, j]
    counts = torch.bincount(cell, minlength=V ** L).double()

    def chain(M):                                                        # P(x_1..x_L | x_0 = 0)
        probs = M[0].double()
        for _ in range(L - 1):
            probs = probs[..., None] * M.double()                        # M[x_last, x_next]
        return probs.flatten()
    expected = N * chain(P)
    chi2, dof = pearson(counts, expected)
    critical = chi2_critical(dof)
    assert chi2 < critical, (chi2, critical)
    power = float(N * ((chain(Q) - chain(P)) ** 2 / chain(P)).sum())
    assert power > 3 * critical, (power, critical)
    rate = kept / judged
    assert (judged > 1000).all() and ((rate > 0.15) & (rate < 0.85)).all(), (judged, rate)


# --------------------------------------------------------------------------------------------------
# drafts: every family offers some, bad ones are refused in one line

@pytest.mark.parametrize('route', ['none', 'ffn', 'mod', 'halt', 'exit', 'ensemble'])
def test_every_family_offers_its_drafts(route):
    cfg = GPTConfig(route=route, n_layer=4)
    family = build(route).family
    drafts = family.drafts(cfg)
    default = {'none': 'layers', 'ffn': 'cheap', 'mod': 'skip', 'halt': 'halt', 'exit': 'exit',
               'ensemble': 'earliest'}[route]
    assert next(iter(drafts)) == default and 'layers' in drafts
    assert speculative.resolve_draft(cfg, family)[0] == default
    with pytest.raises(ValueError, match=f"draft 'bogus' is not one of route='{route}'") as e:
        speculative.resolve_draft(cfg, family, 'bogus')
    assert all(f"'{name}'" in str(e.value) for name in drafts) and '\n' not in str(e.value)
    with pytest.raises(ValueError, match='draft_layers=9'):
        speculative.resolve_draft(cfg, family, 'layers', 9)


def test_draft_depths():
    exit_cfg = GPTConfig(route='exit', n_layer=8)          # exits {2, 4, 6}
    exit_family = build('exit').family
    assert speculative.resolve_draft(exit_cfg, exit_family) == ('exit', 4)
    assert speculative.resolve_draft(exit_cfg, exit_family, 'exit', 6) == ('exit', 6)
    with pytest.raises(ValueError, match=r"one of \[2, 4, 6\]"):
        speculative.resolve_draft(exit_cfg, exit_family, 'exit', 3)
    ffn_cfg = GPTConfig(route='ffn')
    with pytest.raises(ValueError, match="'cheap' has no depth"):
        speculative.resolve_draft(ffn_cfg, build('ffn').family, 'cheap', 2)


def test_generate_refuses_speculation_without_the_cache():
    model = build('none').eval()
    idx = tokens(0, 1, 4)
    with pytest.raises(ValueError, match='use_cache=True'):
        model.generate(idx, 3, speculate=2, use_cache=False)
    with pytest.raises(ValueError, match='within block_size 24'):
        model.generate(idx, 21, speculate=2)


def test_a_ragged_batch_past_block_size_is_not_sent_to_plain_decoding():
    """Past block_size, uniform prompts are told that plain decoding decodes longer (it crops the
    context); prompts of different lengths are not, since plain decoding refuses them too."""
    model = build('none').eval()
    idx = tokens(0, 2, 4)
    with pytest.raises(ValueError, match='; decode longer with speculate=0$'):
        model.generate(idx, 21, speculate=2)
    with pytest.raises(ValueError, match='exceeds block_size 24'):
        model.generate(idx, 21, lengths=[4, 2])
    with pytest.raises(ValueError) as refused:
        model.generate(idx, 21, speculate=2, lengths=[4, 2])
    assert str(refused.value) == ('speculative decoding needs the longest prompt (4) plus 21 new '
                                  'tokens within block_size 24')


@pytest.mark.parametrize('option', [dict(draft='nope'), dict(draft='exit'),
                                    dict(draft_layers=2), dict(draft_stop=0.5),
                                    dict(passes_per_graph=4)])
def test_generate_refuses_draft_options_without_speculation(option):
    """A draft option given to plain decoding (speculate=0) is refused, as sample.py refuses it,
    not silently dropped; the defaults sample.py passes without --speculate are plain decoding."""
    model = build('exit').eval()
    idx = tokens(0, 2, 4)
    with pytest.raises(ValueError, match=f'{next(iter(option))}=.* needs speculate=K >= 1'):
        model.generate(idx, 3, temperature=0, **option)
    plain = model.generate(idx, 3, temperature=0)
    assert torch.equal(model.generate(idx, 3, temperature=0, draft=None, draft_layers=None,
                                      draft_stop=0.0, passes_per_graph=1), plain)


@pytest.mark.parametrize('speculate', [0, 2])
@pytest.mark.parametrize('lengths', [None, [4, 2]])
def test_generate_refuses_a_negative_or_nan_temperature(speculate, lengths):
    """A temperature below 0 sampled the least likely tokens first (logits over a negative
    number), and NaN sampled from NaN probabilities, plain or speculative: both are refused, as
    sample.py and bench.py refuse them."""
    model = build('exit').eval()
    idx = tokens(0, 2, 4)
    for bad in (-0.5, float('nan')):
        with pytest.raises(ValueError, match=re.escape(f'must be >= 0 (0: greedy), got {bad}')):
            model.generate(idx, 3, temperature=bad, speculate=speculate, lengths=lengths)
    if speculate:
        with pytest.raises(ValueError, match='temperature must be >= 0'):
            speculative.generate(model, idx, 3, speculate, temperature=-1.0)
    plain = model.generate(idx, 3, temperature=0, lengths=lengths)
    assert [r.tolist() for r in model.generate(idx, 3, temperature=0.0, speculate=speculate,
                                               lengths=lengths)] == [r.tolist() for r in plain]


@pytest.mark.parametrize('speculate', [0, 2])
@pytest.mark.parametrize('lengths', [None, [4, 2]])
def test_generate_refuses_a_negative_token_count(speculate, lengths):
    """max_new_tokens < 0 is refused whatever the decoding: speculation returned the prompt less
    its last token for -1 and failed on an index for -3, and ragged plain decoding on a shape."""
    model = build('exit').eval()
    idx = tokens(0, 2, 4)
    for new in (-1, -3):
        with pytest.raises(ValueError, match=f'max_new_tokens must be >= 0, got {new}'):
            model.generate(idx, new, temperature=0, speculate=speculate, lengths=lengths)
    if speculate:
        with pytest.raises(ValueError, match='max_new_tokens must be >= 0, got -1'):
            speculative.generate(model, idx, -1, speculate, temperature=0)
    assert model.generate(idx, 0, temperature=0, speculate=speculate).tolist() == idx.tolist()
    with pytest.raises(ValueError, match='top_k must be >= 0'):     # not torch.topk's own error
        model.generate(idx, 2, temperature=1.0, top_k=-1, speculate=speculate, lengths=lengths)


def test_sample_speculates_and_prints_the_acceptance(run, capsys):
    """sample.py --speculate=K gives plain greedy decoding's text and reports the draft's
    figures."""
    args = [f"--out_dir={run / 'out'}", "--max_new_tokens=6", "--num_samples=2", "--device=cpu",
            "--temperature=0"]
    assert sample.main(args) == 0
    plain = capsys.readouterr().out.splitlines()
    assert sample.main([*args, "--speculate=3", "--draft=layers"]) == 0
    spec = capsys.readouterr().out.splitlines()
    assert spec[:4] == plain[:4]
    assert "speculative decoding (draft 'layers', E=1, K=3)" in spec[-1], spec[-1]


def test_a_draft_longer_than_the_block_is_refused(run):
    """K > block_size is refused before any buffer of K is made (a huge K ran out of memory)."""
    model = build('exit').eval()
    K = model.config.block_size + 1
    with pytest.raises(ValueError, match=f'at most block_size {K - 1}, got {K}'):
        model.generate(tokens(0, 1, 4), 2, temperature=0, speculate=K)
    with pytest.raises(UserError, match=r"--speculate=1000000000 exceeds the model's block_size="):
        sample.main([f"--out_dir={run / 'out'}", "--max_new_tokens=2", "--device=cpu",
                     "--speculate=1000000000"])


def test_sample_compiles_decoding_and_speculation(run, capsys, monkeypatch):
    """sample.py --compile=True gives eager decoding's greedy text, plain, speculative and with
    passes chained (--passes_per_graph=2), and compiles the decoding step, the draft pass and
    verifier pass, and the chained passes (GPT.compiled; here traced whole and run without code
    generation)."""
    from model import GPT
    made = []

    def compiled(step, device):
        made.append(step.__name__)
        return torch.compile(step, backend='eager', fullgraph=True, dynamic=False)
    monkeypatch.setattr(GPT, 'compiled', staticmethod(compiled))
    args = [f"--out_dir={run / 'out'}", "--max_new_tokens=12", "--num_samples=2", "--device=cpu",
            "--temperature=0"]
    texts = []
    try:
        for extra in ([], ["--speculate=3", "--draft=layers"],
                      ["--speculate=2", "--passes_per_graph=2"]):
            assert sample.main([*args, *extra]) == 0
            eager = capsys.readouterr().out.splitlines()
            assert sample.main([*args, *extra, "--compile=True"]) == 0
            compiled_out = capsys.readouterr().out.splitlines()
            assert compiled_out[:4] == eager[:4] and len(eager[0]) == 13
            assert 'compiled, route=' in compiled_out[4]
            texts.append(eager[:4])
        assert texts[1] == texts[2] == texts[0]        # speculative greedy: plain decoding's text
    finally:
        torch._dynamo.reset()
    assert sorted(set(made)) == ['chained_passes', 'decode_step', 'draft_pass', 'verify_pass',
                                 'whole_pass']


@pytest.mark.parametrize('extra,needle', [
    (["--compile=True", "--use_cache=False"], "--compile compiles the cached decoding step"),
    (["--speculate=2", "--draft=bogus"], r"--draft/--draft_layers: draft 'bogus' is not one of "
                                         r"route='ffn''s drafts \('cheap': every routed FFN"),
    (["--speculate=2", "--draft_layers=2"], "draft 'cheap' has no depth"),
    (["--speculate=2", "--draft=layers", "--draft_layers=5"], "draft_layers=5 is not a depth"),
    (["--draft=layers"], "give K >= 1 too"),
    (["--speculate=-1"], "speculate must be >= 0"),
    (["--speculate=2", "--use_cache=False"], "--speculate needs the KV cache"),
    (["--speculate=2", "--max_new_tokens=30"], "within block_size 16"),
])
def test_sample_refuses_bad_speculation_options(run, extra, needle):
    with pytest.raises(UserError, match=needle):
        sample.main([f"--out_dir={run / 'out'}", "--device=cpu", *extra])


def test_speculative_passes_attend_over_the_filled_buckets_only(monkeypatch):
    """Each pass attends over KVCache.bucket(last position + 1) slots, as plain decoding does, not
    over all block_size slots: with block_size 160 a decode from 50 to 100 tokens attends over 64
    and then 128 slots, never 160; greedy tokens equal plain decoding's (same bucketed kernels)."""
    from model import KVCache
    model = build('exit', seed=3, block_size=160).eval()
    idx = tokens(3, 2, 50)
    seen = []
    orig = KVCache.attend_to

    def attend_to(self, n):
        orig(self, n)
        seen.append(self.attend_len)
    monkeypatch.setattr(KVCache, 'attend_to', attend_to)
    out = speculative.generate(model, idx, 50, 3, 'exit', temperature=0)
    assert set(seen) == {64, 128}
    monkeypatch.setattr(KVCache, 'attend_to', orig)
    assert torch.equal(out, model.generate(idx, 50, temperature=0))


def pass_outputs(model, idx, K, draft, temperature, **kw):
    """The number of tensors each pass's steps returned in speculative.generate(**kw), by step."""
    from torch.utils._pytree import tree_leaves
    counts = {}

    def counting(model, device, compile, step):
        def run(*args):
            out = step(*args)
            n = sum(isinstance(x, torch.Tensor) for x in tree_leaves(out))
            counts.setdefault(step.__name__, set()).add(n)
            return out
        return run
    with mock.patch.object(speculative, 'pass_step', counting):
        speculative.generate(model, idx, 12, K, draft, temperature=temperature, **kw)
    return counts


@settings(**{**SETTINGS, 'max_examples': 10})
@given(case=st.sampled_from(CASES), seed=st.integers(0, 999), K=st.integers(1, 3),
       n_layer=st.sampled_from([4, 8]), how=st.sampled_from(['apart', 'one_graph', 'chained']),
       temperature=st.sampled_from([0.0, 1.0]), data=st.data())
def test_a_pass_returns_what_decoding_reads_in_as_many_tensors_at_any_depth(
        case, seed, K, n_layer, how, temperature, data):
    """Compiled on CUDA, every tensor a pass returns is copied out of its graph at a host cost of
    its own, so a pass returns what generate reads, in a number of tensors that does not grow with
    the model's depth: a draft its window (and its distributions q when sampling); a verification
    (or chained passes) the kept counts, the next token and the kept tokens, and only where a
    recorder or a trace reads them the routing decisions of every layer as one tensor (a trace
    also takes the logits)."""
    model = build(*case, seed=seed, n_layer=n_layer).eval()
    draft = data.draw(st.sampled_from(sorted(model.family.drafts(model.config))))
    idx = tokens(seed, 2, 3)
    _, _, aux = model(idx)
    masks, margins = len(aux.get('masks', {})), len(aux.get('margins', {}))
    sampled = temperature > 0
    opts = dict(one_graph=how != 'apart', passes_per_graph=2 if how == 'chained' else 1)

    def counts(**kw):
        got = pass_outputs(model, idx, K, draft, temperature, **opts, **kw)
        drafts = got.pop('draft_pass', None)
        assert (drafts is None) == (how != 'apart')
        if drafts is not None:      # (an eager decode's last pass may draft nothing: no q then)
            assert drafts in ({1 + sampled}, {1, 1 + sampled})
        assert ('chained_passes' in got) == (how == 'chained')
        return got
    for kw, want in ((dict(stats={}), 3), (dict(record=lambda aux: 0), 3 + (masks > 0)),
                     (dict(trace={}), 4 + (masks + margins > 0))):
        assert set(map(frozenset, counts(**kw).values())) == {frozenset([want])}, kw


@pytest.mark.parametrize('case', DETERMINISTIC)
def test_plain_decodings_step_returns_the_logits_alone_unless_statistics_are_read(case):
    """Plain decoding's compiled step (GPT.decode_step) returns the next-token logits and, only
    where generate's stats are asked for, the family's routing statistics (one tensor each): on
    CUDA every tensor a graph returns is one more copy a token. Uniform and ragged prompts."""
    from torch.utils._pytree import tree_leaves
    model = build(*case, seed=1).eval()
    idx = tokens(1, 2, 3)
    _, _, aux = model(idx)
    reported = sum(k in aux for k in ('full_frac', 'tlops_saved'))
    counts = set()

    def compiled(step, device):
        def run(*args):
            out = step(*args)
            counts.add(sum(isinstance(x, torch.Tensor) for x in tree_leaves(out)))
            return out
        return run
    with mock.patch.object(GPT, 'compiled', staticmethod(compiled)):
        for lengths in (None, [3, 2]):
            for stats, want in ((None, 1), ({}, 1 + reported)):
                counts.clear()
                model.generate(idx, 4, temperature=0, compile=True, lengths=lengths, stats=stats)
                assert counts == {want}, (lengths, stats)


@pytest.mark.parametrize('case', [c for c in CASES if not is_random(c)])
@pytest.mark.parametrize('speculate', [0, 2])
def test_a_padded_batch_reports_the_routing_of_its_real_tokens(case, speculate):
    """The statistics of prompts of different lengths are their real tokens' alone: what fills the
    padding changes nothing, and the prefill's full-path fraction is the token-weighted mean of
    each prompt's own (decisions are causal per token: a prompt alone decides as in the batch)."""
    model = build(*case).eval()
    lengths, idx = [3, 7], tokens(5, 2, 7)

    def stats(idx, new, **kw):
        out = {}
        model.generate(idx, new, temperature=0, stats=out, speculate=speculate, **kw)
        return {k: out[k] for k in ('full_frac', 'tlops_saved') if k in out}   # (not timings)

    alone = [stats(idx[b:b + 1, :n], 1) for b, n in enumerate(lengths)]
    if 'full_frac' not in alone[0]:
        pytest.skip(f"{case[0]} records no full-path fraction")
    padded = [idx.clone().masked_fill_(torch.arange(7) >= torch.tensor(lengths)[:, None], v)
              for v in (0, 9)]
    for new in (1, 4):
        got = [stats(p, new, lengths=lengths) for p in padded]
        assert got[0] == got[1], new            # the padding's tokens are not counted
    want = [sum(n * a['full_frac'][l] for n, a in zip(lengths, alone)) / sum(lengths)
            for l in range(len(alone[0]['full_frac']))]
    assert stats(padded[0], 1, lengths=lengths)['full_frac'] == pytest.approx(want, abs=1e-6)
