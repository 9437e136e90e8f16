#!/usr/bin/env bash
# Install reconciler on Debian (as root): the system packages it needs, then a wheel built
# from this checkout into its own virtualenv (Debian's python3 is "externally managed": no
# pip install into it), with `reconcile` linked into /usr/local/bin.
#
#   bash scripts/install.sh              install, or upgrade to this checkout (run it again
#                                        after `git pull`); the checkout can then go
#   bash scripts/install.sh --dev        an editable install of this checkout instead, for
#                                        working on the project (it needs the checkout)
#   bash scripts/install.sh --test       --dev, with the test and bench extras and the tools
#                                        the tests use (what scripts/test.sh runs)
#   bash scripts/install.sh --uninstall  remove what it installed (scripts/uninstall.sh)
#
# Environment: RECONCILER_VENV (/opt/reconciler), RECONCILER_BIN_DIR (/usr/local/bin: where
# the `reconcile` link goes), RECONCILER_SYSTEM_PACKAGES=0 (skip apt-get: everything is
# there already). Running it twice changes nothing the second time but the package's files.
# docs/install.md: a fresh host with systemd, upgrades, uninstalling.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
VENV=${RECONCILER_VENV:-/opt/reconciler}
BIN_DIR=${RECONCILER_BIN_DIR:-/usr/local/bin}
#: written into the venv: what uninstall.sh removes is what this script made
MARKER=.installed-by-reconciler
mode=wheel
case "${1:-}" in
  "") ;;
  --dev) mode=dev ;;
  --test) mode=test ;;
  --uninstall) exec bash scripts/uninstall.sh ;;
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install.sh: unknown option $1 (--dev, --test, --uninstall)" >&2; exit 1 ;;
esac

need=()
command -v ip >/dev/null || need+=(iproute2)
command -v iptables-restore >/dev/null || need+=(iptables)
command -v nft >/dev/null || need+=(nftables)
ldconfig -p 2>/dev/null | grep -q "libnftables.so.1 " || need+=(libnftables1)  # in-process nft
command -v nsenter >/dev/null || need+=(util-linux)
command -v dockerd >/dev/null || need+=(docker.io)
command -v git >/dev/null || need+=(git)
command -v python3 >/dev/null || need+=(python3)
if [ "$mode" = test ]; then
  [ -x /bin/busybox ] || need+=(busybox-static)  # the tests' container image
  command -v conntrack >/dev/null || need+=(conntrack)
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
  # docs/workloads.md's podman way is tried in an allocation (a store of the test's own)
  command -v podman >/dev/null || need+=(podman)
fi
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then need+=(python3-venv); fi
if [ "${#need[@]}" -gt 0 ] && [ "${RECONCILER_SYSTEM_PACKAGES:-1}" != 0 ]; then
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
touch "$VENV/$MARKER"
pip=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
if [ "$mode" = wheel ]; then
  # A wheel of this checkout, not an editable install: the venv keeps working when the
  # checkout moves or goes, and the next run on a newer checkout replaces it (the same
  # version number too: --force-reinstall, of the package alone; its dependencies are
  # installed or kept by the first call).
  dist=$(mktemp -d)
  trap 'rm -rf "$dist"' EXIT
  "${pip[@]}" wheel --no-deps -w "$dist" .
  wheel=("$dist"/reconciler-*.whl)
  "${pip[@]}" install "${wheel[0]}"
  "${pip[@]}" install --force-reinstall --no-deps "${wheel[0]}"
else
  extra=""
  # the tests also draw a small figure with bench/plots.py: matplotlib, the bench extra
  [ "$mode" = test ] && extra="[test,bench]"
  "${pip[@]}" install -e ".${extra}"
fi
mkdir -p "$BIN_DIR"
ln -sfn "$VENV/bin/reconcile" "$BIN_DIR/reconcile"
how="from a wheel of $(pwd)"
[ "$mode" = wheel ] || how="editable: it runs $(pwd), which must stay"
echo "Installed $("$BIN_DIR/reconcile" --version) in $VENV ($how); $BIN_DIR/reconcile links to it."
