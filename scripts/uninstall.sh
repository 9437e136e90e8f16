#!/usr/bin/env bash
# Remove what scripts/install.sh installed: its virtualenv and the `reconcile` link. Says
# what it leaves: the state under /var/lib/reconciler (pending changes, revert records),
# the desired state under /etc/reconciler, systemd units you installed, the system
# packages, and everything the reconciler made on the host (run `reconcile destroy`
# first to remove that: after this script there is no `reconcile` to do it).
# Environment: RECONCILER_VENV (/opt/reconciler), RECONCILER_BIN_DIR (/usr/local/bin).
set -euo pipefail
VENV=${RECONCILER_VENV:-/opt/reconciler}
BIN_DIR=${RECONCILER_BIN_DIR:-/usr/local/bin}
MARKER=.installed-by-reconciler
link="$BIN_DIR/reconcile"
removed=0
if [ -L "$link" ] && [ "$(readlink "$link")" = "$VENV/bin/reconcile" ]; then
  rm -f "$link"
  echo "Removed $link."
  removed=1
elif [ -e "$link" ] || [ -L "$link" ]; then
  echo "Left $link: it is not the link install.sh made (to $VENV/bin/reconcile)."
fi
if [ -f "$VENV/$MARKER" ]; then
  rm -rf "$VENV"
  echo "Removed $VENV."
  removed=1
elif [ -d "$VENV" ]; then
  echo "Left $VENV: install.sh did not make it (no $MARKER in it)."
fi
[ "$removed" = 1 ] || echo "Nothing to remove: no install of scripts/install.sh at $VENV."
echo "Left in place (remove them yourself if you want them gone):"
echo "  /var/lib/reconciler: pending changes and revert records"
echo "  /etc/reconciler: your desired state"
echo "  /run/reconciler: locks and sockets (a tmpfs: gone at the next boot)"
for unit in /etc/systemd/system/reconciler.service /etc/systemd/system/reconciler-revert.service; do
  [ -e "$unit" ] && echo "  $unit (systemctl disable --now $(basename "$unit"), then remove it)"
done
echo "  what the reconciler made on the host (bridges, allocations, rules, Docker networks)"
echo "  the system packages install.sh added (iproute2, iptables, nftables, docker.io, git, ...)"
