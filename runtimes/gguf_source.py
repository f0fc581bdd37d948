"""Model paths that name a llama.cpp GGUF file: the file itself (``model.Q4_1.gguf``) or a
folder holding exactly one ``*.gguf`` and no ``config.json``. ``transformers`` reads such a
file directly (config, tokenizer and chat template from its metadata) and de-quantizes the
weights to float; edgemtp only resolves the path and checks the file before loading it.

::

    smollm/                                  resolve_model("smollm")
      SmolLM2-135M-Instruct.Q4_1.gguf   ->   ModelSource(folder="smollm",
                                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")

Resolving is stdlib only (the numpy core calls it); :func:`read_gguf` needs the ``gguf``
package (``edgemtp[export]``).
"""

from __future__ import annotations

import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from edgemtp.errors import ModelLoadError, UnsupportedModelError

SUFFIX = ".gguf"
HASH_LIMIT = 4 * 2**30  # hash GGUF files up to this size (about 10 s); larger ones by size only


@dataclass(frozen=True)
class ModelSource:
    """What ``from_pretrained`` is given: a folder (or hub id), and the GGUF file in it."""

    folder: str
    gguf_file: str | None = None

    @property
    def path(self) -> str:
        return str(Path(self.folder) / self.gguf_file) if self.gguf_file else self.folder

    def pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(path: str) -> ModelSource:
    """``path`` as a :class:`ModelSource`; a one-line error for a ``.gguf`` path that is not a
    file, or a folder (without config.json) that holds more than one GGUF file."""
    p = Path(path).expanduser()
    if p.suffix.lower() == SUFFIX and not p.is_dir():
        if not p.is_file():
            raise ModelLoadError(f"GGUF file {path!r} does not exist; expected a llama.cpp "
                                 f"{SUFFIX} model file")
        return ModelSource(str(p.parent), p.name)
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(f.name for f in p.iterdir()
                       if f.suffix.lower() == SUFFIX and f.is_file())
        if len(found) > 1:
            raise ModelLoadError(f"{path!r} holds {len(found)} GGUF files ({', '.join(found)}); "
                                 f"expected one: give the path of the one to load")
        if found:
            return ModelSource(str(p), found[0])
    return ModelSource(path)


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file says about itself, read without loading its weights."""

    file: str
    bytes: int
    architecture: str
    tensor_types: dict[str, int] = field(hash=False)   # e.g. {"Q4_1": 210, "F32": 61}
    sha256: str | None = None

    def quant_summary(self) -> str:
        """``Q4_1 x210, F32 x61, Q8_0 x1`` (most common first)."""
        return ", ".join(f"{t} x{n}" for t, n in sorted(self.tensor_types.items(),
                                                         key=lambda kv: -kv[1]))


def read_gguf(source: ModelSource, sha256: bool = False) -> GGUFInfo:
    """Check ``source``'s GGUF file before any weight loads: readable and whole (its size is
    what its tensor table describes). Reads the header only, skipping the metadata values
    (tokenizer tables included) but the architecture: ``gguf.GGUFReader`` parses every token
    and takes seconds. ``sha256`` hashes it (files up to :data:`HASH_LIMIT`)."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ModuleNotFoundError:
        raise ModelLoadError("reading a GGUF model needs the 'gguf' package "
                             "(pip install 'edgemtp[export]')") from None
    path = Path(source.path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header = _Header(f)
        known = {int(t) for t in GGMLQuantizationType}
        unknown = sorted({t for t, _, _ in header.tensors if t not in known})
        if unknown:  # a newer llama.cpp's type, or one it removed: not damage
            from importlib.metadata import version

            raise UnsupportedModelError(
                f"the GGUF file {str(path)!r} stores tensors in type {unknown[0]}, which the "
                f"installed gguf package ({version('gguf')}) does not know "
                f"(a newer or a removed llama.cpp type); pip install -U gguf, or convert the "
                f"model with a type it knows (e.g. Q4_0, Q8_0, F16)")
        types = Counter(GGMLQuantizationType(t).name for t, _, _ in header.tensors)
        end = max((header.data_start + offset + n // GGML_QUANT_SIZES[t][0]
                   * GGML_QUANT_SIZES[t][1] for t, n, offset in header.tensors), default=0)
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"the GGUF file {str(path)!r} is damaged or not GGUF ({size} "
                             f"bytes): {first}; restore it") from None
    if end > size:
        raise ModelLoadError(f"the GGUF file {str(path)!r} is damaged: {size} bytes, but its "
                             f"tensor table describes {end} (truncated or incomplete "
                             f"download?); restore it")
    if not header.architecture:
        raise UnsupportedModelError(f"the GGUF file {str(path)!r} names no architecture "
                                    f"('general.architecture'); expected a llama.cpp model")
    from edgemtp.runtimes.package import _sha256  # hashed as package files are

    digest = _sha256(path) if sha256 and size <= HASH_LIMIT else None
    return GGUFInfo(path.name, size, header.architecture, dict(types), digest)


# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


class _Header:
    """A GGUF header (v2, v3; little-endian): magic, version, counts, metadata, tensor table.

    ``tensors``: (GGML type, elements, offset in the data section) per tensor; ``table``:
    (name, GGML type, dims (ggml order: the row length first), offset) per tensor."""

    def __init__(self, f) -> None:
        self.f, self.size = f, os.fstat(f.fileno()).st_size
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"magic {magic!r}, expected b'GGUF'")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}, expected 2 or 3")
        self.architecture, alignment = None, 32
        for _ in range(n_kv):
            key, kind = self._string(), self._u("I")
            if key == "general.architecture" and kind == 8:
                self.architecture = self._string()
            elif key == "general.alignment" and kind == 4:
                alignment = self._u("I")
            else:
                self._skip(kind)
        self.tensors, self.table = [], []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u("I")
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = self._u("I"), self._u("Q")
            self.tensors.append((kind, math.prod(dims), offset))
            self.table.append((name, kind, dims, offset))
        self.data_start = -(-f.tell() // alignment) * alignment

    def _u(self, fmt: str) -> int:
        (v,) = struct.unpack("<" + fmt, self.f.read(struct.calcsize(fmt)))
        return v

    def _string(self) -> str:
        n = self._u("Q")
        if self.f.tell() + n > self.size:
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        return self.f.read(n).decode("utf-8")

    def _skip(self, kind: int) -> None:
        if kind in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[kind]), 1)
        elif kind == 8:
            self.f.seek(self._u("Q"), 1)
        elif kind == 9:
            inner, n = self._u("I"), self._u("Q")
            if inner in _SCALARS:
                self.f.seek(n * struct.calcsize(_SCALARS[inner]), 1)
            else:
                for _ in range(n):
                    self._skip(inner)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def check_gguf(source: ModelSource, sha256: bool = False) -> GGUFInfo:
    """A GGUF file that is whole and holds a family edgemtp runs (before any weight loads)."""
    from edgemtp.models.families import FAMILIES

    info = read_gguf(source, sha256)
    # the families whose GGUF architecture transformers' loader reads (llama.cpp writes
    # Mistral models as 'llama'; transformers' loader has no gguf-py name for 'mistral')
    readable = sorted(f for f in FAMILIES if f != "mistral")
    if info.architecture not in readable:
        raise UnsupportedModelError(
            f"the GGUF file {source.path!r} holds a {info.architecture!r} model, not a supported "
            f"causal LM; supported GGUF architectures: {', '.join(readable)} (a Mistral "
            f"model's GGUF from llama.cpp says 'llama')")
    return info


def check_hf_folder(path: str) -> None:
    """One line for a local path that is not a Hugging Face model folder (stdlib only, so
    ``Model.load`` says it before importing torch)."""
    p = Path(path)
    looks_local = p.exists() or os.sep in path or path.startswith(".")
    if looks_local and not p.is_dir():
        raise ModelLoadError(f"model folder {path!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        if (p / "model.onnx").is_file() or (p / "plans").is_dir():  # (qa8b D15)
            raise ModelLoadError(f"{path!r} holds an edgemtp package's files but no "
                                 f"edgemtp.json (a damaged or unfinished export); export it "
                                 f"again")
        raise ModelLoadError(f"{path!r} has no config.json; expected a Hugging Face model folder")
