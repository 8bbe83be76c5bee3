"""The chaos harness: fault scenarios on real processes and real nats-servers.

``python -m tests.chaos`` (``nox -s chaos``) runs every registered scenario and prints
one table; see docs/reliability.rst. Scenario modules are ``tests/chaos/scenarios_*.py``
(found at run time, so each adds itself without a shared list).
"""
