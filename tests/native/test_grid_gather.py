"""Kernels chosen per CPU by timing, which must give the same bits either way (the choice is
made once per process, so each setting runs in a process of its own):

- the i-quants whose grid look-ups may be gathered (iq2_s, iq3_xxs, iq3_s: AVX-512) take
  gathering or one-by-one loads (HYBRIDMOE_GRID_GATHER=0/1 forces each);
- the byte-plane decode GEMVs of the iq1, iq2 and iq3 formats (AVX-512) look their grids up with
  two-table or one-table byte permutes (HYBRIDMOE_ONE_TABLE_LOOKUPS=0/1)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe.backend.engine import native_kernels

pytestmark = pytest.mark.skipif(native_kernels._native is None, reason="native extension not built")

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
        data = stored(fmt, 40, 768, seed=5)  # three super-blocks a row: the iq1 / iq2 planes' odd tail too
        tensor = torch.from_numpy(data)
        linear = _native.DenseLinear(fmt, 768, [(40, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
        for tokens in (1, 3, 37):
            x = torch.from_numpy(np.random.default_rng(tokens).standard_normal((tokens, 768)).astype(np.float32))
            y = torch.empty(tokens, 40)
            linear.forward(x, y, 1 << 30)  # the GEMV (37: the many-token one)
            out[f"{name}/{fmt}/{tokens}"] = y.numpy()
np.savez(sys.argv[1], **out)
"""


def _outputs(tmp_path, env_name: str, value: str, formats: tuple[str, ...]) -> dict:
    path = tmp_path / f"{env_name}{value}.npz"
    env = {**os.environ, env_name: value}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(path), ",".join(formats)], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("env_name, formats", [
    ("HYBRIDMOE_GRID_GATHER", ("iq2_s", "iq3_xxs", "iq3_s")),
    ("HYBRIDMOE_ONE_TABLE_LOOKUPS", ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s")),
])
def test_both_ways_give_the_same_bits(tmp_path, env_name, formats):
    on, off = _outputs(tmp_path, env_name, "1", formats), _outputs(tmp_path, env_name, "0", formats)
    assert on.keys() == off.keys() and on
    for key in on:
        assert np.array_equal(on[key], off[key]), key
