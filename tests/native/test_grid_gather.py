"""The i-quants whose grid look-ups may be gathered (iq2_s, iq3_xxs, iq3_s: AVX-512) take
gathering or one-by-one loads by what is faster on the CPU, timed once per format; both must
give the same bits. HYBRIDMOE_GRID_GATHER=0/1 forces each, in a process of its own (the
choice is made once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe.backend.engine import native_kernels

pytestmark = pytest.mark.skipif(native_kernels._native is None, reason="native extension not built")

FORMATS = ("iq2_s", "iq3_xxs", "iq3_s")

_SCRIPT = r"""
import sys
import numpy as np, torch
from hybridmoe.backend.engine import native_kernels
from tests.native.test_gguf_types import stored
_native = native_kernels._native
out = {}
for name in _native.isa_info()["supported"]:
    _native.set_isa(name)
    for fmt in sys.argv[2].split(","):
        data = stored(fmt, 40, 512, seed=5)
        tensor = torch.from_numpy(data)
        linear = _native.DenseLinear(fmt, 512, [(40, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
        for tokens in (1, 3, 37):
            x = torch.from_numpy(np.random.default_rng(tokens).standard_normal((tokens, 512)).astype(np.float32))
            y = torch.empty(tokens, 40)
            linear.forward(x, y, 1 << 30)  # the GEMV (37: the many-token one)
            out[f"{name}/{fmt}/{tokens}"] = y.numpy()
np.savez(sys.argv[1], **out)
"""


def _outputs(tmp_path, gather: str) -> dict:
    path = tmp_path / f"gather{gather}.npz"
    env = {**os.environ, "HYBRIDMOE_GRID_GATHER": gather}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(path), ",".join(FORMATS)], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_gathered_and_loaded_grids_give_the_same_bits(tmp_path):
    gathered, loaded = _outputs(tmp_path, "1"), _outputs(tmp_path, "0")
    assert gathered.keys() == loaded.keys() and gathered
    for key in gathered:
        assert np.array_equal(gathered[key], loaded[key]), key
