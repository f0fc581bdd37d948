"""The bench's row log: every finished (task, method, BC) row is appended to a JSON-lines file
and flushed at once, so an interrupted bench keeps what it measured and the same command,
run again, measures only the rows still missing.

A row is reused only when it was measured with the same settings (model, backend, device,
dtype, threads, new tokens, repeats) on the same prompts (a hash of the task's prompt texts).
Rows measured with other settings stay in the file untouched; ``fresh`` starts the file over
(at the first new row, so an interrupted fresh run that measured nothing loses nothing).

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "rows.jsonl"
>>> log = RowLog(path, {"repeats": 1})
>>> log.add("stories", "greedy", 1, ["Once upon"], {"tokens": 9})
>>> log.close()
>>> RowLog(path, {"repeats": 1}).get("stories", "greedy", 1, ["Once upon"])
{'tokens': 9}
>>> RowLog(path, {"repeats": 3}).get("stories", "greedy", 1, ["Once upon"]) is None
True
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class RowLog:
    def __init__(self, path: Path, settings: dict, fresh: bool = False) -> None:
        self.path, self.settings, self.fresh = Path(path), settings, fresh
        self.records: dict[str, dict] = {} if fresh else self._read()
        self._file = None

    @property
    def kept(self) -> int:
        """Rows in the file measured with these settings."""
        return len(self.records)

    def get(self, task: str, method: str, bc: int, prompts: list[str]) -> dict | None:
        return self.records.get(_key(task, method, bc, prompts))

    def add(self, task: str, method: str, bc: int, prompts: list[str], record: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w" if self.fresh else "a")
        key = _key(task, method, bc, prompts)
        line = dict(settings=self.settings, key=key, task=task, method=method, bc=bc,
                    record=record)
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()  # a Ctrl-C after this line keeps the row
        self.records[key] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _read(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        out = {}
        with open(self.path) as f:
            for text in f:
                try:
                    line = json.loads(text)
                except json.JSONDecodeError:  # a line cut short by a killed run
                    continue
                if isinstance(line, dict) and line.get("settings") == self.settings:
                    out[line["key"]] = line["record"]
        return out


def _key(task: str, method: str, bc: int, prompts: list[str]) -> str:
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return f"{task}|{method}|{bc}|{digest}"
