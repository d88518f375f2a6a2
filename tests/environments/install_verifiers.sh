#!/usr/bin/env bash
# TEST SUPPORT ONLY: a virtualenv with verifiers 0.4.0 on the CPU torch wheel, for the verifiers adapter's tests
# (tests/environments/test_verifiers_env.py, marker verifiers). torch is pinned: unpinned, verifiers' dependencies pull
# a multi-GB CUDA build. uv is installed beside it because verifiers runs its harness programs as uv scripts, and
# without one on PATH it installs uv itself into ~/.local (pip --user, or curl | sh). The first episode on a machine
# downloads the harness program's packages into uv's cache (~/.cache/uv, about 60 MB).
#     bash tests/environments/install_verifiers.sh .venv-verifiers && .venv-verifiers/bin/python -m pytest -m verifiers
set -euo pipefail
venv=${1:?usage: install_verifiers.sh <virtualenv directory>}
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python -m venv --clear "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" -e "$repo[dev,verifiers]"
"$venv/bin/python" -c "import torch, verifiers
assert torch.__version__.startswith('2.13.0'), torch.__version__
assert verifiers.__version__ == '0.4.0', verifiers.__version__"
