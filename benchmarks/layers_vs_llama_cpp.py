"""The engine's blocks against llama.cpp's own intermediate tensors on a GGUF, layer by layer,
each block fed llama.cpp's input: where the two computations part, and by how much.

    python benchmarks/layers_vs_llama_cpp.py MODEL.gguf [--text TEXT] [--decode] [--threads 2]

llama.cpp hands every tensor of its graph to a callback as it computes it (the context's
cb_eval); this takes the residual stream after each layer (l_out-N) and after its attention
(ffn_inp-N), and the logits. The engine then runs the same prompt through its layer-by-layer
path with each layer's input replaced by llama.cpp's, and each feed-forward block's input too,
so that a gap belongs to the block it is printed for and does not carry over from the layers
before. --decode compares the step of the prompt's last token, after a prompt forced the same
way (the caches then hold the same rows as far as the blocks agree). Gaps are the RMS of the
difference over the RMS of llama.cpp's tensor.

Where the engine rounds as llama.cpp does (docs/architecture.md, "Numerics"), a block's gap is
float summation order, 1e-7 to 1e-6 of its size, except where a Q8 code of an input that
differs in its last bit rounds the other way (1e-4 to 1e-3 for that block). A systematic
difference shows in every layer.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = 'def read_lines(path):\n    with open(path, encoding="utf-8") as f:\n        for line in f:\n            yield line\n'


class _Tensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64), as far as its name and data."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


WANTED = ("l_out", "ffn_inp", "result_output")


def capture(bindings, into: dict[str, np.ndarray]):
    """A cb_eval callback that copies the float32 tensors named in WANTED (per layer "l_out-3")
    into `into` as [rows, width] arrays."""

    @bindings.ggml_backend_sched_eval_callback
    def callback(pointer, ask, _user):
        t = ctypes.cast(pointer, ctypes.POINTER(_Tensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return name.rsplit("-", 1)[0] in WANTED
        if t.type == 0 and t.data:  # GGML_TYPE_F32, in host memory (a CPU run)
            ne, nb = list(t.ne), list(t.nb)
            size = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
            flat = np.frombuffer((ctypes.c_char * size).from_address(t.data), dtype=np.float32)
            array = np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1])
            into[name] = array.reshape(-1, ne[0]).copy()
        return True

    return callback


def gap(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.sqrt(((ours - theirs) ** 2).mean() / (theirs**2).mean()))


def main() -> int:
    import llama_cpp
    import torch

    from hybridmoe.backend.bench.generate import _load_engine
    from hybridmoe.backend.llamacpp.model import RawModel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--decode", action="store_true", help="compare the step of the prompt's last token")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    seen: dict[str, np.ndarray] = {}
    context = llama_cpp.llama_context_default_params()
    context.n_ctx = context.n_batch = context.n_ubatch = 512
    context.n_threads = context.n_threads_batch = args.threads
    context.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as bench generate runs it
    context.cb_eval = callback = capture(llama_cpp, seen)
    llm = RawModel(args.model, params=SimpleNamespace(model=llama_cpp.llama_model_default_params(), context=context))
    try:
        ids = llm.tokenize(args.text.encode())
        if args.decode:
            llm.eval(ids[:-1])
            prompt = dict(seen)
            seen.clear()
        llm.eval(ids[-1:] if args.decode else ids)
        step = dict(seen)
    finally:
        llm.close()
    del callback

    net, _ = _load_engine(str(args.model), 512, args.threads)
    net.native_decode = False  # the layer-by-layer path, whose blocks take hooks
    theirs = step
    ours: dict[str, torch.Tensor] = {}

    def given(name: str) -> torch.Tensor:
        return torch.from_numpy(theirs[name])

    for i, layer in enumerate(net.layers):
        if i:
            layer.register_forward_pre_hook(lambda _m, a, i=i: (given(f"l_out-{i - 1}"), *a[1:]))
        layer.ffn_norm.register_forward_pre_hook(lambda _m, a, i=i: (given(f"ffn_inp-{i}"),))
        layer.attn.register_forward_hook(lambda _m, _a, out, i=i: ours.__setitem__(f"attn-{i}", out.float()))
        layer.ffn.register_forward_hook(lambda _m, _a, out, i=i: ours.__setitem__(f"ffn-{i}", out.float()))
    if args.decode:
        theirs = prompt
        net.forward_batch([(net.sequence, ids[:-1], 0)], prompt=True)
        theirs = step
        (logits,) = net.forward_batch([(net.sequence, ids[-1:], len(ids) - 1)])
    else:
        (logits,) = net.forward_batch([(net.sequence, ids, 0)], prompt=True)

    print(f"{args.model.name}: {len(ids)} tokens, {'the last one as a decode step' if args.decode else 'a prompt'}")
    print("layer | attention | feed-forward")
    last = len(net.layers) - 1
    for i in range(len(net.layers)):
        # llama.cpp keeps only the rows it returns logits for after the last layer's attention.
        rows = slice(-1, None) if i == last and not args.decode else slice(None)
        ffn_inp, l_out = theirs[f"ffn_inp-{i}"], theirs[f"l_out-{i}"]
        attention = "" if i == 0 else f"{gap(ours[f'attn-{i}'][rows], ffn_inp - theirs[f'l_out-{i - 1}'][rows]):.1e}"
        print(f"{i} | {attention} | {gap(ours[f'ffn-{i}'][rows], l_out - ffn_inp):.1e}")
    their_logits = theirs["result_output"][-1]
    ours_last = logits.float().reshape(-1).numpy()
    print(f"logits: {gap(ours_last, their_logits):.1e} of their size, "
          f"{np.sqrt(((ours_last - their_logits) ** 2).mean()) / their_logits.std():.1e} of their spread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
