#!/usr/bin/env bash
# Build the reconciler image where no image registry is reachable (run as root):
#   1. debootstrap a minimal Debian from the mirror apt already uses on this machine,
#   2. `docker import` it as the base image (skipped when that image already exists),
#   3. `docker build` the Containerfile on that base.
# Environment: BASE_IMAGE (reconciler-base:bookworm), IMAGE (reconciler:dev), SUITE (bookworm),
# MIRROR (default: read from /etc/apt/sources.list*), REBUILD_BASE=1 to debootstrap again,
# PIP_IN_IMAGE=1 to let pip inside the build fetch from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE=${SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-reconciler-base:$SUITE}
IMAGE=${IMAGE:-reconciler:dev}
PACKAGES=python3,python3-venv,iproute2,iptables,nftables,git
cleanup=()
trap 'rm -rf "${cleanup[@]}"' EXIT

# The first Debian archive URI apt uses for $SUITE itself (not -updates or -security).
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$SUITE" '
      BEGIN { RS = ""; FS = "\n" }
      {
        uris = ""; ok = 0; types = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) types = 1
          if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
          if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1 }
        }
        if (types && ok && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit }
      }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk -v suite="$SUITE" '$1 == "deb" {
        i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { print $i; exit } }'
  return 0
}

if [ "${REBUILD_BASE:-0}" != 1 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "== base image $BASE_IMAGE exists; not bootstrapping again (REBUILD_BASE=1 forces it)"
else
  command -v debootstrap >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  mirror=${MIRROR:-$(apt_mirror | head -n1 || true)}
  if [ -z "$mirror" ]; then
    echo "cannot find the Debian mirror for $SUITE in /etc/apt/sources.list*; set MIRROR=" >&2
    exit 1
  fi
  rootfs=$(mktemp -d /var/tmp/reconciler-rootfs.XXXXXX)
  cleanup+=("$rootfs")
  echo "== debootstrap $SUITE from $mirror"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || { tail -30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  # What a -slim image leaves out: package caches, lists, docs, man pages, locales.
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
  find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' \
    -exec rm -rf {} + 2>/dev/null || true
  echo "== docker import $BASE_IMAGE"
  tar --numeric-owner -C "$rootfs" -c . \
    | docker import --change 'CMD ["/bin/bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$BASE_IMAGE" >/dev/null
fi

# By default the wheels are built here, with this machine's pip configuration (proxies, CA
# certificates, mirrors), and the build installs only those: no network inside the build.
# PIP_IN_IMAGE=1 lets pip inside the build fetch from PyPI instead.
rm -rf wheelhouse
if [ "${PIP_IN_IMAGE:-0}" != 1 ]; then
  echo "== pip wheel . (and its dependencies) into wheelhouse/"
  cleanup+=(wheelhouse)
  py=python3
  [ -x "${RECONCILER_VENV:-/opt/reconciler}/bin/python" ] && py="${RECONCILER_VENV:-/opt/reconciler}/bin/python"
  "$py" -m pip wheel -q --disable-pip-version-check -w wheelhouse .
  ls wheelhouse/reconciler-*.whl >/dev/null
fi

echo "== docker build $IMAGE (base $BASE_IMAGE)"
docker build -q --network host --build-arg BASE="$BASE_IMAGE" -t "$IMAGE" -f Containerfile . >/dev/null
docker image ls "$IMAGE" --format '== built {{.Repository}}:{{.Tag}} ({{.Size}})'
