"""What a Plan says about devices, in ``build_model``'s terms.

The Plan shares the decoder layers among GPUs (a pipeline: each card holds its layers'
attention, cache, dense and shared weights and GPU experts; or tensor parallelism: each card
a share of every layer and its own GPU experts), chooses how GPU experts are held (dense, int8
or their stored 4-bit codes), and sizes the prefill reserve and the token count from which
prompts stream CPU experts to the GPU. ``build_kwargs`` turns those into the arguments
``build_model`` takes; the engine's session passes them on.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridmoe.backend.engine.hybrid import options_from_plan
from hybridmoe.backend.errors import UsageError


def build_kwargs(plan, device: str | None = None) -> dict[str, Any]:
    """`placement` and `pipeline`, or `tensor_parallel`; `resident_form` and `hybrid` for build_model.

    device: a main device the caller insists on (e.g. "cpu"): one stage there, no pipeline.
    Otherwise the Plan's GPUs when it planned for them and this process can reach them.
    """
    kwargs: dict[str, Any] = {"resident_form": plan.resident_form}
    cards = [d for d in plan.devices if d.kind == "gpu"] if plan.parallel == "tp" else []
    if device is None and cards and torch.cuda.is_available():
        _check_visible([d.engine_device for d in cards])
        kwargs["tensor_parallel"] = [(d.engine_device, d.experts) for d in cards]
        kwargs["hybrid"] = options_from_plan(plan)
        return kwargs
    kwargs["placement"] = plan.placement()
    stages = plan.pipeline() if plan.main_device == "cuda" else []
    if device is None and stages and torch.cuda.is_available():
        _check_visible([d for d, _ in stages])
        kwargs["pipeline"] = stages
        kwargs["hybrid"] = options_from_plan(plan)
    elif device is not None and torch.device(device).type == "cuda":
        kwargs["hybrid"] = options_from_plan(plan)
    return kwargs


def _check_visible(devices: list[str]) -> None:
    count = torch.cuda.device_count()
    missing = [d for d in devices if torch.device(d).index is not None and torch.device(d).index >= count]
    if missing:
        raise UsageError(f"the plan places layers on {', '.join(missing)}, but only {count} GPU(s) are visible",
                         "Make the plan again on this machine (`hybridmoe plan`).")
