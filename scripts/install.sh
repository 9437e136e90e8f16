#!/usr/bin/env bash
# Install everything reconciler needs on Debian (run as root): system packages, then the
# package in its own virtualenv (Debian's python3 is "externally managed": no pip install
# into it), with `reconcile` linked into /usr/local/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
VENV=${RECONCILER_VENV:-/opt/reconciler}
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v iptables-restore >/dev/null || need+=(iptables)
command -v nft >/dev/null || need+=(nftables)
command -v nsenter >/dev/null || need+=(util-linux)
command -v dockerd >/dev/null || need+=(docker.io)
command -v git >/dev/null || need+=(git)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v conntrack >/dev/null || need+=(conntrack)
command -v python3 >/dev/null || need+=(python3)
if [ "${1:-}" = "--test" ]; then
  command -v zsh >/dev/null || need+=(zsh)  # the completion test checks the zsh script
  # the coexistence matrix runs them inside namespaces of its own, never on the machine
  command -v firewalld >/dev/null || need+=(firewalld)
  command -v ufw >/dev/null || need+=(ufw)
  command -v dbus-daemon >/dev/null || need+=(dbus-daemon)
  # promtool checks and unit-tests the shipped alert rules; a prometheus server of the
  # tests' own (127.0.0.1, its own port and storage) scrapes a sandboxed agent
  command -v promtool >/dev/null && command -v prometheus >/dev/null || need+=(prometheus)
  # `reconcile graph`'s DOT is rendered by Graphviz's own dot in the tests
  command -v dot >/dev/null || need+=(graphviz)
fi
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then need+=(python3-venv); fi
if [ "${#need[@]}" -gt 0 ]; then
  # no package may start its service on this machine (firewalld would take over its
  # firewall): invoke-rc.d asks policy-rc.d, and 101 means "not now"
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    guard=1
  fi
  trap '[ -n "$guard" ] && rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [ -n "$guard" ] && rm -f /usr/sbin/policy-rc.d
  guard=""
fi
if [ ! -x "$VENV/bin/pip" ]; then
  python3 -m venv "$VENV"
fi
extra=""
# the tests also draw a small figure with bench/plots.py: matplotlib, the bench extra
[ "${1:-}" = "--test" ] && extra="[test,bench]"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".${extra}"
ln -sf "$VENV/bin/reconcile" /usr/local/bin/reconcile
