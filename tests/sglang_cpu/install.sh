#!/usr/bin/env bash
# TEST SUPPORT ONLY: a virtualenv with SGLang 0.5.23 on the CPU torch wheel, for the real-SGLang tier
# (tests/sglang_real/test_sglang_real.py; .ci/run's SGLang step). SGLang does not support CPU-only x86 machines: this installs
# it without its dependencies (it pins a CUDA torch 2.14.1, flashinfer, sgl-kernel, torchvision, torchaudio) and
# then only what its CPU path imports, listed in requirements.txt; tests/sglang_cpu/sitecustomize.py stands in
# for sgl_kernel and torchvision. Never install torchvision or torchaudio here (PyPI's builds do not import beside
# the CPU torch 2.13.0 wheel).
#     bash tests/sglang_cpu/install.sh .venv-sglang && .venv-sglang/bin/python -m pytest -m sglang_real
set -euo pipefail
venv=${1:?usage: install.sh <virtualenv directory>}
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" -r "$here/requirements.txt" -e "$repo" \
    "pytest>=8" "pytest-timeout>=2.3"
"$venv/bin/python" -m pip install --quiet --no-deps "sglang==0.5.23"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
