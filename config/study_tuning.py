# The Mixture-of-Depths Ensemble as a tuning method (Luo & Specia, arXiv 2410.13077) against LoRA
# (Hu et al., arXiv 2106.09685), on a task new to the backbone, scored by exact match: two-digit
# addition (padded, answers reversed) tuned into the 8-layer Shakespeare backbone, 1,000 steps,
# 3 seeds per arm. The claims: the ensemble added to LoRA beats LoRA; the ensemble alone
# (backbone frozen) matches LoRA with about 3% of its trainable parameters. The room first: full
# fine-tuning minus the zero-shot backbone. Learning rates from one-seed probes on val loss
# (docs/results.md): full 1e-3 (of 1e-3, 3e-3), last3 3e-3 (of 1e-3, 3e-3), LoRA 1e-2 (of 1e-3,
# 3e-3, 1e-2), the ensemble arms LoRA's. About an hour with --jobs=2 on 2 cores, plus about 25
# minutes for the backbone where out/tuning_backbone_shakespeare has none.
#   python data/prepare.py shakespeare_char
#   python data/prepare.py arith --vocab_from=data/shakespeare_char --digits=2 --ops=+ \
#       --num_problems=6000 --answer=reversed --pad=True --out_dir=data/arith_add2rp_sc
#   python sweep.py config/study_tuning.py --dry_run      # every run and its estimated time
#   python sweep.py config/study_tuning.py --jobs=2
base = 'config/tuning_arith_shakespeare.py'
out_root = 'out/study_tuning'
before = [['config/tuning_backbone_shakespeare.py',
           '--out_dir=out/tuning_backbone_shakespeare']]
seeds = [1, 2, 3]
LR_FULL, LR_LAST3, LR_ADAPTER = ['--learning_rate=1e-3', '--min_lr=1e-4'], \
    ['--learning_rate=3e-3', '--min_lr=3e-4'], ['--learning_rate=1e-2', '--min_lr=1e-3']
arms = {
    'zero_shot': ['--max_iters=0'],
    'full': ['--trainable=all', *LR_FULL],
    'last3': ['--trainable=last_layers', *LR_LAST3],
    'lora': ['--trainable=lora', *LR_ADAPTER],
    'ensemble': ['--route=ensemble', '--trainable=controller', *LR_ADAPTER],
    'ensemble_lora': ['--route=ensemble', '--trainable=controller+lora', *LR_ADAPTER],
}
reference = 'lora'
# exact match of the greedy answers on the test split (operand pairs no training problem has)
score = ['arith.py', '--ckpt={ckpt}', '--dataset=arith_add2rp_sc', '--split=test', '--json']
score_metrics = {'accuracy': False}
room_arms = ('zero_shot', 'full', 'accuracy')
