"""Chat prompts rendered with the model's own Jinja chat template (from GGUF metadata)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ParameterError

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Model

log = logging.getLogger("ouroboros_local")

# Used only when a GGUF carries no template, as llama-server does (README, "Chat prompts").
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _Refusal(jinja2.exceptions.TemplateError):
    """A template's own ``raise_exception``: it refuses this conversation (a client's error)."""


def _raise(message: str) -> None:
    raise _Refusal(message)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' marks of the assistant's text): the body
    alone, as llama.cpp's template engine renders it."""

    tags = {"generation"}

    def parse(self, parser: "jinja2.parser.Parser") -> list[nodes.Node]:
        next(parser.stream)
        # the body's own statements, no scope of their own: a {% set %} inside is seen after the block
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """``tojson`` as llama.cpp's templates see it (and transformers'): plain JSON, keys in their order,
    no HTML escaping (Jinja's own filter writes ``<`` as ``\\u003c`` and sorts the keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader(),
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


@lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """The template compiled once per source: compiling a model's template took ~3.5 ms, every request."""
    return _environment().from_string(source)


@lru_cache(maxsize=8)
def template_problem(source: str) -> str | None:
    """Why ``source`` cannot render a plain one-message conversation (it does not compile, or fails on it),
    or None. Its own refusals (``raise_exception``) are left to the conversations it refuses."""
    try:
        _compiled(source).render(messages=[{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                 bos_token="", eos_token="", tools=None, documents=None)
    except _Refusal:
        return None
    except jinja2.exceptions.TemplateError as exc:
        return str(exc)
    except Exception as exc:   # the template's own code: 'int' is not iterable
        return f"{type(exc).__name__}: {exc}"
    return None


_NOTED: set[tuple[Any, ...]] = set()   # the models whose ChatML fallback was told


def fallback_note(model: "Model") -> str | None:
    """Why this model's chats are wrapped in ChatML: it has no chat template, or one that does not work
    (as llama-server does); None where its own template is used. Told once per model file: the command
    line says it in its own words, and the API's first chat logs it."""
    source = model.chat_template()
    if source is None:
        reason = "this model has no chat template"
    elif (problem := template_problem(source)) is not None:
        reason = f"this model's chat template does not work ({problem})"
    else:
        return None
    key = tuple(getattr(model, "file_id", None) or (id(model),))
    if key in _NOTED:
        return None
    _NOTED.add(key)
    return reason


def model_template(model: "Model") -> str:
    """The model's chat template, or ChatML where it has none or one that does not work."""
    source = model.chat_template()
    if source is not None and template_problem(source) is None:
        return source
    note = fallback_note(model)
    if note:
        log.warning("%s; the prompt is wrapped in ChatML (<|im_start|>...)", note)
    return CHATML


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ParameterError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ParameterError(f"message {i} needs a string 'role'")
        role = ROLE_ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            raise ParameterError(f"message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        for name in _UNSUPPORTED_PARTS:
            if m.get(name):
                raise ParameterError(f"message {i}: {name!r} is not supported (text messages only; no tool calling)")
        content = m.get("content")
        if content is None:   # OpenAI's assistant turn may have none; a question or an instruction must
            if role != "assistant":
                raise ParameterError(f"message {i} ({m['role']}) needs 'content'")
            content = ""
        if isinstance(content, list):  # OpenAI content parts: text only (no images, audio or files)
            content = _joined_parts([_text_part(i, part) for part in content])
        if not isinstance(content, str):
            raise ParameterError(f"message {i} needs string 'content'")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise ParameterError(f"message {i}: 'name' must be a string")
        # the name goes to the template, as llama-server and vLLM pass it (ChatML's leaves it out); so do
        # the message's other fields (an assistant turn's reasoning_content), as transformers passes them
        others = {k: v for k, v in m.items() if k not in ("role", "content", "name")}
        out.append(others | {"role": role, "content": content} | ({"name": name} if name else {}))
    return out


def _joined_parts(texts: list[str]) -> str:
    """Text parts one per line, as llama-server joins them for a template that takes a string (and vLLM):
    glued, "Summarise this file:" and "import os" read as one line."""
    joined = ""
    for text in texts:
        joined += ("\n" if joined else "") + text   # no newline before the first text, as llama-server
    return joined


ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system role
# what a message may carry beside its text; refused, since rendering the text alone would drop it
_UNSUPPORTED_PARTS = ("tool_calls", "function_call", "audio")


def _text_part(i: int, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type", "text") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ParameterError(f"message {i}: content part {kind!r} is not supported (only "
                             "text parts are)")
    if not isinstance(part.get("text"), str):
        raise ParameterError(f"message {i}: a text part needs a string 'text'")
    return part["text"]


def render_chat(model: "Model", messages: Any, add_generation_prompt: bool = True,
                template: str | None = None, *, continue_final: bool = False,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The conversation as the model's template writes it. ``continue_final``: the final (assistant)
    message is continued: the generation prompt of the messages before it, then its text as it is (how
    llama-server writes a prefill). ``template_kwargs``: more variables for the template (Qwen3's
    ``enable_thinking``, say)."""
    messages = validate_messages(messages)
    extra = template_variables(template_kwargs)
    if not continue_final:
        text = _render(model, messages, add_generation_prompt, template, extra)
    elif messages[-1]["role"] != "assistant":
        raise ParameterError(f"only an assistant message can be continued; the final message is the "
                             f"{messages[-1]['role']}'s")
    else:
        text = _render(model, messages[:-1], True, template, extra) + messages[-1]["content"]
    if not text:
        raise ParameterError("the chat template rendered an empty prompt for these messages")
    return text


def template_variables(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """More variables for a template, checked: none may stand in for one the conversation sets or for a
    function templates call (``self``, ``namespace``, ``raise_exception``, ...)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ParameterError("chat template variables must be a mapping of names to values")
    taken = sorted(({"self", "messages", "add_generation_prompt", "bos_token", "eos_token"}
                    | set(_environment().globals)).intersection(kwargs))
    if taken:
        raise ParameterError(f"chat template variable {taken[0]!r} is set by the conversation or the template "
                             "engine itself")
    return dict(kwargs)


def _render(model: "Model", messages: list[dict[str, str]], add_generation_prompt: bool, template: str | None,
            extra: dict[str, Any]) -> str:
    source = template or model_template(model)
    try:
        compiled = _compiled(source)
        # tools and documents: None where a request has none, as transformers renders them
        return compiled.render(**({"tools": None, "documents": None} | extra), messages=messages,
                               add_generation_prompt=add_generation_prompt,
                               bos_token=model.token_text(model.bos) if model.bos >= 0 else "",
                               eos_token=model.token_text(model.eos) if model.eos >= 0 else "")
    except jinja2.exceptions.TemplateError as exc:
        raise ParameterError(f"chat template failed: {exc}") from None
    except Exception as exc:   # the template's own code on a variable of the wrong type: 'int' is not iterable
        raise ParameterError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def for_added_specials(model: "Model", text: str) -> str:
    """A rendered chat as llama-server tokenizes it, with the vocabulary's own specials added
    (add_special): a BOS the template wrote first (an EOS it wrote last) is dropped where the vocabulary
    adds one, so the prompt holds one BOS whether the template writes it or not (a model without a
    template, such as Gemma 3 270M, gets its BOS too)."""
    if model.add_bos and model.bos >= 0:
        bos = model.token_text(model.bos)
        if bos and text.startswith(bos):
            text = text[len(bos):]
    if model.add_eos and model.eos >= 0:
        eos = model.token_text(model.eos)
        if eos and text.endswith(eos):
            text = text[:-len(eos)]
    return text
