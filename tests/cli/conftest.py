"""Fixtures of the CLI tests (shared with the simulator tests)."""

from tests.sim.conftest import openb, small_trace

__all__ = ["openb", "small_trace"]
