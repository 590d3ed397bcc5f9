#!/usr/bin/env bash
# Make the second interpreter the flashinfer-0.7.4 tests run in (tests/test_flashinfer_074.py).
#
#   scripts/make_fi074_venv.sh [VENV_DIR]        (default: .venv-fi074 in the checkout)
#   export CUTE_DISKCACHE_FI074_PYTHON="$VENV_DIR/bin/python"
#
# It uses pip's ordinary configuration (index, find-links, constraints), so it works offline
# wherever the main install does. flashinfer 0.7.4 requires nvidia-cutlass-dsl >= 4.8.0; the
# same 4.8.1 as the main environment is pinned so both flashinfer versions are tested against
# one DSL. torch is pinned exactly: an open spec would pull a multi-GB CUDA build.
# Idempotent: an existing venv that already has flashinfer 0.7.4 is only refreshed for this
# checkout (editable install of cute-diskcache).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-fi074}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("flashinfer-python") != "0.7.4")' 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet \
        "torch==2.13.0" "flashinfer-python==0.7.4" "nvidia-cutlass-dsl==4.8.1" \
        triton msgpack platformdirs tqdm huggingface_hub pytest pytest-timeout filelock
fi
"$venv/bin/python" -m pip install --quiet --no-deps -e "$repo"
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
print("fi074 venv ready:", ", ".join(f"{d}=={m.version(d)}" for d in ("flashinfer-python", "nvidia-cutlass-dsl", "torch")))
PY
echo "export CUTE_DISKCACHE_FI074_PYTHON=$venv/bin/python"
