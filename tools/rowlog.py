"""The bench's row log: every finished (task, method, BC) row is appended to a JSON-lines file
and flushed at once, so an interrupted bench keeps what it measured and the same command,
run again, measures only the rows still missing.

A row is reused only when it was measured with the same settings (model, backend, device,
dtype, threads, new tokens, repeats) on the same prompts (a hash of the task's prompt texts),
the model's settings including what is at its path (:func:`model_identity`): a package
exported again to the same folder (``export --force``) is another model, whose rows are
measured anew.
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
import os
from pathlib import Path

MANIFEST = "edgemtp.json"


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


def model_identity(path: str) -> str | None:
    """A digest of what the model at ``path`` is, cheap to take (no weights read):

    - an exported package: its manifest's bytes (which record every file's size and sha256),
      and the size and modification time of each file it lists;
    - a Hugging Face folder (or a folder of GGUF files): its ``config.json`` bytes, and the
      name, size and modification time of every other file at its top level;
    - a file (a ``.gguf``): its size and modification time.

    - a hub id (``org/name``): the snapshot of it in the local Hugging Face cache, the one
      ``from_pretrained`` loads (its folder, named by the commit, and that folder's files as
      above).

    None where neither is here to read (a hub id not in the cache).

    >>> import tempfile, pathlib, time
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "config.json").write_text('{"model_type": "llama"}') and None
    >>> first = model_identity(str(d))
    >>> first == model_identity(str(d)), model_identity(str(d / "nothing"))
    (True, None)
    >>> (d / "model.safetensors").write_bytes(b"x") and None
    >>> model_identity(str(d)) == first
    False
    """
    p = Path(path)
    h = hashlib.sha256()
    try:
        if p.is_file():
            _stat_into(h, p, p.name)
        elif (p / MANIFEST).is_file():
            data = (p / MANIFEST).read_bytes()
            h.update(data)
            try:
                files = json.loads(data).get("files") or {}
            except (ValueError, AttributeError):
                files = {}
            for name in sorted(files if isinstance(files, dict) else ()):
                f = p / name
                if f.is_file():  # (a missing one: loading the package says so)
                    _stat_into(h, f, name)
        elif p.is_dir():
            if (p / "config.json").is_file():
                h.update((p / "config.json").read_bytes())
            for f in sorted(p.iterdir()):
                if f.is_file() and not f.name.startswith("."):
                    _stat_into(h, f, f.name)
        else:
            snapshot = _cached_snapshot(path)
            inner = snapshot and model_identity(snapshot)
            if not inner:
                return None
            h.update(f"{snapshot}|{inner}".encode())
    except OSError:
        return None
    return h.hexdigest()[:16]


def _cached_snapshot(name: str) -> str | None:
    """The local folder of hub id ``name``'s snapshot in the Hugging Face cache (no network),
    or None."""
    if not name or name.startswith((".", "/")) or name.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not cached, not a valid id, or huggingface_hub missing
        return None


def _stat_into(h, f: Path, name: str) -> None:
    st = os.stat(f)
    h.update(f"|{name}|{st.st_size}|{st.st_mtime_ns}".encode())
