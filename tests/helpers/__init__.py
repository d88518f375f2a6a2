"""Helpers that test modules share: a test module imports from here, conftest.py or fakes.py, never another one."""
