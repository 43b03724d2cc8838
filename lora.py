"""
LoRA: low-rank adapters on a frozen model ("LoRA: Low-Rank Adaptation of Large Language Models",
Hu et al., arXiv 2106.09685).

A projection y = W x + b becomes y = W x + b + (alpha / r) · B A dropout(x), with W and b frozen,
A (r x in) drawn like nn.Linear's own weight (Kaiming-uniform, a = √5, as the paper's reference
code) and B (out x r) zero, so an adapted model starts as its base model, bit for bit.

    from lora import apply_lora, merge_lora
    apply_lora(model, rank=8, alpha=16, dropout=0.0, targets='attn.c_attn,mlp.c_fc')
    ...train model.lora_parameters()...
    merge_lora(model)        # W += (alpha / r) · B A; plain nn.Linear modules again, for inference

A target names a projection by the end of its module name: 'attn.c_attn' adapts the QKV projection
of every block; 'h.3.mlp.c_fc' only block 3's. The state dict keeps the base weight under
`<module>.base.weight` (bit-identical to the backbone's `<module>.weight`) beside `<module>.lora_A`
and `<module>.lora_B`; checkpoint.load_model rebuilds the adapters from the run's config, loads
and merges; a run started from such a checkpoint (train.py --init_from) takes that merged model.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# the linear projections of a nanodepth block, by the end of their module names
DEFAULT_TARGETS = 'attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj'


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update. `weight` and `bias` read as the
    effective (merged) ones, so code that reads a projection's weight directly (the sparse-execution
    kernels) sees the adapted projection; forward itself never forms the merged matrix."""

    def __init__(self, base, rank, alpha, dropout=0.0):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dt))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout)

    @property
    def weight(self):
        return self.base.weight + self.scale * (self.lora_B @ self.lora_A)

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return self.base(x) + self.scale * update

    @torch.no_grad()
    def merged(self):
        """A plain nn.Linear with W + (alpha / r) · B A (the base's own tensors are left as they
        are)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.base.bias is not None,
                        device=self.base.weight.device, dtype=self.base.weight.dtype)
        out.weight.copy_(self.weight)
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        return out

    def extra_repr(self):
        return f"rank={self.rank}, alpha={self.alpha}"


def projection_names(model):
    """Module names of every nn.Linear a target may name (the tied LM head is the embedding too:
    not adaptable here)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n and n != 'lm_head']


def parse_targets(targets):
    names = [t.strip().strip('.') for t in str(targets).split(',') if t.strip().strip('.')]
    if not names:
        raise ValueError(
            f"lora_targets names no module (got {targets!r}); e.g. {DEFAULT_TARGETS!r}"
        )
    return names


def names_target(name, target):
    """A module matches a target when its name is the target or ends with '.' + target."""
    return name == target or name.endswith('.' + target)


def matching(model, targets):
    """{target: [module names it matches]}."""
    names = projection_names(model)
    return {t: [n for n in names if names_target(n, t)] for t in parse_targets(targets)}


def check_targets(model, targets):
    """ValueError naming a target that matches no projection, with the names there are."""
    for target, hits in matching(model, targets).items():
        if not hits:
            ends = sorted({'.'.join(n.split('.')[-2:]) for n in projection_names(model)})
            raise ValueError(f"lora_targets: {target!r} matches no projection of this model; "
                             f"its projections end in {', '.join(ends)}")


def apply_lora(model, rank, alpha, dropout=0.0, targets=DEFAULT_TARGETS):
    """Freeze every parameter of model and wrap each projection that a target names in a
    LoRALinear (in place). Returns the adapted module names."""
    if rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {rank}")
    check_targets(model, targets)
    chosen = sorted({n for hits in matching(model, targets).values() for n in hits})
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition('.')
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return chosen


def lora_parameters(model):
    """The adapters' A and B, the only parameters LoRA trains."""
    return [p for m in model.modules() if isinstance(m, LoRALinear)
            for p in (m.lora_A, m.lora_B)]


def merge_lora(model):
    """Replace every LoRALinear by the plain nn.Linear of its merged weight (in place; for
    inference: the adapters are gone). Returns model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition('.')
            setattr(model.get_submodule(parent_name), child, module.merged())
    return model


def has_lora_keys(state):
    return any(k.endswith('.lora_A') for k in state)

