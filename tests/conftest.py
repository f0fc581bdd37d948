"""Shared test fixtures: real checkpoints and prompts from ../shared (never copied)."""

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
STORY_PROMPTS = SHARED / "data" / "stories_prompts.jsonl"


def story_prompts(n: int = 48) -> list[str]:
    with open(STORY_PROMPTS) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


@pytest.fixture(scope="session")
def stories_path() -> str:
    assert STORIES.is_dir(), f"missing shared model {STORIES}"
    return str(STORIES)


def pytest_configure(config):
    # the shared test models are tiny: one intra-op thread is fastest and keeps several test
    # processes (and CI's 2 cores) from oversubscribing
    try:
        import torch
    except ModuleNotFoundError:
        return
    torch.set_num_threads(1)
