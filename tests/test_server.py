"""The OpenAI-compatible server, started for real on 127.0.0.1 (uvicorn in a thread, or the CLI in a
subprocess) and driven with the official `openai` client and raw HTTP."""

from __future__ import annotations

from types import SimpleNamespace

import http.client as httpclient
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn

from ouroboros_local.engine import Engine, EngineConfig, GenerationResult, GenerationStats
from ouroboros_local.calibration import CostModel
from ouroboros_local.llama import Model
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.server.app import ServerConfig, create_app
from ouroboros_local.server.protocol import stats_body
from ouroboros_local.testing import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
N_CTX = 512
PROMPT = "The lighthouse keeper woke before the sun and"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]


# ---- helpers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving an app in a daemon thread on 127.0.0.1:<free port>."""

    def __init__(self, app: Any):
        self.app = app
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.base = f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def http(base: str, path: str, body: Any = None, *, raw: bytes | None = None, method: str | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, Any, bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def client_for(base: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def assert_error(status: int, body: bytes, expected: int, param: str | None = "?") -> dict[str, Any]:
    assert status == expected, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    return err


SAMPLE = r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})? ([-+0-9.eE]+|NaN|[+-]Inf)$'


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(SAMPLE, line)
        assert m, line
        if m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_idle(base: str, timeout: float = 20.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, body = http(base, "/health", headers=headers)
        state = json.loads(body)
        if status == 200 and not state["busy"] and state["queue_depth"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server is still busy after {timeout}s: {state}")


def slow_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider random model (~50 MB, ~100 tok/s on one thread) whose greedy chat answers run long,
    so a test can interrupt an answer midway. Written once per session."""
    path = tmp_path_factory.getbasetemp() / "slow_chat.gguf"
    if not path.exists():
        write_tiny_model(path, seed=7, n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536,
                         n_ctx_train=4096)
    return path


def long_answer_prompt(engine: Engine, system: str | None = "You are terse.",
                       candidates=("hi", "Hello", "Write some code", "Why?", "ok", "Tell me more")) -> str:
    """A user message whose greedy answer does not end within 80 tokens (the model is random)."""
    for text in candidates:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        tokens = engine.chat_tokens(msgs)
        res = engine.generate(tokens, max_tokens=80, method="vanilla")
        if res.stats.finish_reason == "length":
            return text
    pytest.skip("no candidate prompt gives a long answer with this random model")


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    eng = Engine(Model(tiny_target), Model(tiny_draft), EngineConfig(n_ctx=N_CTX, n_batch=64, n_seq_max=8,
                                                                      threads=1, threads_batch=1))
    eng.check_kv = True
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def live(engine):
    app = create_app(engine, ServerConfig(model_id="tiny", aliases=("tiny-alias",), max_queue=8,
                                          sampling=SamplingParams(temperature=0.0)))
    srv = LiveServer(app)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return client_for(live.base)


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory):
    eng = Engine(Model(slow_chat_model(tmp_path_factory)), None,
                 EngineConfig(n_ctx=2048, n_batch=64, n_seq_max=4, threads=1, threads_batch=1))
    eng.check_kv = True
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def slow_live(slow_engine):
    app = create_app(slow_engine, ServerConfig(model_id="slow", method="vanilla", max_queue=0))
    srv = LiveServer(app)
    yield srv
    srv.stop()


def greedy(engine: Engine, prompt: Any, max_tokens: int, chat: bool = False):
    if chat:
        prompt = engine.chat_tokens(prompt)
    return engine.generate(prompt, max_tokens=max_tokens, method="vanilla",
                           sampling=SamplingParams(temperature=0.0))


# ---- the happy path with the official client ----------------------------------------------------
def test_models_health_and_defaults(live, client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = models.data[0].model_extra["meta"]
    assert card["n_ctx"] == N_CTX and card["draft"] is True
    assert card["default_method"] in card["methods"]
    assert client.models.retrieve("tiny").id == "tiny"
    status, _, body = http(live.base, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_completion_matches_engine_greedy(client, engine):
    expected = greedy(engine, PROMPT, 24)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == ("length" if expected.stats.finish_reason == "length" else "stop")
    assert resp.usage.prompt_tokens == len(engine.tokenize(PROMPT))
    assert resp.usage.completion_tokens == len(expected.tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    stats = resp.model_extra["stats"]
    assert stats["target_passes"] >= 1 and stats["method"]
    assert stats["extra"]["python_ms_per_round"] >= 0 and "time_split" in stats["extra"]
    # Token-id prompts and the model alias work too.
    ids = engine.tokenize(PROMPT)
    resp2 = client.completions.create(model="tiny-alias", prompt=ids, max_tokens=24, temperature=0)
    assert resp2.choices[0].text == expected.text


def test_chat_streaming_equals_non_streaming(client, engine):
    expected = greedy(engine, CHAT, 40, chat=True)
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected.text
    assert full.usage.completion_tokens == len(expected.tokens)

    pieces, finish, usage, roles = [], None, None, []
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(pieces) == expected.text
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stats_carry_extra_but_not_the_servers_file_errors():
    stats = GenerationStats(method="auto", extra={"time_split": {"draft": 0.1}, "history_not_saved": "/srv/x.pool"})
    body = stats_body(GenerationResult("", [], stats))
    assert body["extra"] == {"time_split": {"draft": 0.1}}


def test_completion_streaming(client, engine):
    expected = greedy(engine, PROMPT, 30)
    text = ""
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
                                           stream=True):
        text += chunk.choices[0].text
    assert text == expected.text


def test_raw_sse_format(live):
    status, headers, body = http(live.base, "/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def test_method_override_is_lossless(client, engine):
    base = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32, temperature=0,
                                          extra_body={"method": "vanilla"})
    assert base.model_extra["stats"]["method"] == "vanilla"
    # verification as cheap as a step (a GPU's curve): the scheduler lets the draft model draft here
    sched = engine.scheduler()
    costs, sched.costs = sched.costs, CostModel.flat()
    try:
        spec = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32, temperature=0,
                                              extra_body={"method": "speculative", "method_options": {"gamma": 3}})
    finally:
        sched.costs = costs
    assert spec.model_extra["stats"]["method"] == "speculative"
    assert spec.model_extra["stats"]["drafted"] > 0
    assert spec.choices[0].message.content == base.choices[0].message.content


def test_sampling_seed_and_stop(client, engine):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.9, seed=1234,
                  extra_body={"top_k": 20, "min_p": 0.01})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    greedy_text = greedy(engine, PROMPT, 24).text
    stop = next(greedy_text[i:i + 3] for i in range(4, len(greedy_text) - 3)
                if greedy_text[i:i + 3].strip() and "\ufffd" not in greedy_text[i:i + 3])
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy_text[:greedy_text.index(stop)]
    single = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert single.choices[0].text == cut.choices[0].text
    assert a.model_extra["stats"]["seed"] == 1234 and "seed" not in cut.model_extra["stats"]
    # no seed: the one drawn is in the stats (README), and asked again it gives the same (vanilla) answer
    drawn = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9,
                                      extra_body={"method": "vanilla"})
    seed = drawn.model_extra["stats"]["seed"]
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=seed,
                                      extra_body={"method": "vanilla"})
    assert again.choices[0].text == drawn.choices[0].text


# ---- bad input ----------------------------------------------------------------------------------
LONG = "the sea " * 400   # > N_CTX tokens

BAD_REQUESTS = [
    # (name, path, json body or raw bytes, status, param)
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("deep nesting", "/v1/completions", b"[" * 100000, 400, None),
    ("bad utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
    ("model wrong type", "/v1/completions", {"model": 3, "prompt": "x"}, 400, "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("batched prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("negative token", "/v1/completions", {"prompt": [1, -4]}, 400, "prompt"),
    ("prompt too long", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
     "messages"),
    ("max_tokens too large", "/v1/completions", {"prompt": "x", "max_tokens": N_CTX}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens fraction", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("temperature bool", "/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("NaN top_p", "/v1/completions", b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    ("Infinity temperature", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400,
     "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("negative top_k (-1 is off)", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("min_p one", "/v1/completions", {"prompt": "x", "min_p": 1.0}, 400, "min_p"),
    ("negative seed", "/v1/completions", {"prompt": "x", "seed": -7}, 400, "seed"),
    ("stop wrong type", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("stop list of ints", "/v1/completions", {"prompt": "x", "stop": ["a", 1]}, 400, "stop"),
    ("stream not bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("unknown method", "/v1/completions", {"prompt": "x", "method": "magic"}, 400, "method"),
    ("method_options wrong type", "/v1/completions", {"prompt": "x", "method_options": [1]}, 400,
     "method_options"),
    ("method_options bad value", "/v1/completions",
     {"prompt": "x", "method": "speculative", "method_options": {"gamma": "many"}}, 400, "method_options"),
    ("method_options out of range", "/v1/completions",
     {"prompt": "x", "method": "speculative", "method_options": {"gamma": 0}}, 400, "method_options"),
    # issue 15: requests that once killed the server (O(W^2) allocations before the check) or wrote files
    ("lookahead window 100000", "/v1/completions",
     {"prompt": "x", "max_tokens": 3, "method": "lookahead", "method_options": {"window": 100000}}, 400,
     "method_options"),
    ("lookahead window 20000", "/v1/completions",
     {"prompt": "x", "method": "lookahead", "method_options": {"window": 20000}}, 400, "method_options"),
    # checked once the generation begins, where the window meets the context's sequence ids
    ("lookahead window beyond the sequence ids", "/v1/completions",
     {"prompt": "x", "max_tokens": 3, "method": "lookahead", "method_options": {"window": 16}}, 400,
     "method_options"),
    ("ouroboros window 100000", "/v1/completions",
     {"prompt": "x", "method": "ouroboros", "method_options": {"window": 100000}}, 400, "method_options"),
    ("prompt-lookup max_ngram 1e9", "/v1/completions",
     {"prompt": "x", "method": "prompt-lookup", "method_options": {"max_ngram": 1000000000}}, 400,
     "method_options"),
    ("unknown method option", "/v1/completions",
     {"prompt": "x", "method": "prompt-lookup", "method_options": {"windoww": 4}}, 400, "method_options"),
    ("pool path from a request", "/v1/completions",
     {"prompt": "x", "method": "ouroboros", "method_options": {"pool": "/tmp/evil.pool"}}, 400,
     "method_options"),
    # the shared suffix trie's bounds: one request must not evict the others' history or unbound the trie
    ("suffix history cut to one request", "/v1/completions",
     {"prompt": "x", "method": "suffix", "method_options": {"max_requests": 1}}, 400, "method_options"),
    ("suffix history of 10M tokens", "/v1/completions",
     {"prompt": "x", "method": "suffix", "method_options": {"max_tokens": 10_000_000}}, 400, "method_options"),
    ("option of the wrong type", "/v1/completions",
     {"prompt": "x", "method": "lookahead", "method_options": {"level": [3]}}, 400, "method_options"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    # JSON may escape half of a UTF-16 pair, which is not text (once a 500 from the encoder)
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', 400, "messages"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "\\udfff"}', 400, "prompt"),
    ("text part without text", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]}, 400, "messages"),
    ("n = 2", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("penalty", "/v1/chat/completions", {"messages": CHAT, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("logprobs", "/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    # completions' logprobs 0 still asks for the chosen tokens' logprobs (it was ignored)
    ("logprobs 0", "/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs"),
    # llama.cpp-style samplers that change the distribution were ignored
    ("repeat_penalty", "/v1/completions", {"prompt": "x", "repeat_penalty": 1.1}, 400, "repeat_penalty"),
    ("typical_p", "/v1/chat/completions", {"messages": CHAT, "typical_p": 0.9}, 400, "typical_p"),
    ("mirostat", "/v1/completions", {"prompt": "x", "mirostat": 2}, 400, "mirostat"),
    ("ignore_eos", "/v1/completions", {"prompt": "x", "ignore_eos": True}, 400, "ignore_eos"),
    ("grammar", "/v1/chat/completions", {"messages": CHAT, "grammar": "root ::= \"a\""}, 400, "grammar"),
    # vLLM's and llama-server's fields that constrain or reorder were answered 200 and ignored
    ("guided_choice", "/v1/chat/completions", {"messages": CHAT, "guided_choice": ["a", "b"]}, 400,
     "guided_choice"),
    ("min_tokens", "/v1/completions", {"prompt": "x", "min_tokens": 5}, 400, "min_tokens"),
    ("bad_words", "/v1/completions", {"prompt": "x", "bad_words": ["the"]}, 400, "bad_words"),
    ("stop_token_ids", "/v1/completions", {"prompt": "x", "stop_token_ids": [3]}, 400, "stop_token_ids"),
    ("samplers reordered", "/v1/completions",
     {"prompt": "x", "temperature": 0.8, "samplers": ["temperature", "top_k", "top_p", "min_p"]}, 400, "samplers"),
    ("samplers without top_p", "/v1/completions", {"prompt": "x", "temperature": 0.8, "top_p": 0.9,
                                                   "samplers": ["top_k", "min_p", "temperature"]}, 400, "samplers"),
    ("samplers as letters, reordered", "/v1/completions", {"prompt": "x", "temperature": 0.8, "samplers": "tkpm"},
     400, "samplers"),
    ("min_keep", "/v1/completions", {"prompt": "x", "min_keep": 5}, 400, "min_keep"),
    ("json mode on completions", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    # an earlier tool call, a user turn without text and audio output were taken, the tool call dropped
    ("tool call in the history", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "user", "content": "and?"}]}, 400, "messages"),
    ("user turn without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("audio output", "/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("audio settings", "/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "x"}}, 400, "audio"),
    # a setting that does nothing without streaming was ignored, as OpenAI refuses it
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # the field the client sent is the one named (it said max_tokens)
    ("max_completion_tokens negative", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1},
     400, "max_completion_tokens"),
    ("max_completion_tokens too large", "/v1/chat/completions",
     {"messages": CHAT, "max_completion_tokens": N_CTX}, 400, "max_completion_tokens"),
    # two length limits that disagree: max_completion_tokens was dropped silently
    ("two length limits", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "max_completion_tokens": 3},
     400, "max_completion_tokens"),
    ("n_predict below -1", "/v1/completions", {"prompt": "x", "n_predict": -2}, 400, "n_predict"),
    # vLLM's fields that change what is returned were answered 200 and ignored
    ("include_stop_str_in_output", "/v1/completions", {"prompt": "x", "stop": ",", "include_stop_str_in_output": True},
     400, "include_stop_str_in_output"),
    ("truncate_prompt_tokens", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 2}, 400,
     "truncate_prompt_tokens"),
    ("prompt_logprobs", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("skip_special_tokens false", "/v1/chat/completions", {"messages": CHAT, "skip_special_tokens": False}, 400,
     "skip_special_tokens"),
    ("beam search", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    # a number no float holds was a 500 (OverflowError)
    ("temperature 10**400", "/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400,
     "temperature"),
]


def test_neutral_sampler_values_that_clients_send_are_taken(live, engine):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "typical_p": 1,
               "mirostat": False, "top_n_sigma": -1, "ignore_eos": False, "n_probs": 0, "logprobs": False,
               "min_tokens": 0, "min_keep": 0, "top_k": -1, "bad_words": [], "skip_special_tokens": True,
               "include_stop_str_in_output": False, "use_beam_search": False, "truncate_prompt_tokens": None,
               "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]}
    status, _, body = http(live.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **neutral})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == greedy(engine, PROMPT, 6).text


def test_llama_servers_n_predict_is_the_length_limit(live, engine):
    """n_predict, llama-server's own length field, was ignored: 16 tokens came back for 3."""
    status, _, body = http(live.base, "/v1/completions", {"prompt": PROMPT, "n_predict": 3})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == greedy(engine, PROMPT, 3).text
    status, _, body = http(live.base, "/v1/completions", {"prompt": PROMPT, "n_predict": 3, "max_tokens": 3})
    assert status == 200, body   # two that agree
    status, _, body = http(live.base, "/v1/completions", {"prompt": PROMPT, "n_predict": -1})
    assert status == 200, body   # until the context is full: past the default 16 unless the answer ends
    answer = json.loads(body)
    full = greedy(engine, PROMPT, N_CTX - len(engine.tokenize(PROMPT)))
    assert answer["choices"][0]["text"] == full.text and answer["choices"][0]["finish_reason"] == full.finish_reason


def test_a_sampler_chain_that_applies_ours_as_we_do_is_taken(live):
    """llama.cpp reads a chain's names in any case, kebab-case, without dashes, as aliases or as letters, and
    a sampler whose value changes nothing may be left out: such chains were refused."""
    sampled = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.7, "seed": 3}
    status, _, body = http(live.base, "/v1/completions", sampled)
    assert status == 200, body
    plain = json.loads(body)["choices"][0]["text"]
    for chain, extra in ((["Top-K", "nucleus", "minp", "temp"], {}), ("kpmt", {}),
                         (["top_p", "temperature"], {"top_k": 0, "min_p": 0})):
        status, _, body = http(live.base, "/v1/completions", {**sampled, **extra, "samplers": chain})
        assert status == 200, (chain, body)
        if not extra:
            assert json.loads(body)["choices"][0]["text"] == plain


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_then_normal_request(live, engine, name, path, body, status, param):
    if isinstance(body, bytes):
        got = http(live.base, path, raw=body, method="POST")
    else:
        got = http(live.base, path, body)
    err = assert_error(got[0], got[2], status, param)
    assert err["type"] == "invalid_request_error"
    # ... and the server still answers a normal request correctly.
    ok_status, _, ok_body = http(live.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6})
    assert ok_status == 200, ok_body
    assert json.loads(ok_body)["choices"][0]["text"] == greedy(engine, PROMPT, 6).text


@pytest.mark.parametrize("pair, refused, message, runs", [
    # pearl needs a draft of the target's vocabulary: with another one it is the request's method that is
    # wrong, and the server goes on with what the pair can run
    ("other vocabulary", ("pearl",), "pearl needs a draft with the target's vocabulary", "speculative"),
    # once a 400 naming no field that told the client to pass -d/--draft, a command-line flag
    ("no draft", ("speculative", "pearl"), "{method} needs a draft model, and this server has none",
     "prompt-lookup"),
])
def test_a_method_the_draft_cannot_run_is_refused_by_name(tiny_target, tiny_other_vocab, pair, refused, message,
                                                          runs):
    draft = Model(tiny_other_vocab) if pair == "other vocabulary" else None
    eng = Engine(Model(tiny_target), draft, EngineConfig(n_ctx=N_CTX, n_batch=64, n_seq_max=8, threads=1,
                                                         threads_batch=1))
    srv = LiveServer(create_app(eng, ServerConfig(model_id="tiny", sampling=SamplingParams(temperature=0.0))))
    try:
        for method in refused:
            got = http(srv.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "method": method})
            err = assert_error(got[0], got[2], 400, "method")
            assert err["type"] == "invalid_request_error" and message.format(method=method) in err["message"]
        ok_status, _, ok_body = http(srv.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "method": runs})
        assert ok_status == 200, ok_body
        assert json.loads(ok_body)["choices"][0]["text"] == greedy(eng, PROMPT, 6).text
    finally:
        srv.stop()
        eng.close()


def test_json_only_cross_origin_style_request_is_refused(live, engine, tmp_path):
    """A web page may POST text/plain to 127.0.0.1 without a preflight: such a body is never read."""
    target = tmp_path / "written-by-a-web-page.pool"
    body = json.dumps({"prompt": "x", "max_tokens": 2, "method": "ouroboros",
                       "method_options": {"pool": str(target)}}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        req = urllib.request.Request(live.base + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": content_type, "Origin": "http://evil.example"})
        if not content_type:
            req.remove_header("Content-type")
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 415, content_type
            assert json.loads(exc.read())["error"]["code"] == "unsupported_media_type"
    assert not target.exists()
    ok_status, _, ok_body = http(live.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4},
                                 headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok_status == 200, ok_body


def test_server_history_pool_is_set_at_start(engine, tmp_path):
    """The history pool file is the server's (serve --pool): requests share it and cannot move it."""
    path = tmp_path / "history.pool"
    app = create_app(engine, ServerConfig(model_id="tiny", method="ouroboros", method_options={"pool": str(path)}))
    server = LiveServer(app)
    try:
        status, _, body = http(server.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6})
        assert status == 200, body
        assert path.exists() and path.stat().st_size > 0
        status, _, body = http(server.base, "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 6, "method": "speculative"})
        assert status == 200, body   # the server's pool option goes only to methods that have one
    finally:
        server.stop()
        engine.history.clear()


def test_bad_requests_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=4)
    assert nf.value.status_code == 404
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert br.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model="tiny", prompt="x", temperature=-1.0)
    assert br.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as big:   # 413 before: clients that trim history missed it
        client.completions.create(model="tiny", prompt=LONG, max_tokens=4)
    assert big.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    assert br.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as br:   # a 309-digit count was spelled out
        client.completions.create(model="tiny", prompt="x", extra_body={"max_tokens": 1e308})
    assert "1e+308 for the completion" in br.value.message and len(br.value.message) < 300
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3).choices[0].text is not None


def test_a_refused_prompt_leaves_nothing_for_the_garbage_collector(live):
    """The tokenizer's ContextOverflowError crossed anyio's future, and exception, traceback and future made
    a cycle holding the request's body and prompt bytes until a full collection: a client resending an
    over-long chat grew the server by gigabytes."""
    import gc
    import types

    long_chat = {"messages": [{"role": "user", "content": "word " * N_CTX}], "max_tokens": 4}
    long_prompt = {"prompt": "word " * (2 * N_CTX), "max_tokens": 4}
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for path, body in [("/v1/chat/completions", long_chat), ("/v1/completions", long_prompt)] * 2:
            status, _, reply = http(live.base, path, body)
            assert status == 400 and b"context_length_exceeded" in reply
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, BaseException)
                or (isinstance(o, types.FrameType) and "ouroboros_local" in o.f_code.co_filename)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, ours


def test_only_the_errors_answered_as_400s_lose_their_traceback() -> None:
    """An unexpected error (a 500) lost the frames it was raised in, so its logged traceback ended at
    ``raise outcome``."""
    from ouroboros_local.errors import ParameterError
    from ouroboros_local.server.app import _returning_errors

    def refuse() -> None:
        raise ParameterError("bad")

    def crash() -> None:
        raise RuntimeError("bug")

    refused = _returning_errors(refuse)()
    assert isinstance(refused, ParameterError) and refused.__traceback__ is None
    with pytest.raises(RuntimeError) as info:
        _returning_errors(crash)()
    assert any(entry.name == "crash" for entry in info.traceback)


def test_unknown_route_and_wrong_verb(live):
    status, _, body = http(live.base, "/v1/nothing")
    assert_error(status, body, 404)
    status, _, body = http(live.base, "/v1/chat/completions", method="GET")
    assert_error(status, body, 405)
    status, _, body = http(live.base, "/v1/models/other")
    assert_error(status, body, 404, "model")


def test_body_size_limit(engine):
    app = create_app(engine, ServerConfig(model_id="tiny", max_body_bytes=1024))
    srv = LiveServer(app)
    try:
        status, _, body = http(srv.base, "/v1/completions", {"prompt": "x" * 5000})
        assert_error(status, body, 413)
        assert http(srv.base, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        srv.stop()


# ---- metrics ------------------------------------------------------------------------------------
def test_metrics_exposition(live, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, extra_body={"method": "speculative"})
    status, headers, body = http(live.base, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or re.match(SAMPLE, line), line
    assert metric(text, "ouroboros_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(text, "ouroboros_generated_tokens_total", method="speculative") >= 5
    assert metric(text, "ouroboros_target_passes_total", method="speculative") >= 1
    assert metric(text, "ouroboros_accepted_tokens_total", method="speculative") >= 0
    assert metric(text, "ouroboros_tokens_per_second", method="speculative") > 0
    assert "ouroboros_queue_depth 0" in text.splitlines()
    before = metric(text, "ouroboros_requests_total", endpoint="/v1/completions", status="400")
    http(live.base, "/v1/completions", {"prompt": "x", "temperature": -1})
    after = metric(http(live.base, "/metrics")[2].decode(), "ouroboros_requests_total",
                   endpoint="/v1/completions", status="400")
    assert after == before + 1


# ---- API key ------------------------------------------------------------------------------------
def test_api_key_checked_on_every_request(engine):
    app = create_app(engine, ServerConfig(model_id="tiny", api_key="s3cret"))
    srv = LiveServer(app)
    try:
        for path in ("/v1/models", "/health", "/metrics"):
            status, _, body = http(srv.base, path)
            assert_error(status, body, 401)
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, body = http(srv.base, "/v1/completions", {"prompt": "x"},
                               headers={"Authorization": "Bearer wrong"})
        assert_error(status, body, 401)
        with pytest.raises(openai.AuthenticationError):
            client_for(srv.base, "wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        good = client_for(srv.base, "s3cret")
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens <= 2
        assert http(srv.base, "/health", headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        srv.stop()


def test_a_local_server_without_a_key_answers_its_own_names_only(engine):
    """DNS rebinding: a page whose name was re-pointed at 127.0.0.1 is same-origin to the browser, so it
    could post JSON to a local server without a key and read the answer; its Host header names its site."""
    from ouroboros_local.server.gate import host_name, is_loopback_name

    assert [host_name(h) for h in ("[::1]:8080", "localhost:80", "LOCALHOST", "::1")] == \
        ["::1", "localhost", "localhost", "::1"]
    assert all(map(is_loopback_name, ("localhost", "127.0.0.1", "127.3.2.1", "::1", "app.localhost", "localhost.")))
    assert not any(map(is_loopback_name, ("attacker.example", "0.0.0.0", "192.168.1.4", "localhost.example")))
    app = create_app(engine, ServerConfig(model_id="tiny", local_names_only=True))
    srv = LiveServer(app)
    try:
        foreign = {"Host": f"attacker.example:{srv.port}", "Origin": f"http://attacker.example:{srv.port}"}
        status, _, body = http(srv.base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=foreign)
        assert json.loads(body)["error"]["code"] == "host_not_allowed" and status == 403
        for host in (f"localhost:{srv.port}", f"127.0.0.1:{srv.port}"):
            assert http(srv.base, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                        headers={"Host": host})[0] == 200
    finally:
        srv.stop()


# ---- disconnects and the queue ------------------------------------------------------------------
def _open_stream(base: str, body: dict[str, Any]) -> httpclient.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn


def _hard_close(conn: httpclient.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_a_client_gone_while_sending_its_body_logs_no_error(live, engine, caplog):
    # starlette raises ClientDisconnect while the body is read: once a 500 logged as "unhandled error"
    with socket.create_connection((HOST, int(live.base.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
        sock.shutdown(socket.SHUT_RDWR)
    time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    ok_status, _, ok_body = http(live.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6})
    assert ok_status == 200 and json.loads(ok_body)["choices"][0]["text"] == greedy(engine, PROMPT, 6).text


def test_client_disconnect_cancels_generation(slow_live, slow_engine):
    prompt = long_answer_prompt(slow_engine)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
    metrics0 = http(slow_live.base, "/metrics")[2].decode()
    cancelled0 = metric(metrics0, "ouroboros_generations_total", finish_reason="cancelled")
    total0 = metric(metrics0, "ouroboros_generations_total")

    conn = _open_stream(slow_live.base, {"messages": messages, "max_tokens": 1500, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")    # the role chunk
    while not resp.readline().startswith(b"data: {"):   # wait for a first content chunk
        pass
    t0 = time.monotonic()
    _hard_close(conn)
    wait_idle(slow_live.base, timeout=15)
    elapsed = time.monotonic() - t0
    text = http(slow_live.base, "/metrics")[2].decode()
    assert metric(text, "ouroboros_generations_total", finish_reason="cancelled") == cancelled0 + 1
    assert metric(text, "ouroboros_generations_total") == total0 + 1
    generated = metric(text, "ouroboros_generated_tokens_total") - metric(metrics0, "ouroboros_generated_tokens_total")
    assert generated < 1500, "the generation ran to its end instead of stopping"
    print(f"stream cancelled {elapsed:.2f}s after the disconnect, {generated:.0f} of 1500 tokens generated")
    # The KV cache stayed consistent: a normal request gives exactly the engine's greedy answer.
    status, _, body = http(slow_live.base, "/v1/chat/completions", {"messages": messages, "max_tokens": 12})
    assert status == 200
    assert json.loads(body)["choices"][0]["message"]["content"] == greedy(slow_engine, messages, 12, chat=True).text


def test_client_disconnect_cancels_a_generation_that_is_not_streamed(slow_live, slow_engine):
    """A non-streamed answer's items come every few milliseconds: the disconnect was polled only after a
    quiet spell, so the whole answer was made for nobody (and a retrying client queued behind it)."""
    prompt = long_answer_prompt(slow_engine)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
    metrics0 = http(slow_live.base, "/metrics")[2].decode()
    conn = _open_stream(slow_live.base, {"messages": messages, "max_tokens": 1500})
    deadline = time.monotonic() + 10
    while not json.loads(http(slow_live.base, "/health")[2])["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    _hard_close(conn)
    wait_idle(slow_live.base, timeout=15)
    text = http(slow_live.base, "/metrics")[2].decode()
    assert metric(text, "ouroboros_generations_total", finish_reason="cancelled") == \
        metric(metrics0, "ouroboros_generations_total", finish_reason="cancelled") + 1
    generated = metric(text, "ouroboros_generated_tokens_total") - metric(metrics0, "ouroboros_generated_tokens_total")
    assert generated < 1500, "the generation ran to its end for a client that had gone"


def test_queue_full_503_and_queued_disconnect(slow_live, slow_engine, monkeypatch):
    """max_queue=0: one generation at a time, anything else is refused with 503 while it runs (before its
    prompt is tokenized: seconds of CPU for a long one)."""
    prompt = long_answer_prompt(slow_engine)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
    conn = _open_stream(slow_live.base, {"messages": messages, "max_tokens": 1500, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()
    tokenized: list[Any] = []
    monkeypatch.setattr(slow_engine, "prompt_tokens", lambda *a, **k: tokenized.append(a) or [1, 2])
    try:
        status, headers, body = http(slow_live.base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert not tokenized
        err = assert_error(status, body, 503)
        assert err["code"] == "queue_full" and err["type"] == "server_error"
        assert headers.get("Retry-After") == "1"
        with pytest.raises(openai.APIStatusError) as exc:
            client_for(slow_live.base).completions.create(model="slow", prompt="x", max_tokens=2)
        assert exc.value.status_code == 503 and not tokenized
        text = http(slow_live.base, "/metrics")[2].decode()
        assert metric(text, "ouroboros_requests_total", endpoint="/v1/completions", status="503") >= 2
        assert metric(text, "ouroboros_requests_rejected_total") >= 2
        assert metric(text, "ouroboros_generations_in_progress") == 1
    finally:
        monkeypatch.undo()
        _hard_close(conn)
    wait_idle(slow_live.base)
    status, _, body = http(slow_live.base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, body


def test_queued_request_disconnect_is_skipped(slow_engine):
    """A client that gives up while queued never reaches the engine."""
    app = create_app(slow_engine, ServerConfig(model_id="slow", method="vanilla", max_queue=4))
    srv = LiveServer(app)
    try:
        prompt = long_answer_prompt(slow_engine)
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
        first = _open_stream(srv.base, {"messages": messages, "max_tokens": 1500, "stream": True})
        resp = first.getresponse()
        resp.readline()
        queued = _open_stream(srv.base, {"messages": CHAT, "max_tokens": 50})   # waits behind `first`
        deadline = time.monotonic() + 10
        while json.loads(http(srv.base, "/health")[2])["queue_depth"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _hard_close(queued)
        time.sleep(0.6)          # > the disconnect poll interval
        # it holds no place in the queue (a new client got a false 503 until its turn came)
        assert json.loads(http(srv.base, "/health")[2])["queue_depth"] == 0
        _hard_close(first)
        wait_idle(srv.base)
        text = http(srv.base, "/metrics")[2].decode()
        assert metric(text, "ouroboros_generations_total") == 1           # only `first` ever ran
        assert metric(text, "ouroboros_generations_total", finish_reason="cancelled") == 1
        assert metric(text, "ouroboros_queue_wait_seconds_count") == 2
    finally:
        srv.stop()


def test_requests_are_served_first_in_first_out(slow_engine, monkeypatch):
    started: list[str] = []          # prompts in the order the worker hands them to the engine
    real_stream = slow_engine.stream

    def recording_stream(prompt, **kwargs):
        started.append(slow_engine.detokenize(prompt))
        return real_stream(prompt, **kwargs)

    monkeypatch.setattr(slow_engine, "stream", recording_stream)
    app = create_app(slow_engine, ServerConfig(model_id="slow", method="vanilla", max_queue=8))
    srv = LiveServer(app)
    try:
        prompt = long_answer_prompt(slow_engine)
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
        blocker = _open_stream(srv.base, {"messages": messages, "max_tokens": 1500, "stream": True})
        blocker.getresponse().readline()
        errors: list[str] = []

        def request(i: int) -> None:
            status, _, body = http(srv.base, "/v1/completions", {"prompt": f"request {i}", "max_tokens": 3})
            if status != 200:
                errors.append(body.decode())

        threads = []
        for i in range(5):
            t = threading.Thread(target=request, args=(i,))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 10
            while json.loads(http(srv.base, "/health")[2])["queue_depth"] != i + 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        _hard_close(blocker)
        for t in threads:
            t.join(timeout=60)
        assert not errors
        served = [p for p in started if p.startswith("request ")]
        assert served == [f"request {i}" for i in range(5)]
    finally:
        srv.stop()


def test_requests_while_the_model_loads_hear_503_loading_at_once(tiny_target, monkeypatch) -> None:
    """The port listens before the load (a taken port fails at once): a health probe sent during a load and
    a first calibration waited unanswered in its backlog for minutes (llama-server answers "Loading model")."""
    from ouroboros_local import cli
    from ouroboros_local.cli import main

    port = free_port()
    heard = []

    class Loaded(Exception):
        pass

    def load(args, *_):
        for method, body in (("GET", None), ("POST", json.dumps({"prompt": "x" * 100_000}))):
            conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request(method, "/health" if body is None else "/v1/completions", body=body)
            reply = conn.getresponse()
            heard.append((reply.status, reply.getheader("Retry-After"), json.loads(reply.read())["error"]["code"]))
            conn.close()
        raise Loaded

    monkeypatch.setattr(cli, "_engine_from_args", load)
    with pytest.raises(Loaded):
        main(["serve", "-m", str(tiny_target), "--port", str(port), "--method", "vanilla"])
    assert heard == [(503, "5", "loading")] * 2
    with socket.socket() as probe:   # nothing listens there once the command ends (its replies' TIME_WAIT aside)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


def test_the_loading_replies_outlast_a_lack_of_descriptors_and_end_with_their_slow_clients() -> None:
    """accept() failing once (EMFILE) ended the loading replies for good; a client that kept sending
    kept its reply thread past the hand-over."""
    from ouroboros_local.server import loading

    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]

        class OutOfDescriptorsOnce:
            failed = False

            def fileno(self):
                return sock.fileno()

            def accept(self):
                if not self.failed:
                    self.failed = True
                    raise OSError(24, "Too many open files")
                return sock.accept()

        replies = loading.LoadingReplies(OutOfDescriptorsOnce())   # type: ignore[arg-type]
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /health HTTP/1.1\r\n")   # and nothing more
        conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        conn.close()
        started = time.monotonic()
        replies.stop()
        while any(t.name == "ouroboros-loading-reply" for t in threading.enumerate()):
            assert time.monotonic() - started < loading.READ_SECONDS + 2
            time.sleep(0.05)
        slow.close()


def test_serve_notes_a_model_without_a_chat_template(tiny_target, monkeypatch) -> None:
    """generate --chat and chat said that a model without a template gets ChatML; serve said nothing."""
    from ouroboros_local import cli
    from ouroboros_local.cli import main

    class Noted(Exception):
        pass

    def note(engine, plain):
        raise Noted(plain)

    monkeypatch.setattr(cli, "_engine_from_args", lambda args, *_: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(cli, "warn_without_chat_template", note)
    with pytest.raises(Noted, match="/v1/completions takes plain text"):
        main(["serve", "-m", str(tiny_target), "--port", "0", "--method", "vanilla"])


# ---- the real CLI in a subprocess ----------------------------------------------------------------
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])   # Ctrl-C; systemd's and docker's stop
def test_serve_cli_subprocess(tiny_target, tmp_path, stop):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OUROBOROS_CALIBRATION_FILE": str(tmp_path / "costs.json"),   # none cached: it measures
           "OUROBOROS_ESTIMATES_FILE": str(tmp_path / "estimates.json"), "NO_COLOR": "1"}
    env.pop("OUROBOROS_API_KEY", None)
    cmd = [sys.executable, "-m", "ouroboros_local.cli", "serve", "-m", str(tiny_target), "-c", "256",
           "-b", "32", "-t", "1", "--port", str(port), "--api-key", "k3y", "--max-queue", "2",
           "--model-name", "tiny-cli", "--log-level", "info"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://{HOST}:{port}"
    auth = {"Authorization": "Bearer k3y"}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if http(base, "/health", headers=auth, timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        assert http(base, "/v1/models")[0] == 401
        assert http(base, "/health", headers={**auth, "Host": "proxy.example"})[0] == 200   # a key: any name
        client = client_for(base, "k3y")
        assert [m.id for m in client.models.list().data] == ["tiny-cli"]
        resp = client.chat.completions.create(model="tiny-cli", messages=CHAT, max_tokens=8)
        assert resp.usage.completion_tokens <= 8
        assert resp.model_extra["stats"]["method"] in ("auto", "prompt-lookup", "vanilla")
    finally:
        proc.send_signal(stop)
        try:
            stdout, out = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, out = proc.communicate()
    assert proc.returncode == 128 + stop, out   # as every other command exits on it (it was 0)
    # uvicorn's access lines went to stdout alone, coloured under NO_COLOR
    assert stdout == "" and '"GET /v1/models HTTP/1.1" 401' in out and "\x1b[" not in out
    assert f"stopped ({signal.Signals(stop).name})" in out
    assert (tmp_path / "estimates.json").is_file(), "closed without saving what it learned"   # SIGTERM once skipped it
    assert f"http://127.0.0.1:{port}/v1" in out
    # the first calibration before it listens, not in the first request (a client may time out)
    assert -1 < out.find("measuring this machine's verify cost") < out.find(f"http://127.0.0.1:{port}/v1"), out


def test_a_queued_request_hears_shutting_down_even_when_health_is_read_meanwhile():
    """/health (probed on after a SIGTERM) dropped the cancelled queued jobs as gone clients: a 499."""
    import asyncio

    from ouroboros_local.server.metrics import Metrics
    from ouroboros_local.server.worker import GenerationWorker, Job, ShuttingDown

    release = threading.Event()

    class BusyEngine:
        def stream(self, tokens, cancel, **kwargs):
            release.wait(10)   # a long prefill batch: the cancel is heard only after it
            yield SimpleNamespace(text="", result=None)

    async def scenario() -> object:
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(BusyEngine(), Metrics(), max_queue=4)
        running, queued = Job([1], {}, loop), Job([1], {}, loop)
        worker.submit(running)
        await asyncio.sleep(0.05)
        worker.submit(queued)
        worker.shut_down()
        assert worker.depth == 0
        kind, payload = await asyncio.wait_for(queued.items.get(), 5)
        release.set()
        await asyncio.to_thread(worker.close)
        return payload

    assert isinstance(asyncio.run(scenario()), ShuttingDown)


@pytest.mark.parametrize("max_queue", [0, 1])
def test_a_client_that_asks_again_as_soon_as_it_has_its_answer_is_never_refused(max_queue):
    """An answered job held the running place while its stream closed (its history saved), and the next job
    counted as waiting until the worker took it: one client alone heard 503 queue_full (5 in 30)."""
    import asyncio

    from ouroboros_local.server.metrics import Metrics
    from ouroboros_local.server.worker import GenerationWorker, Job

    class SlowToCloseEngine:
        def stream(self, tokens, cancel, **kwargs):
            try:
                yield SimpleNamespace(text="hi", tokens=[1], result=SimpleNamespace(stats=SimpleNamespace(
                    finish_reason="stop")))
            finally:
                time.sleep(0.2)   # the history's save

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        worker = GenerationWorker(SlowToCloseEngine(), Metrics(), max_queue=max_queue)
        worker.metrics.observe_generation = lambda stats: None
        answered = worker._answered
        # the worker thread descheduled around the hand-over: the client's next request came first
        worker._answered = lambda job: (time.sleep(0.05), answered(job))[1]
        clients = max_queue + 1   # each sends its next request as soon as it has its answer
        jobs = [Job([1], {}, loop) for _ in range(clients)]
        for job in jobs:
            worker.submit(job)
        for _ in range(3):
            for i, job in enumerate(jobs):
                kind, payload = await asyncio.wait_for(job.items.get(), 5)
                assert kind == "event" and payload.result is not None
                jobs[i] = Job([1], {}, loop)
                worker.submit(jobs[i])   # QueueFull raised here
        for job in jobs:
            await asyncio.wait_for(job.items.get(), 5)
        await asyncio.to_thread(worker.close)

    asyncio.run(scenario())


@pytest.mark.parametrize("stop", [signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)])
def test_a_server_asked_to_stop_ends_its_running_and_queued_generations_at_once(
        slow_engine, tmp_path_factory, tmp_path, stop):
    """A running answer used to be cut by uvicorn's graceful timeout (a plain-text 500, a traceback in
    the log) and a queued one started after the signal; both now end at once with a JSON 503. SIGHUP (the
    terminal closed) cut the stream off mid-chunk and answered the queued request a plain-text 500."""
    prompt = long_answer_prompt(slow_engine)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OUROBOROS_CALIBRATION_FILE": str(tmp_path / "costs.json"),
           "OUROBOROS_ESTIMATES_FILE": str(tmp_path / "estimates.json")}
    env.pop("OUROBOROS_API_KEY", None)
    cmd = [sys.executable, "-m", "ouroboros_local.cli", "serve", "-m", str(slow_chat_model(tmp_path_factory)),
           "-c", "2048", "-t", "1", "--port", str(port), "--method", "vanilla", "--max-queue", "2"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://{HOST}:{port}"
    queued: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if http(base, "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        assert http(base, "/health", headers={"Host": "attacker.example"})[0] == 403   # on 127.0.0.1, no key
        running = _open_stream(base, {"messages": messages, "max_tokens": 1500, "stream": True})
        resp = running.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data: {\"id"):
            pass

        def queue_one() -> None:
            queued["answer"] = http(base, "/v1/completions", {"prompt": "x", "max_tokens": 1500})

        waiter = threading.Thread(target=queue_one)
        waiter.start()
        while json.loads(http(base, "/health")[2])["queue_depth"] != 1:
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(stop)
        events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        waiter.join(timeout=30)
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + stop, out
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    status, _, body = queued["answer"]
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert "Traceback" not in out and "ERROR" not in out, out
    assert elapsed < 4, f"stopping took {elapsed:.1f}s"


def test_serve_refuses_an_empty_host_or_name(tiny_target, capsys):
    """--host '' listened on every interface (and printed http://:PORT); --model-name '' fell back to the
    file's name unsaid."""
    from ouroboros_local import cli

    for flags, message in ((["--host", ""], "--host is empty"), (["--model-name", ""], "--model-name is empty")):
        assert cli.main(["serve", "-m", str(tiny_target), "--port", "0", *flags]) == 2
        assert message in capsys.readouterr().err


def test_serve_cli_errors_without_loading(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    bad = subprocess.run([sys.executable, "-m", "ouroboros_local.cli", "serve", "-m", str(tmp_path / "none.gguf"),
                          "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error:")
    # an empty key turned authentication off; a blank one locked every client out
    for flag, environ in ((["--api-key", ""], {}), ([], {"OUROBOROS_API_KEY": "  "})):
        run = subprocess.run([sys.executable, "-m", "ouroboros_local.cli", "serve", "-m", str(tmp_path / "none.gguf"),
                              "--port", str(free_port()), *flag], env={**env, **environ}, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and "is empty: give a key" in run.stderr, run.stderr


def test_serve_refuses_a_key_or_name_that_is_not_utf8_and_names_a_file_that_is_not(tmp_path):
    """A key with a byte that is not UTF-8 made every request a 500 (the right key's too); so did such a
    --model-name, or a model file so named (/health, /v1/models and every answer name it)."""
    from ouroboros_local.server.cli import _utf8_name

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OUROBOROS_API_KEY", None)
    base = [sys.executable, "-m", "ouroboros_local.cli", "serve", "-m", str(tmp_path / "none.gguf"), "--port", "0"]
    runs = [(base + [b"--api-key", b"k\xffy"], {}, "--api-key"),
            (base + [b"--model-name", b"m\xff"], {}, "--model-name"),
            (base, {b"OUROBOROS_API_KEY": b"k\xffy"}, "OUROBOROS_API_KEY")]
    for argv, environ, flag in runs:
        run = subprocess.run(argv, env={**{k.encode(): v.encode() for k, v in env.items()}, **environ},
                             capture_output=True, timeout=60)
        said = run.stderr.decode(errors="replace")
        assert run.returncode == 2 and said.startswith(f"error: {flag}") and "not UTF-8" in said, said
    assert _utf8_name(os.fsdecode(b"model-\xff.gguf")) == "model-\ufffd.gguf"
    json.dumps(_utf8_name(os.fsdecode(b"model-\xff.gguf"))).encode()   # what a response must carry


# ---- the examples -------------------------------------------------------------------------------
def _run_example(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OUROBOROS_API_KEY", None)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_example_openai_client(live):
    out = _run_example("examples/openai_client.py", "--base-url", live.base + "/v1", "--max-tokens", "16").stdout
    assert "model: tiny" in out
    assert "identical to the non-streaming answer: True" in out
    assert "a bad request is refused" in out and "400" in out


def test_example_python_api(tiny_target, tiny_draft):
    out = _run_example("examples/python_api.py", str(tiny_target), str(tiny_draft)).stdout
    assert "identical: True" in out
    assert "with seed 42: the same text: True" in out


def test_example_streaming(tiny_target):
    proc = _run_example("examples/streaming.py", str(tiny_target), "--max-tokens", "20", "--prompt", "hi")
    assert re.search(r"\] \d+ tokens, first text after", proc.stderr)


def test_a_second_signal_inside_the_first_ones_handler_does_not_hang(monkeypatch) -> None:
    """Two Ctrl-Cs 2 ms apart (or `timeout` signalling the group) hung serve for good: the second handler ran
    inside the first one's Event.set(), whose lock it then waited for."""
    from ouroboros_local.server import cli as server_cli

    ended = threading.Event()
    server: list = []
    armed: list = []
    real_event = threading.Event

    class FakeUvicornServer:
        def __init__(self, config) -> None:
            pass

        def handle_exit(self, sig, frame) -> None:
            pass

    class SecondSignalInside(real_event):   # an event whose set() hears the second signal with its lock held
        def set(self) -> None:
            if armed:
                armed.clear()
                with self._cond:
                    server[0].handle_exit(signal.SIGINT, None)
            super().set()

    monkeypatch.setattr(threading, "Event", SecondSignalInside)
    server.append(server_cli._server(SimpleNamespace(Server=FakeUvicornServer), None, ended.set))
    monkeypatch.setattr(threading, "Event", real_event)
    armed.append(True)
    first = threading.Thread(target=server[0].handle_exit, args=(signal.SIGINT, None), daemon=True)
    first.start()
    first.join(5)
    assert not first.is_alive(), "the second signal's handler waits for a lock the first one holds"
    assert ended.wait(5) and server[0].stopped_by == signal.SIGINT


def test_a_second_ctrl_c_while_stopping_does_not_force_uvicorn_past_the_apps_shutdown() -> None:
    """Two Ctrl-Cs 50 ms apart set uvicorn's force_exit, which skipped the app's lifespan shutdown: a
    "Traceback ... KeyboardInterrupt ... CancelledError" in every such stop's log."""
    import uvicorn

    from ouroboros_local.server import cli as server_cli

    ended = threading.Event()
    server = server_cli._server(uvicorn, uvicorn.Config(lambda *a: None), ended.set)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit and server.stopped_by == signal.SIGTERM
    assert ended.wait(5)
