"""Rollout engines: the ``Engine`` protocol and its implementations."""
