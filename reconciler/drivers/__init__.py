"""Drivers: the only layer that talks to the kernel, iptables and Docker."""
