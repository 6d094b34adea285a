"""How a graph is compiled (CompileMode) and run (ExecMode), and the parsers of their string
spellings. The ground floor: every layer that takes a mode (the runtime, compile(),
compile_train, the models) reads it from here."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class CompileMode(enum.Enum):
    JIT = "jit"   # kernels compile on first use
    AOT = "aot"   # every kernel compiled inside compile()


@dataclass(frozen=True)
class ExecMode:
    kind: str
    streams: int = 1

    @staticmethod
    def MULTISTREAM(n: int, graph: bool = False) -> "ExecMode":  # noqa: N802 - the contract's name
        """n streams ordered by events; with ``graph=True`` that is captured into one CUDA
        graph (GRAPH over n streams)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ExecMode.MULTISTREAM: n must be a positive int, got {n!r}")
        return ExecMode("graph" if graph else "multistream", n)

    def __str__(self) -> str:
        if self.kind == "graph" and self.streams > 1:
            return f"MULTISTREAM({self.streams}, graph=True)"
        return self.kind.upper() if self.kind != "multistream" else f"MULTISTREAM({self.streams})"


ExecMode.STREAM = ExecMode("stream")    # launches queued on one stream, one sync per run
ExecMode.EAGER = ExecMode("eager")      # a sync after every step: errors point at their step
ExecMode.GRAPH = ExecMode("graph")


def parse_compile_mode(m) -> CompileMode:
    """A CompileMode, or its name ("jit", "aot", any case)."""
    if isinstance(m, CompileMode):
        return m
    try:
        return CompileMode(str(m).lower())
    except ValueError:
        raise ValueError(f"compile: unknown compile_mode {m!r}; expected 'jit' or 'aot'") from None


def parse_exec_mode(m) -> ExecMode:
    """An ExecMode, or its spelling: "stream", "eager", "graph", "multistream(n)"."""
    if isinstance(m, ExecMode):
        return m
    s = str(m).lower()
    if s in ("stream", "eager", "graph"):
        return getattr(ExecMode, s.upper())
    if s.startswith("multistream"):
        digits = s[len("multistream"):].strip("():")
        if digits and not digits.isdigit():
            raise ValueError(f"compile: exec_mode {m!r}: the stream count must be an int")
        return ExecMode.MULTISTREAM(int(digits) if digits else 2)
    raise ValueError(f"compile: unknown exec_mode {m!r}; expected stream, eager, graph or "
                     f"multistream(n)")


PRECISIONS = ("f32", "bf16", "f16")


def parse_precision(precision) -> str:
    """"f32" / "bf16" / "f16" (also "float32", "bfloat16", "float16"); ValueError otherwise."""
    name = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return name
