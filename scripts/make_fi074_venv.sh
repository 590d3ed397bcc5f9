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
#
# Two parts, so a fresh clone does not pay for the packages again:
# - the packages (torch, flashinfer 0.7.4, the DSL, ~1 min to install) in a venv shared by every
#   checkout on this machine, $CUTE_DISKCACHE_VENV_CACHE (default ~/.cache/cute-diskcache/venvs),
#   named by a hash of the pins and the interpreter, built once;
# - VENV_DIR: a thin venv of this checkout that reads that one's site-packages (a .pth line) and
#   holds this checkout as an editable install (seconds).
# Both are checked and built under flock(1): the test suite runs on two workers, and several of
# its modules call this script; one builds, the others wait and find it done. Idempotent.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-fi074}"
venv="${venv%/}"
python="${PYTHON:-python3}"
cache="${CUTE_DISKCACHE_VENV_CACHE:-$HOME/.cache/cute-diskcache/venvs}"
pins=("torch==2.13.0" "flashinfer-python==0.7.4" "nvidia-cutlass-dsl==4.8.1"
      triton msgpack platformdirs tqdm huggingface_hub pytest pytest-timeout filelock)
tag="$({ printf '%s\n' "${pins[@]}"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"
base="$cache/fi074-$tag"
mkdir -p "$cache" "$(dirname "$venv")"

{
    flock 9
    if [ ! -f "$base/cdc-complete" ]; then
        rm -rf "$base"
        "$python" -m venv --without-pip "$base"
        "$python" -m pip --python "$base/bin/python" install --quiet --disable-pip-version-check "${pins[@]}"
        printf '%s\n' "${pins[@]}" > "$base/cdc-complete"
    fi
} 9>"$base.lock"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

{
    flock 9
    if [ "$(cat "$venv/cdc-base" 2>/dev/null)" != "$base_site" ] || [ ! -x "$venv/bin/python" ]; then
        rm -rf "$venv"
        "$python" -m venv --without-pip "$venv"
        site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        # Read first (00-): the package's own start-up hook, read next, may import its dependencies.
        # addsitedir also reads the shared venv's own .pth files.
        echo "import site; site.addsitedir('$base_site')" > "$site/00-cdc-fi074-base.pth"
        echo "$base_site" > "$venv/cdc-base"
    fi
    # This checkout, editable: refreshed only when the venv imports cute_diskcache from elsewhere.
    if ! (cd / && "$venv/bin/python" -c 'import cute_diskcache, sys; sys.exit(not cute_diskcache.__file__.startswith(sys.argv[1] + "/"))' "$repo") 2>/dev/null; then
        "$python" -m pip --python "$venv/bin/python" install --quiet --disable-pip-version-check --no-deps -e "$repo"
    fi
} 9>"$venv.lock"

"$venv/bin/python" - <<'PY'
import importlib.metadata as m
print("fi074 venv ready:", ", ".join(f"{d}=={m.version(d)}" for d in ("flashinfer-python", "nvidia-cutlass-dsl", "torch")))
PY
echo "export CUTE_DISKCACHE_FI074_PYTHON=$venv/bin/python"
