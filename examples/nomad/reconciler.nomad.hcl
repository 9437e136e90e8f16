# The reconciler agent on every client of a Nomad cluster, driven from git: a
# git-sync sidecar keeps a checkout of your config repo in a Docker volume the tasks
# share, and `reconcile watch` keeps the host's networking converged with it. Not in
# the allocation directory: Nomad makes /alloc world-writable (0777), and the agent
# refuses config under a directory others can write.
# Explained in docs/fleet-with-watch.md. Replace the image and the repo URL.
#
# The Docker driver must allow what the agent needs, in the client's plugin config:
#   plugin "docker" {
#     config {
#       allow_caps = ["audit_write", "chown", "dac_override", "fowner", "fsetid", "kill",
#                     "mknod", "net_bind_service", "setfcap", "setgid", "setpcap",
#                     "setuid", "sys_chroot", "net_raw", "net_admin", "sys_admin"]
#       volumes { enabled = true }     # bind mounts of host paths
#     }
#   }

job "reconciler" {
  type        = "system" # one allocation on every eligible client
  datacenters = ["*"]

  group "reconciler" {
    restart {
      attempts = 10
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    # The first checkout, before the agent starts.
    task "git-clone" {
      driver = "docker"
      lifecycle {
        hook    = "prestart"
        sidecar = false
      }
      user = "0" # root-owned files: the agent refuses files others own
      config {
        image = "registry.k8s.io/git-sync/git-sync:v4.2.4"
        args = ["--repo=https://git.example.com/infra/host-networking.git", "--ref=main",
                "--root=/git", "--link=repo", "--one-time"]
        mount {
          type   = "volume"
          source = "reconciler-git" # a named volume: root's, 0755
          target = "/git"
        }
      }
    }

    # Keeps /git/repo up to date; the agent's file watch picks up each change.
    task "git-sync" {
      driver = "docker"
      lifecycle {
        hook    = "prestart"
        sidecar = true
      }
      user = "0"
      config {
        image = "registry.k8s.io/git-sync/git-sync:v4.2.4"
        args = ["--repo=https://git.example.com/infra/host-networking.git", "--ref=main",
                "--root=/git", "--link=repo", "--period=30s"]
        mount {
          type   = "volume"
          source = "reconciler-git"
          target = "/git"
        }
      }
      resources {
        cpu    = 20
        memory = 64
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
        cap_add      = ["net_admin", "sys_admin"]
        # No AppArmor profile (it forbids mount), and a writable /proc/sys for ip_forward.
        security_opt = ["apparmor=unconfined", "systempaths=unconfined"]
        args = ["watch", "/git/repo/fleet",
                "--hostname=${node.unique.name}", # what files' `hosts:` patterns match
                "--interval=30", "--log-format=json", "--status-addr=127.0.0.1:9477"]

        mount {
          type     = "volume"
          source   = "reconciler-git"
          target   = "/git"
          readonly = true
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
