"""norm ops: shape/dtype rules and the Graph builder methods (mixed into Graph)."""
from __future__ import annotations

from . import dtypes as dt  # noqa: F401
from .ops import fmt, normalize_axes, normalize_axis  # noqa: F401


class NormOps:
    """Builder methods; self is the Graph (_check, _add, _operand)."""
