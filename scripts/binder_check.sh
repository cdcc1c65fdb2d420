#!/usr/bin/env bash
# Check binder/: install from that folder alone (requirements + postBuild, as repo2docker does) into a fresh
# virtual environment, then execute chapter 1 there and compare its outputs with strict nbval.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=$(mktemp -d)/binder-venv
python3 -m venv "$env_dir"
source "$env_dir/bin/activate"
python -m pip install --quiet -r binder/requirements.txt
bash binder/postBuild
# Binder's image brings JupyterLab and its kernel; nbval and ipykernel stand in for them here.
python -m pip install --quiet ipykernel "nbval>=0.11,<0.12"
python -m pytest chapters/01_microbatch_statistics.ipynb --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -q
echo "binder/ installs everything chapter 1 needs: $(python -c 'import gradaccum, torch; print("gradaccum", gradaccum.__version__, "torch", torch.__version__)')"
rm -rf "$(dirname "$env_dir")"
