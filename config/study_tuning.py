# The Mixture-of-Depths Ensemble as a tuning method (Luo & Specia, arXiv 2410.13077) against LoRA
# (Hu et al., arXiv 2106.09685), on a task new to the backbone, scored by exact match: two-digit
# addition (answers reversed) tuned into the 8-layer Shakespeare backbone, 3 seeds per arm. The
# claims: the ensemble added to LoRA beats LoRA; the ensemble alone (backbone frozen) matches
# LoRA with about 3% of its trainable parameters. The room first: full fine-tuning minus the
# zero-shot backbone. Not yet run at this recipe (docs/results.md: what a 300-step probe reached).
#   python data/prepare.py shakespeare_char
#   python data/prepare.py arith --vocab_from=data/shakespeare_char --digits=2 --ops=+ \
#       --num_problems=6000 --answer=reversed --out_dir=data/arith_add2r_sc
#   python sweep.py config/study_tuning.py --dry_run      # every run and its estimated time
#   python sweep.py config/study_tuning.py
base = 'config/tuning_arith_shakespeare.py'
out_root = 'out/study_tuning'
before = [['config/tuning_backbone_shakespeare.py',
           '--out_dir=out/tuning_backbone_shakespeare']]
seeds = [1, 2, 3]
arms = {
    'zero_shot': ['--max_iters=0'],
    'full': ['--trainable=all'],
    'last3': ['--trainable=last_layers'],
    'lora': ['--trainable=lora'],
    'ensemble': ['--route=ensemble', '--trainable=controller'],
    'ensemble_lora': ['--route=ensemble', '--trainable=controller+lora'],
}
reference = 'lora'
# exact match of the greedy answers on the test split (operand pairs no training problem has)
score = ['arith.py', '--ckpt={ckpt}', '--dataset=arith_add2r_sc', '--split=test', '--json']
score_metrics = {'accuracy': False}
room_arms = ('zero_shot', 'full', 'accuracy')
