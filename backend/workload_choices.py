"""The names a workload chooses among (docs/sizing.md): cache precisions with the bytes of one
cached element, expert strategies, backends, prefill reserve, how GPU experts are held.

A leaf of the import graph: the planner's `Workload` (plan/workload.py) and the settings file,
which checks a hand-written entry against the same names, both read them from here, and the
settings file stays below the planner (docs/architecture.md, "Layering rules").
"""

# Bytes one cached element takes. q8_0 is llama.cpp's 8-bit cache: 32 int8 + one fp16 scale.
KV_BYTES_PER_ELEMENT = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "q8_0": 34 / 32}
STRATEGIES = ("uniform", "frequency", "cpu-only")
BACKENDS = ("auto", "engine", "llamacpp")
PREFILL_RESERVE = ("auto", "on", "off")
# How routed experts are held on a GPU: "auto" (dense when every routed expert fits that way,
# else as stored for a GGUF whose expert types the GPU kernels read, else int4 for experts
# stored in a 4-bit format, else int8, which fits twice as many as dense), "dense" (the compute
# dtype), "int8" (weight-only), "int4" (the stored 4-bit codes) or "stored" (the GGUF's blocks).
GPU_EXPERT_FORMS = ("auto", "dense", "int8", "int4", "stored")
# How several GPUs share the model: "pp" (a pipeline: each card holds whole layers), "tp"
# (tensor parallel: each card holds a share of every layer), "auto" (the faster for the workload).
PARALLEL = ("auto", "pp", "tp")
