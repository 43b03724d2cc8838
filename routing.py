"""
The routing-family contract, and what the dense model and every family share: the per-forward
context `RouteCtx`, the `Family` base class, the MLP of any width, and sparse execution (gather
the selected tokens, compute, scatter back).

A family is one file, route_<name>.py, ending in `FAMILY = TheFamily()`, and its name in
model.ROUTES. Its class subclasses Family and defines

the core (every family defines these; tests/test_families.py checks it):
    Options              the dataclass of its config fields (<name>_..., with defaults): a base of
                         model.GPTConfig, so --<name>_x=... and config files set them
    validate(config)     refuse bad values of its options when it routes (ValueError naming the
                         field and what it must be)
    run_blocks(model, x, pos, cache, ctx, start=0)  and/or  logits(model, x, ctx, last)
                         its forward: the stack of blocks, routed, and the output logits (the base
                         class runs the dense stack and the LM head)
    loss(model, ctx, lm_loss, targets, aux)   the training loss: LM plus its named, weighted terms
    is_controller_key(name)   its controller's parameters (what trainable='controller' trains)
    forward_flops(config, T, mode='train', full_frac=None, **options)   analytic FLOPs of a forward,
    backward_flops(config, T, trainable='all', adapters=None, **options)   and of a training
                         step's backward, the backbone trained or frozen (with LoRA `adapters`:
                         block_backward below counts a block's) (flops.py sums them; the tests
                         compare them with FlopCounterMode)

and, only where it needs them, the optional hooks, whose defaults in Family do nothing (or the
dense thing):
    modules    build_block(block, config, layer), build(model), init_weights(model),
               after_load(model) (fix-ups once backbone weights are loaded)
    forward    begin(model, ctx) (prepare a forward; its own per-forward state goes in ctx.state),
               stats(model, ctx, aux) (routing statistics: full_frac, TLOps saved, ...)
    config     reads (fields declared elsewhere that it reads too), check_values(config) (ranges
               of its fields, checked whatever the route), routed_layers(config)
    training   step_options(model, step, run) (per-step options, a dict only it interprets, handed
               to the forward and to the FLOPs hooks), logged_stats, last_layers_option,
               ddp_find_unused(config), no_gradient(config), calibrate(model, idx) (causal
               thresholds on held-out data), oracle_flops(config, T, **options) (no-grad passes),
               adapter_forward_flops(config, T, adapters, **options) (where LoRA adapters run)
    budget     budget_field, budget(config), with_budget(config, b): the fraction of tokens on the
               expensive path; bench_config(config, b), bench_knob(config): what bench.py times
    resuming   backbone_options, layers_option, resume_options, spelled_options,
               option_meaning(config, key), stored_before: what a resumed or stage-2
               run must share with its checkpoint, and how stored configs are read
    reporting  routes, references, by_class, eval_stats, room_rules, report(...), report_lines(r),
               executed_fracs(masks), cannot_generate(config): what eval.py, train.py and
               sample.py show or refuse
    decoding   drafts(config), draft_depths(config, name), draft_logits(model, name, idx, pos,
               cache, depth): the cheap versions of the model that self-speculative decoding
               (speculative.py) drafts with (the default: the first E blocks, ln_f, LM head);
               is_draft_key(name): parameters only a draft uses (what trainable='draft' trains),
               draft_options: its fields that shape or train them (a draft run may change them)

docs/new_family.md walks through a complete small family. The dense model is `Dense` below: the base
class with LayerSkip's layer dropout, routing nothing.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from routed_rows import PATHS, default_path, matmul_dtype, mlp_rows, sort_by_mask


@dataclass
class RouteCtx:
    """What one forward pass asks of the routing family, and what it leaves behind.
    force: None (gates decide), 'full' (every routed decision open: the dense model) or 'cheap'.
    calibrate: (eval) set each layer's threshold to hit the budget on this batch, in layer order.
    collect: record scores, masks and loss terms (off for the oracle's counterfactual passes).
    sparse: (eval) run the expensive path on the selected tokens only (gather, compute, scatter), or
    masked-dense (every path on every token, mixed by the mask: the reference sparse must equal).
    options: the family's per-step options, from its step_options, which only it interprets.
    exec_mode: how sparse eval runs: a path of routed_rows.PATHS, 'static' or None (see exec_path).
    state: what the family itself keeps during this forward, in an object of its own (route_ffn's
    FFNState, ...); None until the family sets it."""
    force: str = None
    calibrate: bool = False
    collect: bool = True
    sparse: bool = True
    exec_mode: str = None
    targets: torch.Tensor = None
    idx: torch.Tensor = None                         # the input ids and positions (oracle forks
                                                     # rerun them)
    pos: torch.Tensor = None
    options: dict = field(default_factory=dict)
    keep_hidden: set = field(default_factory=set)    # depths whose state after d blocks is kept
    hidden: dict = field(default_factory=dict)       # (Family.run_blocks keeps them)
    scores: dict = field(default_factory=dict)       # layer -> gate score (B, T)
    masks: dict = field(default_factory=dict)        # layer -> (B, T), 1 = full path / block runs
    margins: dict = field(default_factory=dict)      # layer -> (B, T): how far each causal decision
                                                     # was from flipping (> 0 full path, < 0 not)
    terms: dict = field(default_factory=dict)        # named loss terms and statistics
    final: torch.Tensor = None                       # the final hidden state and the logits, once
                                                     # known
    logits: torch.Tensor = None
    state: object = None                             # the family's own (see above)

    def add(self, name, value):
        self.terms[name] = self.terms.get(name, 0.0) + value


class Family:
    """The base of every routing family: the core (see the module docstring) does the dense thing,
    and every optional hook is neutral, so a family overrides only what it changes."""

    # ---------------------------------------------------------------------------------------------
    # the core

    Options = None                      # the dataclass of its config fields (a base of GPTConfig)

    def validate(self, config):
        pass

    def run_blocks(self, model, x, pos, cache, ctx, start=0):
        for l, block in enumerate(model.transformer.h[start:], start):
            p = layer_dropout_prob(model.config, l) if model.training else 0.0
            if p > 0:                   # LayerSkip layer dropout: whole sequences skip block l
                keep = torch.rand(x.size(0), 1, 1, device=x.device) >= p
                x = torch.where(keep, block(x, pos, cache), x)
            else:
                x = block(x, pos, cache)
            if l + 1 in ctx.keep_hidden:
                ctx.hidden[l + 1] = x
        return x

    def logits(self, model, x, ctx, last):
        return model.lm_head(model.transformer.ln_f(last(x)))

    def loss(self, model, ctx, lm_loss, targets, aux):
        return lm_loss

    def is_controller_key(self, name):
        return False

    # analytic FLOPs of one sequence of length T, as torch's FlopCounterMode counts them (flops.py
    # states the conventions and sums these); options: the family's per-step options (step_options)
    def forward_flops(self, config, T, mode='train', full_frac=None, **options):
        """One forward. mode 'train' (training forward, training-only heads included), 'eval'
        (causal, masked-dense), 'policy' (no grad, training decisions, no loss heads) or 'sparse'
        (sparse execution at the realised fractions full_frac: a float, or one per routed layer)."""
        c = flop_costs(config, T)
        total = c['head']
        for _ in range(config.n_layer):
            total += c['attn_proj'] + c['attn_core'] + c['full']
        return T * total

    def backward_flops(self, config, T, trainable='all', adapters=None, **options):
        """The backward of one training step, as autograd runs it: a matmul costs 2x its forward
        when its input and weight both need gradients, 1x when only one does. trainable 'all'
        (joint), 'controller' (frozen backbone: the dense model has no controller, so nothing
        runs), 'lora' or 'controller+lora' (frozen backbone, LoRA `adapters`: input gradients from
        the first adapter up, and the adapters')."""
        c, w = flop_costs(config, T), 2 if trainable == 'all' else 1
        stream, total = trainable == 'all', 0
        for layer in range(config.n_layer):
            cost, stream = block_backward(config, layer, T, c['attn_core'], stream, w, adapters)
            total += cost
        return total + (T * w * c['head'] if stream else 0)

    def adapter_forward_flops(self, config, T, adapters, **options):
        """Forward FLOPs of the LoRA adapters (lora.py) in the passes forward_flops(mode='train')
        counts (oracle_flops counts them in its own): each block's on every token."""
        return sum(adapter_flops_per_layer(config, adapters, BLOCK_PROJECTIONS, T))

    # ---------------------------------------------------------------------------------------------
    # optional hooks: config

    reads = ()                          # config fields declared elsewhere that it reads too

    @property
    def options(self):
        """The config fields this family reads (another family's, set under its route, are
        refused)."""
        return (option_names(self.Options) if self.Options else ()) + self.reads

    def check_values(self, config):
        """Refuse out-of-range values of its own fields, whatever the route."""

    def routed_layers(self, config):
        """The layers whose decisions it makes (routed FFNs or blocks), else []."""
        return []

    # optional hooks: modules and the forward

    def build_block(self, block, config, layer):
        """Add its per-block modules (cheap FFN, gate, router) to a block."""

    def build(self, model):
        """Add its model-level modules (halting routers, exit heads, norms)."""

    def init_weights(self, model):
        """Its own initialisation, after the GPT-2 init."""

    def after_load(self, model):
        """Fix-ups once backbone weights are loaded (from_pretrained, a stage-2 run)."""

    def begin(self, model, ctx):
        """Prepare this forward (what to keep for losses computed after it: ctx.keep_hidden,
        ctx.state)."""

    def stats(self, model, ctx, aux):
        """Routing statistics added to aux (the realised fraction of its masks, TLOps saved)."""
        if ctx.masks:
            aux['full_frac'] = torch.stack([ctx.masks[l].float().mean() for l in sorted(ctx.masks)])
            aux['masks'] = ctx.masks
        if ctx.margins:
            aux['margins'] = ctx.margins

    # optional hooks: training (train.py)

    logged_stats = ()           # statistics in aux the train log averages (and every *_loss term)
    # trainable='last_layers', the dense fine-tuning baseline for controllers on a frozen backbone,
    # trains as many last blocks as this option says (the ensemble's k: what it is compared with)
    last_layers_option = 'ens_layers'

    def step_options(self, model, step, run):
        """Per-step forward options, a dict only this family interprets (the oracle layers, the exit
        curriculum); model(...) and the FLOPs hooks take them as keywords. run: the training
        config."""
        return {}

    def ddp_find_unused(self, config):
        """Whether some parameters get no gradient in a step (DDP must look for them)."""
        return False

    def no_gradient(self, config):
        """Names of the parameters the training loss does not reach by design; every other one gets
        a gradient (tests/test_families.py)."""
        return ()

    def calibrate(self, model, idx):
        """Set causal thresholds on held-out batches idx; returns the realised fractions or None."""
        return None

    def oracle_flops(self, config, T, **options):
        """No-grad passes a training step runs beside forward and backward (ffn's oracle labels)."""
        return 0

    # optional hooks: the budget, and what bench.py times

    budget_field = None         # the field that sets the fraction of tokens on the expensive path

    def budget(self, config):
        """The fraction of tokens on the expensive path this config asks for, or None."""
        return getattr(config, self.budget_field) if self.budget_field else None

    def with_budget(self, config, b):
        """A copy of config at budget b."""
        if not self.budget_field:
            raise ValueError(f"route={config.route!r} has no budget")
        return replace(config, **{self.budget_field: b})

    def bench_config(self, config, b):
        """The config bench.py times at budget b (an untrained model: its decisions must hold the
        budget), or None where the family routes no budget of tokens (nor has a bench_knob)."""
        if self.budget_field:
            return self.with_budget(config, b)
        return config if self.bench_knob(config) else None

    def bench_knob(self, config):
        """(field, lo, hi): an eval threshold whose raising keeps more tokens active, which bench.py
        bisects so that an untrained model's realised active fraction meets the budget (families
        whose causal decision is a threshold rather than a budget: TSA's τ, the exits'
        confidence); or None."""
        return None

    # optional hooks: resuming. What a run must share with the checkpoint it starts from (train.py)

    backbone_options = ()       # shape backbone weights: a stage-2 run must agree as well
    layers_option = None        # the routed layers (their modules are in the weights): a resume too
    resume_options = ()         # how the controllers are built and what their losses train: too
    spelled_options = ()        # options a resume compares by option_meaning
    stored_before = {}          # a stored config lacking these options ran with these values

    def option_meaning(self, config, key):
        """What option `key` of `config` means to this family: the routed layers for ffn_layers
        (none for the dense model, whatever the spelling), the value itself otherwise."""
        return self.routed_layers(config) if key == 'ffn_layers' else getattr(config, key)

    # optional hooks: reporting. What eval.report adds, the lines train.py prints at a run's end

    routes = True               # False only for the dense model: train.py reports no routing
    references = ()             # forced settings whose val loss is reported beside the causal one
    by_class = False            # report the full-path fraction per difficulty class
    eval_stats = ()             # statistics in aux that eval.evaluate averages over its batches
    # eval.room: decision rules that bracket what a learned gate can do, as config overrides
    # (e.g. random and oracle routing at the budget)
    room_rules = {}

    def report(self, model, batches, autocast, evaluate):
        """What eval.report adds (a family that routes at a budget: the budget)."""
        return dict(budget=self.budget(model.config)) if self.budget_field else {}

    def report_lines(self, r):
        """The lines train.py prints at the end of a run (a family that routes at a budget: one
        summary line)."""
        return routed_report_lines(r) if self.budget_field else []

    def executed_fracs(self, masks, path='compact'):
        """Fraction of tokens sparse execution on `path` (routed_rows.PATHS) runs per routed layer,
        when it differs from the mean: on the reference, which computes every row (static shapes,
        saving nothing), 1 at every layer."""
        return torch.ones(len(masks), dtype=torch.float64) if path == 'reference' else None

    def cannot_generate(self, config):
        """Why a model of this config cannot generate text (one line for sample.py), or None."""
        return None

    # optional hooks: decoding. The drafts of self-speculative decoding (speculative.py): cheap
    # versions of the same model whose guesses the full model verifies

    def drafts(self, config):
        """{name: what it computes} of the drafts this family offers, its default first."""
        return dict(layers=LAYERS_DRAFT)

    def draft_depths(self, config, name):
        """(the depths E draft `name` may stop after, the default E), or None for a draft that has
        no depth option."""
        return list(range(1, config.n_layer + 1)), max(1, config.n_layer // 2)

    draft_options = ()

    def is_draft_key(self, name):
        """Is parameter `name` a draft's own (used by no forward of the model itself)?"""
        return False

    def draft_logits(self, model, name, idx, pos, cache, depth):
        """Draft `name`'s next-token logits (B, T, V) for tokens idx at positions pos (B, T), at
        depth E = `depth` (None for a draft without one). It reads and writes `cache`, the
        verifier's KV cache: its K/V at the positions it drafts are overwritten by the verifier, and
        where it computes what the verifier computes (the first E blocks of the dense model) it
        reuses the verifier's K/V of the accepted prefix instead of recomputing them."""
        return first_blocks_logits(model, idx, pos, cache, depth)


LAYERS_DRAFT = "the first E blocks, unrouted, then the final norm and the LM head"


def first_blocks_logits(model, idx, pos, cache, depth, head=None):
    """Logits of the first `depth` blocks run dense (every token, every update) through `head`
    (default: the final norm and the LM head): the depth drafts of speculative decoding."""
    x = model.embed(idx, pos)
    for block in model.transformer.h[:depth]:
        x = block(x, pos, cache)
    return head(x) if head is not None else model.lm_head(model.transformer.ln_f(x))


def cheap_path_logits(model, idx, pos, cache):
    """Logits of the model with every routed decision on the cheap path (force='cheap'): the drafts
    of the families whose routed layers have one (ffn's cheap FFN, MoD's skip)."""
    ctx = RouteCtx(force='cheap', collect=False)
    x = model.family.run_blocks(model, model.embed(idx, pos), pos, cache, ctx)
    return model.lm_head(model.transformer.ln_f(x))


class Dense(Family):
    """The dense model (route='none'): every block on every token, and LayerSkip's layer dropout."""
    reads = ('layer_dropout',)
    routes = False


def option_names(options):
    """The field names of a family's options dataclass, in declaration order."""
    return tuple(f.name for f in fields(options))


def check_at_least(config, low, keys):
    """Refuse any field in keys below low: every config is checked, whatever its route, so that a
    bad value is caught where it is given, not when a run switches to the family that reads it."""
    for key in keys:
        if getattr(config, key) < low:
            raise ValueError(f"{key} must be >= {low}, got {getattr(config, key)}")


def check_choices(config, **allowed):
    """Refuse any field (a keyword) whose value is not one of those allowed for it."""
    for key, values in allowed.items():
        if getattr(config, key) not in values:
            raise ValueError(f"{key} must be one of {values}, got {getattr(config, key)!r}")


def check_fraction(config, key):
    """Refuse a fraction of tokens outside (0, 1]."""
    if not 0.0 < getattr(config, key) <= 1.0:
        raise ValueError(f"{key} must be in (0, 1], got {getattr(config, key)}")


def routed_report_lines(r):
    """The summary line of the families that route to a cheaper path at a budget (ffn, mod)."""
    v = r['val_loss']
    return [f"val loss (causal routing) {v['loss']:.4f} | all-full {r['val_loss_full']:.4f} | "
            f"all-cheap {r['val_loss_cheap']:.4f} | realised full-path fraction "
            f"{sum(v['full_frac']) / len(v['full_frac']):.3f} (budget {r['budget']})"
            + (f" | causal rule agrees with top-k on {v['mod_acc']:.3f}" if 'mod_acc' in v else '')
            + (f" | TLOps saved {v['tlops_saved']:.3f}" if 'tlops_saved' in v else '')]


def flop_costs(config, T):
    """Forward FLOPs per token of the pieces every family is built from (attention core at length
    T): a block's attention projections and core, the full FFN, the LM head."""
    d = config.n_embd
    return dict(attn_proj=2 * d * 3 * d + 2 * d * d, attn_core=4 * T * d, full=2 * 2 * d * 4 * d,
                head=2 * d * config.vocab_size)


# --------------------------------------------------------------------------------------------------
# the backward of a block, as autograd runs it, when its weights train (w=2), are frozen (w=1), or
# are frozen with LoRA adapters (lora.py) on some of its projections: the shared pieces of the
# families' backward_flops

LORA_MODES = ('lora', 'controller+lora')
BLOCK_PROJECTIONS = ('attn.c_attn', 'attn.c_proj', 'mlp.c_fc', 'mlp.c_proj')


@dataclass(frozen=True)
class Adapters:
    """LoRA as the FLOPs hooks see it: the adapters' rank, and per block the projections (of
    BLOCK_PROJECTIONS) they adapt (train.py refuses targets that name other modules)."""
    rank: int
    adapted: tuple      # one frozenset of projection names per block


def adapters_of(config, rank, targets):
    """The Adapters that lora.apply_lora(model, rank, ..., targets) puts on a model of config."""
    from lora import names_target, parse_targets
    wanted = parse_targets(targets)
    return Adapters(rank, tuple(
        frozenset(p for p in BLOCK_PROJECTIONS
                  if any(names_target(projection_name(layer, p), t) for t in wanted))
        for layer in range(config.n_layer)))


def projection_name(layer, name):
    """The module name of block `layer`'s projection `name` (of BLOCK_PROJECTIONS)."""
    return f'transformer.h.{layer}.{name}'


def adapted_at(adapters, layer):
    """The projections of block `layer` that adapters (None: no LoRA) adapt."""
    return adapters.adapted[layer] if adapters else frozenset()


def projection_shape(config, name):
    """(in, out) features of a block projection."""
    d = config.n_embd
    return dict(zip(BLOCK_PROJECTIONS, ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d))))[name]


def adapter_flops(config, adapters, layer, names, rows, input_grad=None):
    """FLOPs of the adapters (A: r x in, B: out x r) of block `layer`'s projections `names` (those
    adapted) on `rows` tokens: their forward (input_grad None), or their backward: B's weight and
    input gradients, A's weight gradient and, where the projection's input needs a gradient
    (input_grad[name]), A's input gradient."""
    total = 0
    for name in set(names) & adapted_at(adapters, layer):
        fan_in, fan_out = projection_shape(config, name)
        if input_grad is None:
            total += 2 * rows * adapters.rank * (fan_in + fan_out)
        else:
            total += 2 * rows * adapters.rank * (2 * fan_out + fan_in * (1 + input_grad[name]))
    return total


def adapter_flops_per_layer(config, adapters, names, rows):
    """adapter_flops' forward of projections `names` in every block, one figure per block."""
    return [adapter_flops(config, adapters, layer, names, rows) for layer in range(config.n_layer)]


def attention_backward(config, layer, rows, core, stream, w, adapters=None):
    """Backward FLOPs of block `layer`'s attention on `rows` tokens (`core`: its core's forward
    FLOPs per token) whose input needs a gradient if `stream`; w: 2 where its weights train, else
    1. Returns (flops, whether the residual after it needs a gradient). Each projection costs w x
    its forward where its input needs a gradient, w − 1 x where not; the core twice where q, k and
    v need gradients."""
    d, here = config.n_embd, adapted_at(adapters, layer)
    qkv = stream or 'attn.c_attn' in here
    total = rows * ((w if stream else w - 1) * 2 * d * 3 * d + (w if qkv else w - 1) * 2 * d * d)
    total += 2 * rows * core if qkv else 0
    total += adapter_flops(config, adapters, layer, BLOCK_PROJECTIONS[:2], rows,
                           {'attn.c_attn': stream, 'attn.c_proj': qkv})
    return total, stream or bool(here & set(BLOCK_PROJECTIONS[:2]))


def mlp_backward(config, layer, rows, stream, w, adapters=None):
    """Backward FLOPs of block `layer`'s dense FFN on `rows` tokens whose input needs a gradient if
    `stream` (w as attention_backward), and whether its output needs one."""
    d, here = config.n_embd, adapted_at(adapters, layer)
    hidden = stream or 'mlp.c_fc' in here
    total = rows * ((w if stream else w - 1) + (w if hidden else w - 1)) * 2 * d * 4 * d
    total += adapter_flops(config, adapters, layer, BLOCK_PROJECTIONS[2:], rows,
                           {'mlp.c_fc': stream, 'mlp.c_proj': hidden})
    return total, stream or bool(here & set(BLOCK_PROJECTIONS[2:]))


def block_backward(config, layer, rows, core, stream, w, adapters=None):
    """attention_backward then mlp_backward: (flops, whether the block's output needs a
    gradient)."""
    attn, mid = attention_backward(config, layer, rows, core, stream, w, adapters)
    mlp, out = mlp_backward(config, layer, rows, mid, w, adapters)
    return attn + mlp, out


@contextmanager
def training_flags(modules, training):
    """Set each module's own `training` flag (not its children's) for the duration, then restore
    each flag as it was, also on error: model.mode (train/eval) and the oracle's dropout-free
    forks."""
    saved = [(m, m.training) for m in modules]
    for m, _ in saved:
        m.training = training
    try:
        yield
    finally:
        for m, was in saved:
            m.training = was


@contextmanager
def overridden(config, **fields):
    """config's fields set for the duration, then restored, also on error (the model reads its
    config at every forward): eval sweeps (TSA's τ and hard mode, the exits' threshold, eval.room's
    rules)."""
    saved = {k: getattr(config, k) for k in fields}
    for k, v in fields.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)


def layer_dropout_prob(config, layer):
    """LayerSkip's rate for block `layer`: p_max·D(l), D(l) = exp(l·ln2/(L−1)) − 1 (0 at the first
    block, p_max at the last); the time schedule S(t) is constant 1 here."""
    L = config.n_layer
    return config.layer_dropout * (math.exp(layer * math.log(2) / (L - 1)) - 1) if L > 1 else 0.0


def add_weighted(loss, aux, weights):
    """loss + Σ w·aux[name] over the named loss terms present in aux, added in the order given."""
    for name, w in weights.items():
        if name in aux:
            loss = loss + w * aux[name]
    return loss


def tlops_saved(full_frac, n_layer):
    """Token-layer operations skipped: 1 − (Σ_l fraction run at routed layer l + layers not routed)
    / L."""
    return 1 - (full_frac.sum() + (n_layer - len(full_frac))) / n_layer


# --------------------------------------------------------------------------------------------------
# layers and sparse execution

class MLP(nn.Module):
    """The FFN, d -> width -> d: the full path at width 4d, the cheap path low-rank."""

    def __init__(self, config, width=None):
        super().__init__()
        width = width or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, width, bias=config.bias)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = config.gelu

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))
        return self.dropout(y) if self.training else y      # eval: no dropout call to pay


# Sparse eval runs on one of the paths of routed_rows.py (routed_rows.PATHS):
#   'compact':   gather exactly the selected tokens (a host sync and data-dependent shapes),
#                compute, scatter. The fastest eagerly on a CPU and on GPUs without a faster kernel.
#   'grouped_mm', 'triton', 'reference': static. Sort the tokens selected-first, keep the count as a
#                0-dim device tensor, and compute each path over a static-size buffer restricted to
#                its device-side range of the order (rows_apply). No host sync, no data-dependent
#                shape: what torch.compile(fullgraph=True) and CUDA graphs need.
# A model's exec_mode names one of them, or 'static' (the fastest static one here), or None
# (routed_rows.default_path: by torch version, device, dtype and whether torch.compile traces).
EXEC_MODES = ('static',) + PATHS


def exec_path(x, mode=None):
    """The path sparse eval on tensor x runs (one of routed_rows.PATHS) for exec_mode `mode`."""
    if mode is not None and mode not in EXEC_MODES:
        raise ValueError(f"exec_mode must be one of {EXEC_MODES} or None, got {mode!r}")
    if mode not in (None, 'static'):
        return mode
    path = default_path(x)
    return 'reference' if mode == 'static' and path == 'compact' else path


def rows_apply(x_flat, order, lo, hi, fn, out=None, path=None):
    """out[order[i]] = fn(x_flat[order[i]]) for lo <= i < hi; every other row of out untouched. lo,
    hi: Python ints or 0-dim device tensors. fn maps rows to rows; out=None starts from zeros of
    fn's output. Returns out (written in place when given). An MLP goes to routed_rows.mlp_rows on
    `path` (None: the fastest static one). Any other fn (an exit head) runs the reference: fn on
    all N rows, those in range written (static shapes, no host sync)."""
    # mlp_rows runs dropout-free
    if isinstance(fn, MLP) and not (fn.training and fn.dropout.p > 0):
        if out is None:         # the dtype fn's output would have (autocast's where it is on)
            out = x_flat.new_zeros(x_flat.shape[0], fn.c_proj.out_features,
                                   dtype=matmul_dtype(x_flat))
        return mlp_rows(x_flat, order, lo, hi, fn, out, path)
    y = fn(x_flat.index_select(0, order))
    out = y.new_zeros(y.shape) if out is None else out
    i = torch.arange(order.numel(), device=order.device)
    rows = ((i >= lo) & (i < hi))[:, None]
    return out.index_copy_(0, order, torch.where(rows, y.to(out.dtype), out.index_select(0, order)))


def split_apply(x, mask, fn_true, fn_false=None, mode=None):
    """Sparse execution: fn_true on the tokens of x (B, T, C) where mask (B, T), fn_false (or zeros)
    on the rest, scattered back into (B, T, C). mode (an exec_mode, see exec_path): on the compact
    path each side's tokens are gathered exactly into one batch (the count of selected tokens is a
    host sync, causal decisions make it data-dependent); on a static path each side runs over its
    device-side range of the selected-first order."""
    flat, m = x.reshape(-1, x.size(-1)), mask.reshape(-1)
    path = exec_path(x, mode)
    if path != 'compact':
        order, n = sort_by_mask(m)
        out = rows_apply(flat, order, 0, n, fn_true, path=path)
        if fn_false is not None:
            rows_apply(flat, order, n, m.numel(), fn_false, out, path=path)
        return out.view(*x.shape[:-1], -1)
    idx_t, idx_f = m.nonzero().squeeze(1), (~m).nonzero().squeeze(1)
    y_t = fn_true(flat.index_select(0, idx_t))
    out = y_t.new_zeros(flat.shape[:1] + y_t.shape[1:])
    out.index_copy_(0, idx_t, y_t)
    if fn_false is not None:
        out.index_copy_(0, idx_f, fn_false(flat.index_select(0, idx_f)).to(out.dtype))
    return out.view(*x.shape[:-1], -1)


def gather_rows(x, idx):
    """x (B, T, ...) at per-row indices idx (B, k) -> (B, k, ...)."""
    return x.gather(
        1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:])
    )


def layer_ids(config, field, default):
    """The layers named by a family's layers option `field` (ffn_layers, mod_layers): 'all',
    'every_other' (1, 3, 5, ...), a list such as '0,2,5', or 'auto' (the family's `default`)."""
    L, spec = config.n_layer, str(getattr(config, field))
    if spec == 'auto':
        spec = default
    if spec == 'all':
        return list(range(L))
    if spec == 'every_other':
        return list(range(1, L, 2))        # may be empty for L = 1: validate refuses that
    if any(c not in '0123456789, ' for c in spec):
        raise ValueError(
            f"{field} must be 'auto', 'all', 'every_other' or e.g. '0,2,5', got {spec!r}"
        )
    return parse_layer_list(spec, 0, L - 1, field)


def parse_layer_list(spec, lo, hi, what):
    """'0,2,5' -> [0, 2, 5], each in lo..hi; ValueError naming `what` otherwise."""
    try:
        ids = sorted({int(t) for t in str(spec).replace(' ', '').split(',') if t})
    except ValueError:
        ids = []
    if not ids or ids[0] < lo or ids[-1] > hi:
        raise ValueError(f"{what} {spec!r} must name layers in {lo}..{hi}, e.g. '{lo},{hi}'")
    return ids
