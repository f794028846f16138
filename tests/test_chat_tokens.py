"""Chat prompts become the tokens llama-server makes of them: the rendered template tokenized with the
vocabulary's own specials, after dropping a BOS the template wrote itself (llama.cpp common/chat.cpp).
A vocabulary that asks for BOS ("s", Llama-2 style, whose template writes none) gets exactly one."""

from __future__ import annotations

import json

import pytest

from ouroboros_local.chat import for_added_specials
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.errors import ParameterError
from ouroboros_local.llama import Model

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def spm_engine(tiny_sentencepiece):
    eng = Engine(Model(tiny_sentencepiece), None, EngineConfig(n_ctx=256, threads=1, threads_batch=1))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def bpe_engine(tiny_target):
    eng = Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, threads=1, threads_batch=1))
    yield eng
    eng.close()


def test_a_vocabulary_that_adds_bos_gets_one_bos_in_a_chat(spm_engine: Engine) -> None:
    model = spm_engine.target
    assert model.add_bos and model.bos >= 0
    rendered = spm_engine.apply_chat_template(CHAT)
    assert not rendered.startswith(model.token_text(model.bos))     # this template writes no BOS
    tokens = spm_engine.chat_tokens(CHAT)
    assert tokens[0] == model.bos and tokens.count(model.bos) == 1
    assert tokens == spm_engine.tokenize(rendered, add_special=True, parse_special=True)
    assert spm_engine.prompt_tokens("Tell me about the sea.", chat=True) == \
        spm_engine.chat_tokens([{"role": "user", "content": "Tell me about the sea."}])


def test_a_bos_the_template_writes_is_not_doubled(spm_engine: Engine) -> None:
    model = spm_engine.target
    bos = model.token_text(model.bos)
    rendered = spm_engine.apply_chat_template(CHAT)
    assert for_added_specials(model, bos + rendered) == rendered
    with_bos = spm_engine.tokenize(for_added_specials(model, bos + rendered), add_special=True)
    assert with_bos == spm_engine.chat_tokens(CHAT)
    # only a leading one is the template's: a BOS text inside a message stays
    assert for_added_specials(model, rendered + bos) == rendered + bos


def test_a_vocabulary_without_bos_tokenizes_the_rendered_chat_as_it_is(bpe_engine: Engine) -> None:
    model = bpe_engine.target
    assert not model.add_bos and not model.add_eos
    rendered = bpe_engine.apply_chat_template(CHAT)
    assert bpe_engine.chat_prompt(CHAT) == rendered
    assert bpe_engine.chat_tokens(CHAT) == bpe_engine.tokenize(rendered, add_special=False, parse_special=True)


def test_the_server_and_the_chat_session_send_the_bos(spm_engine: Engine) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from ouroboros_local.chat_cli import ChatSession
    from ouroboros_local.server.app import ServerConfig, create_app

    want = spm_engine.chat_tokens(CHAT)
    with TestClient(create_app(spm_engine, ServerConfig(model_id="tiny", method="vanilla"))) as client:
        resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.text)["usage"]["prompt_tokens"] == len(want)
    session = ChatSession(spm_engine, system="You are terse.", method="vanilla", max_tokens=1)
    tokens, _, _ = session._tokens(session.messages + [{"role": "user", "content": "Tell me about the sea."}])
    assert tokens == want


def test_templates_render_as_llama_cpp_renders_them(bpe_engine: Engine) -> None:
    """Loop controls, transformers' generation marks and a tojson that neither escapes nor sorts."""
    from ouroboros_local.chat import render_chat

    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}"
                "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                "{{ {'z': '<b> & é', 'a': 1} | tojson }}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]
    assert render_chat(bpe_engine.target, messages, template=template) == '[hi]{"z": "<b> & é", "a": 1}'
    scoped = ("{% for m in messages %}{% generation %}{% set x = m.content %}{% endgeneration %}"
              "[{{ x }}]{% endfor %}")
    assert render_chat(bpe_engine.target, messages, template=scoped) == "[hi][no]"   # no scope of its own


def test_a_conversation_or_chat_ids_as_the_prompt_say_what_to_do(bpe_engine: Engine) -> None:
    """A list of messages as the prompt said "token ids are integers (got {'role': ...})", and chat=True
    with token ids was ignored (the ids taken as they are)."""
    from ouroboros_local.errors import ParameterError

    with pytest.raises(ParameterError, match=r"engine.chat_tokens\(messages\)"):
        bpe_engine.generate(CHAT, chat=True, max_tokens=2)
    with pytest.raises(ParameterError, match="token ids are taken as they are"):
        bpe_engine.generate(bpe_engine.chat_tokens(CHAT), chat=True, max_tokens=2)
    ids = (t for t in bpe_engine.chat_tokens(CHAT))   # a generator is still taken once
    assert bpe_engine.generate(ids, max_tokens=2).tokens == \
        bpe_engine.generate(bpe_engine.chat_tokens(CHAT), max_tokens=2).tokens


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is "}]


@pytest.mark.parametrize("template", [None,   # the model's own (ChatML here)
                                      "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>"
                                      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"])
def test_a_final_assistant_message_can_be_continued(bpe_engine: Engine, template: str | None) -> None:
    """A prefill, as llama-server writes it: the generation prompt, then the message's text as it is."""
    from ouroboros_local.chat import render_chat
    from ouroboros_local.errors import ParameterError

    model = bpe_engine.target
    continued = render_chat(model, PREFILL, continue_final=True, template=template)
    assert continued == render_chat(model, PREFILL[:1], template=template) + "My favourite is "
    empty = [PREFILL[0], {"role": "assistant", "content": ""}]
    assert render_chat(model, empty, continue_final=True, template=template) == \
        render_chat(model, PREFILL[:1], template=template)
    with pytest.raises(ParameterError, match="only an assistant message can be continued; the final message is "
                                             "the user's"):
        render_chat(model, PREFILL[:1], continue_final=True, template=template)
    own = render_chat(model, PREFILL, continue_final=True)   # the engine renders with the model's template
    assert bpe_engine.chat_tokens(PREFILL, continue_final=True) == \
        bpe_engine.tokenize(own, add_special=True, parse_special=True)


def test_template_variables_and_message_names_reach_the_template(bpe_engine: Engine) -> None:
    """chat_template_kwargs (Qwen3's enable_thinking) and a message's name were dropped."""
    from ouroboros_local.chat import render_chat
    from ouroboros_local.errors import ParameterError

    template = ("{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}"
                "{% for m in messages %}{{ m.name | default('-') }}:{{ m.content }};{% endfor %}")
    named = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    model = bpe_engine.target
    assert render_chat(model, named, template=template) == "ann:hi;-:yo;"
    assert render_chat(model, named, template=template, template_kwargs={"enable_thinking": False}) == \
        "[no think]ann:hi;-:yo;"
    for taken in ("messages", "self", "namespace", "raise_exception"):   # 'self' was a TypeError: a 500
        with pytest.raises(ParameterError, match=f"'{taken}' is set by the conversation or the template engine"):
            render_chat(model, named, template=template, template_kwargs={taken: 1})
    with pytest.raises(ParameterError, match="chat template failed: TypeError: 'int' object is not iterable"):
        render_chat(model, named, template="{% for t in tools %}{% endfor %}", template_kwargs={"tools": 5})
    with pytest.raises(ParameterError, match="'name' must be a string"):
        render_chat(model, [{"role": "user", "content": "hi", "name": 3}], template=template)


def test_the_server_continues_a_final_assistant_message_unless_told_otherwise(bpe_engine: Engine) -> None:
    """It was closed and answered anew, and continue_final_message, add_generation_prompt, chat_template,
    chat_template_kwargs, prefix and tool_choice without tools were all taken and ignored."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from ouroboros_local.server.app import ServerConfig, create_app

    def prompt_tokens(**fields) -> int | str:
        resp = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **fields})
        body = json.loads(resp.text)
        return body["usage"]["prompt_tokens"] if resp.status_code == 200 else body["error"]["param"]

    def count(messages, **options) -> int:
        return len(bpe_engine.chat_tokens(messages, **options))

    user = PREFILL[:1]
    with TestClient(create_app(bpe_engine, ServerConfig(model_id="tiny", method="vanilla"))) as client:
        assert prompt_tokens(messages=PREFILL) == count(PREFILL, continue_final=True)
        assert prompt_tokens(messages=PREFILL, continue_final_message=False) == count(PREFILL)
        assert prompt_tokens(messages=PREFILL, add_generation_prompt=True) == count(PREFILL)
        assert prompt_tokens(messages=PREFILL, add_generation_prompt=False) == \
            count(PREFILL, add_generation_prompt=False)
        prefixed = [PREFILL[0], {**PREFILL[1], "prefix": True}]
        assert prompt_tokens(messages=prefixed, add_generation_prompt=True) == count(PREFILL, continue_final=True)
        assert prompt_tokens(messages=user) == count(user)
        assert prompt_tokens(messages=user, add_generation_prompt=False) == count(user, add_generation_prompt=False)
        assert prompt_tokens(messages=user, chat_template_kwargs={"enable_thinking": False}) == count(user)
        for refused in [dict(messages=user, continue_final_message=True),
                        dict(messages=PREFILL, continue_final_message=True, add_generation_prompt=True),
                        dict(messages=[{**user[0], "prefix": True}, PREFILL[1]]),
                        dict(messages=user, add_generation_prompt="yes"),
                        dict(messages=user, chat_template="{{ messages }}"),
                        dict(messages=user, chat_template_kwargs=[1]),
                        dict(messages=user, chat_template_kwargs={"add_generation_prompt": False}),
                        dict(messages=user, chat_template_kwargs={"self": 1}),
                        dict(messages=user, chat_template_kwargs={"tools": [{"type": "function"}]}),
                        dict(messages=[PREFILL[0], {**PREFILL[1], "prefix": "false"}], add_generation_prompt=True),
                        dict(messages=user, tool_choice="required"),
                        dict(messages=user, function_call={"name": "f"})]:
            assert prompt_tokens(**refused) in ("messages", "continue_final_message", "add_generation_prompt",
                                                "chat_template", "chat_template_kwargs", "tool_choice",
                                                "function_call"), refused
        assert prompt_tokens(messages=user, tool_choice="none") == count(user)
        nulled = [PREFILL[0], {**PREFILL[1], "prefix": None}]   # JSON null: as if not given
        assert prompt_tokens(messages=nulled, add_generation_prompt=True) == count(PREFILL)


def test_text_parts_are_joined_one_per_line_as_llama_server_joins_them(bpe_engine: Engine) -> None:
    """Parts were glued: "Summarise this file:" and "import os" reached the model as one line."""
    parts = [{"type": "text", "text": ""}, {"type": "text", "text": "Summarise this file:"},
             {"type": "text", "text": "import os"}]
    joined = [{"role": "user", "content": "Summarise this file:\nimport os"}]
    assert bpe_engine.chat_tokens([{"role": "user", "content": parts}]) == bpe_engine.chat_tokens(joined)


def _model_with(template: str | None, name: str):
    from types import SimpleNamespace

    return SimpleNamespace(chat_template=lambda: template, bos=-1, eos=-1, token_text=lambda t: "",
                           file_id=[name, 1, 2])


@pytest.mark.parametrize("broken", ["{% for m in messages %}{{ m.content }}{% endfor }}",   # does not compile
                                    "{{ foo.bar }}{% for m in messages %}{{ m.content }}{% endfor %}",
                                    "{{ messages | no_such_filter }}"])
def test_a_template_that_does_not_work_falls_back_to_chatml_with_one_note(broken: str, caplog) -> None:
    """It was found at the first render: chat refused every message, and serve answered every chat request
    with a 400 that blamed the client for the model file (llama-server falls back to ChatML at load)."""
    from ouroboros_local.chat import CHATML, fallback_note, render_chat

    model = _model_with(broken, f"broken-{len(broken)}.gguf")
    hello = [{"role": "user", "content": "hi"}]
    with caplog.at_level("WARNING", logger="ouroboros_local"):
        first = render_chat(model, hello)
        assert render_chat(model, hello) == first == render_chat(model, hello, template=CHATML)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["this model's chat template does not work"]
    assert fallback_note(model) is None                        # told once, whoever tells it
    refusing = _model_with("{{ raise_exception('no system role') }}", "refusing.gguf")
    with pytest.raises(ParameterError, match="no system role"):   # its own refusal stays the client's error
        render_chat(refusing, hello)
    assert fallback_note(_model_with(None, f"none-{len(broken)}.gguf")) == "this model has no chat template"


def test_tools_documents_and_other_message_fields_reach_the_template_as_transformers_passes_them() -> None:
    """tools was undefined (`tools | tojson` failed) and reasoning_content was dropped from its message."""
    from ouroboros_local.chat import render_chat

    template = ("{% if tools is not none %}{{ tools | tojson }}{% endif %}{% if documents is none %}[no docs]"
                "{% endif %}{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }};{% endfor %}")
    model = _model_with(template, "tools.gguf")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "hm"}]
    assert render_chat(model, turns) == "[no docs]hi;<think>hm</think>yo;"
    assert render_chat(model, turns, template_kwargs={"tools": [{"name": "f"}]}).startswith('[{"name": "f"}]')


def test_a_template_that_renders_nothing_says_so() -> None:
    from ouroboros_local.chat import render_chat

    with pytest.raises(ParameterError, match="the chat template rendered an empty prompt"):
        render_chat(_model_with("{% if false %}x{% endif %}", "empty.gguf"), [{"role": "user", "content": "hi"}])
