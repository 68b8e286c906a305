"""The decode path a plan will take, named before anything is loaded.

The model's family describes its layers from its config (``describe_layers``) as the plan
would load them (``Loading``: the main device, the experts it leaves on the GPUs, the formats
the native kernels read); ``decode_path.decode_plan`` then says which executor runs each
layer group and why, the same pure function the engine asks with the descriptions of the
modules it built (tests/plan/test_planned_decode.py holds the two to each other on every
family's tiny model). ``plan`` prints its summary and ``plan --json`` its groups.

What this machine decides (whether the native kernels are built and on, whether Triton is
installed) is read here, as for the engine's load on this machine.
"""

from __future__ import annotations

import importlib.util

from hybridmoe.backend.hardware.cpu_kernels import native_kernels_missing
from hybridmoe.backend.models.families import family_by_name
from hybridmoe.backend.models.inventory import TensorInventory
from hybridmoe.backend.models.layer_description import Loading
from hybridmoe.backend.models.slow_paths import cpu_slow_path
from hybridmoe.backend.models.spec import ModelSpec
from hybridmoe.backend.plan.decode_path import DecodePlan, Machine, decode_plan
from hybridmoe.backend.plan.plan import Plan


def planned_loading(spec: ModelSpec, inventory: TensorInventory, plan: Plan, checkpoint: str,
                    kernels_missing: str | None) -> Loading:
    """How the engine would load `spec` under `plan`: on a CPU main device with the native
    kernels every projection is read natively (in its stored form, or widened once at load);
    routed experts in a format the kernels do not read take the slow path (models.slow_paths)."""
    cpu = plan.main_device == "cpu"
    slow = cpu_slow_path(inventory, kernels_missing) if kernels_missing is None else None
    slow_why = None if slow is None else f"experts stored as {', '.join(slow.formats)}, which the native kernels do not read"
    return Loading(
        main_device="cpu" if cpu else "cuda:0", context=plan.workload.context, checkpoint=checkpoint,
        cache_dtype="float32" if spec.torch_dtype == "float32" else "bfloat16",
        projections_native=cpu and kernels_missing is None,
        experts_on_main={layer: len(ids) for layer, ids in plan.gpu_experts.items() if ids},
        experts_native={layer: slow_why for layer in (slow.bytes_by_layer if slow else ())},
        streamed=not cpu)


# Layers split across cards are shards: they are not described, and the machine alone decides.
_SHARDED = "layers split across cards"


def planned_machine(plan: Plan, kernels_missing: str | None) -> Machine:
    if plan.main_device == "cpu":
        return Machine(main_device="cpu", split=None,
                       native_off=None if kernels_missing is None else f"the native kernels are not in use: {kernels_missing}")
    sharded = plan.parallel == "tp" and sum(1 for d in plan.devices if d.kind == "gpu") > 1
    return Machine(main_device="cuda:0", native_off=None, split=_SHARDED if sharded else "experts streamed by a scheduler",
                   gpu_kernels_off=None if importlib.util.find_spec("triton") is not None else "Triton is not installed")


def planned_decode(spec: ModelSpec, inventory: TensorInventory, plan: Plan, checkpoint: str) -> DecodePlan:
    """The path of each layer for one new token under `plan` (`checkpoint`: "safetensors" or
    "gguf", what the model is stored as)."""
    missing = native_kernels_missing()
    machine = planned_machine(plan, missing)
    layers = None
    if machine.split != _SHARDED:
        loading = planned_loading(spec, inventory, plan, checkpoint, missing)
        layers = list(family_by_name(spec.family).describe_layers(spec, loading))
    return decode_plan(layers, machine, spec.num_layers)
