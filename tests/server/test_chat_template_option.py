"""--chat-template FILE for `hybridmoe run` and `hybridmoe serve`: a model whose own template has a
mistake can still be used, with a corrected template, rendered in the same sandbox."""

from __future__ import annotations

import json
import shutil

import pytest

from hybridmoe.app.cli import main

MINE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture
def broken_model(tiny_chat_model, tmp_path):
    """The tiny chat model with a syntax error in its chat template (chat_template.jinja wins over
    tokenizer_config.json's)."""
    model = tmp_path / "broken-template-model"
    shutil.copytree(tiny_chat_model, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    return model


def run_json(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["run", *args, "-p", "Hello", "--max-tokens", "2", "--temperature", "0", "--context", "256", "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_a_corrected_template_is_used_instead_of_a_broken_one(broken_model, tmp_path, capsys):
    from hybridmoe.backend.text.chat_template import ChatTemplate
    from hybridmoe.backend.text.tokenizer import load_tokenizer

    code, _, err = run_json(capsys, "-m", str(broken_model))
    assert code == 1 and "chat_template.jinja has a syntax error at line 2" in err
    assert "--chat-template FILE" in err and "Traceback" not in err
    corrected = tmp_path / "corrected.jinja"
    corrected.write_text(MINE, encoding="utf-8")
    code, answer, err = run_json(capsys, "-m", str(broken_model), "--chat-template", str(corrected))
    assert code == 0, err
    rendered = ChatTemplate(MINE).render([{"role": "user", "content": "Hello"}])
    assert rendered == "[user] Hello\n[assistant]"
    assert answer["stats"]["prompt_tokens"] == len(load_tokenizer(broken_model).encode_prompt(rendered))


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_template_file_is_refused_before_the_model_loads(command, tiny_chat_model, tmp_path, capsys,
                                                                 monkeypatch):
    import hybridmoe.backend.backends

    loads = []
    monkeypatch.setattr(hybridmoe.backend.backends, "load_session", lambda *args, **kwargs: loads.append(args))
    broken = tmp_path / "mine.jinja"
    broken.write_text("ok\n{% if %}", encoding="utf-8")
    for path, words in ((tmp_path / "missing.jinja", "does not exist"),
                        (broken, "mine.jinja has a syntax error at line 2")):
        args = [command, "-m", str(tiny_chat_model), "--context", "256", "--chat-template", str(path)]
        args += ["-p", "Hello"] if command == "run" else ["--port", "0"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
    assert loads == []  # refused before the model loads (minutes, for a large one)
    assert "Correct the template in" in err
