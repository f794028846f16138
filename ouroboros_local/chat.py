"""Chat prompts rendered with the model's own Jinja chat template (from GGUF metadata)."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ParameterError

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Model

# Used only when a GGUF carries no template (documented in the README).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """The template compiled once per source: compiling a model's template took ~3.5 ms, every request."""
    return _environment().from_string(source)


def validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ParameterError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ParameterError(f"message {i} needs a string 'role'")
        role = ROLE_ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            raise ParameterError(f"message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI content parts: text only (no images, audio or files)
            content = "".join(_text_part(i, part) for part in content)
        if not isinstance(content, str):
            raise ParameterError(f"message {i} needs string 'content'")
        out.append({"role": role, "content": content})
    return out


ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system role


def _text_part(i: int, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type", "text") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ParameterError(f"message {i}: content part {kind!r} is not supported (this server takes "
                             "text parts only)")
    if not isinstance(part.get("text"), str):
        raise ParameterError(f"message {i}: a text part needs a string 'text'")
    return part["text"]


def render_chat(model: "Model", messages: Any, add_generation_prompt: bool = True,
                template: str | None = None) -> str:
    messages = validate_messages(messages)
    source = template or model.chat_template() or CHATML
    try:
        compiled = _compiled(source)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=model.token_text(model.bos) if model.bos >= 0 else "",
                               eos_token=model.token_text(model.eos) if model.eos >= 0 else "")
    except jinja2.exceptions.TemplateError as exc:
        raise ParameterError(f"chat template failed: {exc}") from None
