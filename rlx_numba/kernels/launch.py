"""Launch geometry, in one place. The simulator runs one OS thread per CUDA thread, so its
launches are kept small (grid-stride loops cover the rest)."""
from ..runtime.device import SIMULATOR, device_info

_SM = None


def sm_count() -> int:
    global _SM
    if _SM is None:
        _SM = device_info()["sm_count"]
    return _SM


def grid_1d(n: int, threads: int = 256, waves: int = 32) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over n items."""
    if SIMULATOR:
        return (max(1, min(2, -(-n // 16))), 16)
    blocks = -(-n // threads)
    # enough blocks to fill every SM several times; the loop strides over the rest
    return (max(1, min(blocks, sm_count() * waves * (2048 // threads))), threads)
