#!/usr/bin/env bash
# Make the interpreter the SGLang tests run in (tests/test_sglang.py): SGLang 0.5.23 over its own
# flashinfer and DSL pins, with a CPU torch.
#
#   scripts/make_sglang_venv.sh [VENV_DIR]      (default: sglang-0.5.23 beside the compat cells,
#                                               outside any checkout: built once per machine)
#   export CUTE_DISKCACHE_SGLANG_PYTHON="$VENV_DIR/bin/python"
#
# SGLang 0.5.23 pins flashinfer_python[cu13]==0.7.2 and nvidia-cutlass-dsl[cu13]==4.8.0: the
# compatibility matrix's SGLang cell (fi0.7.2-dsl4.8.0, a CPU torch) holds exactly those, so the
# venv layers SGLang over that cell (a .pth line, nothing copied), building the cell first with
# scripts/compat_matrix.py where it is absent (once per machine, shared by every checkout).
# SGLang's wheel requires torch==2.14.1, a CUDA build here (gigabytes), so SGLang and everything
# below go in with --no-deps: what importing its FA4 interface and its SM12x entry points needs
# on a CPU box (found by importing them), at the versions measured to work, plus SGLang's own
# exact pins that touch compiled code (quack-kernels, apache-tvm-ffi). Idempotent; checked and
# built under flock(1) (the test suite's two workers may both ask).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scratch="${CUTE_DISKCACHE_COMPAT_SCRATCH:-$HOME/.cache/cute-diskcache/compat}"
venv="${1:-$scratch/sglang-0.5.23}"
python="${PYTHON:-python3}"
cell="${CUTE_DISKCACHE_SGLANG_CELL:-$scratch/cells/fi0.7.2-dsl4.8.0}"
# SGLang's pins (its wheel's metadata) and the import-time dependencies of the modules the tests drive.
pins=("sglang==0.5.23" "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.11")
imports=(orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0
         pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 ipython==9.19.1 traitlets==5.16.1 pygments==2.21.0
         typing_inspection==0.4.5 aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4
         aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 safetensors==0.8.0)

venv="${venv%/}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --without-pip "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
stamp="$venv/sglang-venv.txt"  # what was installed: a list that grew since reinstalls the lot
if [ "$(cat "$stamp" 2>/dev/null)" != "${pins[*]} ${imports[*]}" ]; then
    if [ -z "${CUTE_DISKCACHE_SGLANG_CELL:-}" ]; then
        "$python" - "$repo/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import compat_matrix as cm
cm.cell_venv(next(c for c in cm.CELLS if c.name == "fi0.7.2-dsl4.8.0"), cm.DEFAULT_SCRATCH)
PY
    fi
    [ -n "$(flock "$cell.lock" sh -c '[ -f "$1/compat-cell.json" ] && echo yes || true' sh "$cell")" ] || {
        echo "make_sglang_venv.sh: no complete cell at $cell" >&2; exit 1; }
    cell_site="$("$cell/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # Lowest priority: the venv's own packages (SGLang's tvm-ffi pin) shadow the cell's.
    echo "import site; site.addsitedir('$cell_site')" > "$site/zz_sglang_cell.pth"
    "$python" -m pip --python "$venv/bin/python" install --quiet --no-deps "${pins[@]}" "${imports[@]}"
    echo "${pins[*]} ${imports[*]}" > "$stamp"
fi
"$venv/bin/python" -c "import sglang.kernels.jit.cute_aot_cache, sglang.srt.arg_groups.cuda_graph_hook"  # its package, and what prewarm imports
exec 9>&-
"$venv/bin/python" -c 'import importlib.metadata as m; print("sglang venv ready:", ", ".join(f"{d}=={m.version(d)}" for d in ("sglang", "flashinfer-python", "nvidia-cutlass-dsl", "apache-tvm-ffi", "torch")))'
echo "export CUTE_DISKCACHE_SGLANG_PYTHON=$venv/bin/python"
