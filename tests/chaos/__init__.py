"""The fault-injection scenarios ("chaos"), tests at three scales: tests/chaos/test_chaos.py runs the "ci" scale under
pytest, ``python -m tests.chaos`` the short one and ``python -m tests.chaos --full`` (``make chaos``) the full one
(tests/chaos/scenarios.py). docs/reliability.md explains each scenario and its figures."""
