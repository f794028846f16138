"""Chat prompts become the tokens llama-server makes of them: the rendered template tokenized with the
vocabulary's own specials, after dropping a BOS the template wrote itself (llama.cpp common/chat.cpp).
A vocabulary that asks for BOS ("s", Llama-2 style, whose template writes none) gets exactly one."""

from __future__ import annotations

import json

import pytest

from ouroboros_local.chat import for_added_specials
from ouroboros_local.engine import Engine, EngineConfig
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
