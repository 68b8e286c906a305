"""`hybridmoe run`: one prompt in, the answer streamed to stdout.

Progress and statistics go to stderr, and only when stderr is a terminal, so pipes get
the answer alone. Ctrl-C stops generation cleanly (exit 130) with what was generated
already printed.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict

from hybridmoe.app.waiting import Waiting
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.session import CancelToken, Done, Message, Progress, TextPiece

EXIT_CANCELLED = 130
DEFAULT_CONTEXT = 4096  # tokens, when neither --plan nor --context is given


def read_prompt(prompt: str | None) -> str:
    """-p TEXT (or TEXT as an argument), or `-p -` / `-` / none with piped stdin: the prompt
    from standard input."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt given", "Pass -p 'your question', or pipe it in: echo 'question' | hybridmoe run -m MODEL")
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt read from standard input is empty")
    return text


def load_plan(args, model, users: int = 1):
    """The plan from --plan, or one made now for this machine, the requested context and
    ``users`` conversations at once."""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.plan import Plan, Workload, make

    if args.plan:
        return Plan.load(args.plan)
    # A context asked for is planned as asked, so one beyond the model is refused as `plan`
    # refuses it; the default is lowered to what the model supports.
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, model.spec.max_context)
    plan = make(model.spec, model.inventory, detect(measure_bandwidth=False),
                Workload(context=context, users=users, backend=args.backend))
    if not plan.fits:
        from hybridmoe.backend.errors import PlanError

        raise PlanError(
            f"{model.spec.name} does not fit this machine: {plan.reason}",
            " ".join(plan.suggestions) or "See `hybridmoe plan` for the details.",
        )
    return plan


def user_chat_template(path: str | None):
    """--chat-template FILE, read and checked now (before a model loads, which takes minutes):
    the TemplateFile ``load_session`` renders with instead of the model's own, or None."""
    if path is None:
        return None
    from hybridmoe.backend.text.chat_template import read_template_file

    return read_template_file(path)


CHAT_TEMPLATE_HELP = ("a Jinja chat template file to use instead of the model's own (one with a mistake, say); "
                      "it renders in the same sandbox")


def _say_fallback(why) -> None:
    # Said whether or not stderr is a terminal: it explains why the run uses another backend.
    sys.stderr.write(f"hybridmoe: the embedded engine cannot serve this model, using llama.cpp instead: {why.what}\n")


class _BackendChoice:
    """Which backend serves the run (or `serve`) and why: in `run --json` always, and on stderr
    (whether or not it is a terminal) whenever the command line did not decide it: a saved
    plan's backend, or the fallback to llama.cpp."""

    def __init__(self, args):
        self.plan_file = args.plan
        self.backend = args.backend if args.backend != "auto" else "engine"
        self.reason = (f"asked for with --backend {args.backend}" if args.backend != "auto"
                       else "auto: the embedded engine serves this model")

    def chosen(self, backend: str, reason: str) -> None:
        from hybridmoe.backend.backends import BACKEND_NAMES

        self.backend = backend
        self.reason = f"{reason} ({self.plan_file})" if self.plan_file else reason
        sys.stderr.write(f"hybridmoe: backend: {BACKEND_NAMES[backend]}, because {self.reason}; "
                         "choose another with --backend\n")

    def fell_back(self, why) -> None:
        self.backend = "llamacpp"
        self.reason = f"the embedded engine cannot serve this model: {why.what}"
        _say_fallback(why)

    def warn_slow_path(self, plan) -> None:
        """Said on stderr (terminal or not) when the engine serves a model part of which it
        computes on a slow path; where that made `auto` choose, `chosen` said it already."""
        if self.backend == "engine" and plan.engine_slow_path and plan.engine_slow_path not in self.reason:
            sys.stderr.write(f"hybridmoe: warning: {plan.engine_slow_path}; --backend llamacpp reads them in place\n")


class _StderrProgress:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, p: Progress) -> None:
        if self.enabled:
            total = f"/{p.total:g}" if p.total else ""
            sys.stderr.write(f"\r{p.stage}: {p.done:g}{total} {p.unit}  ")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")


def cmd_run(args) -> int:
    # Each wait of a second or more says what it is (on a terminal): the imports and the plan
    # took seconds before anything was shown.
    waiting = Waiting(enabled=sys.stderr.isatty() and not args.json)
    try:
        return _run(args, waiting)
    finally:
        waiting.clear()  # an error is said on a line of its own


def _run(args, waiting: Waiting) -> int:
    from hybridmoe.backend.hub.catalogue import runnable_path
    from hybridmoe.backend.models import inspect_model

    # Usage errors and a wrong model name first: they need no torch, which takes seconds to import.
    if args.prompt is not None and args.text is not None:
        raise UsageError("the prompt is given twice (-p and as an argument)", "Give it once.")
    prompt = read_prompt(args.prompt if args.prompt is not None else args.text)
    waiting.say("reading the model's files")
    path = runnable_path(args.model)  # a path, a name `hybridmoe models` lists, a catalogue name on disk
    model = inspect_model(path)

    waiting.say("loading PyTorch")
    from hybridmoe.backend.backends import load_session
    from hybridmoe.backend.text.sampling import SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop or ()),
    )
    waiting.say("planning the layout")
    plan = load_plan(args, model)
    chat_template = user_chat_template(args.chat_template)
    waiting.clear()  # the load's own progress follows
    interactive = sys.stderr.isatty() and not args.json
    progress = _StderrProgress(interactive)
    cancel = CancelToken()

    def on_sigint(signum, frame):
        if cancel.cancelled:  # the second Ctrl-C: stop now, whatever is running
            raise KeyboardInterrupt
        cancel.cancel()

    backend_choice = _BackendChoice(args)
    signal.signal(signal.SIGINT, on_sigint)
    try:
        session = load_session(args.backend, model, plan, progress, cancel, on_fallback=backend_choice.fell_back,
                               on_choice=backend_choice.chosen, chat_template=chat_template)
        progress.done()
        backend_choice.warn_slow_path(plan)
        if args.record_stats and not session.counts_experts:
            raise UsageError("--record-stats needs the embedded engine; llama.cpp does not report expert activations",
                             "Run with --backend engine, or leave out --record-stats.")
        messages = [Message("system", args.system)] if args.system else []
        messages.append(Message("user", prompt))
        done = None
        waiting.say("reading the prompt")
        for event in session.generate(messages, sampling, cancel):
            waiting.clear()  # the first token: the answer speaks for itself
            if isinstance(event, TextPiece) and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Done):
                done = event
        if args.record_stats:
            session.save_expert_stats(args.record_stats)
        decode_path = session.decode_path
        session.close()  # its threads end before the interpreter does
        if done is not None:
            from hybridmoe.backend.plan.expected import remember_rates

            remember_rates(plan, done.stats)
    finally:
        # The run is over: a Ctrl-C from here on could only interrupt the way out. Python hands
        # SIGINT back to the system's default while it shuts down, so one sent as a run ended
        # killed it (1 of 20 tries at the moment of exit), once with a SIGABRT; ignored stays
        # ignored through the shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.json:
        json.dump(
            {
                "model": model.spec.name,
                "backend": done.stats.backend,
                "backend_reason": backend_choice.reason,
                # Routed experts the engine computes (or would) on a slow path on the CPU; null: none.
                "engine_slow_path": plan.engine_slow_path,
                # Which path computed each new token, per layer group, and why.
                "decode_path": decode_path,
                "text": done.text,
                "token_ids": list(done.token_ids),
                "finish_reason": done.reason,
                "stats": asdict(done.stats),
                # The plan's figures for this run (docs/sizing.md §6), beside the measured ones in stats.
                "plan_expected": {"decode_tokens_per_s": plan.decode_tokens_per_s_expected,
                                  "decode_source": plan.decode_expected_source,
                                  "decode_tokens_per_s_upper_bound": plan.decode_tokens_per_s_upper_bound,
                                  "prefill_tokens_per_s": plan.prefill_tokens_per_s_expected},
            },
            sys.stdout,
        )
        sys.stdout.write("\n")
    else:
        if done.text and not done.text.endswith("\n"):
            sys.stdout.write("\n")
        if interactive:
            s = done.stats
            parts = [f"{s.prompt_tokens} prompt + {s.generated_tokens} generated tokens"]
            if s.time_to_first_token_s is not None:
                parts.append(f"first token {s.time_to_first_token_s:.2f} s")
            if s.prefill_tokens_per_s:
                prefill = plan.prefill_tokens_per_s_expected
                parts.append(f"prefill {s.prefill_tokens_per_s:.1f} tok/s"
                             + (f" (the plan expected {prefill:.1f})" if prefill else ""))
            if s.decode_tokens_per_s:
                expected = plan.decode_tokens_per_s_expected
                bound = plan.decode_tokens_per_s_upper_bound
                source = f" from {plan.decode_expected_source}" if plan.decode_expected_source else ""
                said = ", ".join(([f"the plan expected {expected:.1f}{source}"] if expected else [])
                                 + ([f"at most {bound:.1f}"] if bound else []))
                parts.append(f"decode {s.decode_tokens_per_s:.1f} tok/s" + (f" ({said})" if said else ""))
            if s.main_device_expert_share is not None and plan.main_device != "cpu":
                parts.append(f"{s.main_device_expert_share:.0%} of experts on the GPU")
            sys.stderr.write(", ".join(parts) + "\n")
            sys.stderr.write(decode_path + "\n")
    return EXIT_CANCELLED if done.reason == "cancelled" else 0


def add_parser(sub) -> None:
    from hybridmoe.app.arguments import positive_int
    from hybridmoe.backend.plan.workload import BACKENDS

    p = sub.add_parser("run", help="answer one prompt (headless): the answer to stdout, progress to stderr")
    p.add_argument("-m", "--model", required=True,
                   help="a model directory, a .gguf file, or a local model's name as `hybridmoe models` lists it")
    p.add_argument("-p", "--prompt", help="the prompt; '-' (or none, with a pipe) reads standard input")
    # As `cat -` reads standard input: `echo question | hybridmoe run -m MODEL -`.
    p.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt, as -p takes it ('-': standard input)")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="stop after this many tokens (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--plan", help="a saved plan (hybridmoe plan --save FILE); default: plan for this machine now")
    p.add_argument("--context", type=positive_int,
                   help=f"context length when no --plan is given (default {DEFAULT_CONTEXT}, or the model's maximum "
                        "when that is less)")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="auto (default): the embedded engine, or llama.cpp when the engine cannot serve the model")
    p.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--record-stats", metavar="FILE", help="save per-expert activation counts for --strategy frequency")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")
    p.set_defaults(func=cmd_run)
