"""Instruction prompts of embedding models: what a model has, and which one a request gets.

sentence-transformers' rules, kept here once for the daemon (it checks names
before queueing and maps Cohere `input_type` / Jina `task` onto them) and for
the worker (it prepends the text):

* A model's prompts come from its folder's `config_sentence_transformers.json`
  (`prompts`, `default_prompt_name`); its catalog entry may set more or other
  ones (a name set there wins, as `SentenceTransformer(prompts=...)` does). The
  pull records the merged table in the manifest.
* A sentence-transformers model always knows `query` and `document` (empty
  unless the model sets them), as `SentenceTransformer._default_prompts` does.
* `prompt` (a text) wins over `prompt_name`; neither means the model's
  `default_prompt_name`, if it has one; `prompt: ""` means no prompt at all.
  An unknown name is refused, listing the model's names.
* The prompt is prepended to each text (`prompt + text`) and tokenized with it,
  so its tokens count in `usage` and in the model's length limit.

Light imports only: the API process imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from fleet.errors import BadRequest

#: Where sentence-transformers keeps a model's prompts.
CONFIG_FILE = "config_sentence_transformers.json"
#: Names every sentence-transformers model knows (empty unless it sets them).
ST_PROMPT_NAMES = ("query", "document")
#: Runtimes whose models know ST_PROMPT_NAMES.
ST_RUNTIMES = frozenset({"sentence-transformers"})


def folder_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """(prompts, default_prompt_name) as a model folder's `config_sentence_transformers.json`
    says; ({}, None) when it has none (or no such file)."""
    try:
        data: Any = msgspec.json.decode((folder / CONFIG_FILE).read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}, None
    if not isinstance(data, dict):
        return {}, None
    prompts = data.get("prompts")
    prompts = {str(k): str(v) for k, v in prompts.items() if v is not None} if isinstance(prompts, dict) else {}
    default = data.get("default_prompt_name")
    return prompts, str(default) if isinstance(default, str) and default else None


def merged_prompts(folder: Path | None, prompts: dict[str, str] | None, default: str | None,
                   ) -> tuple[dict[str, str], str | None]:
    """The folder's prompts with `prompts` (a catalog entry's) over them, and the
    default name (the entry's, else the folder's)."""
    own, own_default = folder_prompts(folder) if folder is not None else ({}, None)
    return {**own, **(prompts or {})}, default or own_default


def prompt_table(runtime: str, prompts: dict[str, str] | None) -> dict[str, str]:
    """Every prompt name a model of `runtime` takes -> its text."""
    base = dict.fromkeys(ST_PROMPT_NAMES, "") if runtime in ST_RUNTIMES else {}
    return {**base, **(prompts or {})}


def check_default(model: str, table: dict[str, str], default: str | None) -> None:
    if default is not None and default not in table:
        raise BadRequest(f"{model}: default_prompt_name {default!r} is not one of its prompts "
                         f"({names_of(table)})")


def names_of(table: dict[str, str]) -> str:
    return ", ".join(repr(k) for k in table) or "none"


def resolve_prompt(model: str, table: dict[str, str], default: str | None, prompt: str | None,
                   prompt_name: str | None) -> str:
    """The text to put before each input of a request ('' = none)."""
    if prompt is not None:
        return prompt
    name = prompt_name if prompt_name is not None else default
    if name is None:
        return ""
    try:
        return table[name]
    except KeyError:
        raise BadRequest(f"unknown prompt_name {name!r} for {model}: its prompts are {names_of(table)}",
                         param="prompt_name") from None


def first_prompt(table: dict[str, str], candidates: tuple[str, ...]) -> tuple[str | None, bool]:
    """(prompt name, applies) for a route's task-like field (Cohere `input_type`,
    Jina `task`) given the names it means, best first: the first candidate with
    a non-empty prompt (applies); else the first the model knows, empty (the
    model has no instruction for it, and its default prompt is not used either,
    as sentence-transformers' `encode_query` does); else None (not applied)."""
    known = [c for c in candidates if c in table]
    for name in known:
        if table[name]:
            return name, True
    return (known[0] if known else None), False
