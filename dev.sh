#!/usr/bin/env bash
# Set-up and entry points for fxnx. Run from anywhere:
#   ./dev.sh demo            install everything, convert ResNet-18, write out/resnet18.pkl, print its summary
#   ./dev.sh test [ARGS...]  install everything, run ruff, mypy and the whole test suite (ARGS go to pytest)
#   ./dev.sh bench           install everything, run the benchmark scripts
# The virtual environment (.venv, or $FXNX_VENV) is reused when it is complete and up to date;
# it is installed with constraints/dev.txt, the exact torch builds development and CI use.
set -euo pipefail
cd "$(dirname "$0")"

VENV=${FXNX_VENV:-.venv}
PYTHON=${PYTHON:-python3}

need_graphviz() {
    command -v dot >/dev/null 2>&1 && return 0
    echo "dev.sh: installing Graphviz (Debian package graphviz) for rendering" >&2
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null
    elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null
    else
        echo "dev.sh: cannot install Graphviz here; install it yourself (the 'dot' command)." >&2
        echo "        Rendering tests will be skipped until then." >&2
    fi
}

need_venv() {
    # The stamp records what the venv was built from; a changed pyproject.toml rebuilds it.
    local stamp="$VENV/.fxnx-stamp" want
    want=$(cat pyproject.toml constraints/dev.txt dev.sh | sha256sum | cut -d' ' -f1)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    echo "dev.sh: building the virtual environment in $VENV (torch is large: a few minutes)" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints/dev.txt \
        -e ".[test,bench]" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -c "import fxnx, torch, torchvision, networkx, pydot, pytest, matplotlib, torchview, timm, transformers, sklearn, sphinx, nbclient, ipykernel, hypothesis, mypy" \
        || { echo "dev.sh: the install failed; see the pip output above" >&2; exit 1; }
    echo "$want" > "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    demo)
        need_graphviz; need_venv
        exec "$VENV/bin/fxnx" convert resnet18 --input-shape 1,3,224,224 -o out/resnet18.pkl "$@"
        ;;
    test)
        need_graphviz; need_venv
        echo "dev.sh: ruff check (style, as configured in pyproject.toml)" >&2
        "$VENV/bin/ruff" check .
        echo "dev.sh: mypy fxnx (types, as configured in pyproject.toml)" >&2
        "$VENV/bin/mypy" fxnx
        exec "$VENV/bin/python" -m pytest -n 2 "$@"
        ;;
    bench)
        need_graphviz; need_venv
        exec "$VENV/bin/python" scripts/bench.py "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo | test [pytest args] | bench" >&2
        exit 2
        ;;
esac
