"""The ONNX backend node suite as files: onnx/backend/test/data/node/<case>/model.onnx +
test_data_set_0/{input,output}_*.pb. Older onnx wheels ship that directory; newer ones ship
only the generators (onnx.backend.test.case.node), so it is written once into the cache dir
(about 10 s; onnx's own `backend-test-tools generate-data` writes the same files) and read
from there by every later run and xdist worker."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def node_dir() -> Path:
    import onnx
    shipped = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if shipped.is_dir() and any(shipped.iterdir()):
        return shipped
    from rlx_numba.kernels.cache import cache_dir
    out = cache_dir() / f"onnx-node-{onnx.__version__}"
    if not (out / "DONE").exists():
        _generate(out)
    return out


def _generate(out: Path) -> None:
    import warnings
    import numpy as np
    from onnx import TensorProto, numpy_helper
    from onnx.backend.test.case import node
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node.collect_testcases(None)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tol = {}
    for case in cases:
        d = tmp / case.name
        (d / "test_data_set_0").mkdir(parents=True)
        (d / "model.onnx").write_bytes(case.model.SerializeToString())
        tol[case.name] = [case.rtol, case.atol]
        inputs, outputs = case.data_sets[0]
        for kind, vals, infos in (("input", inputs, case.model.graph.input),
                                  ("output", outputs, case.model.graph.output)):
            for j, (v, info) in enumerate(zip(vals, infos)):
                if not info.type.HasField("tensor_type"):
                    continue          # sequences / optionals / maps: no rlx type; not written
                p = numpy_helper.from_array(np.asarray(v), info.name) \
                    if not isinstance(v, TensorProto) else v
                (d / "test_data_set_0" / f"{kind}_{j}.pb").write_bytes(p.SerializeToString())
    (tmp / "tolerances.json").write_text(json.dumps(tol))
    (tmp / "DONE").write_text("ok")
    try:
        os.rename(tmp, out)           # atomic: another worker may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_case(path: Path):
    """(model, inputs list, outputs list) of one case directory."""
    import onnx
    from onnx import numpy_helper
    model = onnx.load(str(path / "model.onnx"))
    ds = path / "test_data_set_0"

    def read(kind):
        out = []
        for j in range(len(model.graph.input if kind == "input" else model.graph.output)):
            if not (ds / f"{kind}_{j}.pb").exists():     # a sequence / optional: not written
                out.append(None)
                continue
            t = onnx.TensorProto()
            t.ParseFromString((ds / f"{kind}_{j}.pb").read_bytes())
            out.append(numpy_helper.to_array(t))
        return out
    return model, read("input"), read("output")
