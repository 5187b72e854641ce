#!/usr/bin/env bash
# ./run.sh train [args]   set up, then train the default model (MLP on digits) on the GPU/lavapipe
# ./run.sh test  [args]   set up with test extras, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/meganeura-xdg-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
cmd="${1:-train}"; shift || true
case "$cmd" in
  train) bash scripts/setup.sh && exec .venv/bin/meganeura train "$@" ;;
  test)  bash scripts/setup.sh --test && .venv/bin/ruff check src tests bench && exec .venv/bin/python -m pytest "$@" ;;
  *) echo "usage: ./run.sh train|test [args]" >&2; exit 2 ;;
esac
