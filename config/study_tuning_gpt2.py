# config/study_tuning.py's six arms on GPT-2 124M (init_from=gpt2, 12 layers, k = 3): the
# ensemble against LoRA on a pretrained model of real size. It runs where GPT-2's weights are on
# the machine, in the Hugging Face cache or in the folder NANODEPTH_GPT2 names; elsewhere the sweep
# prints why and exits. Hours on a CPU: a GPU's study.
#   python data/prepare.py arith --tokenizer=gpt2 --digits=2 --ops=+ --num_problems=6000 \
#       --answer=reversed --pad=True --out_dir=data/arith_add2rp_gpt2
#   python sweep.py config/study_tuning_gpt2.py
import glob
import os

from configurator import hf_hub_cache

GPT2 = os.environ.get('NANODEPTH_GPT2', 'gpt2')


def gpt2_weights_here(name):
    """Whether from_pretrained(name) finds GPT-2's weights without the network: a folder saved by
    transformers, or the hub name's snapshot in the Hugging Face cache."""
    if os.path.isdir(name) or os.sep in name:       # a folder, or a path to none
        return os.path.isfile(os.path.join(name, 'config.json'))
    repo = f"models--{name.replace('/', '--')}"
    files = glob.glob(os.path.join(hf_hub_cache(), repo, 'snapshots', '*', '*'))
    return any(os.path.basename(f) in ('model.safetensors', 'pytorch_model.bin') for f in files)


skip = None if gpt2_weights_here(GPT2) else (
    f"no GPT-2 weights for init_from={GPT2} on this machine (Hugging Face cache, or a folder in "
    f"NANODEPTH_GPT2 saved by GPT2LMHeadModel.save_pretrained)")
base = 'config/tuning_arith_gpt2.py'
overrides = [f'--init_from={GPT2}']
out_root = 'out/study_tuning_gpt2'
seeds = [1, 2, 3]
LR_FULL, LR_LAST3, LR_ADAPTER = ['--learning_rate=1e-4', '--min_lr=1e-5'], \
    ['--learning_rate=3e-4', '--min_lr=3e-5'], ['--learning_rate=1e-3', '--min_lr=1e-4']
arms = {
    'zero_shot': ['--max_iters=0'],
    'full': ['--trainable=all', *LR_FULL],
    'last3': ['--trainable=last_layers', *LR_LAST3],
    'lora': ['--trainable=lora', *LR_ADAPTER],
    'ensemble': ['--route=ensemble', '--trainable=controller', *LR_ADAPTER],
    'ensemble_lora': ['--route=ensemble', '--trainable=controller+lora', *LR_ADAPTER],
}
reference = 'lora'
score = ['arith.py', '--ckpt={ckpt}', '--dataset=arith_add2rp_gpt2', '--split=test', '--json']
score_metrics = {'accuracy': False}
room_arms = ('zero_shot', 'full', 'accuracy')
