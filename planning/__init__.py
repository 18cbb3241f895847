"""Capacity planning from measured costs: per-step and KV-transfer cost models now, a simulator
and a planner on top of them later.

Plain Python and numpy only: the torch-free coordinator imports this package, so nothing here may
load torch, Ray, the engine or the kernels (a contract in pyproject.toml checks it).
"""
