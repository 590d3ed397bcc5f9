#!/usr/bin/env bash
# Make the interpreter the b12x tests run in (tests/test_b12x.py): b12x 1.5.1, the standalone package
# vLLM 0.34's b12x backends import (pip install vllm[b12x]).
#
#   scripts/make_b12x_venv.sh [VENV_DIR]        (default: .venv-b12x in the checkout)
#   export CUTE_DISKCACHE_B12X_PYTHON="$VENV_DIR/bin/python"
#
# b12x 1.5.1 pins nvidia-cutlass-dsl==4.8.0, which the flashinfer 0.7.4 matrix cell
# (fi0.7.4-dsl4.8.0) already holds with a CPU torch: the venv layers b12x over that cell (a .pth
# line, nothing copied) when it exists, else installs the same pins itself. b12x goes in with
# --no-deps: its torch>=2.12 requirement would let pip pull a multi-GB CUDA build; what it needs
# besides is named here (apache-tvm-ffi exactly as the cell has it). b12x's own site-packages
# entry comes before the cell's, so flashinfer 0.7.4's `b12x` alias package is shadowed by the
# real one. Idempotent.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-b12x}"
python="${PYTHON:-python3}"
cell="${CUTE_DISKCACHE_B12X_CELL:-$HOME/.cache/cute-diskcache/compat/cells/fi0.7.4-dsl4.8.0}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --without-pip "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("b12x") != "1.5.1" or m.version("flashinfer-python") != "0.7.4")' 2>/dev/null; then
    if [ -d "$cell" ]; then
        cell_site="$("$cell/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "$cell_site" > "$site/zz_b12x_cell.pth"
        # The cell's own .pth lines (its base: torch, msgpack, ...) are read from its directory.
        echo "import site; site.addsitedir('$cell_site')" >> "$site/zz_b12x_cell.pth"
    else
        # The cell's contents, flashinfer 0.7.4 included (its embedded b12x copy is what
        # tests/test_b12x.py tells apart from the standalone package), on a machine without it.
        "$python" -m pip --python "$venv/bin/python" install --quiet \
            "torch==2.13.0" "flashinfer-python==0.7.4" "nvidia-cutlass-dsl==4.8.0" "nvidia-cutlass-dsl-libs-cu13==4.8.0" \
            cuda-python msgpack platformdirs filelock triton numpy pytest
    fi
    "$python" -m pip --python "$venv/bin/python" install --quiet --no-deps "b12x==1.5.1" \
        "apache-tvm-ffi==0.1.15.post2" rich safetensors msgpack platformdirs filelock
fi
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
import b12x._lib.compiler as c
print("b12x venv ready:", ", ".join(f"{d}=={m.version(d)}" for d in ("b12x", "nvidia-cutlass-dsl", "torch")), "b12x at", c.__file__)
PY
echo "export CUTE_DISKCACHE_B12X_PYTHON=$venv/bin/python"
