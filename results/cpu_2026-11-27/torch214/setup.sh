#!/bin/bash
# The newest torch pip resolves here (2.14.1+cu130: torch 2.15.0's dependencies did not resolve
# from this machine's package mirror), as a user with `pip install -r requirements.txt` on a fresh
# machine gets it, in a virtual environment on the 2-core CPU (the CUDA wheel's CPU kernels run
# without a GPU). From the repo root:
#   bash results/cpu_2026-11-27/torch214/setup.sh
#   /tmp/venv214/bin/python -m pytest -q -n 2 -p no:cacheprovider
set -e
python -m venv /tmp/venv214
/tmp/venv214/bin/pip install -q -r requirements.txt -r requirements-extra.txt
/tmp/venv214/bin/python -c "import torch, triton, numpy
print(torch.__version__, triton.__version__, numpy.__version__)"
