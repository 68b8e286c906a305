"""Chat messages to prompt text, through the model's own chat template.

Chat templates come with the model (tokenizer_config.json, chat_template.jinja, GGUF
metadata), so they are untrusted code. They render in jinja2's ImmutableSandboxedEnvironment
configured the way transformers' ``apply_chat_template`` configures it, so a template renders
here exactly as it does there: ``trim_blocks``/``lstrip_blocks``, the loop-controls extension,
a no-op ``{% generation %}`` block, ``raise_exception``, ``strftime_now``, a ``tojson`` with
json.dumps semantics (``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), and the
special tokens (``bos_token``, ``eos_token``, ...) as strings. Inputs are copied into plain JSON
types first and ``None`` fields are dropped, as transformers does.

On top of the sandbox: reaching for an unsafe attribute (``__class__``, ``__globals__``,
``mro``, ...) fails at once instead of quietly rendering nothing, templates cannot load other
templates or files, and one render is bounded in size and time (``_MAX_TEXT_LEN``,
``_MAX_ITEMS``, ``_MAX_RENDER_S``). The bounds are checked generally rather than per operator:
every value an operator, call, filter, ``~`` or ``{{ }}`` produces is size-checked; the few
operations that can multiply a size in one step (repetition, ``replace``, padding, ``join``,
formatting, ``indent``, ...) are estimated before they run; printing a container counts the
objects it holds many times over; and every ``for`` loop, call and output chunk checks the
deadline. Every failure (syntax error, sandbox refusal, limit, ``raise_exception``, undefined
name, runtime error) becomes one ``ModelError`` naming the template's source and line.

``--chat-template FILE`` (``hybridmoe run``/``serve``) replaces a model's template:
``read_template_file`` checks the file and gives a ``TemplateFile``, which ``load_session`` (its
``chat_template`` argument) hands to the backend: its session renders with the file instead of
the model's own template, with the model's special tokens.

A model without a chat template gets ``FALLBACK_TEMPLATE`` (``is_fallback`` tells the UI to
say so).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import string
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.defaults import DEFAULT_FILTERS
from jinja2.exceptions import (
    SecurityError,
    TemplateError,
    TemplateSyntaxError,
    UndefinedError,
)
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridmoe.backend.errors import ModelError, UsageError

if TYPE_CHECKING:
    from hybridmoe.backend.text.tokenizer import Tokenizer

# The format used when a model has no chat template: plain role-prefixed paragraphs, which
# base models continue sensibly and which needs no special tokens:
#
#     System: You are terse.
#
#     User: Hi
#
#     Assistant:
#
# A reply ends where the model starts the next user turn (FALLBACK_STOP_STRINGS).
FALLBACK_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.content is string -%}{%- set text = message.content -%}"
    "{%- else -%}{%- set text = message.content | selectattr('text', 'defined') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{ message.role | capitalize }}: {{ text | trim }}{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)
FALLBACK_STOP_STRINGS = ("\nUser:",)
FALLBACK_ORIGIN = "built-in fallback template (the model has no chat template)"

# What one render may build and how long it may take: far beyond any real template (which
# renders a conversation in milliseconds), far below what exhausts the machine. 8 Mi characters
# is over two million tokens, more than any model's context.
_MAX_TEXT_LEN = 8 * 2**20  # characters in the prompt and in any text built on the way
_MAX_ITEMS = 1_000_000  # items in any list or mapping built
_MAX_INT_BITS = 4_096  # a template has no use for numbers beyond 1e1200
_MAX_POWER_EXPONENT = 1_000
_MAX_JSON_INDENT = 64
_MAX_SUMMED_COPIES = 10**8  # items copied by `sum` on lists (a fraction of a second)
_MAX_RENDER_S = 5.0
# The deadline is read every this many loop iterations (reading the clock costs more than one).
_ITERATIONS_PER_CLOCK_READ = 256
# A --chat-template file larger than this is not a chat template.
_MAX_TEMPLATE_FILE_BYTES = 1 * 2**20

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """One compiled chat template (plus the model's "tool_use" variant, when it has one)."""

    def __init__(
        self,
        source: str | None,
        *,
        origin: str = "chat template",
        special_tokens: Mapping[str, str] | None = None,
        tool_use_source: str | None = None,
        tool_use_origin: str | None = None,
        replacement: TemplateFile | None = None,
    ):
        if replacement is not None:  # --chat-template FILE: the user's template wins over the model's
            source, origin, tool_use_source = replacement.source, replacement.origin, None
        self.is_fallback = source is None
        self.source = FALLBACK_TEMPLATE if source is None else source
        self.origin = FALLBACK_ORIGIN if source is None else origin
        # Stop strings the caller should add: only the fallback format needs any; real templates
        # end turns with special tokens, which the tokenizer's stop ids cover.
        self.stop_strings: tuple[str, ...] = FALLBACK_STOP_STRINGS if source is None else ()
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self._template = _compile(self.source, self.origin)
        self._tool_use = None
        if tool_use_source is not None:
            self._tool_use = (_compile(tool_use_source, tool_use_origin or origin), tool_use_source, tool_use_origin or origin)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, replacement: TemplateFile | None = None) -> ChatTemplate:
        """The tokenizer's default template (or the fallback, or `replacement`), with its special tokens."""
        templates, origins = tokenizer.chat_templates, tokenizer.chat_template_origins
        default = templates.get("default")
        if default is None and templates:  # several named templates, none called default
            name = min(templates)
            default, origins = templates[name], {**origins, "default": origins.get(name, name)}
        return cls(
            default,
            origin=origins.get("default", "chat template"),
            special_tokens=tokenizer.special_tokens,
            tool_use_source=templates.get("tool_use"),
            tool_use_origin=origins.get("tool_use"),
            replacement=replacement,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **variables: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with "role", "content", and whatever else
        the template reads: tool_calls, reasoning_content, ...).

        ``tools`` are JSON schemas; ``variables`` go to the template as they are (e.g.
        ``enable_thinking=False`` for Qwen3, ``reasoning_effort="high"`` for gpt-oss) and
        override the special tokens of the same name. ``continue_final_message`` leaves the
        last message open so the model continues it (prefill), as transformers does.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        if not messages:
            raise ValueError("cannot render an empty conversation")
        # Plain copies first (messages may be dataclasses such as hybridmoe.backend.session.Message).
        chat = _alias_reasoning_fields([_drop_none(m) for m in _plain(list(messages))])
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be mappings, got {message!r}")
        template, origin = self._template, self.origin
        if tools is not None and self._tool_use is not None:
            template, _, origin = self._tool_use

        final_text = None
        if continue_final_message:
            final_text = _tag_final_message(chat)

        context = {**self.special_tokens, **_plain(variables)}
        text = _render(
            template,
            origin,
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
        if final_text is not None:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise ModelError(
                    f"chat template from {origin} dropped the final message, so it cannot be continued",
                    "Send the conversation without continuing the last message.",
                )
            cut = text.rindex(tag)
            # Templates that strip message text also strip the space the tag carried.
            text = text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()
        return text


# -- a template the user supplies (--chat-template FILE) -----------------------------------------

@dataclasses.dataclass(frozen=True)
class TemplateFile:
    """A chat template the user supplies in place of the model's own: its text and where it
    came from (for error messages)."""

    source: str
    origin: str


def read_template_file(path: str | Path) -> TemplateFile:
    """A chat template file, checked: readable UTF-8 text that compiles. The file is jinja
    text for the same sandbox as a model's template, never Python."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise UsageError(f"the chat template {path} is not a file", "Give a Jinja template file.")
        if size > _MAX_TEMPLATE_FILE_BYTES:
            raise UsageError(f"the chat template {path} has {size:,} bytes; chat templates have a few thousand",
                             "Give a Jinja template file (such as a model's chat_template.jinja).")
        source = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"the chat template {path} does not exist", "Check the path given to --chat-template.")
    except OSError as error:
        raise UsageError(f"cannot read the chat template {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"the chat template {path} is not UTF-8 text (byte {error.start})",
                         "Give a Jinja template file (such as a model's chat_template.jinja).") from error
    origin = str(path)
    try:
        _compile(source, origin)
    except ModelError as error:
        raise UsageError(error.what, f"Correct the template in {path}.") from error
    return TemplateFile(source, origin)


# -- environment --------------------------------------------------------------------------------


class _TemplateRaised(TemplateError):
    """raise_exception() called by the template itself: it refuses the conversation."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for inference it simply renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _RefusingLoader(jinja2.BaseLoader):
    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str | None, Any]:
        raise SecurityError(f"loading another template or file ({template!r}) is not allowed")


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, which could shadow its internals (as in
    transformers)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"storing the underscore name {name!r} on a namespace is not allowed")


class _Dict:
    """dict() for templates, without exposing the dict type itself (its mro, subclasses)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _LimitExceeded(SecurityError):
    """The render went past a bound on size or time (``_MAX_TEXT_LEN``, ...)."""


# The time.monotonic() by which the render in progress in this thread must end (renders may
# run in several threads at once).
_render_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("chat_template_deadline",
                                                                                 default=None)


def _check_time() -> None:
    deadline = _render_deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise _LimitExceeded(f"rendering took longer than {_MAX_RENDER_S:g} s")


def _refuse_text(length: int, what: str = "a text") -> None:
    if length > _MAX_TEXT_LEN:
        raise _LimitExceeded(f"{what} of {length:,} characters would be built; the limit is {_MAX_TEXT_LEN:,}")


def _checked(value: Any) -> Any:
    """``value`` when it is within the size bounds (anything a template builds passes here)."""
    if isinstance(value, str):
        _refuse_text(len(value))
    elif isinstance(value, (list, tuple, dict)):
        if len(value) > _MAX_ITEMS:
            raise _LimitExceeded(f"a collection of {len(value):,} items would be built; the limit is {_MAX_ITEMS:,}")
    elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise _LimitExceeded(f"a number of {value.bit_length():,} bits would be built; the limit is {_MAX_INT_BITS:,}")
    return value


def _text_size(value: Any) -> int:
    """A lower bound of ``len(str(value))``, computed without building the text, and exact
    enough to refuse: a list holding one large list many times is cheap to build but huge to
    print, so a container counts what it holds as often as it holds it. Stops counting once past
    the limit; a container met again counts its first size (no walk is repeated)."""
    if isinstance(value, str):
        return len(value)
    sizes: dict[int, int] = {}
    todo: list[tuple[Any, bool]] = [(value, False)]  # (object, its parts are counted)
    while todo:  # depth-first without recursion: nesting depth is the template's to choose
        item, counted = todo.pop()
        if counted:
            sizes[id(item)] = 2 + sum(sizes.get(id(part), 1) + 2 for part in _parts(item))
            if sizes[id(item)] > _MAX_TEXT_LEN:
                return sizes[id(item)]
        elif isinstance(item, str):
            sizes[id(item)] = len(item) + 2  # quoted inside a container
        elif isinstance(item, (list, tuple, dict)) and id(item) not in sizes:
            sizes[id(item)] = 0  # a container holding itself counts itself as empty
            todo.append((item, True))
            todo.extend((part, False) for part in _parts(item))
    return sizes.get(id(value), 1)


def _parts(container: Any) -> Iterator[Any]:
    if isinstance(container, dict):
        for key, item in container.items():
            yield key
            yield item
    else:
        yield from container


def _materialized(value: Any) -> Any:
    """An iterator (``map``, ``select``, ...) as a list, so that its size can be known before a
    filter joins or prints it; anything else as it is."""
    if isinstance(value, Iterator):
        return _checked(list(value))
    return value


# -- estimates of the operations that can multiply a size in one step ----------------------------

_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(template: str, args: Any) -> None:
    """``template % args``: refused before it runs when its widths or its arguments are too large."""
    values = args if isinstance(args, tuple) else (args,)
    star = False
    for match in _PRINTF_FIELD.finditer(template):
        for number in match.groups():
            star = star or number == "*"
            if number and number != "*":
                _refuse_text(int(number), "a padded field")
    if star:
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool):
                _refuse_text(abs(value), "a padded field")
    _refuse_text(len(template) + _text_size(args))


def _check_str_format(template: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """``template.format(...)``: refused before it runs when its widths or arguments are too large."""
    nested = False
    for _, field, spec, _ in string.Formatter().parse(template):
        if field is not None and spec:
            nested = nested or "{" in spec
            for number in re.findall(r"\d+", spec):
                _refuse_text(int(number), "a padded field")
    if nested:  # a width given as an argument: "{:{}}".format(x, 10**9)
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                _refuse_text(abs(value), "a padded field")
    _refuse_text(len(template) + sum(_text_size(v) for v in (*args, *kwargs.values())))


def _replaced_length(text: str, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


def _joined_length(items: Any, separator: str) -> int:
    if isinstance(items, str):  # joined character by character
        return len(items) * (1 + len(separator))
    if not isinstance(items, (list, tuple, dict)):
        return 0  # not a collection: join refuses it
    return sum(_text_size(item) for item in items) + len(separator) * len(items)


def _width(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """The str methods whose result can be far larger than their inputs, estimated first."""
    if name == "replace" and len(args) >= 2:
        _refuse_text(_replaced_length(text, *args[:3]))
    elif name in ("center", "ljust", "rjust", "zfill") and args:
        _refuse_text(_width(args[0]), "a padded text")
    elif name == "expandtabs":
        tab = _width(args[0] if args else kwargs.get("tabsize", 8))
        _refuse_text(len(text) + text.count("\t") * tab)
    elif name == "join" and args:
        _refuse_text(_joined_length(args[0], text))
    elif name == "format":
        _check_str_format(text, args, kwargs)
    elif name == "format_map" and args and isinstance(args[0], Mapping):
        _check_str_format(text, (), args[0])


def _check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """Filters whose result can be far larger than their input, estimated first; any other filter
    that prints a container has that container's printed size checked."""
    if name == "center":
        _refuse_text(_width(args[0] if args else kwargs.get("width", 80)), "a padded text")
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        prefix = len(width) if isinstance(width, str) else _width(width)
        text = value if isinstance(value, str) else ""
        _refuse_text(_text_size(value) + (text.count("\n") + 1) * prefix)
    elif name == "wordwrap":
        width = _width(args[0] if args else kwargs.get("width", 79)) or 1
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring")
        text = value if isinstance(value, str) else ""
        breaks = len(text) // width + text.count(" ") + text.count("\n") + 1  # lines, at most
        _refuse_text(len(text) + breaks * len(wrap if isinstance(wrap, str) else "\n"))
    elif name == "replace" and isinstance(value, str) and len(args) >= 2:
        _refuse_text(_replaced_length(value, *args[:3]))
    elif name == "join":
        _refuse_text(_joined_length(value, str(args[0] if args else kwargs.get("d", ""))))
    elif name == "format" and isinstance(value, str):
        _check_printf(value, kwargs or args)
    elif name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        if (len(indent) if isinstance(indent, str) else _width(indent)) > _MAX_JSON_INDENT:
            raise _LimitExceeded(f"a JSON indent of more than {_MAX_JSON_INDENT} is not allowed")
        _refuse_text(_text_size(value))
    elif name in ("batch", "slice"):
        count = _width(args[0] if args else 0)
        if count > _MAX_ITEMS:
            raise _LimitExceeded(f"lists of {count:,} items would be built by {name}; the limit is {_MAX_ITEMS:,}")
    elif name == "sum":
        lists = [v for v in (value if isinstance(value, (list, tuple)) else ()) if isinstance(v, (list, tuple))]
        items = sum(len(v) for v in lists)
        # Each addition copies the sum so far: the copies grow with the lists times their items.
        if items > _MAX_ITEMS or len(lists) * items > _MAX_SUMMED_COPIES:
            raise _LimitExceeded(f"summing {len(lists):,} lists of {items:,} items in all is not allowed")
    elif name not in _FILTERS_THAT_DO_NOT_PRINT and isinstance(value, (list, tuple, dict)):
        _refuse_text(_text_size(value), "a printed collection")


# Filters that take a collection without turning it into text.
_FILTERS_THAT_DO_NOT_PRINT = frozenset({
    "abs", "attr", "count", "d", "default", "dictsort", "first", "groupby", "items", "last", "length",
    "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "select", "selectattr",
    "sort", "unique",
})


def _bounded_filter(name: str, function: Any) -> Any:
    """``function`` (a filter) with its time, estimate and result checks."""
    value_at = 1 if jinja2.utils._PassArg.from_obj(function) is not None else 0

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        if len(args) > value_at:
            value = _materialized(args[value_at])
            args = (*args[:value_at], value, *args[value_at + 1 :])
            _check_filter(name, value, args[value_at + 1 :], kwargs)
        result = function(*args, **kwargs)
        return _checked(result) if not isinstance(result, Iterator) else result

    return bounded


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    # About eight characters a word.
    _refuse_text(_width(n) * _width(max) * 8, "a lorem ipsum text")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """The parsed template, with every ``~`` and every ``for`` loop routed through the checks
        below: jinja compiles ``~`` to a plain join and loops to plain Python loops, neither of
        which the sandbox sees."""
        tree = super()._parse(source, name, filename)
        for concat in tree.find_all(jinja2.nodes.Concat):
            concat.nodes = [_environment_call("checked_concat", concat.nodes, concat.lineno)]
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = _environment_call("timed_iteration", [loop.iter], loop.iter.lineno)
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "" and only raises when used
        # further; a template probing __class__ or __globals__ is refused outright instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator_name == "*":
            for seq, n in ((left, right), (right, left)):
                limit = _MAX_TEXT_LEN if isinstance(seq, str) else _MAX_ITEMS
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                    raise SecurityError(f"repeating a sequence to {len(seq) * n:,} items is not allowed "
                                        f"(the limit is {limit:,})")
        elif operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_POWER_EXPONENT:
                raise SecurityError(f"raising to the power {right} is not allowed")
        elif operator_name == "%" and isinstance(left, str):
            _check_printf(left, right)
        return _checked(super().call_binop(context, operator_name, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        _check_time()
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        if isinstance(getattr(method, "__self__", None), str):
            # Without the loop and block variables jinja passes along for macros.
            given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            args = tuple(_materialized(arg) for arg in args)  # ''.join(a generator) is sized too
            _check_str_method(method.__self__, getattr(method, "__name__", ""), args, given)
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def checked_concat(self, *parts: Any) -> str:
        """``a ~ b ~ ...``: sized before it is built."""
        _check_time()
        _refuse_text(sum(_text_size(part) for part in parts))
        return "".join(map(str, parts))

    def timed_iteration(self, iterable: Any) -> Iterator[Any]:
        """A ``for`` loop's items, with the deadline checked as they go."""
        _check_time()
        for count, item in enumerate(iterable, 1):
            if count % _ITERATIONS_PER_CLOCK_READ == 0:
                _check_time()
            yield item


def _environment_call(method: str, args: list[jinja2.nodes.Expr], lineno: int) -> jinja2.nodes.Call:
    # An attribute of the environment, which a template cannot reach or shadow.
    return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(method), args, [], None, None, lineno=lineno)


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}`` before it is printed."""
    _check_time()
    if not isinstance(value, str):
        _refuse_text(_text_size(value), "a printed value")
    return value


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes and forces ASCII; templates are written against
    # transformers' json.dumps version.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Environment:
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        loader=_RefusingLoader(),
        finalize=_finalize,
    )
    env.filters = {name: _bounded_filter(name, function)
                   for name, function in {**DEFAULT_FILTERS, "tojson": _tojson}.items()}
    env.globals["lipsum"] = _bounded_lipsum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


_ENV = _environment()


def _compile(source: str, origin: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as exc:
        raise ModelError(
            f"chat template from {origin} has a syntax error at line {exc.lineno}: {exc.message}",
            "The model's chat template cannot be used; give a corrected one to `hybridmoe run` or "
            "`hybridmoe serve` with --chat-template FILE.",
        ) from exc


def _render(template: jinja2.Template, origin: str, **context: Any) -> str:
    deadline = _render_deadline.set(time.monotonic() + _MAX_RENDER_S)
    try:
        # Chunk by chunk rather than template.render(), to stop at the limit rather than after it.
        chunks, length = [], 0
        for chunk in template.generate(**context):
            length += len(chunk)
            _refuse_text(length, "the prompt")
            _check_time()
            chunks.append(chunk)
        return "".join(chunks)
    except _LimitExceeded as exc:
        raise ModelError(
            f"chat template from {origin}{_where(exc)} was stopped: {exc}",
            "Real chat templates render a conversation in milliseconds, within a few characters per character of "
            "the conversation: this template looks malicious or broken (or the conversation is far longer than "
            "any model's context).",
        ) from exc
    except _TemplateRaised as exc:
        raise ModelError(
            f"chat template from {origin} refused the conversation{_where(exc)}: {exc.message}",
            "The model's template does not accept this conversation: check the message roles and their order "
            "(many templates need user and assistant turns to alternate), and the shape of any tool calls.",
        ) from exc
    except SecurityError as exc:
        raise ModelError(
            f"chat template from {origin}{_where(exc)} does something not allowed: {exc}",
            "Templates run in a sandbox without access to Python internals or files; this template looks malicious or broken.",
        ) from exc
    except TemplateSyntaxError as exc:  # from a template string built at render time
        raise ModelError(f"chat template from {origin} has a syntax error at line {exc.lineno}: {exc.message}") from exc
    except UndefinedError as exc:
        raise ModelError(
            f"chat template from {origin} failed{_where(exc)}: {exc.message}",
            "The template expects something the conversation does not have.",
        ) from exc
    except (TemplateError, RecursionError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
        raise ModelError(f"chat template from {origin} failed{_where(exc)}: {type(exc).__name__}: {exc}") from exc
    finally:
        _render_deadline.reset(deadline)


def _where(exc: BaseException) -> str:
    """' at line N' from the template frames jinja puts into the traceback."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line is not None else ""


# -- inputs -------------------------------------------------------------------------------------


def _drop_none(message: Any) -> Any:
    # APIs send content=None or tool_calls=None; templates handle a missing key but often print
    # "None" for a None value.
    if isinstance(message, Mapping):
        return {k: v for k, v in message.items() if v is not None}
    return message


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only: caller objects can carry methods the sandbox does
    not know to be dangerous, and templates must not mutate the caller's messages."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry extra methods: strip them
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # numpy scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[Any]) -> list[Any]:
    # Reasoning arrives as reasoning_content, thinking or reasoning; Qwen/DeepSeek templates read
    # reasoning_content, gpt-oss reads thinking (the same aliasing transformers applies).
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict]) -> str:
    final = chat[-1].get("content")
    if isinstance(final, str):
        chat[-1]["content"] = final + _CONTINUE_TAG
        return final
    if isinstance(final, list):
        for block in reversed(final):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
    raise ValueError("continue_final_message needs a final message with text content")
