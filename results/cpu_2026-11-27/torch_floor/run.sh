#!/bin/bash
# The suite under an older torch: its pip wheel (on x86_64 the CUDA build, whose CPU kernels run
# without a GPU) in a virtual environment, with requirements.txt and each package of
# requirements-extra.txt that installs beside it (torch held at VERSION), then the suite as CI
# runs it. From the repo root:
#   bash results/cpu_2026-11-27/torch_floor/run.sh VERSION     # e.g. 2.4.1, 2.9.1
set -u
v=${1:?usage: run.sh TORCH_VERSION}
D=results/cpu_2026-11-27/torch_floor
V=/tmp/venv-torch-$v
python -m venv $V
$V/bin/pip install -q torch==$v
echo "torch==$v" > $V/constraints.txt
# (requirements.txt's own torch line is left out: it names the floor this checks)
grep -v '^torch' requirements.txt > $V/requirements-but-torch.txt
$V/bin/pip install -q -c $V/constraints.txt -r $V/requirements-but-torch.txt
grep -o '^[A-Za-z0-9_.-]*' requirements-extra.txt | while read -r pkg; do
  [ -n "$pkg" ] && { $V/bin/pip install -q -c $V/constraints.txt "$pkg" || echo "$pkg: not installed"; }
done
CI=true $V/bin/python -m pytest -q -p no:cacheprovider -rs > $D/pytest_torch$v.log 2>&1
tail -1 $D/pytest_torch$v.log
gzip -f $D/pytest_torch$v.log
