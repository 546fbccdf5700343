#!/usr/bin/env bash
# Installs the plugin from a wheelhouse (`make wheelhouse`) where there is no network and a CUDA torch is
# already installed: every wheel of WHEELS/requirements.txt that fits this Python, with
# `pip install --no-index --no-deps --target SITE`, so nothing is installed over the image's torch.
#   examples/gpt_moe/install_wheels.sh WHEELS SITE && export PYTHONPATH=SITE:$PYTHONPATH PATH=SITE/bin:$PATH
# PYTHON: the interpreter (default: python3). Checks afterwards that torch is the image's and the plugin imports.
set -eu
wheels=${1:?usage: $0 WHEELS SITE}
site=${2:?usage: $0 WHEELS SITE}
py=${PYTHON:-python3}
if [ ! -f "$wheels/requirements.txt" ]; then
    echo "error: $wheels: not a wheelhouse (no requirements.txt); make one with \`make wheelhouse\` where pip works" >&2
    exit 2
fi
if ! "$py" -c "import torch" 2> /dev/null; then
    echo "error: $py has no torch: the wheelhouse installs the plugin beside the image's torch" >&2
    exit 2
fi
"$py" -m pip install -q --no-index --no-deps --no-cache-dir --target "$site" --find-links "$wheels" \
    -r "$wheels/requirements.txt"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "
import sys, torch, deepspeed, megatron.core, moe_plugin
assert '$site' not in torch.__file__, 'torch came from the wheelhouse'
print(f'installed into $site: moe_plugin {moe_plugin.__version__}, deepspeed {deepspeed.__version__}, '
      f'megatron-core {megatron.core.__version__} beside torch {torch.__version__} ({torch.__file__})')"
