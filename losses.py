"""
Loss terms, as pure functions. Each docstring gives its equation; shapes are (B, T) per token unless
stated. All computed in fp32.

Notation: s_t the gate score of token t at a controlled layer l, m_t in {0,1} its top-k membership,
U_t the oracle utility label of taking the full rather than the cheap path at l.
"""
import torch
import torch.nn.functional as F


def per_token_ce(logits, targets):
    """CE_t = −log softmax(logits_t)[y_t], (B, T); positions with target −1 give 0."""
    ce = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction='none'
    )
    return ce.view(targets.shape)


def lm_loss(logits, targets):
    """L_LM = mean_t CE_t over positions whose target is not −1; 0 (no gradient) where none is,
    e.g. a task's window that holds no answer, whose mean would be NaN."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
    return torch.where(targets.ne(-1).any(), ce, ce.new_zeros(()))


def oracle_utility(ce_cheap, ce_full):
    """U_t = CE_t(cheap at l) − CE_t(full at l), the later layers fixed by the label's policy
    (off-policy: all full; on-policy: the current gate policy). U_t > 0: the full path helps t."""
    return (ce_cheap - ce_full).detach()


def utility_regression(score, utility, valid=None):
    """L_util = mean_t (s_t − U_t)²: the score regressed onto the raw label (no rescaling), over
    the positions valid (B, T) bool marks (None: all): where the target is −1 (a task's prompt)
    there is no CE, so U_t = 0 would be a label nobody measured."""
    sq = (score.float() - utility).pow(2)
    if valid is None:
        return sq.mean()
    v = valid.float()
    return (sq * v).sum() / v.sum().clamp(min=1)


def pairwise_rank(score, utility, n_pairs, kind='logistic', margin=0.1, generator=None,
                  valid=None):
    """Pairs (i, j) drawn uniformly within each sequence (n_pairs per sequence, static shape),
    ordered so that U_i > U_j (ties dropped, and pairs with a position valid (B, T) bool does not
    mark: no label there). With δ = s_i − s_j:
        logistic: L_rank = mean log(1 + exp(−δ))
        margin:   L_rank = mean max(0, margin − δ)"""
    B, T = score.shape
    i = torch.randint(0, T, (B, n_pairs), device=score.device, generator=generator)
    j = torch.randint(0, T, (B, n_pairs), device=score.device, generator=generator)
    du = utility.gather(1, i) - utility.gather(1, j)
    sign = torch.sign(du)
    delta = sign * (score.float().gather(1, i) - score.float().gather(1, j))
    loss = F.softplus(-delta) if kind == 'logistic' else F.relu(margin - delta)
    kept = sign != 0
    if valid is not None:
        kept = kept & valid.gather(1, i) & valid.gather(1, j)
    kept = kept.float()
    return (loss * kept).sum() / kept.sum().clamp(min=1)


def jepa_alignment(pred, target):
    """L_JEPA = mean_t ||P(h_t, a) − sg(T·outcome_t(a))||² / latent, summed over the actions a given
    (pred, target are lists of (B, T, latent) tensors, one per action)."""
    return sum((p.float() - z.detach().float()).pow(2).mean() for p, z in zip(pred, target))


def membership_bce(logit, mask):
    """L_pred = BCE(σ(q_t), m_t): a causal predictor q of top-k membership (targets
    stop-gradient)."""
    return F.binary_cross_entropy_with_logits(logit.float(), mask.float().detach())


def cheap_mimic(cheap_out, full_out):
    """L_mimic = mean ||cheap(h) − sg(full(h))||²: teaches the cheap FFN to imitate the full one."""
    return (cheap_out.float() - full_out.detach().float()).pow(2).mean()


def draft_distillation(model_logits, draft_logits):
    """L_draft = mean over positions of KL(sg(p) || q), p the model's next-token distribution, q its
    draft's: a draft whose q is near p has its tokens kept by the rejection rule (the chance of
    keeping one is 1 − TV(p, q)) and agrees with the model's argmax."""
    logp = F.log_softmax(model_logits.detach().float(), dim=-1)
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def exit_loss_weights(depths, n_layer, schedule, scale=1.0):
    """Weights α_d of the early-exit losses in L = L_n + Σ_d α_d·L_d, for exits after d blocks
    (d in depths, all < n_layer), summing to `scale`:
        uniform:   α_d ∝ 1
        calm:      α_d ∝ d                         (CALM: ω_i ∝ i)
        layerskip: α_d ∝ e_scale·Σ_{i≤l} i = l(l+1)/2 with l = d − 1 LayerSkip's 0-based index of
                   the block the exit follows (so an exit after the first block weighs 0, as in
                   LayerSkip); e_scale cancels in the normalisation, so `scale` plays its part
    schedule 'mean' is TSA's early-exit baseline: L = mean over every exit and the final layer, i.e.
    the final weight is 1/(|D|+1) rather than 1; it returns the weights of the exits and of the
    final layer together as {d: w} with n_layer included."""
    depths = sorted(depths)
    if schedule == 'mean':
        return {d: 1.0 / (len(depths) + 1) for d in depths + [n_layer]}
    raw = {'uniform': lambda d: 1.0, 'calm': lambda d: float(d),
           'layerskip': lambda d: (d - 1) * d / 2}[schedule]
    total = sum(raw(d) for d in depths)
    w = {d: scale * raw(d) / total if total > 0 else 0.0 for d in depths}
    w[n_layer] = 1.0
    return w


def distill_kl(student_logits, teacher_logits, direction='forward', targets=None):
    """Distillation from a stop-gradient teacher, mean over tokens, in fp32:
        forward: KL(p_teacher ‖ p_student) = Σ p_t (log p_t − log p_s)   (the usual distillation)
        reverse: KL(p_student ‖ p_teacher)
    With targets, the mean is over the positions the LM loss counts (target != -1): on a task
    whose loss counts answer tokens only, the prompt positions are not distilled either."""
    log_s = F.log_softmax(student_logits.float(), -1)
    log_t = F.log_softmax(teacher_logits.detach().float(), -1)
    if direction == 'forward':
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:
        kl = (log_s.exp() * (log_s - log_t)).sum(-1)
    if targets is None:
        return kl.mean()
    counted = (targets != -1).to(kl.dtype)
    return (kl * counted).sum() / counted.sum().clamp_min(1)
