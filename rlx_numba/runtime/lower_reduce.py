"""Lowerings of the reduce ops (registered with lower.lowering)."""
from __future__ import annotations

from .lower import Step, lowering, step_name  # noqa: F401
