# The reconciler agent on every client of a Nomad cluster, driven from git and
# rolled out client by client: the config revision is pinned in the job's meta,
# git-sync checks out exactly that commit, `watch --expect-revision` refuses any
# other, and a check on /readyz gates the rollout (max_parallel = 1). A new commit
# is a new job version, and so a new rollout:
#   nomad job run -var revision=<commit> reconciler.nomad.hcl
# The checkout is not in the allocation directory: Nomad makes /alloc world-writable
# (0777), and the agent refuses config under a directory others can write. Nor may the
# volume take the git-sync image's /git (65533:65533, mode 2775) when Docker fills a new
# volume from the image: every mount of it says no_copy, and the git-perms task makes
# its root root's alone (0755), as the DaemonSet's git-perms step does; a volume an
# earlier version of this job filled is repaired by it too.
# Explained in docs/fleet-with-watch.md. Replace the image and the repo URL.
#
# Nomad version: the update block below gates the rollout on the check (health_check,
# min_healthy_time, healthy_deadline) and reverts a failed one (auto_revert) only for
# Nomad 1.11.0 or later, where system jobs got deployments. Before 1.11 a system job's
# update block enforces max_parallel and stagger only: the check is registered and
# shown (`nomad alloc status`) but does not hold the rollout; add `stagger = "5m"` and
# watch the check, or stop the job by hand.
#
# The Docker driver must allow what the agent needs, in the client's plugin config:
#   plugin "docker" {
#     config {
#       allow_caps = ["audit_write", "chown", "dac_override", "fowner", "fsetid", "kill",
#                     "mknod", "net_bind_service", "setfcap", "setgid", "setpcap",
#                     "setuid", "sys_chroot", "net_raw", "net_admin", "sys_admin",
#                     "net_broadcast"]
#       volumes { enabled = true }     # bind mounts of host paths
#     }
#   }

variable "revision" {
  type        = string
  description = "the commit of the config repo to roll out (a commit id, never a branch)"
  default     = "0123456789abcdef0123456789abcdef01234567"
}

job "reconciler" {
  type        = "system" # one allocation on every eligible client
  datacenters = ["*"]

  # THE revision this job version delivers: a change of it is a new job version, so
  # its allocations are replaced client by client under the update block
  meta {
    revision = var.revision
  }

  # Nomad 1.11+: one client at a time, each must pass its /readyz check for a minute
  # before the next; a client that does not within healthy_deadline fails the
  # deployment, which stops there and reverts the job to the last good version.
  update {
    max_parallel      = 1
    health_check      = "checks"
    min_healthy_time  = "60s"
    healthy_deadline  = "10m"
    progress_deadline = "15m"
    auto_revert       = true
  }

  group "reconciler" {
    network {
      port "status" {
        static = 9477 # the agent listens on the host's loopback (network_mode host)
      }
    }

    # Ready only when the last pass at the pinned revision converged and its probes
    # hold; a native Nomad service (no Consul needed), checked on the host's loopback.
    service {
      provider = "nomad"
      name     = "reconciler"
      port     = "status"
      address  = "127.0.0.1"

      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "5s"
        timeout  = "2s"
      }
    }

    restart {
      attempts = 10
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    # The volume's root, root's alone (0755) before the agent starts: the agent refuses
    # config under a directory others can write (a local user could swap it). Prestart
    # tasks run side by side; the chmod need not come before git-sync's writes, only
    # before the agent, which starts when every prestart task has finished.
    task "git-perms" {
      driver = "docker"
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }
      user = "0"
      config {
        image   = "registry.example.com/reconciler:0.1.0" # the agent's image: it has a shell
        command = "/bin/sh"
        args    = ["-c", "chown 0:0 /git && chmod 0755 /git"]
        mount {
          type   = "volume"
          source = "reconciler-git"
          target = "/git"
          volume_options {
            no_copy = true # never filled from an image's /git
          }
        }
      }
    }

    # The checkout of exactly the pinned commit, before the agent starts. No sidecar
    # pulling a branch: that would deliver every commit to every client at once,
    # around the rollout; the next revision comes with the next job version.
    task "git-clone" {
      driver = "docker"
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }
      user = "0" # root-owned files: the agent refuses files others own
      config {
        image = "registry.k8s.io/git-sync/git-sync:v4.2.4"
        args = ["--repo=https://git.example.com/infra/host-networking.git",
                "--ref=${NOMAD_META_revision}", "--root=/git", "--link=repo", "--one-time"]
        mount {
          type   = "volume"
          source = "reconciler-git" # a named volume: root's, 0755 (git-perms)
          target = "/git"
          volume_options {
            no_copy = true # not filled from git-sync's /git (65533:65533, mode 2775)
          }
        }
      }
    }

    task "reconciler" {
      driver       = "docker"
      kill_signal  = "SIGTERM" # finishes the change in progress, then exits 0
      kill_timeout = "90s"

      config {
        image        = "registry.example.com/reconciler:0.1.0" # built by scripts/build-image.sh
        network_mode = "host"  # act on the host's network namespace
        pid_mode     = "host"  # lets the agent check /run/netns propagation against pid 1
        # net_broadcast: the plan agent hears every allocation namespace's netlink events
        cap_add      = ["net_admin", "sys_admin", "net_broadcast"]
        # No AppArmor profile (it forbids mount), and a writable /proc/sys for ip_forward.
        security_opt = ["apparmor=unconfined", "systempaths=unconfined"]
        args = ["watch", "/git/repo/fleet",
                "--hostname=${node.unique.name}",            # what files' `hosts:` patterns match
                "--expect-revision=${NOMAD_META_revision}", # any other checkout: refused, not ready
                "--interval=30", "--log-format=json",
                "--status-addr=127.0.0.1:${NOMAD_PORT_status}"]

        mount {
          type     = "volume"
          source   = "reconciler-git"
          target   = "/git"
          readonly = true
          volume_options {
            no_copy = true
          }
        }
        # Allocation namespaces must be visible on the host: shared propagation.
        mount {
          type   = "bind"
          source = "/run/netns"
          target = "/run/netns"
          bind_options {
            propagation = "rshared"
          }
        }
        # One writer per host, shared with a `reconcile apply` run on the host.
        mount {
          type   = "bind"
          source = "/run/reconciler"
          target = "/run/reconciler"
        }
        # Pending changes and revert records: must survive the allocation and a reboot
        # (not under /run, a tmpfs).
        mount {
          type   = "bind"
          source = "/var/lib/reconciler"
          target = "/var/lib/reconciler"
        }
        # Only needed for docker_networks.
        mount {
          type   = "bind"
          source = "/var/run/docker.sock"
          target = "/var/run/docker.sock"
        }
      }

      resources {
        cpu    = 100
        memory = 128
      }
    }
  }
}
