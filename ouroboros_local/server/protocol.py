"""The OpenAI-compatible wire protocol: request parsing and validation, and the response shapes.

Pure functions over JSON values, with no application state: ``.app`` calls them. Errors use OpenAI's
body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..chat import template_variables, validate_messages
from ..errors import (ContextOverflowError, DrafterError, IncompatiblePairError, MethodOptionError, OuroborosError,
                      ParameterError)
from ..options import Option
from ..proposers import (applicable_options, check_options, check_pair_options, method_names, method_options,
                         needs_draft, overlaid)
from ..sampling import SamplingParams
from .worker import ShuttingDown

if TYPE_CHECKING:  # pragma: no cover
    from ..generation import GenerationResult

MAX_STOPS = 16
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions


# ---- errors -------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answer: its HTTP status and headers, and the OpenAI body's message, type, param, code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.type, self.param, self.code = type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def engine_error(exc: BaseException, user_options: bool) -> ApiError:
    """The answer to an exception the engine raised; ``user_options``: the request set method_options."""
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, MethodOptionError) and user_options:
        return bad_request("method_options", f"invalid method_options: {exc}")
    if isinstance(exc, IncompatiblePairError):   # a method (or the request's options) this server's draft cannot run
        return bad_request("method_options" if exc.options and user_options else "method", str(exc))
    if isinstance(exc, DrafterError):   # the server's drafter failed, not the request
        return ApiError(500, str(exc), type="server_error", code="drafter_error")
    if isinstance(exc, OuroborosError):
        return ApiError(400, str(exc), code="invalid_value")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error",
                    code="internal_error")


# ---- the request body ---------------------------------------------------------------------------
def require_json(content_type: str) -> None:
    # JSON only: a web page may POST text/plain to 127.0.0.1 without a CORS preflight, JSON it may not
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"send the request body as JSON with 'Content-Type: application/json' "
                            f"(got {media_type or 'no content type'!r})", code="unsupported_media_type")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def check_model(body: dict[str, Any], model_ids: set[str], served: str) -> None:
    """The optional "model" field must name the served model (``served``) or one of its aliases."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request("model", "model must be a string", "invalid_type")
    if model not in model_ids:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


# ---- fields -------------------------------------------------------------------------------------
def number_field(body: dict[str, Any], name: str, default: Any, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(name, f"{name} must be {kind} (got {json.dumps(value)[:40]})", "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(name, f"{name} must be a finite number (got {value})")
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise bad_request(name, f"{name} must be an integer (got {value})", "invalid_type")
        value = int(value)
    return value


def sampling_params(body: dict[str, Any], base: SamplingParams) -> SamplingParams:
    """The request's sampling fields, ``base``'s where it omits them."""
    temperature = number_field(body, "temperature", base.temperature)
    if temperature < 0:
        raise bad_request("temperature", f"temperature must be >= 0 (got {temperature})")
    top_p = number_field(body, "top_p", base.top_p)
    if not 0.0 < top_p <= 1.0:
        raise bad_request("top_p", f"top_p must be in (0, 1] (got {top_p})")
    top_k = number_field(body, "top_k", base.top_k, integer=True)
    if top_k == -1:   # vLLM's clients say "off" so
        top_k = 0
    if top_k < 0:
        raise bad_request("top_k", f"top_k must be >= 0, or 0 or -1 for off (got {top_k})")
    min_p = number_field(body, "min_p", base.min_p)
    if not 0.0 <= min_p < 1.0:
        raise bad_request("min_p", f"min_p must be in [0, 1) (got {min_p})")
    seed = _seed(body, base.seed)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                seed=seed).validated()
    except ParameterError as exc:   # a value no float holds (10**400)
        raise bad_request("temperature", str(exc)) from None
    _check_sampler_chain(body.get("samplers"), params)
    return params


def _seed(body: dict[str, Any], default: int | None) -> int | None:
    seed = number_field(body, "seed", default, integer=True)
    if seed is not None and seed < -1:   # -1: random, as SamplingParams takes it
        raise bad_request("seed", f"seed must be >= 0, or -1 for a random seed (got {seed})")
    return seed


def stop_strings(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(value) > MAX_STOPS:
        raise bad_request("stop", f"at most {MAX_STOPS} stop strings are supported (got {len(value)})")
    return [s for s in value if s]


def max_tokens_field(body: dict[str, Any]) -> tuple[int | None, str]:
    """The completion's length limit, None when the request gives none, and the field it came from
    (errors name the field the client sent). OpenAI's ``max_tokens``, its newer ``max_completion_tokens``
    and llama-server's ``n_predict`` (-1: until the context is full, returned as -1) are one limit: a
    request that gives two that disagree is refused (one of them was silently dropped)."""
    given = []
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = number_field(body, name, None, integer=True)
        if value is None:
            continue
        if value < 0 and not (name == "n_predict" and value == -1):
            rule = ">= 0, or -1 for the room left in the context" if name == "n_predict" else ">= 0"
            raise bad_request(name, f"{name} must be {rule} (got {value})")
        given.append((name, value))
    if len({value for _, value in given}) > 1:
        said = " and ".join(f"{name}={value}" for name, value in given)
        raise bad_request(given[-1][0], f"{said} disagree: give one length limit")
    return (given[0][1], given[0][0]) if given else (None, "max_tokens")


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream", "stream must be a boolean", "invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:   # as OpenAI: a setting that would do nothing is named, not ignored
            raise bad_request("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict):
            raise bad_request("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad_request("stream_options", "stream_options.include_usage must be a boolean",
                              "invalid_type")
    return stream, include_usage


def method_and_options(body: dict[str, Any], default: str, server_options: dict[str, Any],
                       has_draft: bool = True, pair: tuple[bool | None, str | None] | None = None,
                       ) -> tuple[str, dict[str, Any], bool]:
    """The method and its options: the server's (those the method can take, ``_suited``) under the
    request's, all checked here, before anything is queued or allocated. A request cannot name a file (the
    history pool is the server's, set when it starts). The flag says whether the request gave options of its
    own. ``has_draft``: the server loaded a draft model (a method that needs one is refused without it);
    ``pair``: whether its vocabulary is the target's, and the difference where not."""
    method = body.get("method")
    if method is None:
        method = default
    if not isinstance(method, str):
        raise bad_request("method", "method must be a string", "invalid_type")
    names = method_names()
    if method not in names:
        raise bad_request("method", f"unknown method {method!r}; choose one of {', '.join(names)}")
    if not has_draft and needs_draft(method):
        raise bad_request("method", f"{method} needs a draft model, and this server has none "
                                    "(ouroboros-local serve -d DRAFT loads one)")
    options = body.get("method_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad_request("method_options", "method_options must be an object", "invalid_type")
    try:
        check_options(method, options, per_request=True)
        merged = overlaid(method, _suited(method, server_options, options, pair), options)
        check_options(method, merged)
    except ParameterError as exc:
        raise bad_request("method_options", f"invalid method_options: {exc}") from None
    return method, merged, bool(options)


def _suited(method: str, server_options: dict[str, Any], request: dict[str, Any],
            pair: tuple[bool | None, str | None] | None) -> dict[str, Any]:
    """The server's options that ``method`` takes, under the request's: each with its value (``serve --method
    speculative --gamma 1`` set gamma for its own method, and every request for pearl, gamma 2-64, heard a
    400 blaming it), with the server's draft (``--p-min`` refused every speculative request with a draft of
    another vocabulary), and with the switch it tunes on (``{"adaedl": false}`` on a server with
    ``--adaedl-lambda`` was told to add adaedl=true)."""
    declared = {alias: option for option in method_options(method) for alias in (option.name, *option.aliases)}
    suited = {name: value for name, value in applicable_options(method, server_options).items()
              if _takes(declared[name], value)}
    if pair is not None and pair[0] is not None:
        refused = _pair_refuses(method, overlaid(method, suited, request), pair)
        given = {declared[name].name for name in request if name in declared}
        suited = {name: value for name, value in suited.items()
                  if declared[name].name not in refused or declared[name].name in given}
    merged = {declared[name].name if name in declared else name: value
              for name, value in overlaid(method, suited, request).items()}

    def switched_off(option: Option) -> bool:
        switch = option.needs[0] if option.needs else None
        return switch is not None and not merged.get(switch, declared[switch].default if switch in declared else None)

    suited = {name: value for name, value in suited.items() if not switched_off(declared[name])}
    return _consistent(method, suited, request)


def _consistent(method: str, suited: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """``suited`` less the one server option that makes a valid request invalid beside it (``--max-ngram
    2`` under a request's min_ngram 3 was a 400 blaming the request)."""
    if _valid(method, overlaid(method, suited, request)) or not _valid(method, request):
        return suited
    for name in suited:
        fewer = {key: value for key, value in suited.items() if key != name}
        if _valid(method, overlaid(method, fewer, request)):
            return fewer
    return suited


def _valid(method: str, options: dict[str, Any]) -> bool:
    try:
        check_options(method, options)
    except ParameterError:
        return False
    return True


def _takes(option: Option, value: Any) -> bool:
    try:
        option.check(value)
    except ParameterError:
        return False
    return True


def _pair_refuses(method: str, options: dict[str, Any], pair: tuple[bool | None, str | None]) -> tuple[str, ...]:
    """The options the server's model pair refuses for ``method`` (none where the options are wrong otherwise:
    that error is the request's to hear)."""
    try:
        check_pair_options(method, options, check_options(method, options), pair[0], pair[1])
    except IncompatiblePairError as exc:
        return exc.options
    except ParameterError:
        pass
    return ()


# ---- unsupported OpenAI features ----------------------------------------------------------------
def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Refuse OpenAI features that this server cannot honour rather than silently ignoring them."""
    _refuse_choices(body)
    for name, neutral in _OUTPUT_CHANGES.items():
        if body.get(name) not in (None, neutral):
            raise _refusal(name, "not implemented")
    _refuse_distribution_changes(body)
    if body.get("logit_bias"):
        raise _refusal("logit_bias", "decoding follows the target model's distribution")
    # chat's logprobs is a bool; completions' an int, where 0 still asks for the chosen tokens' logprobs
    logprobs = body.get("logprobs")
    if not (logprobs is None or logprobs is False or (chat and logprobs == 0)):
        raise _refusal("logprobs", "not implemented")
    if body.get("top_logprobs") not in (None, 0):
        raise _refusal("top_logprobs", "not implemented")
    if chat:
        _refuse_chat_features(body)
    else:
        for name in ("echo", "suffix"):
            if body.get(name):
                raise _refusal(name, "not implemented")


def _refusal(name: str, why: str) -> ApiError:
    return bad_request(name, f"{name} is not supported by this server ({why})", "unsupported_parameter")


def _refuse_choices(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise _refusal("n", "one choice per request")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _refusal("best_of", "one choice per request")


# samplers that change the target's distribution, by the value that leaves it alone: OpenAI's penalties,
# and those of llama.cpp's server, vLLM and other local servers that their clients send
_DISTRIBUTION_CHANGES = {"presence_penalty": 0, "frequency_penalty": 0, "repeat_penalty": 1,
                         "repetition_penalty": 1, "typical_p": 1, "tfs_z": 1, "top_a": 0, "mirostat": 0,
                         "dry_multiplier": 0, "xtc_probability": 0, "dynatemp_range": 0, "top_n_sigma": -1,
                         "smoothing_factor": 0, "n_probs": 0, "ignore_eos": False, "min_tokens": 0}
# constraints on the output: the text would no longer be the model's own (vLLM's guided decoding, token
# allow and ban lists, extra stop tokens)
_CONSTRAINTS = ("grammar", "json_schema", "guided_json", "guided_choice", "guided_grammar", "guided_regex",
                "guided_whitespace_pattern", "structured_outputs", "allowed_token_ids", "bad_words",
                "stop_token_ids")
# llama-server's sampler chain, as far as this server applies one: the order of ``sampling.support``; a
# chain's names as llama.cpp reads them (any case, kebab-case or no dash, a few aliases, or one letter each)
_SAMPLER_ORDER = ("top_k", "top_p", "min_p", "temperature")
_SAMPLER_ALIASES = {"nucleus": "top_p", "temp": "temperature", "topk": "top_k", "topp": "top_p", "minp": "min_p"}
_SAMPLER_LETTERS = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature"}


def _check_sampler_chain(samplers: Any, params: SamplingParams) -> None:
    """A llama-server ``samplers`` chain is taken where it applies this server's samplers as it does: in
    the order top-k, top-p, min-p, temperature, leaving out only those whose value changes nothing."""
    if samplers is None or params.greedy:   # greedy: the chain changes nothing
        return
    if isinstance(samplers, str):
        names = [_SAMPLER_LETTERS.get(c, c) for c in samplers]
    elif isinstance(samplers, list) and all(isinstance(x, str) for x in samplers):
        names = [_SAMPLER_ALIASES.get(x.lower(), x.lower().replace("-", "_")) for x in samplers]
    else:
        raise bad_request("samplers", "samplers must be a list of sampler names or a string of letters",
                          "invalid_type")
    chain = [n for n in names if n in _SAMPLER_ORDER]
    neutral = {"top_k": params.top_k == 0, "top_p": params.top_p == 1.0, "min_p": params.min_p == 0.0,
               "temperature": params.temperature == 1.0}
    wanted = [n for n in _SAMPLER_ORDER if n in chain or not neutral[n]]
    if chain != wanted:
        raise _refusal("samplers", f"the samplers apply in llama.cpp's default order, {', '.join(_SAMPLER_ORDER)}; "
                                   "a chain in another order, or without one whose value changes the distribution, "
                                   "would change it")


# fields of vLLM's that change what is returned, by the value that leaves it as it is here
_OUTPUT_CHANGES = {"include_stop_str_in_output": False, "skip_special_tokens": True, "use_beam_search": False,
                   "truncate_prompt_tokens": None, "prompt_logprobs": None, "return_tokens_as_token_ids": False}


def _refuse_distribution_changes(body: dict[str, Any]) -> None:
    for name, neutral in _DISTRIBUTION_CHANGES.items():
        value = body.get(name)
        if value is None or (isinstance(value, bool) and value == neutral):   # mirostat: false
            continue
        if isinstance(value, bool) != isinstance(neutral, bool) or not isinstance(value, (int, float)):
            kind = "true or false" if isinstance(neutral, bool) else "a number"
            raise bad_request(name, f"{name} must be {kind}", "invalid_type")
        if value != neutral:
            raise _refusal(name, "it would change the target's distribution; decoding is lossless")
    if body.get("min_keep") not in (None, 0, 1):   # at least one token survives the cut-offs here
        raise _refusal("min_keep", "it would change the target's distribution; decoding is lossless")
    for name in _CONSTRAINTS:
        if body.get(name):
            raise _refusal(name, "the output is the model's own, unconstrained")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _refusal("response_format", "only plain text output")


def _refuse_chat_features(body: dict[str, Any]) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise _refusal(name, "no tool calling")
    for name in ("tool_choice", "function_call"):   # "none" and "auto" ask nothing of a tool-less request
        if body.get(name) not in (None, "none", "auto"):
            raise _refusal(name, "no tool calling")
    if body.get("chat_template") is not None:
        raise _refusal("chat_template", "the model's own chat template only")
    if body.get("audio"):
        raise _refusal("audio", "text output only")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _refusal("modalities", "text output only")


# ---- a generation request -----------------------------------------------------------------------
@dataclass
class GenerationRequest:
    """A checked /v1/completions or /v1/chat/completions body, before its prompt is tokenized."""

    chat: bool
    prompt: Any                 # the raw "messages" (chat) or "prompt" (completions) field
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    stops: list[str]
    method: str
    options: dict[str, Any]
    user_options: bool          # the request gave method_options of its own
    max_tokens: int | None
    max_tokens_param: str = "max_tokens"   # or max_completion_tokens, the field the client sent
    template: "ChatTemplateFields | None" = None   # chat only

    @property
    def param(self) -> str:
        """The field holding the prompt, named in errors about it."""
        return "messages" if self.chat else "prompt"


def parse_generation(body: dict[str, Any], chat: bool, sampling: SamplingParams, method: str,
                     server_options: dict[str, Any], has_draft: bool = True,
                     pair: tuple[bool | None, str | None] | None = None) -> GenerationRequest:
    """Check every field of a generation body; ``sampling`` and ``method`` are the server's defaults,
    ``has_draft`` whether it loaded a draft model, ``pair`` whether that shares the target's vocabulary
    (and how not)."""
    refuse_unsupported(body, chat)
    stream, include_usage = stream_flags(body)
    params = sampling_params(body, sampling)
    stops = stop_strings(body)
    method, options, user_options = method_and_options(body, method, server_options, has_draft, pair)
    max_tokens, max_tokens_param = max_tokens_field(body)
    param = "messages" if chat else "prompt"
    if param not in body:
        raise bad_request(param, f"{param} is required", "missing_required_parameter")
    return GenerationRequest(chat, body[param], stream, include_usage, params, stops, method, options,
                             user_options, max_tokens, max_tokens_param,
                             ChatTemplateFields.of(body) if chat else None)


@dataclass(frozen=True)
class ChatTemplateFields:
    """How a chat request asks its prompt to be written (vLLM's fields; llama-server's default)."""

    add_generation_prompt: bool | None
    continue_final_message: bool | None
    kwargs: dict[str, Any] | None

    @classmethod
    def of(cls, body: dict[str, Any]) -> "ChatTemplateFields":
        flags = []
        for name in ("add_generation_prompt", "continue_final_message"):
            value = body.get(name)
            if value is not None and not isinstance(value, bool):
                raise bad_request(name, f"{name} must be true or false", "invalid_type")
            flags.append(value)
        if flags == [True, True]:
            raise bad_request("continue_final_message", "continue_final_message and add_generation_prompt "
                                                        "cannot both be true: a message is either continued "
                                                        "or answered")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs", "chat_template_kwargs must be an object", "invalid_type")
        for name in ("tools", "functions"):   # the template would write them in: tool calling by a side door
            if kwargs and kwargs.get(name):
                raise _refusal("chat_template_kwargs", f"no tool calling ({name!r})")
        try:
            template_variables(kwargs)
        except ParameterError as exc:
            raise bad_request("chat_template_kwargs", str(exc)) from None
        return cls(flags[0], flags[1], kwargs)

    def options(self, messages: list[Any], clean: list[dict[str, Any]]) -> dict[str, Any]:
        """``Engine.chat_prompt``'s options for these (raw, checked) messages. A final assistant message is
        continued unless the request says otherwise (as llama-server does; Mistral's ``prefix: true`` says
        so too); a message marked ``prefix`` elsewhere is refused."""
        prefixes = [m.get("prefix") for m in messages]
        if any(p is not None and not isinstance(p, bool) for p in prefixes):   # "false" is truthy
            raise bad_request("messages", "a message's 'prefix' must be true or false", "invalid_type")
        marked = [i for i, p in enumerate(prefixes) if p]
        if marked and marked != [len(messages) - 1]:
            raise bad_request("messages", "only the final message can be marked 'prefix'")
        if self.continue_final_message is not None:
            continued = self.continue_final_message
        elif marked:
            continued = True
        else:
            continued = self.add_generation_prompt is None and clean[-1]["role"] == "assistant"
        return {"add_generation_prompt": not continued and self.add_generation_prompt is not False,
                "continue_final": continued, "template_kwargs": self.kwargs}


def completion_prompt(prompt: Any) -> str | list[int]:
    """A completions "prompt": text to tokenize, or token ids (``Engine.prompt_tokens`` checks them
    against the vocabulary)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt", "batched prompts are not supported: send one prompt per request",
                          "unsupported_parameter")
    raise bad_request("prompt", "prompt must be a string, a list of token ids, or a list holding one of those",
                      "invalid_type")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat "messages", checked and normalized for the chat template."""
    try:
        return validate_messages(messages)
    except ParameterError as exc:
        raise bad_request("messages", str(exc)) from None


def context_exceeded(n_prompt: int | str, n_ctx: int, param: str) -> ApiError:
    """400 with code context_length_exceeded, as OpenAI and llama-server answer (clients catch it as a bad
    request); ``n_prompt``: the count, or how a ContextOverflowError says it ("at least 70000")."""
    return ApiError(400, f"the prompt has {n_prompt} tokens but the context holds {n_ctx}, a prompt of at most "
                         f"{n_ctx - 1} and a token of answer: shorten the prompt (or start the server with a "
                         "larger --ctx-size)",
                    param=param, code="context_length_exceeded")


def completion_budget(n_prompt: int, max_tokens: int | None, n_ctx: int, default: int, param: str,
                      max_tokens_param: str = "max_tokens") -> int:
    """The completion's token limit: the request's if the context holds it, else ``default`` capped to
    the room left. Refuses an empty prompt and one the context cannot hold (``param``, the prompt's field;
    ``max_tokens_param``, the limit's)."""
    if not n_prompt:
        raise bad_request(param, "the prompt is empty")
    if n_prompt + 1 > n_ctx:
        raise context_exceeded(n_prompt, n_ctx, param)
    room = n_ctx - n_prompt
    if max_tokens is None:
        return min(default, room)
    if max_tokens == -1:   # llama-server's n_predict -1: until the context is full
        return room
    if max_tokens > room:
        raise ApiError(400, f"this model's context holds {n_ctx} tokens, but {_count(n_prompt + max_tokens)} "
                            f"were requested ({n_prompt} in the prompt, {_count(max_tokens)} for the "
                            f"completion): reduce {max_tokens_param} to at most {room}",
                       param=max_tokens_param, code="context_length_exceeded")
    return max_tokens


def _count(n: int) -> str:
    """A count as an error quotes it: a client's 1e308 is not spelled out in 309 digits."""
    return str(n) if n < 10**12 else f"{float(n):.3g}"


# ---- responses ----------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``payload`` (a JSON object, or "[DONE]")."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n"


def finish_reason(result: "GenerationResult") -> str:
    return "length" if result.stats.finish_reason == "length" else "stop"


def stats_body(result: "GenerationResult") -> dict[str, Any]:
    """The speculative-decoding statistics this server adds to OpenAI's response ("stats")."""
    s = result.stats
    return {"method": s.method, "tokens_per_second": round(s.tokens_per_second, 3),
            "target_passes": s.target_passes, "drafted": s.drafted, "accepted": s.accepted,
            "accepted_per_pass": round(s.accepted_per_pass, 4), "tokens_per_pass": round(s.tokens_per_pass, 4),
            "prefill_seconds": round(s.prefill_seconds, 6), "decode_seconds": round(s.decode_seconds, 6),
            "finish_reason": s.finish_reason,
            **({"seed": s.seed} if s.seed is not None else {}),   # a sampled answer's: it can be asked again
            # the method's own counters and the decode's time split, as `generate --json` gives them; a
            # failed history save is the operator's business (its message names the server's files)
            "extra": {k: v for k, v in s.extra.items() if k != "history_not_saved"}}


def usage_body(n_prompt: int, result: "GenerationResult") -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": result.stats.tokens,
            "total_tokens": n_prompt + result.stats.tokens}


@dataclass
class Reply:
    """The response objects of one generation: the whole response, or its stream's chunks."""

    chat: bool
    model: str
    n_prompt: int
    id: str
    created: int

    @classmethod
    def start(cls, chat: bool, model: str, n_prompt: int) -> "Reply":
        return cls(chat, model, n_prompt, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], now())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def body(self, result: "GenerationResult") -> dict[str, Any]:
        """The whole (non-streamed) response."""
        finish = finish_reason(result)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body.update(usage=usage_body(self.n_prompt, result), stats=stats_body(result))
        return body

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, text: str | None, finish: str | None, first_chunk: bool = False) -> dict[str, Any]:
        """A stream chunk: new text, or (with ``finish``) the end; chat's first chunk names the role."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first_chunk:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope(self._chunk_object, [choice])

    def final_chunk(self, result: "GenerationResult") -> dict[str, Any]:
        final = self.chunk(None if self.chat else "", finish_reason(result))
        final["stats"] = stats_body(result)
        return final

    def usage_chunk(self, result: "GenerationResult") -> dict[str, Any]:
        """The extra last chunk that ``stream_options.include_usage`` asks for."""
        chunk = self._envelope(self._chunk_object, [])
        chunk["usage"] = usage_body(self.n_prompt, result)
        return chunk
