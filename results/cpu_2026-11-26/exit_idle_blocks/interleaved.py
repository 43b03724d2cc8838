"""Plain greedy decode, batch 1, ms per token (60 tokens from a 64-token prompt of the validation
text, decode alone: generate(61) minus generate(1), median of 5), of the exit model
(config/exit_drafter_shakespeare.py) before and after the blocks after every token exited write
K/V only ('exit after': the working tree of the commit that made them so), and of the dense model,
in turns, 4 rounds.
Run from the repository root at 857b532 ('after' runs the working tree), with the
commit before checked out beside it:
    git worktree add /tmp/wt_before2 67c3ce6
    ln -s $PWD/data/shakespeare_char /tmp/wt_before2/data/shakespeare_char
and the checkpoints of docs/results.md's speculative section in out/ (ROOT below: the path of this checkout).
    python results/cpu_2026-11-26/exit_idle_blocks/interleaved.py"""
import subprocess
import sys

CODE = '''
import sys, time, numpy as np, torch
sys.path.insert(0, '.')
from checkpoint import load_checkpoint, load_model
torch.set_num_threads(2)
m = load_model(load_checkpoint(sys.argv[1]), 'cpu').eval()
data = np.memmap(sys.argv[2], dtype=np.uint16, mode='r')
idx = torch.from_numpy(data[1000:1064].astype(np.int64))[None]
m.generate(idx, 5, temperature=0)
ts = []
for _ in range(5):
    t = time.perf_counter(); m.generate(idx, 61, temperature=0); t1 = time.perf_counter()
    m.generate(idx, 1, temperature=0); ts.append((t1 - t) - (time.perf_counter() - t1))
print('%.3f' % (1000 * float(np.median(ts)) / 60))
'''
ROOT = '/work/main'
RUNS = {'exit before (67c3ce6)': ('/tmp/wt_before2', 'out/spec_exit_w4d2'),
        'exit after': (ROOT, 'out/spec_exit_w4d2'),
        'dense': (ROOT, 'out/spec_dense')}
times = {k: [] for k in RUNS}
for _ in range(4):
    for name, (tree, ckpt) in RUNS.items():
        out = subprocess.run([sys.executable, '-c', CODE, f'{ROOT}/{ckpt}/ckpt.pt',
                              f'{ROOT}/data/shakespeare_char/val.bin'], cwd=tree,
                             capture_output=True, text=True, check=True).stdout
        times[name].append(float(out))
for name, t in times.items():
    print(f'{name}: ms/token per round {t}, median {sorted(t)[len(t) // 2]:.3f}')
