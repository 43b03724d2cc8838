# Where a plain compiled decode's warm-up goes when its code comes from a compile cache blob, under
# torch 2.11 on the CPU. From the repo root, each with an empty inductor cache:
#   TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. /tmp/venv211/bin/python \
#     results/cpu_2026-11-27/torch211_compile_cache/plain_load.py save BLOB
#   TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. /tmp/venv211/bin/python \
#     results/cpu_2026-11-27/torch211_compile_cache/plain_load.py load BLOB
# It prints the first generate's seconds, inductor's cache counters, and torch's compile-time
# table (the rows that tell: the compiler call, the cache load, compile_file).
import sys
import time

import torch
from torch._dynamo.utils import compile_times, counters

from checkpoint import load_checkpoint, load_model

mode, blob = sys.argv[1], sys.argv[2]
if mode == 'load':
    with open(blob, 'rb') as f:
        torch.compiler.load_cache_artifacts(f.read())
model = load_model(load_checkpoint('out/gpu/spec_exit_w4d2/ckpt.pt'), torch.device('cpu')).eval()
prompt = torch.randint(0, model.config.vocab_size, (1, 64),
                       generator=torch.Generator().manual_seed(0))
t = time.time()
model.generate(prompt, 61, temperature=0.0, compile=True)
print(mode, 'torch', torch.__version__, 'first generate', round(time.time() - t, 1), 's',
      dict(counters['inductor']))
keep = ('_compile.compile_inner', 'bytecode_tracing', 'OutputGraph.call_user_compiler',
        'fx_codegen_and_compile', 'AOTAutogradCache.inductor_load', 'PyCodeCache.load_by_key_path',
        'compile_file', 'async_compile.wait')
for line in compile_times(repr='str', aggregate=True).splitlines():
    if line.split(',')[0] in keep:
        print(' ', line)
if mode == 'save':
    with open(blob, 'wb') as f:
        f.write(torch.compiler.save_cache_artifacts()[0])
