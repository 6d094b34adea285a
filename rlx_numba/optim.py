"""Optimizers for ``rlx.compile_train``: torch.optim's SGD, Adam and AdamW update rules.

An optimizer here holds hyperparameters only (checked as torch checks them, with clearer
errors); ``compile_train`` (train.py) gives it its device state and makes its update one graph
node ("optim_update", ir/ops_optim.py: its ``rule()``), lowered to one multi-tensor kernel
launch over every trained param (runtime/lower_optim.py, kernels/optim.py). The per-step values
(lr, Adam's bias corrections) are computed on the host in float64 as torch does and read by
the kernel from a small device array, so ``Trainer.set_lr`` needs no recompile.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

HYPER_LEN = 4      # the per-step values a kernel reads (kernels/optim.py)


def check_number(opt: str, arg: str, v, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """``v`` as a float, or a ValueError naming the optimizer, the argument and the range."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ValueError(f"{opt}: {arg} must be a finite number, got {v!r}")
    v = float(v)
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if bad_lo or bad_hi:
        lo_s = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
        hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
        raise ValueError(f"{opt}: {arg} must satisfy {lo_s}{arg}{hi_s}, got {v!r}")
    return v


def _flag(opt: str, arg: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{opt}: {arg} must be a bool, got {v!r}")
    return bool(v)


class Optimizer:
    """Base of SGD, Adam and AdamW. ``states``: the names of the per-param device buffers the
    update keeps (torch's state keys)."""

    states: tuple = ()

    def check_lr(self, lr) -> float:
        return check_number(type(self).__name__, "lr", lr, lo=0.0)

    def hyper(self, lr: float, step: int) -> np.ndarray:
        """The per-step values of step ``step`` (1 on the first) with learning rate ``lr``."""
        raise NotImplementedError

    def rule(self) -> tuple:
        """(rule, hp) of its "optim_update" node (ir/ops_optim.py): "sgd" or "adam" and the
        hyperparameters as (name, value) pairs."""
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "states")
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """torch.optim.SGD: the momentum buffer is the first step's gradient, then
    ``momentum * buf + (1 - dampening) * g``. The arguments after momentum are keyword-only:
    torch's positional order (dampening, weight_decay, nesterov) differs from this contract's."""

    def __init__(self, lr, momentum=0.0, *, dampening=0.0, nesterov=False, weight_decay=0.0):
        self.lr = self.check_lr(lr)
        self.momentum = check_number("SGD", "momentum", momentum, lo=0.0)
        self.dampening = check_number("SGD", "dampening", dampening)
        self.nesterov = _flag("SGD", "nesterov", nesterov)
        self.weight_decay = check_number("SGD", "weight_decay", weight_decay, lo=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(f"SGD: nesterov=True requires momentum > 0 and dampening == 0, got "
                             f"momentum={self.momentum}, dampening={self.dampening}")
        self.states = ("momentum_buffer",) if self.momentum != 0 else ()

    def hyper(self, lr, step):
        return np.array([lr, 1.0 if step == 1 else 0.0, 0.0, 0.0], np.float32)

    def rule(self):
        return "sgd", (("momentum", self.momentum), ("dampening", self.dampening),
                       ("weight_decay", self.weight_decay), ("nesterov", self.nesterov))


class Adam(Optimizer):
    """torch.optim.Adam: weight_decay is added to the gradient (L2), as torch."""

    decoupled = False

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False):
        name = type(self).__name__
        self.lr = self.check_lr(lr)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got "
                             f"{betas!r}") from None
        self.betas = (check_number(name, "betas[0]", b1, lo=0.0, hi=1.0, hi_open=True),
                      check_number(name, "betas[1]", b2, lo=0.0, hi=1.0, hi_open=True))
        self.eps = check_number(name, "eps", eps, lo=0.0)
        self.weight_decay = check_number(name, "weight_decay", weight_decay, lo=0.0)
        self.amsgrad = _flag(name, "amsgrad", amsgrad)
        self.states = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def hyper(self, lr, step):
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step        # in float64, as torch's host math
        return np.array([lr, -lr / bc1, bc2 ** 0.5, 1 - lr * self.weight_decay], np.float32)

    def rule(self):
        b1, b2 = self.betas
        return "adam", (("beta1", b1), ("beta2", b2), ("eps", self.eps),
                        ("weight_decay", self.weight_decay), ("decoupled", self.decoupled),
                        ("amsgrad", self.amsgrad))


class AdamW(Adam):
    """torch.optim.AdamW: weight decay decoupled, ``p *= 1 - lr * weight_decay`` before the
    Adam step."""

    decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False):
        super().__init__(lr, betas, eps, weight_decay, amsgrad)


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
