"""reconciler: declarative, GitOps-style reconciler for Linux host networking."""

__version__ = "0.1.0"
