"""How long opening a GGUF with a large vocabulary takes: gguf-py's GGUFReader against the
project's reader (hybridmoe.backend.models.gguf_reader) and the readers built on it. Not a pytest test
(timings depend on the machine); run it by hand:

    python -m tests.models.time_gguf_open [--vocab 150000] [--keep DIR] [--skip-old]

It writes a GGUF with a ``vocab``-token vocabulary (tokens, merges, scores, token types), a
chat template and a few tensors, then prints the open times. The new reader should take well
under a second; GGUFReader takes tens of seconds for 150k tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def write_big_vocab_gguf(path: Path, vocab: int) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("big-vocab")
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_expert_count(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    # A byte-level BPE vocabulary that loads: the 256 byte symbols, then tokens made by merging
    # two earlier ones (each with its merge rule), a few bytes long, as in real vocabularies.
    from hybridmoe.backend.text.tokenizer import _bytes_to_unicode

    tokens = list(_bytes_to_unicode().values())
    seen = set(tokens)
    merges = []
    short = list(tokens)
    while len(tokens) < vocab:
        a, b = short[rng.integers(len(short))], short[rng.integers(len(short))]
        if a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
        if len(a + b) < 6:
            short.append(a + b)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_scores(rng.standard_normal(vocab).astype(np.float32).tolist())
    w.add_token_types(rng.integers(1, 7, vocab).tolist())
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}" * 20)
    w.add_tensor("token_embd.weight", rng.standard_normal((256, 64)).astype(np.float16))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    from gguf.quants import quantize
    w.add_tensor("blk.0.ffn_gate_exps.weight", quantize(rng.standard_normal((4, 32, 64)).astype(np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def timed(label: str, fn, repeat: int = 1) -> float:
    """The best of `repeat` runs (a busy machine adds noise, never removes it)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    dt = min(times)
    print(f"  {label:<58} {dt:8.3f} s" + (f"  (best of {repeat})" if repeat > 1 else ""))
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--keep", type=Path, help="write the file into this folder (kept)")
    ap.add_argument("--skip-old", action="store_true", help="do not time gguf.GGUFReader (slow)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs for the fast readers")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"vocab{args.vocab}.gguf"
        t0 = time.perf_counter()
        write_big_vocab_gguf(path, args.vocab)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {args.vocab} tokens, {args.vocab - 256} merges) "
              f"in {time.perf_counter() - t0:.1f} s")

        from hybridmoe.backend.models.gguf_reader import open_gguf_file

        print("open times:")
        n = args.repeat
        new_open = timed("gguf_reader.open_gguf_file (header + tensor infos)", lambda: open_gguf_file(path).close(), n)

        def open_and_decode() -> None:
            with open_gguf_file(path) as g:
                assert len(g.metadata["tokenizer.ggml.tokens"]) == args.vocab

        new_full = timed("gguf_reader.open_gguf_file + every array decoded", open_and_decode, n)

        from hybridmoe.backend.models.gguf_files import read_gguf
        timed("gguf_files.read_gguf (inspect)", lambda: read_gguf(path), n)
        from hybridmoe.backend.text.tokenizer import read_gguf_metadata
        timed("tokenizer.read_gguf_metadata (every array decoded)", lambda: read_gguf_metadata(path), n)
        from hybridmoe.backend.text.tokenizer import load_tokenizer
        timed("tokenizer.load_tokenizer (incl. building the BPE)", lambda: load_tokenizer(path), n)
        from hybridmoe.backend.formats.gguf_weights import open_gguf
        timed("gguf_weights.open_gguf (weights)", lambda: open_gguf(path).close(), n)
        try:
            from hybridmoe.backend.llamacpp.header import read_header
            timed("llamacpp.header.read_header", lambda: read_header(path), n)
        except ImportError as exc:  # pragma: no cover - the backend is optional
            print(f"  llamacpp.header.read_header: not available ({exc})")

        if not args.skip_old:
            import gguf

            def old() -> None:
                r = gguf.GGUFReader(path)
                assert len(r.fields["tokenizer.ggml.tokens"].data) == args.vocab

            old_open = timed("gguf.GGUFReader (what the project used before)", old)

            def old_full() -> None:
                r = gguf.GGUFReader(path)
                assert len(r.fields["tokenizer.ggml.tokens"].contents()) == args.vocab

            timed("gguf.GGUFReader + tokens decoded (.contents())", old_full)
            print(f"speed-up of opening: {old_open / new_open:.0f}x "
                  f"({old_open:.2f} s -> {new_open:.3f} s; {new_full:.3f} s with every array decoded)")


if __name__ == "__main__":
    main()
