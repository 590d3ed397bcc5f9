#!/usr/bin/env bash
# Make the interpreter the b12x tests run in (tests/test_b12x.py): b12x 1.5.1, the standalone package
# vLLM 0.34's b12x backends import (pip install vllm[b12x]).
#
#   scripts/make_b12x_venv.sh [VENV_DIR]        (default: .venv-b12x in the checkout)
#   export CUTE_DISKCACHE_B12X_PYTHON="$VENV_DIR/bin/python"
#
# b12x 1.5.1 pins nvidia-cutlass-dsl==4.8.0, which the flashinfer 0.7.4 matrix cell
# (fi0.7.4-dsl4.8.0) already holds with a CPU torch: the venv layers b12x over that cell (a .pth
# line, nothing copied), building the cell first with scripts/compat_matrix.py where it is absent
# (once per machine, shared by every checkout). b12x goes in with
# --no-deps: its torch>=2.12 requirement would let pip pull a multi-GB CUDA build; what it needs
# besides is named here (apache-tvm-ffi exactly as the cell has it). b12x's own site-packages
# entry comes before the cell's, so flashinfer 0.7.4's `b12x` alias package is shadowed by the
# real one. Idempotent; checked and built under flock(1) (the test suite's two workers may both
# ask), and the cell is used only when complete (its stamp), read under the cell's own lock.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-b12x}"
python="${PYTHON:-python3}"
cell="${CUTE_DISKCACHE_B12X_CELL:-${CUTE_DISKCACHE_COMPAT_SCRATCH:-$HOME/.cache/cute-diskcache/compat}/cells/fi0.7.4-dsl4.8.0}"

venv="${venv%/}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --without-pip "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("b12x") != "1.5.1" or m.version("flashinfer-python") != "0.7.4")' 2>/dev/null; then
    if [ -z "${CUTE_DISKCACHE_B12X_CELL:-}" ]; then
        # The cell, built by scripts/compat_matrix.py if absent (under its lock, in the scratch every
        # checkout on this machine shares): flashinfer 0.7.4 included, whose embedded b12x copy is
        # what tests/test_b12x.py tells apart from the standalone package.
        "$python" - "$repo/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import compat_matrix as cm
cm.cell_venv(next(c for c in cm.CELLS if c.name == "fi0.7.4-dsl4.8.0"), cm.DEFAULT_SCRATCH)
PY
    fi
    # The cell as scripts/compat_matrix.py leaves it: its stamp is written last, under its lock.
    [ -n "$(flock "$cell.lock" sh -c '[ -f "$1/compat-cell.json" ] && echo yes || true' sh "$cell")" ] || {
        echo "make_b12x_venv.sh: no complete cell at $cell" >&2; exit 1; }
    cell_site="$("$cell/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$cell_site" > "$site/zz_b12x_cell.pth"
    # The cell's own .pth lines (its base: torch, msgpack, ...) are read from its directory.
    echo "import site; site.addsitedir('$cell_site')" >> "$site/zz_b12x_cell.pth"
    "$python" -m pip --python "$venv/bin/python" install --quiet --no-deps "b12x==1.5.1" \
        "apache-tvm-ffi==0.1.15.post2" rich safetensors msgpack platformdirs filelock
fi
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
import b12x._lib.compiler as c
print("b12x venv ready:", ", ".join(f"{d}=={m.version(d)}" for d in ("b12x", "nvidia-cutlass-dsl", "torch")), "b12x at", c.__file__)
PY
exec 9>&-
echo "export CUTE_DISKCACHE_B12X_PYTHON=$venv/bin/python"
