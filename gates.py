"""
Gates: modules that score tokens for the expensive path, and the rules that turn scores into
decisions.

A gate maps the hidden state h (B, T, C) at a controlled layer to a score (B, T); the higher the
score the more the token should get the full path. Training decides by top-k per sequence at a
static capacity (non-causal, as in the papers); model.eval() decides causally, per token, by a
threshold calibrated on held-out data or by a predictor of top-k membership. Gates run in fp32 even
under autocast (fp16 on V100 would otherwise round scores into ties).

Config values -> modules:
  ffn_gate='mlp'   G1: MLPGate, an MLP from h to a scalar utility score
  ffn_gate='jepa'  G3: JEPAGate, an action-conditional predictor whose latent forecasts are aligned
               to a fixed random projection of each action's actual outcome; the score is read
               from them (ffn_jepa_readout: by default a utility MLP on h and the forecast
               difference)
  ffn_gate='random' | 'static_full' | 'static_cheap': baselines without parameters (StaticGate)
  ffn_gate='oracle': scores are the oracle utility labels themselves (see model.py); analysis only
Other families' routers: HaltingRouter (route='halt', TSA), ModRouter (route='mod',
Mixture-of-Depths), EnsembleRouter (route='ensemble'); MembershipPredictor is the causal stand-in
for top-k in 'ffn' and 'mod'.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

GATES = ('mlp', 'jepa', 'random', 'static_full', 'static_cheap', 'oracle')


def capacity(budget, T):
    """Tokens per sequence that take the full path: ceil(budget·T) of the actual length T (never of
    block_size, so short prompts work), at least 1. The epsilon keeps 0.3·10 from rounding up to
    4."""
    return max(1, min(T, math.ceil(budget * T - 1e-9)))


def topk_mask(score, k):
    """Boolean (B, T): True for the k highest scores of each row. Static shapes, no host sync."""
    idx = score.topk(k, dim=-1).indices
    return torch.zeros_like(score, dtype=torch.bool).scatter(-1, idx, True)


def random_mask(B, T, fraction, causal, device):
    """The random-routing baseline, (B, T) boolean: Bernoulli(fraction) per token when causal
    (eval), else exactly capacity(fraction, T) tokens of each row, uniformly (training: static
    shapes)."""
    u = torch.rand(B, T, device=device)
    return u < fraction if causal else topk_mask(u, capacity(fraction, T))


def threshold_mask(score, tau, calibrate_to=None):
    """The causal decision, per token: score > tau. calibrate_to (a budget): first set tau, a 0-dim
    buffer, in place to the (1 − budget) quantile of these scores, so that on this batch the
    fraction above it is the budget."""
    if calibrate_to is not None:
        flat = score.detach().flatten()
        n_cheap = flat.numel() - round(calibrate_to * flat.numel())
        tau.fill_(flat.kthvalue(n_cheap).values if n_cheap > 0 else float('-inf'))
    return score > tau


def straight_through(mask, score):
    """Forward value: the hard 0/1 mask. Backward: the gradient of sigmoid(score)."""
    soft = torch.sigmoid(score)
    return mask.to(soft.dtype) + (soft - soft.detach())   # the bracket is exactly 0: (m + σ) − σ
                                                          # would round


def fp32(module_call):
    """Run a gate computation in fp32 regardless of an enclosing autocast."""
    def wrapped(*args):
        dev = args[0].device.type
        with torch.autocast(device_type=dev, enabled=False):
            return module_call(*(a.float() if torch.is_tensor(a) else a for a in args))
    return wrapped


class MLPGate(nn.Module):
    """G1: u = W2·GELU(W1·h + b1) + b2, one scalar per token."""

    def __init__(self, n_embd, hidden):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden)
        self.out = nn.Linear(hidden, 1)
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, h):
        return fp32(lambda t: self.out(F.gelu(self.fc(t))).squeeze(-1))(h)


class JEPAGate(nn.Module):
    """G3: action-conditional predictor P(h, a) -> R^latent for a in {full, cheap}, and a score read
    from it.

    P(h, a) = W2·GELU(W1·h + e_a): the action enters as a learned embedding e_a added to the first
    layer, so both actions share W1·h. The alignment target is z_a = T·outcome_a, T a fixed random
    projection (a buffer: never trained, no EMA), outcome_a either the FFN update the action makes
    ('delta') or the hidden state after it ('hidden'). e_a ~ N(0, action_std²).

    The score, with d = P(h, full) − P(h, cheap) (how the full path is forecast to change the
    outcome):
      'utility'  u = w2·GELU(W1'·[h, d] + b1) + b2: G1's utility MLP, fed the forecast difference
      'linear'   u = w·d + b
      'distance' u = ||d||² / latent (never negative; its gradient is proportional to d, so with
                 the actions initialised close, action_std = 0.02, util, rank and the LM loss
                 cannot move it)"""

    def __init__(self, n_embd, hidden, latent, readout='utility', action_std=1.0, seed=0):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden)
        self.action = nn.Parameter(torch.zeros(2, hidden))     # row 0: full, row 1: cheap
        self.out = nn.Linear(hidden, latent)
        g = torch.Generator().manual_seed(seed)
        self.register_buffer('target', torch.randn(latent, n_embd, generator=g) / math.sqrt(n_embd))
        self.readout = readout
        self.read = nn.Linear(latent, 1) if readout == 'linear' else None
        self.head = MLPGate(n_embd + latent, hidden) if readout == 'utility' else None
        for lin in (self.fc, self.out):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.action, std=action_std)
        self.latent = latent

    def predict(self, h):
        """(P(h, full), P(h, cheap)), each (B, T, latent), in fp32."""
        def run(t):
            a = self.fc(t)
            return (self.out(F.gelu(a + self.action[0])), self.out(F.gelu(a + self.action[1])))
        return fp32(run)(h)

    def score(self, h, p_full, p_cheap):
        diff = p_full - p_cheap
        if self.head is not None:
            return self.head(torch.cat([h.float(), diff], -1))
        if self.read is None:
            return diff.pow(2).sum(-1) / self.latent
        return fp32(lambda d: self.read(d).squeeze(-1))(diff)

    def target_of(self, outcome):
        """Fixed projection of an action's actual outcome (stop-gradient)."""
        return fp32(lambda o: o.detach() @ self.target.t())(outcome)

    def forward(self, h):
        return self.score(h, *self.predict(h))


class MembershipPredictor(nn.Module):
    """Causal stand-in for top-k: an MLP on the stop-gradient hidden state, trained with BCE to
    predict whether top-k selected the token (MoD's second fix). Its logit is a causal score."""

    def __init__(self, n_embd, hidden):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, h):
        return fp32(lambda t: self.out(F.gelu(self.fc(t.detach()))).squeeze(-1))(h)


class HaltingRouter(nn.Module):
    """TSA (arXiv 2605.05222): p = σ(W2·ReLU(W1·h + b1) + b2) in (0, 1) per token, hidden max(16,
    d/4), b2 = −1 at init (so p ≈ 0.27: blocks start mostly on). p is the probability of skipping
    the next block."""

    def __init__(self, n_embd):
        super().__init__()
        hidden = max(16, n_embd // 4)
        self.fc = nn.Linear(n_embd, hidden)
        self.out = nn.Linear(hidden, 1)
        nn.init.constant_(self.out.bias, -1.0)

    def forward(self, h):
        return fp32(lambda t: torch.sigmoid(self.out(F.relu(self.fc(t)))).squeeze(-1))(h)


class ModRouter(nn.Module):
    """Mixture-of-Depths (arXiv 2404.02258): a scalar linear router r = wᵀx on the block input, in
    fp32. Top-k of r picks the tokens the block runs on; the selected tokens' update is scaled by
    σ(r), which is what trains w (σ rather than the raw r: a raw logit multiplied into the residual
    can blow up)."""

    def __init__(self, n_embd):
        super().__init__()
        self.w = nn.Linear(n_embd, 1, bias=False)
        nn.init.normal_(self.w.weight, std=0.02)

    def forward(self, x):
        return fp32(lambda t: self.w(t).squeeze(-1))(x)


class EnsembleRouter(nn.Module):
    """Mixture-of-Depths Ensemble (arXiv 2410.13077): G(x) = softmax(x·W_g) over the k late layers,
    per token. W_g starts at zero, so the mixture starts uniform."""

    def __init__(self, n_embd, k):
        super().__init__()
        self.w = nn.Linear(n_embd, k, bias=False)
        nn.init.zeros_(self.w.weight)

    def forward(self, x):
        return fp32(lambda t: F.softmax(self.w(t), dim=-1))(x)
