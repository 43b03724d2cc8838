"""Invariants of the dense model: KV cache vs recompute, causality, RoPE, FLOPs vs FlopCounterMode,
GPT-2 weight mapping, MFU peaks."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flops
import speculative
from conftest import FP32_TOL, assert_greedy_traces_agree, greedy_trace
from model import GPT, GPTConfig, KVCache

SETTINGS = dict(max_examples=12, deadline=None)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(block_size=24, vocab_size=37, n_layer=2, n_head=2, n_embd=16)
    args.update(kw)
    return GPT(GPTConfig(**args)).eval()


@settings(**SETTINGS)
@given(seed=st.integers(0, 10_000), pos=st.sampled_from(['learned', 'rope']), B=st.integers(1, 3),
       T0=st.integers(1, 20), new=st.integers(1, 12), bias=st.booleans())
def test_kv_cache_greedy_equals_full_recompute(seed, pos, B, T0, new, bias):
    # new tokens may run past block_size (24): then generate crops the context, as without a cache
    model = tiny(seed, pos=pos, bias=bias)
    idx = torch.randint(0, 37, (B, T0), generator=torch.Generator().manual_seed(seed))
    # a cache step runs T=1 and masked attention, recomputation T and is_causal: logits within
    # FP32_TOL, tokens equal unless a near-tie (conftest.assert_greedy_traces_agree)
    full = greedy_trace(model, idx, new, use_cache=False)
    cached = greedy_trace(model, idx, new, use_cache=True)
    for a, b in zip(cached, full):
        assert_greedy_traces_agree(a, b, FP32_TOL)


@settings(**SETTINGS)
@given(seed=st.integers(0, 10_000), temperature=st.floats(0.1, 3.0),
       speculate=st.sampled_from([0, 2]), use_cache=st.booleans())
def test_top_k_one_is_greedy_without_a_random_draw(seed, temperature, speculate, use_cache):
    # top_k=1 leaves one token to sample: it is the argmax, taken without softmax or RNG
    model = tiny(seed, n_layer=3)
    idx = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(seed))
    use_cache = use_cache or bool(speculate)
    greedy = model.generate(idx, 8, temperature=0, use_cache=use_cache, speculate=speculate)
    state = torch.get_rng_state()
    top1 = model.generate(idx, 8, temperature=temperature, top_k=1, use_cache=use_cache,
                          speculate=speculate)
    assert torch.equal(top1, greedy)
    if speculate:                   # speculative.generate called directly: the same
        import speculative
        direct = speculative.generate(model, idx, 8, speculate, temperature=temperature, top_k=1)
        assert torch.equal(direct, greedy)
    assert torch.equal(torch.get_rng_state(), state)


@settings(**SETTINGS)
@given(seed=st.integers(0, 10_000), pos=st.sampled_from(['learned', 'rope']), T=st.integers(2, 24))
def test_cached_logits_match_full_forward(seed, pos, T):
    model = tiny(seed, pos=pos)
    idx = torch.randint(0, 37, (2, T), generator=torch.Generator().manual_seed(seed))
    ref = model(idx, idx)[0]
    cache = KVCache(model.config, 2, 24, idx.device, torch.float32)
    split = T // 2
    p = torch.arange(T).expand(2, T)
    a = (
        model(idx[:, :split], pos=p[:, :split], cache=cache, last_only=False)[0]
        if split
        else ref[:, :0]
    )
    b = torch.cat(
        [model(idx[:, t : t + 1], pos=p[:, t : t + 1], cache=cache)[0] for t in range(split, T)], 1
    )
    torch.testing.assert_close(torch.cat([a, b], 1), ref, rtol=1e-5, atol=1e-5)


@settings(**SETTINGS)
@given(seed=st.integers(0, 10_000), pos=st.sampled_from(['learned', 'rope']), T=st.integers(2, 24),
       data=st.data())
def test_causal_future_tokens_never_change_past_logits(seed, pos, T, data):
    model = tiny(seed, pos=pos)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 37, (2, T), generator=g)
    t = data.draw(st.integers(0, T - 2))
    other = idx.clone()
    other[:, t + 1:] = torch.randint(0, 37, (2, T - t - 1), generator=g)
    a, b = model(idx, idx)[0], model(other, other)[0]
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=0)



def test_decoding_attends_over_the_bucket_of_filled_slots(monkeypatch):
    """Each forward of generate attends over the smallest power of two >= the positions filled
    (at least 64, at most block_size) slots, not over all block_size: the lengths the cache hands
    to attention, recorded per layer, for an equal-prompt batch and a ragged one."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=300, vocab_size=11)).eval()
    seen, write = [], KVCache.write

    def recording(self, layer, *args):
        k, v, kpos = write(self, layer, *args)
        if layer == 0:
            assert k.shape[2] == v.shape[2] == kpos.shape[1]
            seen.append(k.shape[2])
        return k, v, kpos
    monkeypatch.setattr(KVCache, 'write', recording)
    model.generate(torch.zeros(2, 60, dtype=torch.long), 72, temperature=0)
    # the prefill (60 positions), then steps filling positions < 61 ... < 131
    assert seen == [64] + [64] * 4 + [128] * 64 + [256] * 3
    seen.clear()
    model.generate(torch.zeros(2, 250, dtype=torch.long), 10, temperature=0, lengths=[250, 100])
    assert seen == [256] + [256] * 6 + [300] * 3


@pytest.mark.parametrize('speculate', [0, 2])
def test_ragged_prompts_padded_past_the_longest_decode_as_padded_to_it(speculate):
    """lengths= allows any padded width >= the longest prompt: columns past it are padding alone,
    whether they fit the output's width or even block_size (24) or not."""
    model = tiny(1)
    idx = torch.randint(0, 37, (2, 30), generator=torch.Generator().manual_seed(1))
    want = model.generate(idx[:, :6], 5, temperature=0, lengths=[3, 6], speculate=speculate)
    assert [len(t) for t in want] == [8, 11]
    for width in (10, 30):
        got = model.generate(idx[:, :width], 5, temperature=0, lengths=[3, 6],
                             speculate=speculate)
        assert [t.tolist() for t in got] == [t.tolist() for t in want], width


def test_generate_takes_lengths_as_a_tensor_and_refuses_them_without_the_cache():
    model = tiny(1)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(idx, 4, temperature=0, lengths=[3, 6])
    got = model.generate(idx, 4, temperature=0, lengths=torch.tensor([3, 6]))
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    with pytest.raises(ValueError, match="lengths .* needs use_cache=True"):
        model.generate(idx, 4, temperature=0, lengths=[3, 6], use_cache=False)


def test_a_stats_dict_given_again_gets_the_new_call_figures():
    model = tiny(1, route='ffn', ffn_layers='all')
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(3))
    fresh, reused = {}, {}
    model.generate(idx[:, :2], 3, temperature=0, stats=reused)
    first = reused['full_frac']
    for stats in (fresh, reused):
        model.generate(idx, 5, temperature=0, stats=stats)
    assert reused['full_frac'] == fresh['full_frac'] != first


def test_sampling_top_k_0_is_every_token_and_half_logits_at_a_small_temperature_stay_finite():
    model = tiny(1)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    want = model.generate(idx, 6, temperature=0.9, top_k=None)
    torch.manual_seed(5)
    assert torch.equal(model.generate(idx, 6, temperature=0.9, top_k=0), want)
    # 30 / 1e-4 overflows half precision: the distribution is still the argmax's one-hot
    logits = torch.tensor([[30.0, 29.0, -5.0], [1.0, 2.0, 3.0]], dtype=torch.float16)
    probs = speculative.next_probs(logits, 1e-4, None)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))


def test_rope_depends_only_on_relative_positions():
    model = tiny(3, pos='rope')
    idx = torch.randint(0, 37, (2, 10))
    base = model(idx, last_only=False)[0]
    shifted = model(idx, pos=torch.arange(7, 17).expand(2, 10), last_only=False)[0]
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)
    learned = tiny(3, pos='learned')
    assert not torch.allclose(
        learned(idx, last_only=False)[0],
        learned(idx, pos=torch.arange(7, 17).expand(2, 10), last_only=False)[0],
    )


@settings(**SETTINGS)
@given(n_layer=st.integers(1, 3), n_head=st.sampled_from([1, 2, 4]), hd=st.sampled_from([4, 8]),
       T=st.integers(1, 24), B=st.integers(1, 3), V=st.integers(5, 70),
       pos=st.sampled_from(['learned', 'rope']), bias=st.booleans())
def test_analytic_flops_match_flop_counter(n_layer, n_head, hd, T, B, V, pos, bias):
    cfg = GPTConfig(block_size=24, vocab_size=V, n_layer=n_layer, n_head=n_head, n_embd=n_head * hd,
                    pos=pos, bias=bias)
    model = GPT(cfg)
    idx = torch.randint(0, V, (B, T))
    with sdpa_kernel(SDPBackend.MATH):           # the fused CPU kernel is invisible to
                                                 # FlopCounterMode
        with FlopCounterMode(display=False) as fc:
            with torch.no_grad():
                model(idx, idx)
        fwd = fc.get_total_flops()
        with FlopCounterMode(display=False) as fc:
            model(idx, idx)[1].backward()
        fwdbwd = fc.get_total_flops()
    assert fwd == B * flops.dense_forward_flops(cfg, T)
    assert fwdbwd == 3 * fwd
    assert flops.flops_per_token(model.config, T, training=True) * B * T == fwdbwd


def test_peak_flops_table(monkeypatch):
    assert flops.peak_flops('cpu', 'float32') is None
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    names = {
        'NVIDIA H100 80GB HBM3': ('bfloat16', 989.4e12),
        'NVIDIA H100 PCIe': ('bfloat16', 756e12),
        'NVIDIA H100 NVL': ('bfloat16', 835.5e12),      # not the SXM part its name contains
        'NVIDIA H200 NVL': ('bfloat16', 835.5e12),
        'NVIDIA H200': ('bfloat16', 989.4e12),
        'Tesla V100-SXM2-32GB': ('float16', 125e12),
        'NVIDIA A100-SXM4-40GB': ('bfloat16', 312e12),
    }
    for name, (dt, peak) in names.items():
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None, n=name: n)
        assert flops.peak_flops('cuda', dt) == peak
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'Tesla V100-SXM2-32GB')
    assert flops.peak_flops('cuda', 'bfloat16') is None           # no fast bf16 path on V100
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'NVIDIA L40S')   # not the L4
    assert flops.peak_flops('cuda', 'bfloat16') is None
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'NVIDIA L4')
    assert flops.peak_flops('cuda', 'bfloat16') == 121e12
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'Some Future GPU')
    assert flops.peak_flops('cuda', 'bfloat16') is None
    assert flops.estimate_mfu(tiny().config, 1e6, 'cpu', 'float32') is None


def test_mfu_uses_device_peak(monkeypatch):
    model = tiny()
    monkeypatch.setattr(flops, 'peak_flops', lambda d, t: 1e12)
    assert flops.estimate_mfu(model.config, 1000, 'cuda', 'bfloat16') == pytest.approx(
        flops.flops_per_token(model.config) * 1000 / 1e12
    )


def test_tied_embeddings_and_optimizer_groups():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    n_opt = sum(p.numel() for g in opt.param_groups for p in g['params'])
    assert n_opt == sum(p.numel() for p in model.parameters())     # parameters() dedups the tie
    assert all(p.dim() < 2 for p in opt.param_groups[1]['params'])


@settings(**SETTINGS)
@given(seed=st.integers(0, 10_000), pos=st.sampled_from(['learned', 'rope']), B=st.integers(1, 3),
       T0=st.integers(1, 12), new=st.integers(1, 10), bias=st.booleans())
def test_decode_layout_keeps_the_model_and_its_decoding(seed, pos, B, T0, new, bias):
    """GPT.decode_layout stores every Linear weight transposed in memory (the tied LM head and
    embedding stay one tensor) and changes nothing else: the state_dict bit for bit, greedy decoding
    up to near-ties (other summation order: logits within FP32_TOL), and a training step's loss
    and gradients within FP32_TOL."""
    model = tiny(seed, pos=pos, bias=bias)
    twin = tiny(seed, pos=pos, bias=bias).decode_layout()
    linears = [m for m in twin.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.stride() == (1, m.weight.size(0)) for m in linears)
    assert twin.lm_head.weight is twin.transformer.wte.weight
    ref, got = model.state_dict(), twin.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    idx = torch.randint(0, 37, (B, T0), generator=torch.Generator().manual_seed(seed))
    for a, b in zip(greedy_trace(twin, idx, new), greedy_trace(model, idx, new)):
        assert_greedy_traces_agree(a, b, FP32_TOL)
    for m in (model, twin):
        m.train()
        m.zero_grad()
        m(idx, targets=idx)[1].backward()
    torch.testing.assert_close(twin(idx, targets=idx)[1], model(idx, targets=idx)[1], **FP32_TOL)
    grads = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **FP32_TOL)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match='divisible'):
        GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match='pos'):
        GPTConfig(pos='alibi')
    with pytest.raises(ValueError, match='block_size'):
        tiny()(torch.zeros(1, 25, dtype=torch.long))


def test_from_pretrained_matches_transformers(tmp_path):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=24, n_layer=2, n_head=3,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     initializer_range=0.3)   # large weights: an activation
                                                              # mismatch shows
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 61, (2, 32))
    with torch.no_grad():
        ref = hf(idx).logits
    torch.testing.assert_close(ours(idx, last_only=False)[0], ref, rtol=1e-4, atol=1e-4)
    routed = GPT.from_pretrained(
        str(tmp_path), dict(route='ffn', ffn_gate='mlp', ffn_cheap_rank=4)
    ).eval()
    torch.testing.assert_close(
        routed(idx, last_only=False, force='full')[0], ref, rtol=1e-4, atol=1e-4
    )
    ours.crop_block_size(16)
    torch.testing.assert_close(
        ours(idx[:, :16], last_only=False)[0], ref[:, :16], rtol=1e-4, atol=1e-4
    )
