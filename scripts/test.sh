#!/usr/bin/env bash
# Run the whole test suite (as root: the integration tests use the real kernel,
# iptables and dockerd, each inside network namespaces of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
bash scripts/start-dockerd.sh
VENV=${RECONCILER_VENV:-/opt/reconciler}
"$VENV/bin/ruff" check reconciler tests bench scripts
"$VENV/bin/mypy"
"$VENV/bin/lint-imports" --no-cache  # the layer contract (.importlinter)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
