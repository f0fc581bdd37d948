"""Prompts for the tools, read from ``../shared/data`` (never copied into the repository):
the story prompts (demo, profile, bench's ``stories`` set) and the Spec-Bench questions."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from edgemtp.errors import ConfigError

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORY_PROMPTS = SHARED / "data" / "stories_prompts.jsonl"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
PROMPT_SETS = ("stories", "spec_bench")


def story_prompts(n: int) -> list[str]:
    """The first ``n`` shared story prompts."""
    return load_prompts(str(STORY_PROMPTS), n)


def load_prompts(path: str | None, n: int) -> list[str]:
    """The first ``n`` prompts of a JSONL file (a JSON string, ``prompt``, or Spec-Bench
    ``turns``: the first turn, a line each); ``None``: the shared story prompts."""
    path = str(STORY_PROMPTS) if path is None else path
    rows = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:  # (its own line number is the string's: 1)
                    raise ConfigError(f"cannot read prompts from {path!r}: line {number} is "
                                      f"not JSON ({e.msg} at column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompts from {path!r}: {e}") from None
    prompts = [_first_prompt(r) for r in rows]
    prompts = [p for p in prompts if isinstance(p, str) and p]
    if not prompts:
        raise ConfigError(f"{path!r} has no prompts; expected JSON lines, each a string or an "
                          f"object with 'prompt' or 'turns'")
    return prompts[:n]


def prompt_sets(names: list[str], per_set: int) -> dict[str, list[str]]:
    """``{task: prompts}``: ``stories`` (the shared story prompts) and ``spec_bench`` (the
    Spec-Bench questions, first turn, ``per_set`` per category, one task per category)."""
    unknown = [n for n in names if n not in PROMPT_SETS]
    if unknown or not names:
        raise ConfigError(f"prompt sets must be some of {', '.join(PROMPT_SETS)}, got "
                          f"{','.join(names) or 'none'}")
    out: dict[str, list[str]] = {}
    if "stories" in names:
        out["stories"] = story_prompts(per_set)
    if "spec_bench" in names:
        if not SPEC_BENCH.is_file():
            raise ConfigError(f"Spec-Bench questions not found at {SPEC_BENCH}")
        by_cat: dict[str, list[str]] = defaultdict(list)
        with open(SPEC_BENCH) as f:
            for line in f:
                row = json.loads(line)
                if len(by_cat[row["category"]]) < per_set:
                    by_cat[row["category"]].append(row["turns"][0])
        out.update(by_cat)
    return out


def chat_turns(model, tasks: dict[str, list]) -> dict[str, list]:
    """When the model has a chat template, every Spec-Bench question becomes one user turn
    under it (token ids, as ``Model.encode_chat`` gives them); the stories stay plain text
    (they are continuations, not questions)."""
    if model.tokenizer is None or model.tokenizer.chat_template is None:
        return tasks
    return {task: prompts if task == "stories" else
            [model.encode_chat([{"role": "user", "content": p}]) for p in prompts]
            for task, prompts in tasks.items()}


def _first_prompt(row) -> str | None:
    """A line's prompt: a JSON string, ``{"prompt": ...}``, or Spec-Bench's first turn.

    >>> [_first_prompt(r) for r in ("Once", {"prompt": "Hi"}, {"turns": ["Q1", "Q2"]}, 3)]
    ['Once', 'Hi', 'Q1', None]
    """
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        return None
    turns = row.get("turns")
    return row.get("prompt") or (turns[0] if isinstance(turns, list) and turns else None)
