#!/usr/bin/env bash
# Install everything reconciler needs on Debian (run as root): system packages and the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v iptables-restore >/dev/null || need+=(iptables)
command -v nft >/dev/null || need+=(nftables)
command -v nsenter >/dev/null || need+=(util-linux)
command -v dockerd >/dev/null || need+=(docker.io)
command -v git >/dev/null || need+=(git)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v conntrack >/dev/null || need+=(conntrack)
command -v python3 >/dev/null || need+=(python3 python3-pip python3-venv)
if [ "${#need[@]}" -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".${extra}" 2>&1 \
  | grep -v -e "Location 'file" -e "^WARNING: Running pip" || true
