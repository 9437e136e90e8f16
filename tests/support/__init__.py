"""What tests share that is not a fixture: the CLI runner, the sandbox host and ``sh``,
traffic, Docker scratch objects, fault injection and kill points, the in-memory host.

Fixtures live in ``conftest.py`` files; test modules import helpers from here, never
from one another.
"""
