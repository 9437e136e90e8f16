#!/usr/bin/env bash
# Render the example graphs in docs/ from the built-in example (examples/quickstart.yaml),
# in a throwaway network namespace, never the host (as root; needs Graphviz's dot):
#   docs/graph-quickstart-plan.png  `reconcile graph --plan` before the first apply
#   docs/graph-quickstart-host.png  `reconcile graph` of the sandbox after it
# Usage: bash scripts/docs-graph.sh   (RECONCILE="python3 -m reconciler" to run a checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
RECONCILE=${RECONCILE:-reconcile}
ns="docs-graph-$$"
ip netns add "$ns"
trap '$RECONCILE --netns "$ns" destroy --yes >/dev/null 2>&1 || true; ip netns del "$ns"' EXIT
ip -n "$ns" link set lo up
$RECONCILE --netns "$ns" graph --plan examples/quickstart.yaml 2>/dev/null \
  | dot -Tpng -o docs/graph-quickstart-plan.png
$RECONCILE --netns "$ns" apply --no-probe examples/quickstart.yaml >/dev/null
$RECONCILE --netns "$ns" graph | dot -Tpng -o docs/graph-quickstart-host.png
echo "wrote docs/graph-quickstart-plan.png docs/graph-quickstart-host.png"
