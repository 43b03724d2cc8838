"""
route='ffn': cheap-vs-full FFN routing with G1/G3 gates ("Revisiting Auxiliary Losses for
Conditional Depth Routing", arXiv 2604.17228).

At each controlled layer a gate scores every token; the selected tokens take the full FFN, the rest
a low-rank cheap FFN; attention is not routed. Training selects the top ceil(ffn_budget·T) scores of
each sequence (static shapes, non-causal, as the paper); model.eval() decides causally per token, by
a threshold calibrated on held-out batches or by a predictor of top-k membership. The LM loss
reaches the gate straight-through ('ste'), MoD-style through σ(score) ('scale'), or not at all
('none').

Auxiliary losses, each a named term with its weight (0 = not computed): utility regression and
pairwise rank supervision onto oracle utility labels U_t = CE_t(cheap at l) − CE_t(full at l)
(oracle_labels.py: token t switched alone or the whole sequence, forks from the all-full or the
routed state, later layers all full or following the gates), G3's JEPA alignment, the membership
predictor's BCE, and a cheap-imitates-full term. util/rank/JEPA train only their own layer's gate,
and the imitation only its own cheap FFN, unless ffn_aux_grad='leak'.

Self-speculative decoding drafts with every routed FFN on its cheap path ('cheap'), or, given
ffn_draft_rank > 0, with a draft-only low-rank FFN in each routed layer instead ('distilled'). The
routed model never runs that FFN, so it can be trained afterwards, the model frozen
(trainable='draft'), by self-distillation: L_draft = KL(sg(p_model) || q_draft) over every position,
q_draft the distribution of the model whose routed FFNs are the draft FFNs, reading the model's K/V
before the position as a speculative pass's first draft token does. Leviathan et al.'s acceptance
is 1 − TV(p, q), so this trains what sampled speculation keeps, and it costs the model nothing,
where the cheap path's imitation (ffn_mimic_weight) costs it quality.

Options: FFNOptions below (fields of model.GPTConfig); of the training loop:
ffn_oracle_layers_per_step, calib_iters.
"""
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import losses
from gates import (
    GATES,
    JEPAGate,
    MembershipPredictor,
    MLPGate,
    capacity,
    random_mask,
    straight_through,
    threshold_mask,
    topk_mask,
)
from oracle_labels import (
    fork_utility,
    oracle_flops,
    oracle_losses,
    oracle_start,
    suffix_flops,
    token_fork_utility,
)
from routing import (
    BLOCK_PROJECTIONS,
    LAYERS_DRAFT,
    LORA_MODES,
    MLP,
    Family,
    adapter_flops,
    adapter_flops_per_layer,
    add_weighted,
    attention_backward,
    check_at_least,
    check_choices,
    check_fraction,
    cheap_path_logits,
    flop_costs,
    layer_ids,
    mlp_backward,
    split_apply,
)

STATIC = {'static_full': 'full', 'static_cheap': 'cheap'}     # the gates that send every token down
                                                              # one path


@dataclass
class FFNOptions:
    """The family's fields of model.GPTConfig (a base of it), with their defaults."""
    ffn_gate: str = 'mlp'     # 'mlp' (G1), 'jepa' (G3), 'random', 'static_full', 'static_cheap',
                              # 'oracle'
    ffn_budget: float = 0.5   # fraction of tokens per sequence on the full path: ceil(ffn_budget·T)
                              # in training
    ffn_layers: str = 'auto'  # routed layers: 'all', 'every_other' (1, 3, 5, ...), a list such as
                              # '0,2,5', or 'auto' (all)
    ffn_cheap_rank: int = 16  # rank of the cheap low-rank FFN
    ffn_gate_hidden: int = 64         # hidden width of the gate and predictor MLPs
    ffn_gate_grad: str = 'ste'        # how the LM loss reaches the gate: 'ste' straight-through,
                                      # 'scale' MoD-style, 'none'
    ffn_infer_rule: str = 'threshold' # causal eval decision: 'threshold' on the gate score, or
                                      # 'predictor'
    ffn_jepa_latent: int = 32         # G3 latent size
    ffn_jepa_outcome: str = 'delta'   # G3 outcome projected by the fixed target: 'delta' (FFN
                                      # update) or 'hidden'
    # G3's score from h and the forecasts: 'utility' (an MLP on [h, P(h,full) − P(h,cheap)]),
    # 'linear' in that difference, or 'distance' (its squared norm)
    ffn_jepa_readout: str = 'utility'
    # G3's action embeddings' init std: 1 starts the two forecasts apart; 0.02 with 'distance' is
    # the G3 of the studies before 'utility' (a score util, rank and the LM loss could not move)
    ffn_jepa_action_std: float = 1.0
    # auxiliary losses: a weight of 0 means that computation does not run
    ffn_util_weight: float = 0.0      # utility regression onto oracle labels
    ffn_rank_weight: float = 0.0      # pairwise rank supervision from oracle labels
    ffn_rank_kind: str = 'logistic'   # 'logistic' or 'margin'
    ffn_rank_margin: float = 0.1      # margin of ffn_rank_kind='margin'
    ffn_rank_pairs: int = 256         # pairs sampled per sequence
    ffn_oracle_label: str = 'token'   # labels switch 'token' t alone at l (others keep their
                                      # action) or the whole 'sequence' at once (then U_t moves with
                                      # t's prefix too)
    ffn_oracle_policy: str = 'off'    # labels: 'off' (later layers all full, the paper) or 'on'
                                      # (gate policy)
    ffn_oracle_start: str = 'auto'    # the state at l the forks start from: 'full' (all layers
                                      # below full), 'routed' (this pass's own), 'auto' (full if
                                      # policy 'off', else routed)
    ffn_aux_grad: str = 'own'         # util/rank/JEPA gradients reach only their own layer's gate,
                                      # mimic's only its cheap FFN ('own': their input detached), or
                                      # also the layers below ('leak')
    ffn_jepa_weight: float = 1.0      # λ_JEPA (G3 only)
    ffn_predictor_weight: float = 1.0 # BCE of the membership predictor (ffn_infer_rule='predictor'
                                      # only)
    ffn_mimic_weight: float = 0.0     # cheap FFN imitates the full FFN
    ffn_draft_rank: int = 0           # a draft-only FFN of this rank per routed layer (0: none),
                                      # the 'distilled' draft's
    ffn_draft_weight: float = 1.0     # weight of L_draft, the draft's self-distillation (trained by
                                      # trainable='draft'; with 'all' it reaches the backbone too)


@dataclass
class FFNState:
    """What one forward keeps for the family (RouteCtx.state): the pre-FFN states of the layers
    whose oracle labels fork from them, each gate's detached input for the aux losses, and the
    oracle gate."""
    keep_mid: set = field(default_factory=set)      # layers whose pre-FFN state is kept
    mid: dict = field(default_factory=dict)
    gate_in: dict = field(default_factory=dict)     # layer -> the gate's input, detached
    oracle: object = None           # ffn_gate='oracle': fn(layer, x_mid) -> utility (B, T)
    keep_stream: bool = False       # keep each block's input (the draft's distillation reads them)
    stream: dict = field(default_factory=dict)      # layer -> the block's input, detached


def ffn_state(ctx):
    """ctx's FFNState, made on first use (a forward the family's begin did not open: a fork)."""
    if ctx.state is None:
        ctx.state = FFNState()
    return ctx.state


class FFNRouting(Family):
    Options = FFNOptions
    reads = ('ffn_oracle_layers_per_step', 'calib_iters')      # the training loop's
    # before these options existed, aux-loss gradients took one graph, labels switched whole
    # sequences and G3 read the distance between forecasts from actions drawn N(0, 0.02²)
    stored_before = {'ffn_aux_grad': 'leak', 'ffn_oracle_label': 'sequence',
                     'ffn_jepa_readout': 'distance', 'ffn_jepa_action_std': 0.02}
    budget_field = 'ffn_budget'
    backbone_options, layers_option = ('ffn_cheap_rank',), 'ffn_layers'
    resume_options = (
        'ffn_gate',
        'ffn_gate_hidden',
        'ffn_infer_rule',
        'ffn_jepa_latent',
        'ffn_jepa_readout',
        'ffn_jepa_action_std',
        'ffn_aux_grad',
        'ffn_oracle_label',
        'ffn_oracle_policy',
        'ffn_oracle_start',
    )
    spelled_options = ('ffn_layers',)   # 'auto' and 'all' are the same layers
    logged_stats = ('jepa_pred_std', 'utility_mean')

    def check_values(self, config):
        check_at_least(
            config, 1, ('ffn_cheap_rank', 'ffn_gate_hidden', 'ffn_jepa_latent', 'ffn_rank_pairs')
        )
        check_at_least(
            config,
            0,
            (
                'ffn_util_weight',
                'ffn_rank_weight',
                'ffn_rank_margin',
                'ffn_jepa_weight',
                'ffn_predictor_weight',
                'ffn_mimic_weight',
                'ffn_jepa_action_std',
                'ffn_draft_rank',
                'ffn_draft_weight',
            ),
        )
        check_fraction(config, 'ffn_budget')

    def validate(self, config):
        check_choices(
            config,
            ffn_gate=GATES,
            ffn_gate_grad=('ste', 'scale', 'none'),
            ffn_infer_rule=('threshold', 'predictor'),
            ffn_jepa_outcome=('delta', 'hidden'),
            ffn_jepa_readout=('utility', 'linear', 'distance'),
            ffn_rank_kind=('logistic', 'margin'),
            ffn_oracle_policy=('off', 'on'),
            ffn_oracle_label=('token', 'sequence'),
            ffn_oracle_start=('auto', 'full', 'routed'),
            ffn_aux_grad=('own', 'leak'),
        )
        if not self.routed_layers(config):
            raise ValueError(f"ffn_layers={config.ffn_layers!r} routes no layer of a "
                             f"{config.n_layer}-layer model")
        if config.ffn_draft_rank > 0 and config.ffn_draft_weight <= 0:
            raise ValueError("ffn_draft_rank > 0 needs ffn_draft_weight > 0: nothing else trains "
                             "the draft FFNs")

    def routed_layers(self, config):
        return layer_ids(config, 'ffn_layers', default='all')

    def build_block(self, block, config, layer):
        if layer not in self.routed_layers(config):
            return
        block.cheap = MLP(config, width=config.ffn_cheap_rank)
        if config.ffn_draft_rank > 0:
            block.draft_ffn = MLP(config, width=config.ffn_draft_rank)
        block.gate = (
            MLPGate(config.n_embd, config.ffn_gate_hidden)
            if config.ffn_gate == 'mlp'
            else JEPAGate(
                config.n_embd,
                config.ffn_gate_hidden,
                config.ffn_jepa_latent,
                config.ffn_jepa_readout,
                config.ffn_jepa_action_std,
                seed=1000 + layer,
            )
            if config.ffn_gate == 'jepa'
            else None
        )
        block.predictor = (
            MembershipPredictor(config.n_embd, config.ffn_gate_hidden)
            if config.ffn_infer_rule == 'predictor' and block.gate is not None
            else None
        )
        block.register_buffer('tau', torch.zeros(()))   # calibrated threshold of the causal score

    def begin(self, model, ctx):
        cfg, state = model.config, ffn_state(ctx)
        if cfg.ffn_gate == 'oracle' and ctx.force is None:
            if ctx.targets is None:
                raise ValueError("ffn_gate='oracle' routes by utility labels, which need targets")
            state.oracle = lambda l, x: oracle_routing_labels(model, l, x, ctx.targets, ctx.pos)
        if oracle_start(cfg) == 'routed' and ctx.options.get('oracle_layers'):
            state.keep_mid = set(ctx.options['oracle_layers'])
        state.keep_stream = model.training and cfg.ffn_draft_rank > 0 and ctx.force is None

    def run_blocks(self, model, x, pos, cache, ctx, start=0):
        state = ffn_state(ctx)
        for block in model.transformer.h[start:]:
            if state.keep_stream:
                state.stream[block.layer] = x.detach()
            x = x + block.attn_update(x, pos, cache)
            x = x + (
                routed_ffn_update(block, model.config, x, ctx)
                if hasattr(block, 'cheap')
                else block.ffn_update(x)
            )
        return x

    def loss(self, model, ctx, lm_loss, targets, aux):
        cfg = model.config
        layers = tuple(ctx.options.get('oracle_layers') or ())
        if layers and (cfg.ffn_util_weight > 0 or cfg.ffn_rank_weight > 0):
            oracle_losses(model, ctx, layers, targets, aux)
        if ffn_state(ctx).keep_stream:
            draft = draft_logits_in_model_context(model, ctx.idx, ctx.pos, model_kv(model, ctx))
            aux['draft_loss'] = losses.draft_distillation(ctx.logits, draft)
        return add_weighted(
            lm_loss,
            aux,
            dict(
                util_loss=cfg.ffn_util_weight,
                rank_loss=cfg.ffn_rank_weight,
                jepa_loss=cfg.ffn_jepa_weight,
                pred_loss=cfg.ffn_predictor_weight,
                mimic_loss=cfg.ffn_mimic_weight,
                draft_loss=cfg.ffn_draft_weight,
            ),
        )

    def is_controller_key(self, name):
        return any(f in name for f in ('.gate.', '.predictor.')) or name.endswith('.tau')

    draft_options = ('ffn_draft_rank', 'ffn_draft_weight')

    def is_draft_key(self, name):
        return '.draft_ffn.' in name

    @torch.no_grad()
    def calibrate(self, model, idx):
        """Set every controlled layer's causal threshold so that, on idx (held-out batches), the
        realised full-path fraction equals the budget; layers are calibrated in order, each under
        the already-calibrated decisions of the layers below it. Returns the realised fractions."""
        if model.config.ffn_gate not in ('mlp', 'jepa'):
            return None                    # no score to threshold
        with model.mode(training=False):
            return model(idx, last_only=True, calibrate=True)[2].get('full_frac')

    def step_options(self, model, step, run):
        """The controlled layers that get oracle labels this step (util/rank losses on, and the
        gates trained): sampled from the seed and the step alone, so every DDP rank and a resumed
        run draw the same."""
        cfg = model.config
        if cfg.ffn_gate not in ('mlp', 'jepa') or not (
            cfg.ffn_util_weight > 0 or cfg.ffn_rank_weight > 0
        ):
            return {}
        if run.trainable == 'draft':       # the labels train only gates, which a draft run freezes
            return {}
        ids = self.routed_layers(cfg)
        k = min(run.ffn_oracle_layers_per_step, len(ids))
        return dict(
            oracle_layers=tuple(sorted(random.Random(run.seed * 1_000_003 + step).sample(ids, k)))
        )

    references, by_class = ('full', 'cheap'), True
    room_rules = dict(random=dict(ffn_gate='random'), oracle=dict(ffn_gate='oracle'))

    def report(self, model, batches, autocast, evaluate):
        out = super().report(model, batches, autocast, evaluate)
        if model.config.ffn_draft_rank > 0:
            out['draft'] = distilled_draft_report(model, batches, autocast)
        return out

    def report_lines(self, r):
        lines = super().report_lines(r)
        if 'draft' in r:
            d = r['draft']
            lines.append(f"distilled draft, in the model's context: loss {d['loss']:.4f} | "
                         f"KL(model || draft) {d['kl']:.4f} | kept when sampled (1 - TV) "
                         f"{d['kept']:.3f} | argmax agrees {d['agrees']:.3f}")
        return lines

    def cannot_generate(self, config):
        if config.ffn_gate == 'oracle':
            return ("ffn_gate='oracle' routes by the targets, so it cannot generate; "
                    "sample from a model with a causal gate")
        return None

    def drafts(self, config):
        distilled = dict(distilled="every routed FFN replaced by its layer's draft FFN "
                                   "(ffn_draft_rank), trained by self-distillation")
        return dict(**(distilled if config.ffn_draft_rank > 0 else {}),
                    cheap="every routed FFN on its cheap low-rank path (force='cheap')",
                    layers=LAYERS_DRAFT)

    def draft_depths(self, config, name):
        if name in ('cheap', 'distilled'):
            return None
        return super().draft_depths(config, name)

    def draft_logits(self, model, name, idx, pos, cache, depth):
        if name == 'cheap':
            return cheap_path_logits(model, idx, pos, cache)
        if name == 'distilled':
            return distilled_draft_logits(model, idx, pos, cache)
        return super().draft_logits(model, name, idx, pos, cache, depth)

    def ddp_find_unused(self, config):
        return (config.ffn_gate in STATIC or config.ffn_gate_grad == 'none'
                or (config.ffn_infer_rule == 'predictor' and config.ffn_predictor_weight == 0))

    def forward_flops(self, config, T, mode='train', full_frac=None, **options):
        """Training and eval: both paths dense, mixed by the mask ('train' adds the JEPA targets and
        the membership predictor's training; the oracle gate, its forks); 'sparse': the full FFN on
        a fraction full_frac of the tokens, the cheap FFN on the rest. Oracle labels:
        oracle_flops."""
        c, ids = ffn_costs(config, T), self.routed_layers(config)
        fracs = iter(full_frac if isinstance(full_frac, (list, tuple)) else [full_frac] * len(ids))
        total = c['head']
        for layer in range(config.n_layer):
            total += c['attn_proj'] + c['attn_core']
            kind = config.ffn_gate if layer in ids else 'static_full'
            if kind in STATIC:
                total += c[STATIC[kind]]
            elif mode == 'sparse':          # full_frac: one per layer not routed by a static gate,
                                            # or one for all
                f = next(fracs)
                total += f * c['full'] + (1 - f) * c['cheap']
            else:
                total += c['full'] + c['cheap']
            if kind in ('mlp', 'jepa'):
                n_out = 2 if kind == 'jepa' else 1            # JEPA forecasts both actions
                total += c['gate_fc'] + n_out * c['gate_out'] + c['gate_read']
                if kind == 'jepa' and mode == 'train' and config.ffn_jepa_weight > 0:
                    total += 2 * c['jepa_target']
                if config.ffn_infer_rule == 'predictor' and (
                    mode in ('eval', 'sparse')
                    or (mode == 'train' and config.ffn_predictor_weight > 0)
                ):
                    total += c['pred_fc'] + c['pred_out']
                # aux losses score the detached input again
                if mode == 'train' and config.ffn_aux_grad == 'own':
                    if kind == 'jepa' and config.ffn_jepa_weight > 0:
                        total += c['gate_fc'] + 2 * c['gate_out']
                    if aux_on_score(config) and layer in options.get('oracle_layers', ()):
                        total += c['gate_fc'] + n_out * c['gate_out'] + c['gate_read']
            elif kind == 'oracle':        # both actions again, then two all-full suffixes, per
                                          # layer
                total += c['full'] + c['cheap'] + 2 * suffix_flops(config, layer, c)
            if kind not in STATIC and mode == 'train' and mimic_reruns(config):
                total += c['cheap']         # the imitation's cheap FFN on the detached input
        if mode == 'train' and config.ffn_draft_rank > 0:
            total += draft_forward_flops(config, c, ids)   # the distilled draft, for L_draft
        return T * total

    def backward_flops(self, config, T, trainable='all', oracle_layers=(), adapters=None,
                       **options):
        """Controller-only: activation gradients only, and nothing below the first gate in the
        LM-loss graph; the gate's input needs a gradient only once the stream does. Under LoRA, the
        input gradients from the first adapter up too, and the gates and predictors train only
        under 'controller+lora'."""
        c, ids = ffn_costs(config, T), self.routed_layers(config)
        if config.ffn_draft_rank > 0 and trainable in ('all', 'draft'):
            draft = T * draft_backward_flops(config, c, ids, trainable)
            if trainable == 'draft':        # nothing else trains: the model is frozen
                return draft
        elif config.ffn_draft_rank > 0 and trainable in LORA_MODES:
            draft = draft_backward_under_lora(config, c, ids, T, adapters)
        else:
            draft = 0
        joint, gates_train = trainable == 'all', trainable != 'lora'
        leak, own = config.ffn_aux_grad == 'leak', config.ffn_aux_grad == 'own'
        stream = joint                      # does the residual stream entering this layer need a
                                            # gradient?
        w = 2 if joint else 1               # backbone matmuls: input grad (+ weight grad when
                                            # trainable)
        bwd, body = 0, 0                    # per token (cheap FFNs, gates, head); body: all T
        for layer in range(config.n_layer):
            kind = config.ffn_gate if layer in ids else 'static_full'
            attn, mid = attention_backward(config, layer, T, c['attn_core'], stream, w, adapters)
            body, after = body + attn, mid
            if kind != 'static_cheap':      # the full FFN
                mlp, after = mlp_backward(config, layer, T, mid, w, adapters)
                body += mlp
            if kind != 'static_full':       # the cheap FFN
                bwd += (w if mid else w - 1) * c['cheap']
            if kind not in STATIC and joint and mimic_reruns(config):
                # its weight grads, and the gradient into its hidden layer (its input is detached)
                bwd += 1.5 * c['cheap']
            stream = after
            if kind not in ('mlp', 'jepa'):     # a static or the oracle gate: nothing trainable
                continue
            oracle_here = aux_on_score(config) and layer in oracle_layers
            score_in_graph = config.ffn_gate_grad != 'none' or (leak and oracle_here)
            preds_in_graph = score_in_graph or (
                leak and kind == 'jepa' and config.ffn_jepa_weight > 0
            )
            n_out = 2 if kind == 'jepa' else 1
            if not gates_train:             # frozen: input gradients where the gate's input (the
                if preds_in_graph and mid:  # stream after attention) needs them
                    bwd += c['gate_fc'] + n_out * c['gate_out']
                if score_in_graph and mid:
                    bwd += c['gate_read']
                continue
            # on the detached input: weight grads
            if own and kind == 'jepa' and config.ffn_jepa_weight > 0:
                bwd += c['gate_fc'] + 2 * 2 * c['gate_out']
            if own and oracle_here:
                bwd += c['gate_fc'] + 2 * n_out * c['gate_out'] + 2 * c['gate_read']
            if preds_in_graph:              # gate weights train; its input needs grad only if the
                                            # stream after attention does
                bwd += (2 if mid else 1) * c['gate_fc'] + 2 * n_out * c['gate_out']
            if score_in_graph:
                bwd += 2 * c['gate_read']
            if config.ffn_infer_rule == 'predictor' and config.ffn_predictor_weight > 0:
                bwd += c['pred_fc'] + 2 * c['pred_out']        # its input is detached
            if config.ffn_gate_grad != 'none':
                stream = True               # the mixed update now depends on trainable gate weights
        if stream:
            bwd += w * c['head']
        return bwd * T + body + draft

    def oracle_flops(self, config, T, oracle_layers=(), adapters=None, **options):
        """The oracle labels at the sampled controlled layers (oracle_labels.oracle_flops)."""
        return oracle_flops(self, config, T, ffn_costs(config, T), oracle_layers, adapters)

    def adapter_forward_flops(self, config, T, adapters, **options):
        """Each block's attention adapters and its full FFN's where that runs; the oracle gate's
        forks (the full action at l, then two all-full suffixes) and the distilled draft's passes
        (the model's K/V again, then the draft's blocks, whose routed FFNs are the draft's) run
        them again."""
        ids, L = self.routed_layers(config), config.n_layer
        attn = adapter_flops_per_layer(config, adapters, BLOCK_PROJECTIONS[:2], T)
        mlp = adapter_flops_per_layer(config, adapters, BLOCK_PROJECTIONS[2:], T)
        total = 0
        for layer in range(L):
            kind = config.ffn_gate if layer in ids else 'static_full'
            total += attn[layer] + (mlp[layer] if kind != 'static_cheap' else 0)
            if kind == 'oracle':
                total += mlp[layer] + 2 * (sum(attn[layer + 1:]) + sum(mlp[layer + 1:]))
            if config.ffn_draft_rank > 0:
                total += (adapter_flops(config, adapters, layer, ('attn.c_attn',), T)
                          + attn[layer] + (0 if layer in ids else mlp[layer]))
        return total


def distilled_draft_logits(model, idx, pos, cache):
    """Logits of the model whose routed FFNs are all replaced by their layers' draft FFNs (B, T, V):
    the 'distilled' draft, and what its self-distillation trains."""
    x = model.embed(idx, pos)
    for block in model.transformer.h:
        x = x + block.attn_update(x, pos, cache)
        ffn = block.draft_ffn if hasattr(block, 'draft_ffn') else block.mlp
        x = x + ffn(block.ln_2(x))
    return model.lm_head(model.transformer.ln_f(x))


def draft_forward_flops(config, c, ids):
    """Per token: the distillation's forward: the model's K/V again (model_kv: c_attn on every
    block's input) and the draft's (draft_logits_in_model_context: every routed FFN replaced by its
    draft FFN, attention over 2T keys)."""
    ffns = sum(c['draft'] if layer in ids else c['full'] for layer in range(config.n_layer))
    per_block = c['kv_again'] + c['attn_proj'] + 2 * c['attn_core']
    return config.n_layer * per_block + ffns + c['head']


def draft_backward_flops(config, c, ids, trainable):
    """Per token: L_draft's backward. 'all': every weight and activation of the draft's forward.
    'draft': only the draft FFNs train, so nothing below the lowest one needs a gradient; there,
    its input needs none either; above it, the stream's gradient runs through every block and the
    head (input gradients only, but the attention core's two operands)."""
    if trainable == 'all':              # (the model's K/V are constants)
        ffns = sum(c['draft'] if layer in ids else c['full'] for layer in range(config.n_layer))
        return 2 * (config.n_layer * (c['attn_proj'] + 2 * c['attn_core']) + ffns + c['head'])
    low = min(ids)
    bwd = 1.5 * c['draft'] + c['head']  # the lowest: c_proj's input and weight, c_fc's weight
    for layer in range(low + 1, config.n_layer):
        ffn = 2 * c['draft'] if layer in ids else c['full']
        bwd += c['attn_proj'] + 2 * 2 * c['attn_core'] + ffn
    return bwd


def draft_backward_under_lora(config, c, ids, T, adapters):
    """L_draft's backward on a frozen model with LoRA adapters: input gradients from the first
    adapter up (the attention core over 2T keys, the frozen draft FFNs, the head), and the
    adapters' own (the model's K/V are constants)."""
    stream, total = False, 0
    for layer in range(config.n_layer):
        attn, mid = attention_backward(config, layer, T, 2 * c['attn_core'], stream, 1, adapters)
        total += attn
        if layer in ids:
            total, stream = total + T * c['draft'] * mid, mid
        else:
            mlp, stream = mlp_backward(config, layer, T, mid, 1, adapters)
            total += mlp
    return total + (T * c['head'] if stream else 0)


def model_kv(model, ctx):
    """Every layer's K and V (B, H, T, hd) of this forward's routed model, as constants."""
    stream = ffn_state(ctx).stream
    with torch.no_grad():
        return [block.attn.heads(block.ln_1(stream[block.layer]), ctx.pos)[1:]
                for block in model.transformer.h]


def draft_logits_in_model_context(model, idx, pos, kv):
    """The distilled draft's logits (B, T, V) where each position t reads what the first drafted
    token of a speculative pass reads: the model's K/V (kv, per layer) at positions < t and the
    draft's own at t. Each position's draft stream depends on no other's, so all T run at once,
    attending over the model's T keys (causally, strictly before t) and the draft's own (t alone).
    Its attention has no dropout (trainable='draft' trains with dropout 0)."""
    B, T = idx.shape
    before = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril(-1)
    mask = torch.cat([before, torch.eye(T, dtype=torch.bool, device=idx.device)], dim=1)
    x = model.embed(idx, pos)
    for block, (k_model, v_model) in zip(model.transformer.h, kv):
        q, k, v = block.attn.heads(block.ln_1(x), pos)
        y = F.scaled_dot_product_attention(
            q, torch.cat([k_model, k], dim=2), torch.cat([v_model, v], dim=2), attn_mask=mask
        )
        x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, -1))
        ffn = block.draft_ffn if hasattr(block, 'draft_ffn') else block.mlp
        x = x + ffn(block.ln_2(x))
    return model.lm_head(model.transformer.ln_f(x))


@torch.no_grad()
def distilled_draft_report(model, batches, autocast):
    """The distilled draft beside the model (eval mode: its causal routing and thresholds) on
    batches [(x, y), ...], each position read as a speculative pass's first draft reads it
    (draft_logits_in_model_context): the draft's LM loss, KL(model || draft), the chance a sampled
    draft token is kept (1 − TV, Leviathan et al.'s acceptance) and how often the argmaxes agree,
    means over the batches."""
    sums = dict(loss=0.0, kl=0.0, kept=0.0, agrees=0.0)
    with model.mode(training=False):
        for x, y in batches:
            cache = model.new_cache(x.size(0), x.device)
            with autocast:
                logits = model(x, last_only=False, cache=cache)[0]
                kv = [(k[:, :, :x.size(1)], v[:, :, :x.size(1)]) for k, v in zip(cache.k, cache.v)]
                draft = draft_logits_in_model_context(model, x, None, kv)
            logp, logq = logits.float().log_softmax(-1), draft.float().log_softmax(-1)
            sums['loss'] += losses.lm_loss(draft, y).item()
            sums['kl'] += losses.draft_distillation(logits, draft).item()
            sums['kept'] += torch.minimum(logp.exp(), logq.exp()).sum(-1).mean().item()
            sums['agrees'] += (logp.argmax(-1) == logq.argmax(-1)).float().mean().item()
    return {k: v / len(batches) for k, v in sums.items()}


def aux_on_score(config):
    return config.ffn_util_weight > 0 or config.ffn_rank_weight > 0


def mimic_reruns(config):
    """Does the imitation run the cheap FFN again, on the detached input ('own')?"""
    return config.ffn_mimic_weight > 0 and config.ffn_aux_grad == 'own'


def ffn_costs(config, T):
    """routing.flop_costs plus the cheap FFN, the gates and the membership predictor, per token."""
    d, gh, lat = config.n_embd, config.ffn_gate_hidden, config.ffn_jepa_latent
    return dict(flop_costs(config, T), cheap=2 * 2 * d * config.ffn_cheap_rank,
                draft=2 * 2 * d * config.ffn_draft_rank, kv_again=2 * d * 3 * d,
                gate_fc=2 * d * gh, gate_out=2 * gh * (lat if config.ffn_gate == 'jepa' else 1),
                gate_read=gate_read_flops(config),
                jepa_target=2 * d * lat, pred_fc=2 * d * gh, pred_out=2 * gh)


def gate_read_flops(config):
    """Per token: G3's score from its forecasts ('utility': an MLP on [h, d], 'linear': w·d; the
    difference d and the distance are elementwise, which FlopCounterMode does not count)."""
    d, gh, lat = config.n_embd, config.ffn_gate_hidden, config.ffn_jepa_latent
    if config.ffn_gate != 'jepa':
        return 0
    costs = {'utility': 2 * (d + lat) * gh + 2 * gh, 'linear': 2 * lat}
    return costs.get(config.ffn_jepa_readout, 0)


# --------------------------------------------------------------------------------------------------
# the routed FFN of one block

def routed_ffn_update(block, cfg, x, ctx):
    """Full FFN for the tokens the decision selects, cheap FFN for the rest. Both paths run densely
    and are mixed by the mask (training, and the masked reference for sparse execution)."""
    l, state = block.layer, ffn_state(ctx)
    if l in state.keep_mid:
        state.mid[l] = x.detach()
    h = block.ln_2(x)
    force = ctx.force or STATIC.get(cfg.ffn_gate)
    if force is not None:
        return block.mlp(h) if force == 'full' else block.cheap(h)
    B, T = h.shape[:2]
    causal = not block.training
    sparse = causal and ctx.sparse
    full, cheap = (None, None) if sparse else (block.mlp(h), block.cheap(h))
    score, preds = None, None
    if cfg.ffn_gate == 'random':
        mask = random_mask(B, T, cfg.ffn_budget, causal, h.device)
    elif cfg.ffn_gate == 'oracle':           # analysis only: peeks at the targets, so never causal
        mask = topk_mask(state.oracle(l, x), capacity(cfg.ffn_budget, T))
    else:
        preds = block.gate.predict(h) if cfg.ffn_gate == 'jepa' else None
        score = block.gate.score(h, *preds) if preds is not None else block.gate(h)
        if causal:                  # calibrating: the threshold first set to hit the budget on this
                                    # batch
            decider = block.predictor(h) if block.predictor is not None else score
            mask = threshold_mask(decider, block.tau, cfg.ffn_budget if ctx.calibrate else None)
            if ctx.collect:
                ctx.margins[l] = (decider - block.tau).detach()
        else:
            mask = topk_mask(score.detach(), capacity(cfg.ffn_budget, T))
    if sparse:                      # each path on its own tokens only
        update = split_apply(h, mask, block.mlp, block.cheap, mode=ctx.exec_mode)
        if score is not None and cfg.ffn_gate_grad == 'scale':
            update = update * torch.where(mask, torch.sigmoid(score), 1.0)[..., None]
    # MoD: x + σ(s)·full on the selected path
    elif score is not None and cfg.ffn_gate_grad == 'scale':
        update = torch.where(mask[..., None], torch.sigmoid(score)[..., None] * full, cheap)
    elif score is not None and cfg.ffn_gate_grad == 'ste' and block.training:
        w = straight_through(mask, score)[..., None]
        update = w * full + (1 - w) * cheap
    else:
        update = torch.where(mask[..., None], full, cheap)
    if ctx.collect:
        ctx.masks[l] = mask
        if score is not None:
            ctx.scores[l] = score
            if (
                block.training
                and cfg.ffn_aux_grad == 'own'
                and l in ctx.options.get('oracle_layers', ())
            ):
                state.gate_in[l] = h.detach()
        if block.training:
            collect_losses(block, cfg, ctx, x, h, full, cheap, mask, preds)
    return update


def collect_losses(block, cfg, ctx, x, h, full, cheap, mask, preds):
    n = len(layer_ids(cfg, 'ffn_layers', default='all'))
    if preds is not None:           # collapse monitor (A1): spread of the forecasts across tokens
        ctx.add('jepa_pred_std',
                torch.cat(preds, -1).detach().flatten(0, 1).std(0, correction=0).mean() / n)
    if preds is not None and cfg.ffn_jepa_weight > 0:
        if cfg.ffn_aux_grad == 'own':     # the alignment trains this layer's predictor only
            preds = block.gate.predict(h.detach())
        outcomes = (full, cheap) if cfg.ffn_jepa_outcome == 'delta' else (x + full, x + cheap)
        ctx.add(
            'jepa_loss', losses.jepa_alignment(preds, [block.gate.target_of(o) for o in outcomes])
        )
    if block.predictor is not None and cfg.ffn_predictor_weight > 0:
        ctx.add('pred_loss', losses.membership_bce(block.predictor(h), mask))
    if cfg.ffn_mimic_weight > 0:          # 'own': the imitation trains this cheap FFN alone, so
        if cfg.ffn_aux_grad == 'own':     # it cannot move the input it imitates the full FFN on
            cheap = block.cheap(h.detach())
        ctx.add('mimic_loss', losses.cheap_mimic(cheap, full))


def oracle_routing_labels(model, l, x_mid, targets, pos):
    """The oracle gate's labels: from the state its own decisions below l left, later layers all
    full."""
    if model.config.ffn_oracle_label == 'token':
        full = torch.ones(x_mid.shape[:2], dtype=torch.bool, device=x_mid.device)
        return token_fork_utility(model, l, x_mid, full, targets, pos, later='full')
    return fork_utility(model, l, x_mid, targets, pos, later='full')


FAMILY = FFNRouting()
