"""Scheduler tests: declared topologies, invariants after every action, property-based accounting."""
