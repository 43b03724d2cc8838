#!/bin/bash
# The GPU machine's torch (2.11.0+cu130, with Triton 3.6.0) in a virtual environment on the 2-core
# CPU, to run the test suite and the GPU commands under it before a GPU is lent. From the repo root:
#   bash results/cpu_2026-11-26/torch211/setup.sh && bash results/cpu_2026-11-26/torch211/run.sh
# NumPy < 2.4: Triton 3.6's interpreter cannot run a loop bounded by a kernel argument under NumPy
# 2.4 (the interpreter tests then skip, saying so; with 2.3.5 they run).
set -e
python -m venv /tmp/venv211
/tmp/venv211/bin/pip install -q torch==2.11.0 triton==3.6.0
/tmp/venv211/bin/pip install -q -r requirements.txt -r requirements-extra.txt "numpy<2.4"
/tmp/venv211/bin/python -c "import torch, triton, numpy
print(torch.__version__, triton.__version__, numpy.__version__)"
