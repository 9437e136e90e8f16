"""The dataplane probes' driver: send every probe at once and watch each arrive (SPEC §7).

``runner`` is the run (``run``, its ``Outcome`` and ``Flow``); it opens the
``capture`` (an ``AF_PACKET`` socket behind a classic BPF filter) and the
``echo`` sockets (ICMP); the ``vantage`` is the namespace the external probes
come from; ``diagnosis`` reads the counters that name a failure's cause.
"""
