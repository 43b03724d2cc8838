# The seed paper's A3 (arXiv 2604.17228) on a corpus with room: G1 and G3, standard recipe (util +
# rank from off-policy oracle labels) vs util/rank removed, plus on-policy labels, 3 seeds. Each
# seed trains its own stage-1 backbone (random routing at the budget), so the seed spread includes
# the backbone's. sweep.py measures each backbone's room (eval.py --room: all-full, all-cheap,
# random and oracle routing) and reports the arm differences against it.
#   python sweep.py config/study_a3_lookup.py --jobs=2
base = 'config/ffn_stage2_lookup.py'
out_root = 'out/study_a3_lookup'
before = [['config/ffn_stage1_lookup.py', '--out_dir=out/study_a3_lookup/stage1/seed{seed}']]
# whole-sequence oracle labels: the setting docs/results.md reports this study under
overrides = [
    '--init_from=out/study_a3_lookup/stage1/seed{seed}/ckpt.pt',
    '--ffn_oracle_label=sequence',
]
room_ckpt = 'out/study_a3_lookup/stage1/seed{seed}/ckpt.pt'
seeds = [1, 2, 3]
# G3 arms pin the G3 these results were reported with: a score read from forecasts whose action
# embeddings start 0.02 apart, which util, rank and the LM loss could not move (docs/families.md)
G3_LEGACY = ['--ffn_jepa_readout=distance', '--ffn_jepa_action_std=0.02']
arms = {
    'G1_std': ['--ffn_gate=mlp'],
    'G1_A3': ['--ffn_gate=mlp', '--ffn_util_weight=0', '--ffn_rank_weight=0'],
    'G3_std': ['--ffn_gate=jepa', *G3_LEGACY],
    'G3_A3': ['--ffn_gate=jepa', *G3_LEGACY, '--ffn_util_weight=0', '--ffn_rank_weight=0'],
    'G1_onpolicy': ['--ffn_gate=mlp', '--ffn_oracle_policy=on'],
    # the on-policy arm changes two things; one at a time: where the forks start, what runs after
    # them
    'G1_routed_start': ['--ffn_gate=mlp', '--ffn_oracle_policy=off', '--ffn_oracle_start=routed'],
    'G1_policy_later': ['--ffn_gate=mlp', '--ffn_oracle_policy=on', '--ffn_oracle_start=full'],
    # per-token labels (token t switched alone): from the all-full state with later layers full (the
    # paper's fork), and from the routed state with later layers following the gates (on-policy)
    'G1_token': ['--ffn_gate=mlp', '--ffn_oracle_label=token'],
    'G1_token_onpolicy': ['--ffn_gate=mlp', '--ffn_oracle_label=token', '--ffn_oracle_policy=on'],
}
reference = 'G1_std'
