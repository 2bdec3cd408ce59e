#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at <repo>/.venv and install shardkit into it.
#
# Use it directly (./scripts/setup_env.sh) or source it from another script; after sourcing,
# SHARDKIT_ROOT is the repository root and SHARDKIT_PYTHON the venv's python.
#
# torch is installed first, pinned, so pip picks the CPU wheel available on this machine
# instead of resolving an unpinned torch to a multi-GB CUDA build. Then `pip install -e
# '.[test,docs]'`. pip prints what it collects, downloads and installs as it goes (no --quiet):
# a fresh set-up downloads some 130 packages and takes minutes. A stamp file in .venv records a hash of the packaging files; while it matches,
# nothing is reinstalled, so repeated runs cost a few milliseconds.
#
# Environment overrides:
#   SHARDKIT_PYTHON_BIN  interpreter used to create the venv (default: python3.11, else python3)
#   SHARDKIT_TORCH       torch requirement installed first (default: torch==2.13.0)
#   SHARDKIT_FORCE_SETUP=1  reinstall even if the stamp matches

_shardkit_setup_env() {
    local root venv python_bin torch_spec stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    torch_spec="${SHARDKIT_TORCH:-torch==2.13.0}"
    stamp="$venv/.shardkit-setup-stamp"

    if [ ! -x "$venv/bin/python" ]; then
        python_bin="${SHARDKIT_PYTHON_BIN:-}"
        if [ -z "$python_bin" ]; then
            if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
        fi
        echo "setup_env: creating $venv with $python_bin" >&2
        "$python_bin" -m venv "$venv" || return 1
    fi

    want="$(cat "$root/setup.cfg" "$root/pyproject.toml" 2>/dev/null \
            | { cat; echo "$torch_spec"; "$venv/bin/python" -VV; } | sha256sum | cut -d' ' -f1)"
    if [ "${SHARDKIT_FORCE_SETUP:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        SHARDKIT_ROOT="$root"
        SHARDKIT_PYTHON="$venv/bin/python"
        return 0
    fi

    echo "setup_env: installing $torch_spec, then shardkit[test,docs] (editable) into $venv" >&2
    echo "setup_env: the first time, about 1.8 GB and a few minutes (pip's progress follows)" >&2
    "$venv/bin/python" -m pip install --progress-bar on "$torch_spec" >&2 || return 1
    (cd "$root" && "$venv/bin/python" -m pip install --progress-bar on -e '.[test,docs]' >&2) || return 1
    echo "$want" >"$stamp"
    SHARDKIT_ROOT="$root"
    SHARDKIT_PYTHON="$venv/bin/python"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    _shardkit_setup_env
    echo "setup_env: ready ($SHARDKIT_PYTHON)"
else
    _shardkit_setup_env || return 1
    export SHARDKIT_ROOT SHARDKIT_PYTHON
fi
