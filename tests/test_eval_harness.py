"""eval_harness.py: the harness's three requests against an independent computation (one direct
forward of the whole text and the summed log-softmax of its tokens), the rolling windows' cover
of a text, the realised budget against a recount of the routing masks, and the command line's
refusals; with lm_eval installed, its simple_evaluate on this repository's offline tasks."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import eval_harness as eh
from configurator import UserError
from conftest import ROUTED_TOL, build
from data.loader import load_tokenizer

pytestmark = pytest.mark.usefixtures('one_thread')
CHARS = list('abcdefghijklmnopqrstu\n')         # 22 symbols: id 22 of the model's 23 is padding
META = dict(tokenizer='char', chars=CHARS, vocab_size=len(CHARS))
ROUTES = ['none', 'ffn', 'mod', 'exit']          # dense, gate + threshold, router, early exit


def scorer_for(route, batch_size=4, **kw):
    model = build(route, n_layer=2, **kw).eval()
    encode, decode = load_tokenizer(META)
    return eh.Scorer(model, encode, decode, len(CHARS), eh.prefix_token(META, encode),
                     batch_size=batch_size)


def direct(model, ids, first):
    """log p(ids[first:] | ids[:first]) and whether each is the argmax over the real vocabulary,
    from one forward of the whole text alone (no padding, no windows)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), last_only=False)[0][0]
    logp = F.log_softmax(logits.float(), -1)[first - 1:]
    want = torch.tensor(ids[first:])
    top = logp[:, :len(CHARS)].argmax(-1)
    return float(logp.gather(-1, want[:, None]).sum()), bool((top == want).all())


def greedy_next(model, ids):
    with torch.no_grad():
        return int(model(torch.tensor([ids]))[0][0, -1, :len(CHARS)].argmax())


@pytest.mark.parametrize('route', ROUTES)
def test_loglikelihood_equals_one_direct_forward_and_is_greedy_the_argmax(route):
    """Pairs of every length up to the block, scored in padded batches of 4, against a forward of
    each text alone: log p within ROUTED_TOL, is_greedy exactly; a continuation of the model's own
    argmax is greedy, one of another symbol is not."""
    s = scorer_for(route)
    g = torch.Generator().manual_seed(0)
    text = lambda n: ''.join(CHARS[int(i)] for i in torch.randint(0, 21, (n,), generator=g))
    pairs = [(text(c), text(k)) for c, k in [(1, 1), (5, 3), (12, 12), (20, 4), (3, 1), (7, 9)]]
    best = greedy_next(s.model, s.encode(pairs[1][0]))
    other = (best + 1) % len(CHARS)
    pairs += [(pairs[1][0], CHARS[best]), (pairs[1][0], CHARS[other])]
    got = s.loglikelihood(pairs)
    for (context, continuation), (lp, greedy) in zip(pairs, got):
        ids = s.encode(context + continuation)
        want_lp, want_greedy = direct(s.model, ids, len(context))
        assert lp == pytest.approx(want_lp, rel=ROUTED_TOL['rtol'], abs=ROUTED_TOL['atol'])
        assert greedy == want_greedy
        assert -60 < lp < 0                     # a real log-probability of a few symbols
    assert got[-2][1] is True and got[-1][1] is False


def test_a_contexts_trailing_whitespace_is_scored_with_the_continuation():
    """lm-evaluation-harness's models move all of a context's trailing whitespace (str.rstrip()),
    newlines included, to the continuation: ('ab\\n', 'c') is scored as ('ab', '\\nc'), its
    log-probability counting the newline's."""
    s = scorer_for('none')
    assert s.pair_tokens('ab\n\n', 'c') == (s.encode('ab'), s.encode('\n\nc'))
    (lp, greedy), = s.loglikelihood([('ab\n', 'c')])
    want = direct(s.model, s.encode('ab\nc'), 2)
    assert lp == pytest.approx(want[0], rel=1e-5, abs=1e-5) and greedy == want[1]
    alone = direct(s.model, s.encode('ab\nc'), 3)[0]          # the newline left out
    assert abs(lp - alone) > 1e-2                              # the check can tell them apart
    encode, decode = load_tokenizer(dict(tokenizer='gpt2'))
    bpe = eh.Scorer(build('none', n_layer=1).eval(), encode, decode, 50257, eh.GPT2_EOT)
    ctx, cont = bpe.pair_tokens('Question: 2+2?\nAnswer: \n', '4')
    assert decode(ctx) == 'Question: 2+2?\nAnswer:' and decode(cont) == ' \n4'


def test_an_empty_context_is_the_prefix_token():
    s = scorer_for('ffn')
    (lp, greedy), = s.loglikelihood([('', 'abc')])
    want = direct(s.model, [s.prefix_id] + s.encode('abc'), 1)
    assert lp == pytest.approx(want[0], rel=1e-4, abs=1e-4) and greedy == want[1]
    assert s.prefix_id == CHARS.index('\n')


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 80), first=st.integers(1, 79), block=st.integers(1, 9))
def test_score_windows_predict_each_token_once_with_the_longest_context(n, first, block):
    """Every token of tokens[first:] is a target exactly once, in order; a window's input is the
    at most `block` tokens just before its last target (all there are, when fewer)."""
    first = min(first, n - 1)
    tokens = list(range(100, 100 + n))
    windows = eh.score_windows(tokens, first, block)
    assert [t for _, targets in windows for t in targets] == tokens[first:]
    for inputs, targets in windows:
        last = tokens.index(targets[-1])
        assert inputs == tokens[max(0, last - block):last]
        assert 1 <= len(targets) <= len(inputs) <= block


def test_score_windows_are_lm_evals_rolling_windows():
    """The same (input, target) pairs as the harness's own utility, where it is installed."""
    utils = pytest.importorskip('lm_eval.utils')
    tokens = list(range(1, 30))
    for block in (1, 4, 7, 40):
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
            token_list=tokens, prefix_token=0, max_seq_len=block, context_len=1)]
        ours = eh.score_windows([0] + tokens, 1, block)
        # theirs: (context, continuation), the model's input being context + continuation[:-1]
        assert [(list(a) + list(b)[:-1], list(b)) for a, b in theirs] == ours


@pytest.mark.parametrize('route', ['none', 'ffn'])
def test_rolling_within_one_block_is_the_eval_loss_times_its_tokens(route):
    """A text of one block: its rolling log-likelihood is minus eval.py's loss (the model's
    lm_loss with targets) times its token count."""
    s = scorer_for(route)
    text = 'abcdefghijklmnopqrstu\nab'[:23]
    ids = s.encode(text)
    x, y = torch.tensor([[s.prefix_id] + ids[:-1]]), torch.tensor([ids])
    with torch.no_grad():
        loss = float(s.model(x, y)[2]['lm_loss'])
    (lp,) = s.loglikelihood_rolling([text])
    assert lp == pytest.approx(-loss * len(ids), rel=1e-5)
    assert 1.0 < loss < 20                       # a real loss of an untrained model of 22 symbols


def test_rolling_beyond_the_block_is_the_sum_over_its_windows():
    """A text of 3+ blocks: the sum, over the windows, of one direct forward of each window's
    input alone; each window scored as loglikelihood(input's text, targets' text) gives it too."""
    s = scorer_for('ffn', batch_size=3)
    text = ('hello\nworld\nquick brown\n' * 4).replace(' ', 'a').replace('w', 'b')
    text = ''.join(c if c in CHARS else 'a' for c in text)
    tokens = [s.prefix_id] + s.encode(text)
    windows = eh.score_windows(tokens, 1, s.block_size)
    assert len(windows) >= 3
    total = 0.0
    for inputs, targets in windows:
        with torch.no_grad():
            logits = s.model(torch.tensor([inputs]), last_only=False)[0][0]
        logp = F.log_softmax(logits.float(), -1)[len(inputs) - len(targets):]
        total += float(logp.gather(-1, torch.tensor(targets)[:, None]).sum())
    (lp,) = s.loglikelihood_rolling([text])
    assert lp == pytest.approx(total, rel=1e-5)
    assert lp < -len(tokens) * 0.5               # ~log(22) nats a token, untrained


def test_generate_until_is_greedy_decoding_cut_at_the_first_stop():
    """The text is model.generate's greedy tokens, cut before the first stop string; without a
    stop in reach it is max_gen_toks tokens; a context longer than the block still generates."""
    s = scorer_for('ffn')
    context = 'abcab'
    x = torch.tensor([s.encode(context)])
    full = s.decode(s.model.generate(x, 40, temperature=0.0, vocab_limit=len(CHARS))[0, 5:]
                    .tolist())
    stop = full[7]                              # a symbol it does generate
    want = full[:full.index(stop)]
    got = s.generate_until([(context, dict(until=[stop], max_gen_toks=40)),
                            (context, dict(until=['never'], max_gen_toks=9)),
                            ('abc' * 20, dict(until=[], max_gen_toks=3))])
    assert got[0] == want and len(got[0]) <= 7
    assert got[1] == full[:9]
    assert len(got[2]) == 3
    assert s.routing()['generate_full_frac'] is not None


@pytest.mark.parametrize('route', ['ffn', 'mod'])
def test_routing_reports_the_full_path_fraction_over_real_positions(route):
    """The realised full-path fraction per routed layer over the scored tokens equals a recount
    of the masks of each text's own forward (padding excluded), token-weighted."""
    s = scorer_for(route, batch_size=8)
    texts = ['abcdefg', 'hij', 'klmnopqrstu\nabcd', 'u']
    s.loglikelihood_rolling(texts)
    sums, n = {}, 0
    for t in texts:
        ids = [s.prefix_id] + s.encode(t)
        with torch.no_grad():
            masks = s.model(torch.tensor([ids[:-1]]), last_only=False)[2]['masks']
        for layer, m in masks.items():
            sums[layer] = sums.get(layer, 0.0) + float(m.float().sum())
        n += len(ids) - 1
    r = s.routing()
    assert r['layers'] == sorted(sums) and r['tokens_scored'] == n
    assert r['full_frac'] == pytest.approx([sums[l] / n for l in sorted(sums)], abs=1e-6)
    assert 0.05 < r['full_frac_mean'] < 0.95     # a routed model: some tokens each way
    assert r['budget'] == s.model.family.budget(s.model.config)


def test_a_dense_model_reports_no_full_path_fraction():
    s = scorer_for('none')
    s.loglikelihood([('ab', 'c')])
    r = s.routing()
    assert r['full_frac'] is None and r['budget'] is None and r['tokens_scored'] == 2


def test_gpt2_pairs_split_where_the_contexts_encoding_ends():
    """BPE: the pair is encoded whole and cut after the context's tokens; the context's trailing
    space moves to the continuation, as the harness's own models do."""
    encode, decode = load_tokenizer(dict(tokenizer='gpt2'))
    s = eh.Scorer(build('none', n_layer=1).eval(), encode, decode, 50257, eh.GPT2_EOT)
    ctx, cont = s.pair_tokens('The cat ', 'sat down')
    assert decode(ctx) == 'The cat' and decode(cont) == ' sat down'
    assert ctx + cont == encode('The cat sat down')
    assert s.pair_tokens('', 'Hi') == ([eh.GPT2_EOT], encode('Hi'))
    assert eh.prefix_token(dict(tokenizer='gpt2'), encode) == eh.GPT2_EOT


@pytest.mark.parametrize('until', [[], ['\n\n']])
def test_gpt2_generation_stops_at_end_of_text(until):
    """With GPT-2's tokenizer, generation ends at <|endoftext|> whether or not the request names
    it (as the harness's own models add it), and the text is cut before it."""
    encode, decode = load_tokenizer(dict(tokenizer='gpt2'))
    model = build('none', n_layer=1).eval()
    emitted = encode(' Paris') + [eh.GPT2_EOT] + encode(' and more text')

    def generate(x, n, **kw):       # the same continuation for every call, n tokens of it
        done = x.size(1) - len(encode('Q:'))
        return torch.cat([x, torch.tensor([emitted[done:done + n]])], 1)
    model.generate = generate
    s = eh.Scorer(model, encode, decode, 50257, eh.GPT2_EOT, eos_id=eh.GPT2_EOT)
    assert s.generate_until([('Q:', dict(until=until, max_gen_toks=9))], chunk=2) == [' Paris']
    plain = eh.Scorer(model, encode, decode, 50257, eh.GPT2_EOT)      # no end-of-text token
    assert plain.generate_until([('Q:', dict(until=until, max_gen_toks=4))]) == [
        decode(emitted[:4])]


def test_an_oracle_gate_is_refused_before_any_scoring():
    model = build('ffn', n_layer=2, ffn_gate='oracle').eval()
    encode, decode = load_tokenizer(META)
    with pytest.raises(UserError, match='oracle'):
        eh.Scorer(model, encode, decode, len(CHARS), 0)


# --------------------------------------------------------------------------------------------------
# the command line


@pytest.mark.parametrize('arg,needle', [
    ('--tasks=', 'tasks'), ('--limit=-1', 'limit'), ('--batch_size=0', 'batch_size'),
    ('--num_fewshot=-2', 'num_fewshot'), ('--include_path=/nonexistent', 'include_path'),
    ('--device=bogus', 'device'), ('--out=x.txt', 'out')])
def test_bad_options_are_one_error_naming_the_field(tmp_path, arg, needle):
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'')
    argv = [f'--ckpt={ckpt}', '--tasks=nanodepth_arith', arg]
    with pytest.raises(UserError, match=needle):
        eh.main(argv)


def test_without_lm_eval_one_line_and_exit_2_before_loading(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'not read')
    real = eh.importlib.util.find_spec
    monkeypatch.setattr(eh.importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'lm_eval' else real(name, *a))
    monkeypatch.setattr(eh, 'load_scorer', lambda *a, **k: pytest.fail('loaded the checkpoint'))
    assert eh.main([f'--ckpt={ckpt}', '--tasks=nanodepth_arith']) == 2
    out, err = capsys.readouterr()
    assert out == '' and err == 'error: eval_harness.py needs lm_eval: pip install lm_eval\n'


def test_out_in_a_folder_not_made_yet_gets_the_results(tmp_path, monkeypatch, capsys):
    """--out may name a folder that does not exist yet (the option check accepts one it can make):
    the results are written there after the evaluation, not lost to a missing folder."""
    ckpt, out = tmp_path / 'ckpt.pt', tmp_path / 'new' / 'deeper' / 'harness.json'
    ckpt.write_bytes(b'not read')
    real = eh.importlib.util.find_spec
    monkeypatch.setattr(eh.importlib.util, 'find_spec',
                        lambda name, *a: object() if name == 'lm_eval' else real(name, *a))
    monkeypatch.setattr(eh, 'known_tasks', lambda *a: None)
    monkeypatch.setattr(eh, 'load_scorer', lambda *a, **k: None)
    monkeypatch.setattr(eh, 'evaluate_tasks', lambda *a, **k: {'results': {'t': {'acc': 0.5}}})
    assert eh.main([f'--ckpt={ckpt}', '--tasks=nanodepth_arith', f'--out={out}']) == 0
    assert json.loads(out.read_text())['results'] == {'t': {'acc': 0.5}}
    assert json.loads(capsys.readouterr().out) == json.loads(out.read_text())


def test_help_lists_every_option(capsys):
    assert eh.main(['--help']) == 0
    out = capsys.readouterr().out
    assert out.startswith('Score a checkpoint') and 'UNDOCUMENTED' not in out
    assert all(f'--{k}=' in out for k in eh.DEFAULTS)


# --------------------------------------------------------------------------------------------------
# the offline tasks


def arith_utils():
    import importlib.util
    path = eh.TASKS_DIR + '/arith/utils.py'
    spec = importlib.util.spec_from_file_location('arith_task_utils', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_offline_problems_are_the_arith_tasks_first_test_problems():
    """problems.jsonl is what its builder makes from data/prepare.py arith's test split: the
    question, the true answer, and that answer among the choices at `gold`."""
    import json
    utils = arith_utils()
    with open(utils.PROBLEMS) as f:
        rows = [json.loads(line) for line in f]
    assert rows == utils.build_rows() and len(rows) == 40
    for row in rows:
        assert eval(row['question'][:-1]) == int(row['answer'])
        assert row['choices'][row['gold']] == row['answer'] + '\n'
        assert len(set(row['choices'])) == 4


def arith_scorer():
    """A tiny untrained model speaking the arith task's own 15 characters."""
    from data.prepare import ARITH_SYMBOLS
    meta = dict(tokenizer='char', chars=sorted(ARITH_SYMBOLS), vocab_size=15)
    encode, decode = load_tokenizer(meta)
    model = build('ffn', n_layer=2, vocab_size=16, block_size=16).eval()
    return eh.Scorer(model, encode, decode, 15, eh.prefix_token(meta, encode), batch_size=8)


@pytest.mark.slow          # importing lm_eval takes ~10 s; skipped where it is not installed
def test_lm_evals_simple_evaluate_runs_the_offline_tasks_through_the_scorer():
    """lm_eval (offline) on the three local tasks, 8 problems each: its accuracy is the share of
    problems whose true answer has the highest loglikelihood by the Scorer itself; exact match is
    the share of greedy answers equal to the true one; the routing is reported beside them."""
    pytest.importorskip('lm_eval')
    s = arith_scorer()
    tasks = ['nanodepth_arith', 'nanodepth_arith_choice', 'nanodepth_arith_ppl']
    res = eh.evaluate_tasks(s, tasks, limit=8)
    rows = arith_utils().build_rows()[:8]
    acc = sum(max(range(4), key=lambda c: s.loglikelihood([(r['question'], r['choices'][c])])[0][0])
              == r['gold'] for r in rows) / 8
    said = s.generate_until([(r['question'], dict(until=['\n'], max_gen_toks=8)) for r in rows])
    exact = sum(a == r['answer'] for a, r in zip(said, rows)) / 8
    got = res['results']
    assert got['nanodepth_arith_choice']['acc,none'] == pytest.approx(acc)
    assert got['nanodepth_arith']['exact_match,none'] == pytest.approx(exact)
    assert 1.5 < got['nanodepth_arith_ppl']['byte_perplexity,none'] < 40   # ~15 untrained
    assert res['routing']['tokens_scored'] > 8 * 4 * 5 and 0 < res['routing']['full_frac_mean'] < 1


# --------------------------------------------------------------------------------------------------
# the harness's model from Python: its batch_size


@pytest.mark.parametrize('value,size', [(8, 8), ('8', 8), (' 3 ', 3), ('auto', 16),
                                        ('auto:4', 16), (None, 16)])
def test_a_harness_batch_size_is_a_positive_integer_or_auto(value, size):
    assert eh.harness_batch_size(value) == size


BAD_BATCH_SIZES = [0, '0', -3, '-3', 'x', '', 2.5, '2.5', True, 'auto:0', '²']


@pytest.mark.parametrize('value', BAD_BATCH_SIZES)
def test_a_bad_harness_batch_size_is_one_line_naming_it(value):
    """Refused in one line, not read as 16 (-3, 'x') or left to fail in range() (0, '0')."""
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer or 'auto'") as e:
        eh.harness_batch_size(value)
    assert '\n' not in str(e.value) and repr(value) in str(e.value)


@pytest.fixture
def stub_lm_eval(monkeypatch):
    """register() against a stand-in for lm_eval's LM base class and registry (lm_eval itself is
    large and optional), its class made afresh."""
    import sys
    import types
    api = types.ModuleType('lm_eval.api')
    api.model = types.SimpleNamespace(LM=type('LM', (), {}))
    api.registry = types.SimpleNamespace(register_model=lambda name: (lambda cls: cls))
    for name, module in (('lm_eval', types.ModuleType('lm_eval')), ('lm_eval.api', api),
                         ('lm_eval.api.model', api.model), ('lm_eval.api.registry', api.registry)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(eh, 'HARNESS_MODEL', [])
    return eh.register()


@pytest.mark.parametrize('value', [0, '0', -3, 'x'])
def test_the_harness_model_refuses_a_bad_batch_size_before_loading(value, stub_lm_eval,
                                                                   monkeypatch):
    monkeypatch.setattr(eh, 'load_scorer', lambda *a, **k: pytest.fail('loaded the checkpoint'))
    with pytest.raises(ValueError, match='batch_size'):
        stub_lm_eval(ckpt='out/x/ckpt.pt', batch_size=value)


def test_the_harness_model_passes_its_batch_size_to_the_scorer(stub_lm_eval, monkeypatch):
    sizes = []
    monkeypatch.setattr(eh, 'load_scorer', lambda ckpt, device, data_dir, calib, size:
                        sizes.append(size) or 'scorer')
    for value in ('4', 4, 'auto'):
        assert stub_lm_eval(ckpt='out/x/ckpt.pt', batch_size=value).scorer == 'scorer'
    assert sizes == [4, 4, 16]
