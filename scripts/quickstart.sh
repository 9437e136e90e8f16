#!/usr/bin/env bash
# Install everything, then plan, apply, verify, show and tear down the built-in example
# inside a throwaway network namespace: the host's own network is never touched.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
example=${1:-examples/quickstart.yaml}
ns="reconciler-demo-$$"
ip netns add "$ns"
trap 'reconcile --netns "$ns" destroy --yes >/dev/null 2>&1 || true; ip netns del "$ns" 2>/dev/null || true' EXIT
ip -n "$ns" link set lo up
echo "== reconcile plan $example   (in network namespace $ns)"
reconcile --netns "$ns" plan "$example" || [ $? -eq 2 ]
echo "== reconcile apply $example"
reconcile --netns "$ns" apply "$example"
echo "== reconcile verify: the config matches and packets flow (probes)"
reconcile --netns "$ns" verify "$example"
echo "== reconcile show"
reconcile --netns "$ns" show
echo "== reconcile plan again: nothing to do"
reconcile --netns "$ns" plan "$example"
echo "== reconcile destroy"
reconcile --netns "$ns" destroy --yes
