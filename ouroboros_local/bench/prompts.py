"""Benchmark prompt sets: reading `{id, task, turns, source, meta}` JSONL files and building prompts.

Prompts follow the Ouroboros paper's benchmark scripts (see ../shared/bench/PROMPTS.md):

- humaneval: an instruction line, then the code stub. With a chat template the instruction is the user
  turn and the code stub is forced as the beginning of the answer (appended after the generation prompt).
- cnndm: "Please summarize the following document within one sentence. Document: {article}  Summary: "
  (a user turn with a chat template).
- gsm8k: "Q: {question}\\nA:", optionally after K worked examples (few-shot; a user turn with a chat template).
- mt_bench: the first turn.  wmt: "Translate German to English: {sentence}".  raw: the first turn as is.

Rendering is a pure function of the item, the task, and a chat-template callable, so it is testable
without a model.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..environment import expand_home
from ..errors import ParameterError
from ..text_input import read_text

TASKS = ("humaneval", "cnndm", "gsm8k", "mt_bench", "wmt", "raw")

# Fixed max new tokens per task (overridden by -n). The paper uses 512 (HumanEval), 128 (CNN/DM),
# 256 (GSM8K) and 1024 (Spec-Bench) on GPUs; these are sized for CPU runs.
DEFAULT_MAX_TOKENS = {"humaneval": 192, "cnndm": 128, "gsm8k": 256, "mt_bench": 256, "wmt": 128, "raw": 128}

HUMANEVAL_INSTRUCTION = ("Please complete the following Python code without providing any additional "
                         "tasks such as testing or explanations")
CNNDM_TEMPLATE = "Please summarize the following document within one sentence. Document: {article}  Summary: "
GSM8K_TEMPLATE = "Q: {question}\nA:"
WMT_TEMPLATE = "Translate {src} to {tgt}: {text}"
LANGUAGES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech", "ru": "Russian",
             "zh": "Chinese", "ja": "Japanese", "es": "Spanish", "it": "Italian", "hi": "Hindi"}

_TASK_ALIASES = {"human_eval": "humaneval", "human-eval": "humaneval", "cnn_dm": "cnndm", "cnn-dm": "cnndm",
                 "summarization": "cnndm", "mt-bench": "mt_bench", "mtbench": "mt_bench",
                 "translation": "wmt", "math": "gsm8k"}

ChatTemplate = Callable[[list[dict[str, str]]], str]


@dataclass
class PromptItem:
    id: str
    task: str                       # as written in the file (e.g. "wmt_de_en")
    turns: list[str]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptSet:
    name: str                       # file stem (unique within a run)
    path: str
    task: str                       # normalised task used to build the prompts
    items: list[PromptItem]
    fewshot: list[PromptItem] = field(default_factory=list)   # gsm8k exemplars (not measured)


@dataclass
class BuiltPrompt:
    set_name: str
    id: str
    task: str
    text: str                       # the exact text the model sees (chat template applied if chat)
    tokens: list[int]
    chat: bool
    max_tokens: int


def normalize_task(task: str | None) -> str:
    """Map a file's task field to one of TASKS (wmt_de_en -> wmt; unknown -> raw)."""
    t = (task or "").strip().lower()
    t = _TASK_ALIASES.get(t, t)
    if t in TASKS:
        return t
    for known in TASKS:
        if t.startswith(known):
            return known
    return "raw"


def _is_json(text: str) -> bool:
    """Whether the whole text is one JSON value."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def read_prompt_file(path: str | Path) -> list[PromptItem]:
    """Read a JSONL prompt file (one `{id, task, turns, source, meta}` object per line).

    A file that is not `.jsonl`/`.json` is one raw prompt: its whole text.
    """
    p = Path(path)
    text = read_text(p, "prompt file")
    if p.suffix.lower() not in (".jsonl", ".json"):
        if not text.strip():   # checked here, as JSONL's empty turn: found mid-run, it discarded the run
            raise ParameterError(f"{p}: the prompt file is empty (a non-JSON file is one prompt)")
        return [PromptItem(id=p.stem, task="raw", turns=[text], source=str(p))]
    items: list[PromptItem] = []
    seen: set[str] = set()
    # split at newlines only: str.splitlines also breaks at U+2028 and others, which JSON strings may hold
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if _is_json(text):   # a pretty-printed .json: valid, but not one object per line
                raise ParameterError(f"{p}: a prompt file is JSONL, one JSON object per line; this one is JSON "
                                     "over several lines: write each prompt on a line of its own") from None
            raise ParameterError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ParameterError(f"{p}:{lineno}: each line must be a JSON object (JSONL: one prompt per line)")
        turns = obj.get("turns")
        if isinstance(turns, str):
            turns = [turns]
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) for t in turns)):
            raise ParameterError(f"{p}:{lineno}: 'turns' must be a non-empty list of strings")
        if not all(turns):   # checked here: an empty prompt found mid-run once discarded the whole run
            raise ParameterError(f"{p}:{lineno}: a turn is empty")
        item_id = str(obj.get("id", f"{p.stem}-{lineno}"))
        if item_id in seen:
            raise ParameterError(f"{p}:{lineno}: duplicate id {item_id!r}")
        seen.add(item_id)
        meta = obj.get("meta") or {}
        if not isinstance(meta, dict):
            raise ParameterError(f"{p}:{lineno}: 'meta' must be an object")
        items.append(PromptItem(id=item_id, task=str(obj.get("task", "raw")), turns=list(turns),
                                source=str(obj.get("source", "")), meta=meta))
    if not items:
        raise ParameterError(f"{p}: no prompts")
    return items


def set_task_of(path: str, items: Sequence[PromptItem]) -> str:
    """The one task a file's lines name (a set is built, timed and reported as one task); a mix is refused:
    every line was once built with the first line's task and budget, in silence."""
    first = normalize_task(items[0].task)
    other = next((i for i in items if normalize_task(i.task) != first), None)
    if other is not None:
        raise ParameterError(f"{path}: prompt {items[0].id!r} is a {first} prompt and {other.id!r} a "
                             f"{normalize_task(other.task)} one: a file is one set of one task "
                             "(split it, or force one with --task)")
    return first


def prompt_paths(spec: str | Sequence[str]) -> list[str]:
    """--prompts' files, ``~`` expanded (no shell does it after --prompts=): split at commas, unless the
    whole of ``spec`` names a file (a name with a comma could not be given at all)."""
    def expanded(path: str) -> str:   # only where there is a ~: the path as given is the one reported
        return str(expand_home(path, "give the prompt file's path without ~")) if path.startswith("~") else path

    if isinstance(spec, str) and "," in spec and os.path.exists(expanded(spec)):
        return [expanded(spec)]
    parts = spec.split(",") if isinstance(spec, str) else spec
    return [expanded(part.strip()) for part in parts if part.strip()]


def load_sets(spec: str | Sequence[str], task: str | None = None, limit: int | None = None,
              fewshot: int = 0) -> list[PromptSet]:
    """Read comma-separated prompt files (``prompt_paths``); each file is one set. `limit` keeps the first N
    prompts of each.

    With `fewshot` K > 0, gsm8k sets use their first K items as worked examples (not measured).
    """
    paths = prompt_paths(spec)
    if not paths:
        raise ParameterError("--prompts needs at least one file")
    if task is not None and task not in TASKS:
        raise ParameterError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if limit is not None and limit < 1:
        raise ParameterError("--limit must be >= 1")
    if fewshot < 0:
        raise ParameterError("--fewshot must be >= 0")
    sets: list[PromptSet] = []
    from .report import ALL_SETS   # here, not at import: `python -m ...bench.report` warned at every run

    names: set[str] = {ALL_SETS}   # the report's pooled row: a file all.jsonl becomes set "all-2"
    for path in paths:
        items = read_prompt_file(path)
        if len(items) == 1 and limit is not None and limit > 1:
            logging.getLogger("ouroboros_local").info(
                "bench: %s holds one prompt (a .txt file is one prompt, whatever its lines; a .jsonl file "
                "holds one per line), so --limit %d keeps it whole", path, limit)
        set_task = task or set_task_of(path, items)
        name = Path(path).stem
        k = 2
        while name in names:
            name, k = f"{Path(path).stem}-{k}", k + 1
        names.add(name)
        shots: list[PromptItem] = []
        if set_task == "gsm8k" and fewshot:
            if fewshot >= len(items):
                raise ParameterError(f"{path}: --fewshot {fewshot} leaves no prompt to measure")
            shots, items = items[:fewshot], items[fewshot:]
        if limit is not None:
            items = items[:limit]
        sets.append(PromptSet(name=name, path=str(path), task=set_task, items=items, fewshot=shots))
    return sets


def gsm8k_exemplar(item: PromptItem) -> str:
    """One worked example in the Wei et al. format, from the item's reference solution."""
    answer = str(item.meta.get("answer", ""))
    answer = re.sub(r"<<[^>]*>>", "", answer)
    lines = [ln.strip() for ln in answer.splitlines() if ln.strip()]
    final = item.meta.get("final")
    chain = []
    for ln in lines:
        if ln.startswith("####"):
            final = final or ln[4:].strip()
        else:
            chain.append(ln)
    text = " ".join(chain)
    if final is not None:
        text = f"{text} The answer is {final}.".strip()
    return f"Q: {item.turns[0]}\nA: {text}\n\n"


def _lang(code: Any, default: str) -> str:
    code = str(code or "").lower()
    return LANGUAGES.get(code, code.capitalize() if code else default)


def render_prompt(item: PromptItem, task: str, chat: bool, template: ChatTemplate | None = None,
                  fewshot: Sequence[PromptItem] = ()) -> str:
    """The prompt text for one item (chat template applied when `chat`; `template` renders messages
    with the generation prompt appended)."""
    if chat and template is None:
        raise ParameterError("chat prompts need the model's chat template")
    first = item.turns[0]

    def as_user(content: str, answer_prefix: str = "") -> str:
        if not chat:
            return content + answer_prefix
        assert template is not None
        return template([{"role": "user", "content": content}]) + answer_prefix

    if task == "humaneval":
        if chat:
            return as_user(HUMANEVAL_INSTRUCTION, first)   # the code stub is a forced answer prefix
        return f"{HUMANEVAL_INSTRUCTION}\n{first}"
    if task == "cnndm":
        return as_user(CNNDM_TEMPLATE.format(article=first))
    if task == "gsm8k":
        shots = "".join(gsm8k_exemplar(s) for s in fewshot)
        return as_user(shots + GSM8K_TEMPLATE.format(question=first))
    if task == "wmt":
        src = _lang(item.meta.get("src_lang"), "German")
        tgt = _lang(item.meta.get("tgt_lang"), "English")
        return as_user(WMT_TEMPLATE.format(src=src, tgt=tgt, text=first))
    # mt_bench (first turn only) and raw
    return as_user(first)


_CHAT_NAME = re.compile(r"(instruct|chat|(^|[-_.\s])it([-_.\s]|$)|assistant)", re.IGNORECASE)


def looks_like_chat_model(name: str, has_template: bool) -> bool:
    """Heuristic for --chat's default: an instruct/chat model name and a chat template in the GGUF."""
    return bool(has_template and _CHAT_NAME.search(name or ""))


def build_prompts(sets: Sequence[PromptSet], tokenize: Callable[[str], list[int]],
                  chat: bool, template: ChatTemplate | None, max_tokens: int | None = None
                  ) -> list[BuiltPrompt]:
    """Render and tokenize every prompt. `tokenize(text)` adds the model's usual specials, as llama.cpp's
    tools do to the text they are given; `template` renders a chat as that tokenizer takes it
    (``Engine.chat_prompt``: a BOS the template wrote is dropped where the vocabulary adds one)."""
    out: list[BuiltPrompt] = []
    for s in sets:
        n = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS.get(s.task, 128)
        for item in s.items:
            text = render_prompt(item, s.task, chat, template, s.fewshot)
            tokens = tokenize(text)
            out.append(BuiltPrompt(set_name=s.name, id=item.id, task=s.task, text=text, tokens=tokens,
                                   chat=chat, max_tokens=n))
    return out
