#!/usr/bin/env bash
# Start dockerd in the background unless one already answers (tests need a real engine).
set -u
if timeout 5 docker info >/dev/null 2>&1; then exit 0; fi
nohup dockerd >/var/log/reconciler-ci-dockerd.log 2>&1 &
for _ in $(seq 1 60); do
  if timeout 5 docker info >/dev/null 2>&1; then exit 0; fi
  sleep 1
done
echo "dockerd did not start; see /var/log/reconciler-ci-dockerd.log" >&2
tail -20 /var/log/reconciler-ci-dockerd.log >&2
exit 1
