"""Chat templates render exactly as transformers' apply_chat_template renders them, inside a
sandbox that refuses escapes; every failure is one ModelError naming source and line."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from hybridmoe.backend.text.chat_template import FALLBACK_STOP_STRINGS, ChatTemplate
from hybridmoe.backend.text.tokenizer import load_tokenizer
from hybridmoe.backend.errors import ModelError

from .conftest import write_hf_dir

# -- hand-written templates in the style of the real ones (shortened) -----------------------------

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.last and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

DEEPSEEK_V3 = """{%- set ns = namespace(system_prompt='', is_tool=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set ns.system_prompt = message['content'] -%}{%- endif -%}
{%- endfor -%}
{{ bos_token }}{{ ns.system_prompt }}
{%- if tools %}{{ '\\n\\n## Tools\\n' }}{% for tool in tools %}{{ '\\n### ' + tool['function']['name'] + '\\n' + tool['function']['description'] + '\\n```json\\n' + tool['function']['parameters'] | tojson(indent=2) + '\\n```' }}{% endfor %}{% endif %}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}{{ '<｜User｜>' + message['content'] }}
  {%- elif message['role'] == 'assistant' -%}
    {%- if 'tool_calls' in message -%}
      {{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}
      {%- for tool in message['tool_calls'] -%}
        {{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}
      {%- endfor -%}
      {{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
      {{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set ns.is_tool = true -%}{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.is_tool -%}{{ '<｜Assistant｜><think>\\n' }}{%- endif -%}"""

KIMI = """{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and message.role != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- set role_name = message.get('name') or message.role -%}
  {%- if message.role == 'user' -%}
    <|im_user|>{{ role_name }}<|im_middle|>
  {%- elif message.role == 'assistant' -%}
    <|im_assistant|>{{ role_name }}<|im_middle|>
  {%- else -%}
    <|im_system|>{{ role_name }}<|im_middle|>
  {%- endif -%}
  {%- if message.content is string -%}{{ message.content }}
  {%- else -%}{%- for content in message.content -%}{%- if content.type == 'text' -%}{{ content.text }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
  {%- if message.tool_calls -%}
    <|tool_calls_section_begin|>
    {%- for tc in message.tool_calls -%}
      <|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

MIXTRAL = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set system_message = false -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- if loop.index0 == 0 and system_message != false -%}
    {%- set content = system_message + '\\n\\n' + message['content'] -%}
  {%- else -%}{%- set content = message['content'] -%}{%- endif -%}
  {%- if message['role'] == 'user' -%}{{ '[INST] ' + content.strip() + ' [/INST]' }}
  {%- elif message['role'] == 'assistant' -%}{{ ' ' + content.strip() + eos_token }}{%- endif -%}
{%- endfor -%}"""

# Llama-3.1 style: strftime_now, tojson(indent=4), loop controls, {% generation %}.
LLAMA31 = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4, sort_keys=true) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{{- message.content | trim }}{% endgeneration %}{{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
    {%- if loop.index > 20 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

STYLES = {
    "qwen3": (QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "deepseek_v3": (DEEPSEEK_V3, {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "kimi": (KIMI, {"bos_token": "<|im_system|>", "eos_token": "<|im_end|>"}),
    "mixtral": (MIXTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<s>"}),
    "llama31": (LLAMA31, {"bos_token": "<s>", "eos_token": "</s>"}),
}

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Ünïcode ok: 日本語."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And 3+3? Answer with \"quotes\" & <tags>."},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — ünïcode in descriptions stays as is",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]},
        },
    }
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_0"},
    {"role": "user", "content": "Thanks. And in 東京?"},
]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def style_dirs(tmp_path_factory: pytest.TempPathFactory, qwen_bpe: HFTokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("styles")
    return {name: write_hf_dir(root / name, qwen_bpe, {**special, "chat_template": template}) for name, (template, special) in STYLES.items()}


def ours(model: Path, messages, **kwargs) -> str:
    return ChatTemplate.for_tokenizer(load_tokenizer(model)).render(messages, **kwargs)


def reference(transformers, model: Path, messages, **kwargs) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("style", list(STYLES))
def test_conversation_matches_transformers(style: str, style_dirs: dict[str, Path], transformers) -> None:
    expected = reference(transformers, style_dirs[style], CONVERSATION, add_generation_prompt=True)
    assert ours(style_dirs[style], CONVERSATION, add_generation_prompt=True) == expected
    assert "3+3" in expected
    # And without the generation prompt.
    assert ours(style_dirs[style], CONVERSATION, add_generation_prompt=False) == reference(transformers, style_dirs[style], CONVERSATION, add_generation_prompt=False)


@pytest.mark.parametrize("style", ["qwen3", "deepseek_v3", "kimi", "llama31"])
def test_tools_match_transformers(style: str, style_dirs: dict[str, Path], transformers) -> None:
    messages = TOOL_CONVERSATION if style != "llama31" else CONVERSATION
    expected = reference(transformers, style_dirs[style], messages, add_generation_prompt=True, tools=TOOLS)
    assert ours(style_dirs[style], messages, add_generation_prompt=True, tools=TOOLS) == expected
    assert "get_weather" in expected


def test_template_variables_and_continue_final_message(style_dirs: dict[str, Path], transformers) -> None:
    model = style_dirs["qwen3"]
    assert ours(model, CONVERSATION, enable_thinking=False) == reference(transformers, model, CONVERSATION, add_generation_prompt=True, enable_thinking=False)
    assert ours(model, CONVERSATION, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    prefill = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    expected = reference(transformers, model, prefill, continue_final_message=True)
    assert ours(model, prefill, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith("The answer is")


def test_none_fields_and_content_parts(style_dirs: dict[str, Path], transformers) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "image", "image": "x.png"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "ok", "tool_calls": None, "name": None},
        {"role": "user", "content": "again"},
    ]
    model = style_dirs["kimi"]
    assert ours(model, messages) == reference(transformers, model, messages, add_generation_prompt=True)
    assert "None" not in ours(model, messages)


def test_tool_use_template_chosen_with_tools(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    templates = [{"name": "default", "template": "plain{{ messages | length }}"}, {"name": "tool_use", "template": "tools{{ tools | length }}"}]
    model = write_hf_dir(tmp_path / "m", qwen_bpe, {"chat_template": templates})
    template = ChatTemplate.for_tokenizer(load_tokenizer(model))
    assert template.render([{"role": "user", "content": "x"}]) == "plain1"
    assert template.render([{"role": "user", "content": "x"}], tools=TOOLS) == "tools1"


# -- semantics of the helpers ------------------------------------------------------------------------


def test_tojson_has_transformers_semantics() -> None:
    value = {"b": "ünï <&>", "a": [1, 2]}
    t = ChatTemplate("{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(separators=(',', ':'), sort_keys=true) }}|{{ v | tojson(ensure_ascii=true) }}")
    out = t.render([{"role": "user", "content": ""}], v=value).split("|")
    assert out == [json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2), json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True), json.dumps(value)]


def test_strftime_now_loop_controls_and_trim_blocks() -> None:
    t = ChatTemplate("{{ strftime_now('%Y') }}\n{% for m in messages %}\n  {% if loop.index == 2 %}{% break %}{% endif %}\n{{ m.content }}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == f"{datetime.now().year}\na\n"


def test_caller_messages_are_not_modified() -> None:
    messages = [{"role": "user", "content": "x", "reasoning": "r"}]
    ChatTemplate("{{ messages[0].reasoning_content }}").render(messages)
    assert messages == [{"role": "user", "content": "x", "reasoning": "r"}]


# -- fallback ----------------------------------------------------------------------------------------


def test_fallback_when_model_has_no_template(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    model = write_hf_dir(tmp_path / "base", qwen_bpe, {"eos_token": "<|endoftext|>"})
    template = ChatTemplate.for_tokenizer(load_tokenizer(model))
    assert template.is_fallback and "fallback" in template.origin
    assert template.stop_strings == FALLBACK_STOP_STRINGS
    text = template.render(CONVERSATION[:2] + [{"role": "assistant", "content": [{"type": "text", "text": "4"}]}, CONVERSATION[3]])
    assert text == (
        "System: You are a terse assistant. Ünïcode ok: 日本語.\n\n"
        "User: What is 2+2?\n\n"
        "Assistant: 4\n\n"
        'User: And 3+3? Answer with "quotes" & <tags>.\n\n'
        "Assistant:"
    )
    assert not ChatTemplate(QWEN3).is_fallback


# -- sandbox and errors --------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.__class__ }}",
    "{{ (1).__class__.mro() }}",
    "{{ namespace.__init__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% extends '/etc/hosts' %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ messages[0].update({'x': 1}) }}",
    "{{ 'x' * 100000000 }}",
    "{{ 10 ** 100000000 }}",
    "{{ self.__init__ }}",
    "{{ lipsum.__globals__ }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_are_refused(source: str) -> None:
    template = ChatTemplate(source, origin="evil/tokenizer_config.json")
    with pytest.raises(ModelError) as info:
        template.render([{"role": "user", "content": "hi"}])
    message = str(info.value)
    assert "chat template from evil/tokenizer_config.json" in message and "not allowed" in message
    assert "line 1" in message or "loading another template" in message


def test_undefined_names_fail_clearly() -> None:
    with pytest.raises(ModelError, match=r"chat template from t\.jinja failed at line 2: 'os' is undefined"):
        ChatTemplate("ok\n{{ os.system('touch /tmp/x') }}", origin="t.jinja").render([{"role": "user", "content": ""}])


def test_raise_exception_becomes_model_error(style_dirs: dict[str, Path]) -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ModelError) as info:
        ours(style_dirs["mixtral"], bad)
    message = str(info.value)
    assert "refused the conversation at line 7" in message and "roles must alternate" in message
    assert "tokenizer_config.json" in message and info.value.hint


def test_syntax_error_names_source_and_line() -> None:
    with pytest.raises(ModelError, match=r"chat template from x/chat_template\.jinja has a syntax error at line 3"):
        ChatTemplate("a\nb\n{% if %}", origin="x/chat_template.jinja")


def test_runtime_errors_become_model_errors() -> None:
    with pytest.raises(ModelError, match="at line 1: .*ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render([{"role": "user", "content": ""}])
    with pytest.raises(ModelError, match="at line 2"):
        ChatTemplate("\n{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").render([{"role": "user", "content": ""}])


def test_session_message_dataclasses_render_like_dicts(style_dirs: dict[str, Path]) -> None:
    from hybridmoe.backend.session import Message

    messages = [Message(m["role"], m["content"]) for m in CONVERSATION]
    as_dicts = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    assert ours(style_dirs["qwen3"], messages) == ours(style_dirs["qwen3"], as_dicts)


# -- bounds on size and time -----------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
DOUBLING_24_TIMES = "{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


def test_doubling_a_text_is_refused_at_once_and_small() -> None:
    """The `~` doubling that built a 16 Mi-character prompt at 3.6 GB RSS: in a process of its own,
    to measure its peak memory against the same process rendering a plain template."""
    import subprocess
    import sys

    measure = (
        "import resource, sys\n"
        "from hybridmoe.backend.text.chat_template import ChatTemplate\n"
        "from hybridmoe.backend.errors import ModelError\n"
        "ChatTemplate('{{ messages[0].content }}').render([{'role': 'user', 'content': 'hi'}])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"

        "try:\n"
        "    ChatTemplate(sys.argv[1], origin='evil.jinja').render([{'role': 'user', 'content': 'hi'}])\n"
        "    print('rendered')\n"
        "except ModelError as error:\n"
        "    print(error.what)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", measure, DOUBLING_24_TIMES], cwd=root, capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    grown_mib = float(out[-1])
    assert out[0].startswith("chat template from evil.jinja at line 1 was stopped: a text of 16,777,216 characters")
    assert grown_mib < 64, grown_mib  # refused before the text was built, not after


def test_a_loop_of_ten_to_the_eight_is_stopped_at_the_deadline(monkeypatch) -> None:
    from hybridmoe.backend.text import chat_template

    monkeypatch.setattr(chat_template, "_MAX_RENDER_S", 1.0)  # the real bound, 5 s, makes a slow test
    loops = {
        "nested ranges": "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "one list, no call inside": "{% set r = range(100000) | list %}{% for i in r %}{% for j in r %}"
                                    "{% endfor %}{% endfor %}",
        "printing as it goes": "{% for i in range(10000) %}{% for j in range(10000) %}.{% endfor %}{% endfor %}",
    }
    for name, source in loops.items():
        with pytest.raises(ModelError, match=r"chat template from loop\.jinja.* was stopped: rendering took longer "
                                             r"than 1 s"):
            ChatTemplate(source, origin="loop.jinja").render(HI)


GROWING = {
    "~": DOUBLING_24_TIMES,
    "+ on texts": "{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "* on texts": "{{ 'x' * 100000000 }}",
    "+ on lists": "{% set ns = namespace(l=[1]) %}{% for i in range(24) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "str.replace": "{{ ('x' * 10).replace('', 'y' * 1000000) }}",
    "replace filter": "{{ ('x' * 1000000) | replace('x', 'y' * 100) }}",
    "center filter": "{{ 'x' | center(100000000) }}",
    "str.ljust": "{{ 'x'.ljust(100000000) }}",
    "indent filter": "{{ ('\\n' * 1000000) | indent(100) }}",
    "wordwrap filter": "{{ ('x ' * 1000) | wordwrap(1, wrapstring='y' * 100000) }}",
    "join filter": "{{ (['x' * 1000000] * 100) | join }}",
    "str.join": "{{ ''.join(['x' * 1000000] * 100) }}",
    "join of a text": "{{ ('x' * 1000000) | join('y' * 100) }}",
    "join of a map": "{{ (['x' * 1000000] * 100) | map('string') | join }}",
    "str.join of a map": "{{ ''.join((['x' * 1000000] * 100) | map('string')) }}",
    "str.format width": "{{ '{:>100000000}'.format('x') }}",
    "str.format nested width": "{{ '{:>{}}'.format('x', 100000000) }}",
    "% width": "{{ '%100000000s' % 'x' }}",
    "% star width": "{{ '%*s' % (100000000, 'x') }}",
    "format filter": "{{ '%100000000s' | format('x') }}",
    "printing a list": "{% set a = ['x' * 1000000] * 100 %}{{ a }}",
    "string filter": "{% set a = ['x' * 1000000] * 100 %}{{ a | string }}",
    "tojson": "{% set a = ['x' * 1000000] * 100 %}{{ a | tojson }}",
    "~ on a list": "{% set a = ['x' * 1000000] * 100 %}{{ 'p' ~ a }}",
    "nested lists printed": "{% set a = ['x' * 1000] * 1000 %}{% set b = [a] * 1000 %}{{ b | trim }}",
    "sum of lists": "{{ ([[1]] * 1000000) | sum(start=[]) | length }}",
    "batch": "{{ [1] | batch(1000000000, 'x') | list }}",
    "big numbers": "{% set ns = namespace(n=10 ** 1000) %}{% for i in range(30) %}{% set ns.n = ns.n * ns.n %}"
                   "{% endfor %}",
    "lipsum": "{{ lipsum(1000000) }}",
}


@pytest.mark.parametrize("source", GROWING.values(), ids=GROWING.keys())
def test_growing_a_value_past_the_bounds_is_refused_before_it_is_built(source: str) -> None:
    with pytest.raises(ModelError) as info:
        ChatTemplate(source, origin="evil.jinja").render(HI)
    message = str(info.value)
    assert "chat template from evil.jinja" in message
    assert any(words in message for words in ("would be built", "not allowed")), message


def test_a_long_conversation_still_renders_with_a_real_template(style_dirs: dict[str, Path], transformers) -> None:
    conversation = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "text " * 400}
                    for i in range(400)]  # 800 kB of text: far more than a prompt usually is
    expected = reference(transformers, style_dirs["qwen3"], conversation, add_generation_prompt=True)
    assert ours(style_dirs["qwen3"], conversation) == expected


# -- a template the user supplies -----------------------------------------------------------------


def test_a_template_file_is_checked_when_it_is_read(tmp_path: Path) -> None:
    from hybridmoe.backend.text.chat_template import TemplateFile, read_template_file
    from hybridmoe.backend.errors import UsageError

    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", encoding="utf-8")
    assert read_template_file(good) == TemplateFile(good.read_text(), str(good))
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{% if %}", encoding="utf-8")
    with pytest.raises(UsageError, match=r"broken\.jinja has a syntax error at line 2") as info:
        read_template_file(broken)
    assert info.value.hint == f"Correct the template in {broken}."
    (tmp_path / "latin1.jinja").write_bytes("caf\xe9".encode("latin-1"))
    cases = {tmp_path / "missing.jinja": "does not exist", tmp_path: "is not a file",
             tmp_path / "latin1.jinja": "is not UTF-8 text"}
    for path, words in cases.items():
        with pytest.raises(UsageError, match=words):
            read_template_file(path)


def test_a_supplied_template_replaces_the_models_own_with_its_special_tokens() -> None:
    from hybridmoe.backend.text.chat_template import TemplateFile

    mine = TemplateFile("{{ bos_token }}{{ messages[0].content }}!", "mine.jinja")
    template = ChatTemplate("{% if %} the model's own, broken", origin="model/chat_template.jinja",
                            special_tokens={"bos_token": "<s>"}, tool_use_source="{% broken too", replacement=mine)
    assert template.origin == "mine.jinja" and template.render(HI) == "<s>hi!"
    assert template.render(HI, tools=[{"type": "function"}]) == "<s>hi!"
    with pytest.raises(ModelError, match="give a corrected one to `hybridmoe run` or `hybridmoe serve` with "
                                         "--chat-template FILE"):
        ChatTemplate("{% if %}", origin="model/chat_template.jinja")  # without a replacement: the model's own
