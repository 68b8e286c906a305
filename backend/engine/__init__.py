"""The embedded hybrid backend: plain PyTorch model code, weights read through mmap, routed
experts split between the main device and the CPU (see docs/architecture.md, "The embedded engine").

Entry point for model code: ``hybridmoe.backend.engine.model.build_model``.
"""
