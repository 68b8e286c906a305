"""The `hybridmoe` command line.

Errors a user can cause print one message (what, where, what to do) and exit 1, or 2 for
usage errors; with --json the same message is also printed on stdout as {"error": {...}}, so
that a script reading stdout sees why there is no result. Anything else is a bug: one line
on the terminal, the traceback in the log.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from dataclasses import replace
from datetime import datetime

from hybridmoe.app.arguments import comma_separated, non_negative_int, positive_float, positive_int
from hybridmoe.app.waiting import Waiting
from hybridmoe.backend.errors import HybridMoeError, UnsupportedModelError
from hybridmoe.backend.plan.workload import (
    BACKENDS,
    GPU_EXPERT_FORMS,
    KV_BYTES_PER_ELEMENT,
    PARALLEL,
    PREFILL_RESERVE,
    STRATEGIES,
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130
DEFAULT_PLAN_CONTEXT = 32768  # tokens per conversation when `plan` is given no --context


# ---- commands -------------------------------------------------------------------------------


def cmd_doctor(args) -> int:
    from hybridmoe.app.render import hardware_text
    from hybridmoe.backend import settings
    from hybridmoe.backend.hardware import detect

    waiting = Waiting()  # seconds in all: each part says what it is doing
    store = settings.load().model_store_path
    waiting.say("detecting the hardware" if args.no_bandwidth else
                "detecting the hardware and measuring the memory bandwidth (best of three probes)")
    profile = detect(measure_bandwidth=not args.no_bandwidth, model_dir=store)
    waiting.say("asking llama.cpp and the native kernels what they can do")
    from hybridmoe.backend.engine import native_kernels  # loads PyTorch
    from hybridmoe.backend.llamacpp import system_info, system_summary

    llama_cpp = system_info()
    summary = native_kernels.summary()
    waiting.clear()
    if args.json:
        kernels = native_kernels.isa_info() if native_kernels.enabled() else {"isa": None, "note": native_kernels.summary()}
        _print_json({**profile.to_dict(), "llama_cpp": llama_cpp, "cpu_kernels": kernels})
    else:
        print(hardware_text(profile, extra=[("CPU kernels", summary),
                                            ("llama.cpp", system_summary(llama_cpp))]))
    return EXIT_OK


def cmd_inspect(args) -> int:
    from hybridmoe.app.render import model_text
    from hybridmoe.backend.hub.catalogue import model_path
    from hybridmoe.backend.models import inspect_model

    model = inspect_model(model_path(args.model), expert_format=args.format)
    report = _check_finite(model) if args.check else None
    if args.json:
        _print_json(
            {"path": str(model.path), "kind": model.kind, "spec": model.spec.to_dict(), "inventory": model.inventory.to_dict(),
             **({"check": report.to_dict()} if report else {})}
        )
    else:
        print(model_text(model))
        if report:
            print(_finite_report_text(report))
    if report and report.bad:
        # After the report, not instead of it: it names the tensors.
        print(f"hybridmoe: error: {model.files[0]} holds values that are not numbers (NaN or infinity) in "
              f"{len(report.bad)} tensor(s): its weights are damaged\n  Download or convert the model again.",
              file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _finite_report_text(report) -> str:
    skipped = f"; {len(report.not_checked)} of other types not read" if report.not_checked else ""
    if not report.bad:
        return f"\nNaN / infinity: none in the {report.checked} tensors checked{skipped}."
    lines = [f"\nNaN / infinity in {len(report.bad)} of the {report.checked} tensors checked{skipped}:"]
    lines += [f"  {name}: {count:,} values" for name, count in report.bad.items()]
    return "\n".join(lines)


def _check_finite(model):
    """Read the GGUF's checkable tensors for NaN and infinities, with a progress line."""
    from hybridmoe.app.convert_render import ConvertProgress
    from hybridmoe.backend.errors import UsageError
    from hybridmoe.backend.models.finite_check import check_finite
    from hybridmoe.backend.session import Progress

    if model.kind != "gguf":
        raise UsageError(f"--check reads GGUF files; {model.path} is a {model.kind}",
                         "Give the .gguf file, or leave out --check.")
    line = ConvertProgress(sys.stderr)
    try:
        return check_finite(model.files[0], lambda done, total, name: line(Progress("check", done, total, "B", name)))
    finally:
        line.done()


def cmd_plan(args) -> int:
    from hybridmoe.app.render import plan_text
    from hybridmoe.backend.hub.catalogue import model_path
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.files import write_error
    from hybridmoe.backend.plan import Workload, make
    from hybridmoe.backend.plan.plan import check_plan_path
    from hybridmoe.backend.plan.planned_decode import planned_decode

    workload = Workload(
        context=args.context or DEFAULT_PLAN_CONTEXT,
        users=args.users,
        kv_dtype=args.kv_dtype,
        prefill_reserve=args.prefill_reserve,
        strategy=args.strategy,
        stats_file=args.stats,
        backend=args.backend,
        target_tokens_per_s=args.target_speed,
        gpu_expert_form=args.gpu_experts,
        parallel=args.parallel,
        n_cpu_moe=args.n_cpu_moe,
    )
    if args.save:
        check_plan_path(args.save)  # a name it cannot be saved as fails before the work
    model = inspect_model(model_path(args.model), expert_format=args.format)  # a bad name fails before the probe
    if args.context is None:
        # As `run` does: the default within what the model supports; a context asked for is
        # planned as asked, so one beyond the model is refused, by `run` too.
        workload = replace(workload, context=min(workload.context, model.spec.max_context))
    hardware = resolve_hardware(args)
    plan = make(model.spec, model.inventory, hardware, workload)
    # The engine's path per layer group, named from the family's descriptions (a config alone
    # stands for a safetensors checkpoint); a prediction for this machine, not part of the plan.
    # A model the engine does not run (a rope type it lacks, say) is still planned: llama.cpp's
    # plan needs no engine path, and an engine plan says why there is none.
    try:
        decode = planned_decode(model.spec, model.inventory, plan, "gguf" if model.kind == "gguf" else "safetensors")
        engine_path, engine_line = decode.to_dict(), f"Engine {decode.summary()}"
    except UnsupportedModelError as exc:
        engine_path, engine_line = {"unsupported": exc.what}, f"The embedded engine does not run this model: {exc.what}"
    if args.save:
        try:
            plan.save(args.save)
        except OSError as exc:
            raise write_error(args.save, exc) from exc
    if args.json:
        _print_json({**plan.to_dict(), "decode_path": engine_path})
    else:
        print(plan_text(plan))
        print(f"\n{engine_line}")
        if args.save:
            print(f"\nSaved to {args.save}")
    return EXIT_OK


def cmd_pull(args) -> int:
    """Download a repository into the Hugging Face cache; Ctrl-C cancels (a later pull resumes)."""
    import signal

    from hybridmoe.app.hub_render import ProgressLine, plan_text, pulled_text
    from hybridmoe.backend import settings
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.hub import pull
    from hybridmoe.backend.hub.catalogue import pull_choice
    from hybridmoe.backend.session import CancelToken

    hardware = None if "/" in args.repo or args.quant else detect(measure_bandwidth=False,
                                                                  model_dir=settings.load().model_store_path)
    choice = pull_choice(args.repo, args.quant, hardware)
    if choice.why:
        print(f"hybridmoe: {choice.why}", file=sys.stderr)
    repo, quant = choice.repo, choice.quant
    line = ProgressLine(sys.stderr)
    cancel = CancelToken()

    def on_plan(plan):
        print(plan_text(plan), file=sys.stderr)

    def on_sigint(signum, frame):
        if cancel.cancelled:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        cancel.cancel()
        line.show("cancelling; the partial files are kept for the next pull (Ctrl-C again to abort) ...")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        model = pull(repo, quant=quant, revision=args.revision, on_progress=line, cancel=cancel, on_plan=on_plan)
    finally:
        signal.signal(signal.SIGINT, previous)
        line.done()
    print(pulled_text(model), file=sys.stderr)
    print(model.path)  # stdout: just the path, for scripts
    return EXIT_OK


def cmd_convert(args) -> int:
    """A safetensors checkpoint to one GGUF file; Ctrl-C, SIGTERM and SIGHUP (the terminal
    closed) cancel it, leave no partial file and exit 128 + the signal's number, as a shell
    reports a process the signal ended (130, 143, 129)."""
    import signal

    from hybridmoe.app.convert_render import ConvertProgress, stored_types_text
    from hybridmoe.backend.convert import default_output_path, stored_types, to_gguf
    from hybridmoe.backend.session import Cancelled, CancelToken

    out = args.out or default_output_path(args.model, args.quant)
    line = ConvertProgress(sys.stderr)
    cancel = CancelToken()
    received: list[int] = []

    def on_signal(signum, frame):
        if cancel.cancelled:  # a second signal: stop now (the temporary file is still removed)
            raise KeyboardInterrupt
        received.append(signum)
        cancel.cancel()
        line.show("cancelling (Ctrl-C again to abort) ...")

    stopping = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {signum: signal.signal(signum, on_signal) for signum in stopping}
    try:
        path = to_gguf(args.model, out, args.quant, on_progress=line, cancel=cancel, overwrite=args.force)
    except (Cancelled, KeyboardInterrupt) as stopped:
        error = stopped if isinstance(stopped, Cancelled) else Cancelled("The conversion was cancelled")
        error.exit_code = 128 + (received[0] if received else signal.SIGINT)
        raise error from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        line.done()
    print(stored_types_text(path, stored_types(path, args.quant)), file=sys.stderr)
    print(path)  # stdout: just the path, for scripts
    return EXIT_OK


def cmd_models(args) -> int:
    """Local models; the registered directories; the catalogue."""
    from hybridmoe.app.hub_render import catalogue_text, models_text
    from hybridmoe.backend.hub import discover, registry

    if args.add:
        path = registry.add_dir(args.add)
        found = [discover.describe(m) for m in discover.scan_directory(path, source="directory")]
        print(f"Registered {path}; `hybridmoe models` now searches it.", file=sys.stderr)
        print(models_text(found) if found else "  (no models in it yet)")
        return EXIT_OK
    if args.remove:
        path = registry.remove_dir(args.remove)
        print(f"Unregistered {path}; the models in it were not touched.", file=sys.stderr)
        return EXIT_OK
    if args.catalogue:
        from hybridmoe.backend import settings
        from hybridmoe.backend.hardware import detect
        from hybridmoe.backend.hub import catalogue

        entries = catalogue.load()
        if args.json:
            _print_json([e.to_dict() for e in entries])
            return EXIT_OK
        hardware = detect(measure_bandwidth=settings.load().measure_bandwidth)
        print(catalogue_text(entries, catalogue.rank_for(hardware, catalogue=entries)))
        return EXIT_OK
    models = discover.list_local_models()
    if args.json:
        _print_json([m.to_dict() for m in models])
    else:
        print(models_text(models))
    return EXIT_OK


def cmd_bench_kernels(args) -> int:
    """The native CPU expert kernels on one MoE layer vs memory bandwidth, kt-kernel, PyTorch."""
    from hybridmoe.backend.bench import kernels

    return kernels.main(args)


# What `bench generate --types` retypes a model to: the GGUF types of routed experts the engine
# reads, and the mixes of backend/bench/retype.py.
SWEEP_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
               "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "ud-q2_k_xl", "ud-iq1_s")


def cmd_bench_generate(args) -> int:
    """The engine against llama.cpp end to end, same file, same threads, same prompt ids."""
    from hybridmoe.backend.bench import generate

    _check_gguf_argument(args.model)
    if args.plan or args.gpu_share is not None:
        return _bench_side_by_side(args)
    if args.types:
        result = generate.sweep(args.model, args.types, threads=args.threads, pairs=args.pairs)
        _write_results(args.out, result)
        print(json.dumps(result, indent=1) if args.json else generate.sweep_table(result))
        return EXIT_OK
    summary = generate.measure(args.model, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                               threads=args.threads, repeats=args.repeats, rounds=args.rounds,
                               pairs=args.pairs, backends=args.backends)
    _write_results(args.out, summary)
    print(json.dumps(summary, indent=1) if args.json else generate.table(summary))
    # The table shows each backend's error in its row; a benchmark with a backend that could
    # not be measured did not do what was asked.
    failed = [b for b, r in summary["results"].items() if "error" in r]
    return EXIT_ERROR if failed else EXIT_OK


def _write_results(out: str | None, result: dict) -> None:
    """--out: the results as JSON, whole or not at all (written beside and renamed)."""
    if out:
        from hybridmoe.backend.files import write_atomic

        write_atomic(out, json.dumps(result, indent=1))


def _bench_side_by_side(args) -> int:
    """`bench generate --plan`: the engine's hybrid layout against llama.cpp with the same GPU experts."""
    from hybridmoe.backend.bench import gpu_side_by_side
    from hybridmoe.backend.errors import UsageError

    if args.types:
        raise UsageError("--types and --plan measure different things", "Pass one of them.")
    result = gpu_side_by_side.run(
        args.model, plan_path=args.plan, gpu_share=args.gpu_share, match=args.llamacpp_layout, pairs=args.pairs or 1,
        decode_at=args.decode_at, prefill=args.prefill, decode_tokens=args.gen_tokens, threads=args.threads,
        gpu_expert_form=args.gpu_experts, out=args.out)
    print(json.dumps(result, indent=1) if args.json else gpu_side_by_side.table(result))
    return EXIT_ERROR if gpu_side_by_side.failed(result) else EXIT_OK


def cmd_bench_serve(args) -> int:
    """Concurrent streams on the engine and on llama.cpp, and conversations taking turns."""
    from hybridmoe.backend.bench import serve

    _check_gguf_argument(args.model)
    summary = serve.measure(args.model, streams=args.streams, prompt_tokens=args.prompt, gen_tokens=args.tokens,
                            threads=args.threads, backends=args.backends, turns=args.turns, repeats=args.repeats)
    print(json.dumps(summary, indent=1) if args.json else serve.table(summary))
    return EXIT_OK


def _check_gguf_argument(path: str) -> None:
    """A benchmark's model must be a file: refused before any worker process starts."""
    from hybridmoe.backend.errors import UsageError

    if not os.path.isfile(path):
        raise UsageError(f"{path} is not a file", "Give the path of a .gguf model.")


def resolve_hardware(args):
    """This machine, a preset, or a TOML description; then the command-line overrides."""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.hardware.overrides import apply_overrides
    from hybridmoe.backend.hardware.presets import load_described, preset
    from hybridmoe.backend.units import parse_bytes, parse_rate

    if args.hardware == "this":
        profile = detect(measure_bandwidth=not args.no_bandwidth and args.host_bandwidth is None)
    elif args.hardware.endswith(".toml") or os.path.exists(args.hardware):
        profile = load_described(args.hardware)
    else:
        profile = preset(args.hardware)
    return apply_overrides(
        profile,
        gpu_memory=parse_bytes(args.gpu_memory) if args.gpu_memory else None,
        gpus=args.gpus,
        ram=parse_bytes(args.ram) if args.ram else None,
        host_bandwidth=parse_rate(args.host_bandwidth) if args.host_bandwidth else None,
        cores=args.cores,
    )


def _cmd_tui(args) -> int:
    from hybridmoe.app.tui import run

    return run()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridmoe")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


# ---- parser ---------------------------------------------------------------------------------


class _UsageExit(SystemExit):
    """argparse's exit 2, keeping its message for main to repeat as JSON."""

    def __init__(self, message: str):
        super().__init__(EXIT_USAGE)
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and the usage, exit 2, as argparse does, without the traceback risk
        self.print_usage(sys.stderr)
        sys.stderr.write(f"hybridmoe: error: {message}\n")
        raise _UsageExit(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridmoe",
        description="Run giant Mixture-of-Experts models on one workstation: GPU + CPU expert offload. "
        "With no command: the terminal UI (the setup wizard on first run, then the chat).",
    )
    parser.add_argument("--version", action="version", version=f"hybridmoe {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("doctor", help="show what this machine has (CPU, RAM, GPUs, disk)")
    p.add_argument("--json", action="store_true", help="one JSON object (documented in the README)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the ~1 s host memory bandwidth probe")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("inspect", help="what a model is made of (checkpoint dir, GGUF, or config.json)")
    p.add_argument("model", help="a model directory, a .gguf file (first part of a split set), or a config.json")
    p.add_argument("--format", help="storage format to assume for a bare config.json (bf16, fp8_block, int4_g32, q8_0, q4_0, q4_k_m)")
    p.add_argument("--check", action="store_true",
                   help="GGUF: read the float tensors and the block scales for NaN and infinities (reads the file)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="choose the expert layout and estimate speed for a model on a machine")
    p.add_argument("model", help="a model directory, a .gguf file, or a config.json")
    p.add_argument("--hardware", default="this", help='"this" (default), a preset such as "4x H200 NVL", or a TOML file')
    p.add_argument("--gpus", type=non_negative_int, help="number of GPUs (overrides the hardware)")
    p.add_argument("--gpu-memory", help="memory per GPU as the driver reports it, e.g. 96GiB")
    p.add_argument("--ram", help="host RAM, e.g. 768GiB")
    p.add_argument("--host-bandwidth", help="host memory bandwidth, e.g. 1229GB/s")
    p.add_argument("--cores", type=positive_int, help="physical CPU cores")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the host bandwidth probe on this machine")
    p.add_argument("--format", help="expert storage format to assume for a bare config.json")
    p.add_argument("--context", type=positive_int,
                   help=f"tokens per conversation (default {DEFAULT_PLAN_CONTEXT}, or the model's maximum when that is less)")
    p.add_argument("--users", type=positive_int, default=1, help="concurrent conversations (default 1)")
    p.add_argument("--kv-dtype", choices=list(KV_BYTES_PER_ELEMENT), default="bf16")
    p.add_argument("--prefill-reserve", choices=list(PREFILL_RESERVE), default="auto",
                   help="keep one MoE layer of experts free on each GPU for fast long prompts")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="uniform")
    p.add_argument("--stats", help="expert statistics file for --strategy frequency")
    p.add_argument("--gpu-experts", choices=list(GPU_EXPERT_FORMS), default="auto",
                   help="how GPU experts are held: auto (dense when all fit, else a GGUF's experts as stored, "
                        "else other 4-bit experts' codes, else int8), dense, int8, int4 or stored")
    p.add_argument("--parallel", choices=list(PARALLEL), default="auto",
                   help="how several GPUs share the model: pp (a pipeline of whole layers), tp (tensor "
                        "parallel: a share of every layer on each card) or auto (the faster for the workload)")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto")
    p.add_argument("--n-cpu-moe", type=non_negative_int, metavar="N",
                   help="with --backend llamacpp: check llama.cpp's layout with the experts of blocks 0..N-1 on the CPU "
                        "(default: the plan chooses the smallest N that fits)")
    p.add_argument("--target-speed", type=positive_float, default=5.0,
                   help="tokens/s each conversation needs; below it the plan says one machine is not enough")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", help="write the plan to FILE (.toml or .json)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumable; Ctrl-C cancels)")
    p.add_argument("repo", help="organisation/name on the Hub, or a catalogue name such as kimi-k2.6")
    p.add_argument("--quant", help="GGUF repositories: the quantization to download, e.g. Q4_K_M (any case)")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("convert", help="convert a safetensors checkpoint to a GGUF file (Ctrl-C cancels)")
    p.add_argument("model", help="a Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--to", choices=["gguf"], default="gguf", help="output format (gguf)")
    p.add_argument("--quant", choices=["bf16", "q8_0", "q4_0", "q4_k_m"], default="q8_0",
                   help="weight type (default q8_0); q4_k_m runs llama.cpp's quantizer on a bf16 intermediate")
    p.add_argument("--out", help="output file (default: <model folder>-<QUANT>.gguf next to the folder)")
    p.add_argument("--force", action="store_true",
                   help="replace the output file if it exists (never a file of the checkpoint itself)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("models", help="models on this machine; --catalogue: the models hybridmoe knows by name")
    p.add_argument("--json", action="store_true")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--add", metavar="DIR", help="also search DIR for models (it is never modified)")
    group.add_argument("--remove", metavar="DIR", help="stop searching DIR")
    group.add_argument("--catalogue", action="store_true", help="the catalogue, and what fits this machine")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("bench", help="benchmarks (timed runs, not tests)")
    bench = p.add_subparsers(dest="bench_command", parser_class=_Parser, metavar="BENCHMARK", required=True)
    p = bench.add_parser("kernels", help="native CPU expert kernels on one MoE layer: latency, GB/s, "
                         "share of host memory bandwidth, vs kt-kernel and the PyTorch path")
    p.add_argument("--shapes", nargs="+", choices=["qwen3-30b-a3b", "deepseek-v3"], help="default: both")
    p.add_argument("--formats", nargs="+", help="default: q4_0 q4_k q8_0 int4_g32")
    p.add_argument("--tokens", nargs="+", type=positive_int, help="tokens per call (default: 1 8 64 512)")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: one per physical core)")
    p.add_argument("--seconds", type=positive_float, default=2.0, help="time budget per measurement (default 2)")
    p.add_argument("--deepseek-experts", type=positive_int, default=64,
                   help="experts in the DeepSeek-V3 layer (default 64 of 256, to fit in RAM)")
    p.add_argument("--no-peer", nargs="+", choices=["kt-kernel", "torch"], help="skip these comparisons")
    p.add_argument("--switch", action="store_true", help="measure the decode/prefill switch point instead")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.set_defaults(func=cmd_bench_kernels)
    p = bench.add_parser("generate", help="end-to-end prefill and decode tokens/s and peak RAM: the engine "
                         "and llama.cpp on the same GGUF, each in its own process")
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--prompt-tokens", type=positive_int, default=512)
    p.add_argument("--gen-tokens", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: one per physical core)")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed passes per process (after an untimed one)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="processes per backend, the backends taking turns (a drifting machine slows both alike)")
    p.add_argument("--pairs", type=non_negative_int, default=12,
                   help="then both backends in one process, decoding 16-token passes in alternation: how many "
                        "pairs (default 12; 0: none). Their median ratio is steadier on a shared host")
    p.add_argument("--backends", type=comma_separated(("engine", "llamacpp")), default=["engine", "llamacpp"],
                   help="which to measure (default engine,llamacpp)")
    p.add_argument("--types", type=comma_separated(SWEEP_TYPES),
                   help="sweep: the model retyped to each (its routed experts as random blocks of the type, or "
                        "the mixes ud-q2_k_xl, ud-iq1_s), one file at a time beside the model; per type decode at 64 and "
                        "2048 positions and prefill of 512 tokens against llama.cpp")
    p.add_argument("--json", action="store_true", help="the results, the engine's per-token breakdown "
                   "included, as JSON")
    from hybridmoe.backend.bench.gpu_side_by_side import add_arguments as add_side_by_side_arguments

    # With --plan: --pairs pairs of each measurement, decode passes of --gen-tokens tokens.
    add_side_by_side_arguments(p)
    p.set_defaults(func=cmd_bench_generate)
    p = bench.add_parser("serve", help="several conversations at once: aggregate and per-stream tokens/s, time to "
                         "first token and peak RAM for 1, 2, 4, 8 streams, the engine against llama.cpp with as "
                         "many parallel sequences, beside the plan's figures; then two conversations taking turns")
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--streams", type=comma_separated(positive_int), default=[1, 2, 4, 8],
                   help="numbers of concurrent streams (default 1,2,4,8)")
    p.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens per stream (default 128)")
    p.add_argument("--tokens", type=positive_int, default=64, help="tokens each stream generates (default 64)")
    p.add_argument("--threads", type=positive_int, default=2, help="CPU threads (default 2)")
    p.add_argument("--backends", type=comma_separated(("engine", "llamacpp")), default=["engine", "llamacpp"],
                   help="default engine,llamacpp")
    p.add_argument("--turns", type=non_negative_int, default=2000,
                   help="tokens of each of the two conversations taking turns (default 2000; 0 skips it)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="runs of each number of streams, new prompts each time; medians reported (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_serve)

    from hybridmoe.app import headless
    from hybridmoe.app.server import cli as server_cli

    headless.add_parser(sub)
    server_cli.add_parser(sub)
    return parser


# ---- entry point ----------------------------------------------------------------------------


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def _log_internal_error() -> str:
    from hybridmoe.backend.settings import state_dir

    try:
        log_dir = state_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "errors.log"
        with open(path, "a") as f:
            f.write(f"--- {datetime.now().isoformat()} {' '.join(sys.argv)}\n{traceback.format_exc()}\n")
        return str(path)
    except OSError:
        return "(the log could not be written)"


def _warn_about_settings() -> None:
    """What is wrong in the settings file, said once; the command goes on with the defaults
    for it (every later read of the file is silent)."""
    from hybridmoe.backend import settings

    loaded = settings.read()
    for problem in loaded.problems:
        print(f"hybridmoe: warning: {problem}", file=sys.stderr)
    if loaded.problems:
        print(f"  {loaded.hint}", file=sys.stderr)


def _fail(error: HybridMoeError, as_json: bool) -> int:
    """Report `error` on stderr (and as {"error": ...} on stdout for --json); its exit code."""
    print(f"hybridmoe: error: {error}", file=sys.stderr)
    if as_json:
        try:
            _print_json({"error": {"message": error.what, "hint": error.hint, "exit_code": error.exit_code}})
            sys.stdout.flush()
        except OSError:
            _silence_stdout()
    return error.exit_code


def _silence_stdout() -> None:
    """Point the broken standard output at /dev/null: what is still buffered for it would
    otherwise fail again when the interpreter exits, with a traceback-like warning."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _output_error(exc: OSError) -> HybridMoeError:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return HybridMoeError(f"could not write the output: {'the disk is full' if full else exc.strerror or exc}",
                          "Send the output somewhere with room for it (another file or a terminal)." if full
                          else "Check where the output goes (the redirection or the pipe).")


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with its standard output closed (`>&-`)
        if sys.stderr is not None:
            print("hybridmoe: error: the standard output is closed\n  Run it with its output going to a "
                  "terminal, a file or a pipe (not `>&-`).", file=sys.stderr)
        return EXIT_ERROR
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageExit as stop:  # already said on stderr
        if as_json:
            _print_json({"error": {"message": stop.message, "hint": None, "exit_code": stop.code}})
        return stop.code
    as_json = getattr(args, "json", None) is True  # `bench kernels --json FILE` writes a file instead
    if not getattr(args, "func", None):
        if not (sys.stdin.isatty() and sys.stdout.isatty()):  # a pipe or a script: the UI needs a terminal
            parser.print_help()
            return EXIT_OK
        args.func = _cmd_tui
    try:
        if args.func is not _cmd_tui:  # the terminal UI shows it in a dialog
            _warn_about_settings()
        code = args.func(args)
    except HybridMoeError as e:
        return _fail(e, as_json)
    except KeyboardInterrupt:
        print("hybridmoe: cancelled", file=sys.stderr)
        return EXIT_CANCELLED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK  # the reader (e.g. `| head`) went away; nothing to report
    except OSError as e:
        if _stdout_broken(e):
            _silence_stdout()
            return _fail(_output_error(e), False)
        return _internal_error(e, as_json)
    except Exception as e:  # a bug: say so briefly, keep the details for the report
        return _internal_error(e, as_json)
    try:
        sys.stdout.flush()  # a full disk behind `> file` shows here, while we can still say so
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:
        _silence_stdout()
        return _fail(_output_error(e), False)
    return code


def _stdout_broken(exc: OSError) -> bool:
    """Whether the error a command met came from writing the standard output: flushing it
    fails too, or (a large print fails at once and leaves nothing buffered) an error of writing
    an open file, which names no file, while the output goes to a file or a pipe."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    writing = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
    try:
        return writing and exc.filename is None and not sys.stdout.isatty()
    except ValueError:  # closed
        return True


def _internal_error(e: Exception, as_json: bool) -> int:
    where = _log_internal_error()
    print(f"hybridmoe: internal error: {type(e).__name__}: {e}\n  Details in {where}; please report it.", file=sys.stderr)
    if as_json:
        try:
            _print_json({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                   "hint": f"Details in {where}; please report it.", "exit_code": EXIT_ERROR}})
        except OSError:
            _silence_stdout()
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
