"""Invariants of the ``partitioned`` and ``scheduled`` phases (owned by the planner)."""

from harts.ir.nodes import Module


def verify_partitioned(module: Module) -> None:
    """Placeholder until the planner lands; replaced by the real checks."""


def verify_scheduled(module: Module) -> None:
    """Placeholder until the planner lands; replaced by the real checks."""
