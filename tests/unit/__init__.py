"""Unit tier: pure tests, seconds each, no process of the job started (``python -m pytest -q tests/unit``: the
default while developing, under 3 minutes on 2 cores)."""
