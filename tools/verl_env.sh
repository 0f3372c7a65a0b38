#!/usr/bin/env bash
# Builds .venv-verl/, the environment tests/test_verl.py runs verl 0.9.1 in (its pins clash with the main one's
# [torchrl] extra). The venv sits on top of the main environment (CI's, with this checkout installed:
# --system-site-packages), so the venv's packages win where both have one (tensordict 0.10, transformers < 5.11) and
# the rest (torch, ray, TransferQueue, this checkout) is not installed twice, which takes minutes. (Where the main
# python is itself a venv, its base has none of them, and they are installed here: slower, same result.) Then
# torch 2.13.0 (already there, or the CPU build from local disk), tests/verl/requirements.txt under
# tests/verl/constraints.txt (nothing may pull another torch), verl with --no-deps, and an import of verl's v1
# ReplayBuffer and trainer. Never fails: success leaves .venv-verl/READY; a failure leaves .venv-verl/FAILED
# saying which step stopped and why, and tests/test_verl.py skips with that text.
# Usage: tools/verl_env.sh [python]   (the main environment's python; default: python)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-verl
PY=${1:-python}
rm -rf "$VENV"
log=$(mktemp)

step() {  # step NAME COMMAND...: run it; on failure write FAILED (the step and its last lines) and stop
    local name=$1; shift
    if ! "$@" >"$log" 2>&1; then
        mkdir -p "$VENV"
        { echo "verl environment not built: $name failed ($*):"; grep -v '^WARNING: Location' "$log" | tail -n 15; } \
            >"$VENV/FAILED"
        cat "$VENV/FAILED"
        rm -f "$log"
        exit 0
    fi
}

start=$SECONDS
step "creating the virtual environment" "$PY" -m venv --system-site-packages "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
step "installing torch 2.13.0" "${pip[@]}" torch==2.13.0
step "installing tests/verl/requirements.txt" "${pip[@]}" -c tests/verl/constraints.txt -r tests/verl/requirements.txt
step "installing verl 0.9.1 (--no-deps)" "${pip[@]}" --no-deps verl==0.9.1
step "importing verl's v1 ReplayBuffer and trainer" "$VENV/bin/python" -c \
    "import verl.trainer.ppo.v1.replay_buffer, verl.trainer.ppo.v1.trainer_base, diskreplay.integrations.transferqueue"
"$VENV/bin/python" -c "import torch, verl, transfer_queue as tq, tensordict as td, transformers as t
print('torch', torch.__version__, 'verl', verl.__version__, 'transferqueue', tq.__version__, 'tensordict',
      td.__version__, 'transformers', t.__version__)" >"$VENV/READY" 2>/dev/null
echo "verl environment built in $((SECONDS - start)) s: $(cat "$VENV/READY")"
rm -f "$log"
