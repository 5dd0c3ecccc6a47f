"""Replicas on a Ray cluster: the launcher, the node inventory, the replica actor, a local cluster for tests."""
