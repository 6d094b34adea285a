"""cross_entropy: its OpDefs (ir/opdef.py), argument checks, the Graph builder method (mixed
into Graph) and its VJP.
Kernels: kernels/loss.py; lowering: runtime/lower_loss.py.

``cross_entropy(logits, labels, ...)`` becomes, in the graph:
  cross_entropy      (logits [..., C] f32 / f16 / bf16, labels [...]) -> f32 [...]  each
                     row's loss (0 where the label is ignore_index), one fused row kernel
  [reduction]        "sum": reduce_sum; "mean": reduce_sum / the number of rows whose label
                     is not ignore_index (torch: NaN when every row is ignored)
  [cast]             half logits: the result (rows or the reduced scalar) cast to the logits'
                     dtype, as F.cross_entropy returns it
and its VJP is one node, cross_entropy_bwd (logits, labels, dy rows f32) -> [..., C] in the
logits' dtype: a row kernel that recomputes the softmax from the logits (nothing [rows, C] is
saved for it). Half logits are read in their own dtype: the log-sum-exp, the row losses and
their reduction are f32 (torch reduces nll_loss in f32 too), and only the [rows] result is
rounded to the logits' dtype.
"""
from __future__ import annotations

import numbers

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32, defop
from .ops import fmt

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (dt.I32, dt.I64)


def check_cross_entropy(logits, labels, reduction, ignore_index, label_smoothing):
    op = "cross_entropy"
    if not logits.dtype.is_float:
        raise ValueError(f"{op}: logits must be a float tensor, got {logits.dtype} "
                         f"{fmt(logits.shape)}")
    if len(logits.shape) == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{op}: logits must be [..., C] with C >= 1 classes, got "
                         f"{fmt(logits.shape)}")
    if labels.dtype not in LABEL_DTYPES:
        raise ValueError(f"{op}: labels must be class indices, i32 or i64, got {labels.dtype} "
                         f"{fmt(labels.shape)} (class-probability targets are not supported)")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: labels must have logits' shape without the class axis, "
                         f"{fmt(logits.shape[:-1])} (logits {fmt(logits.shape)}), got "
                         f"{fmt(labels.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(REDUCTIONS)}, got "
                         f"{reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"{op}: ignore_index must fit in 64 bits, got {ignore_index!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"{op}: label_smoothing must be a number in [0, 1], got "
                         f"{label_smoothing!r}")
    return int(ignore_index), float(label_smoothing)


def _rows_operands(op, x, labels):
    """The nodes' operands: f32 / f16 / bf16 logits [..., C] and their labels."""
    if x.dtype not in (dt.F32, dt.F16, dt.BF16) or len(x.shape) == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: logits must be f32, f16 or bf16 [..., C] with C >= 1, got "
                         f"{x.dtype} {fmt(x.shape)}")
    if labels.dtype not in LABEL_DTYPES or tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{op}: labels must be i32 or i64 {fmt(x.shape[:-1])} (logits "
                         f"{fmt(x.shape)}), got {labels.dtype} {fmt(labels.shape)}")


def infer_cross_entropy(x, labels, ignore_index, label_smoothing):
    _rows_operands("cross_entropy", x, labels)
    return labels.shape, dt.F32


def infer_cross_entropy_bwd(x, labels, dy, ignore_index, label_smoothing):
    _rows_operands("cross_entropy_bwd", x, labels)
    if dy.dtype != dt.F32 or tuple(dy.shape) != tuple(labels.shape):
        raise ValueError(f"cross_entropy_bwd: dy must be f32 {fmt(labels.shape)} (one per row), "
                         f"got {dy.dtype} {fmt(dy.shape)}")
    return x.shape, x.dtype


defop("cross_entropy", infer_cross_entropy, dtype_rule=F32,
      doc="each row's (label-smoothed) cross-entropy loss, 0 on ignore_index rows")
defop("cross_entropy_bwd", infer_cross_entropy_bwd, dtype_rule=F32,
      doc="cross_entropy's d logits, the softmax recomputed: one row kernel")


class LossOps:
    """Builder methods; ``self`` is the Graph."""

    def cross_entropy(self, logits, labels, reduction: str = "mean", ignore_index: int = -100,
                      label_smoothing: float = 0.0):
        """torch.nn.functional.cross_entropy with class-index targets, the classes on the
        LAST axis: logits [..., C] (e.g. [N, C], or [B, S, V] for a language model), labels
        i32/i64 of logits.shape[:-1].

        Row loss: (1 - eps) (lse - x[y]) + eps / C * sum_c (lse - x_c) with eps =
        ``label_smoothing``; a row whose label equals ``ignore_index`` contributes 0 and is
        not counted. ``reduction``: "mean" (the sum over the counted rows divided by their
        number: NaN when none is counted, as torch), "sum", or "none" (labels' shape).
        A label outside [0, C) that is not ignore_index gives a NaN row (run() raises
        IndexError for host-array labels out of the range that contains [0, C) and
        ignore_index). Half logits are read as they are (no cast of the logits); the
        log-sum-exp and the reduction are f32 and the result is returned in the logits'
        dtype, as torch does."""
        op = "cross_entropy"
        self.check(op, "logits", logits)
        self.check(op, "labels", labels)
        ignore, eps = check_cross_entropy(logits, labels, reduction, ignore_index,
                                          label_smoothing)
        rows = self.bind(op, [logits, labels], ignore_index=ignore, label_smoothing=eps)
        if reduction == "none":
            out = rows
        else:
            out = self.reduce_sum(rows) if rows.shape else rows
            if reduction == "mean":
                lab = labels if -2**31 <= ignore < 2**31 else self.cast(labels, dt.I64)
                counted = self.cast(self.ne(lab, self.constant(ignore, lab.dtype)), dt.F32)
                out = out / (self.reduce_sum(counted) if counted.shape else counted)
        return out if logits.dtype == dt.F32 else self.cast(out, logits.dtype)


@vjp("cross_entropy")
def _vjp_cross_entropy(g, n, dy):
    """d logits = dy_row * (softmax(x) - eps / C - (1 - eps) onehot(y)), 0 on ignored rows:
    one fused row kernel; the reduction's scale (1/count for mean) is already in dy."""
    x, labels = g.tensor(n.inputs[0]), g.tensor(n.inputs[1])
    dx = g.bind("cross_entropy_bwd", [x, labels, dy], **n.attrs)
    return [dx, None]
