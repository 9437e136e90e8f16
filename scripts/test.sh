#!/usr/bin/env bash
# Run the whole test suite (as root: the integration tests use the real kernel,
# iptables and dockerd, each inside network namespaces of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
bash scripts/start-dockerd.sh
ruff check reconciler tests bench scripts
mypy
python3 -m pytest -q -p no:cacheprovider "$@" tests
