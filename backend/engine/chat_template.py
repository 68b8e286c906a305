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
templates or files, and string/list repetition and powers are size-capped. Every failure
(syntax error, sandbox refusal, ``raise_exception``, undefined name, runtime error) becomes one
``ModelError`` naming the template's source and line.

A model without a chat template gets ``FALLBACK_TEMPLATE`` (``is_fallback`` tells the UI to
say so).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import (
    SecurityError,
    TemplateError,
    TemplateSyntaxError,
    UndefinedError,
)
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.errors import ModelError

if TYPE_CHECKING:
    from backend.engine.tokenizer import Tokenizer

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

# Output-size caps for operators a template could use to exhaust memory.
_MAX_REPEAT_LEN = 1_000_000
_MAX_POWER_EXPONENT = 1_000

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
    ):
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
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The tokenizer's default template (or the fallback), with its special tokens."""
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
        # Plain copies first (messages may be dataclasses such as backend.session.Message).
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


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "" and only raises when used
        # further; a template probing __class__ or __globals__ is refused outright instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT_LEN:
                    raise SecurityError(f"repeating a sequence to {len(seq) * n} items is not allowed")
            return operator.mul(left, right)
        if operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_POWER_EXPONENT:
                raise SecurityError(f"raising to the power {right} is not allowed")
            return operator.pow(left, right)
        return super().call_binop(context, operator_name, left, right)


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
    )
    env.filters["tojson"] = _tojson
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
            "The model's chat template cannot be used; supply a corrected template.",
        ) from exc


def _render(template: jinja2.Template, origin: str, **context: Any) -> str:
    try:
        return template.render(**context)
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
