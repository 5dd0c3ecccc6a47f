"""The control plane: the controller and its loop, the state store, the fleet, sizing, slices and the replica
launchers (local processes, Ray).
"""
