"""The exported package on disk: what ``edgemtp export`` writes and every package backend
reads. Numpy only, so a device that runs packages never imports torch.

::

    out/<name>/
      edgemtp.json     manifest (format version, dims, EOS ids, dtype, max context, graph I/O
                       names, cache layout, plans, embedding statistics)
      model.onnx       one decoder graph for prefill, plain decoding and tree steps
      model.onnx.data  external weights (large models only)
      kv_commit.onnx   gathers accepted K/V rows into a device-resident cache (CUDA, TensorRT)
      embeddings.npy   the input embedding table [V, d], for host-side mask initialisation
      plans/bc30_k1.npz   static and every dynamic plan of one budget: masks, positions, parents
      tokenizer files

Loading validates the folder and says in one line what is wrong (:class:`ModelLoadError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemtp.errors import ModelLoadError
from edgemtp.plans import dynamic_plans, static_plan

FORMAT_VERSION = 1
MANIFEST = "edgemtp.json"
GRAPH = "model.onnx"
COMMIT = "kv_commit.onnx"  # gathers accepted K/V rows into a device-resident cache
EMBEDDINGS = "embeddings.npy"
CACHE_LAYOUT = "[1, P, H_kv, D] per layer, sequence-major"
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}

FIXED_INPUTS = ("input_ids", "position_ids", "tree_mask", "mask_embeds")
FIXED_OUTPUTS = ("topk_ids", "topk_logprobs", "argmax", "logits")


def kv_names(prefix: str, layers: int) -> list[str]:
    """``prefix_key_0, prefix_value_0, prefix_key_1, ...``: the graph's per-layer K/V order."""
    return [f"{prefix}_{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def graph_inputs(layers: int) -> list[str]:
    return [*FIXED_INPUTS, *kv_names("past", layers)]


def graph_outputs(layers: int) -> list[str]:
    return [*FIXED_OUTPUTS, *kv_names("present", layers)]


def plan_file(bc: int, k: int) -> str:
    return f"plans/bc{bc}_k{k}.npz"


def is_package(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


# -- plans ------------------------------------------------------------------------------------


def plan_arrays(bc: int, k: int) -> dict[str, np.ndarray]:
    """The static plan and every dynamic plan of one budget as arrays, for ``plans/*.npz``.

    >>> a = plan_arrays(8, 1)                  # N = 4: root + 3 depth-1 nodes, T = 8
    >>> a["static_mask"].shape, a["dynamic_shapes"].tolist(), a["static_positions"].tolist()
    ((8, 8), [[3]], [0, 1, 1, 1, 1, 2, 2, 2])
    """
    static = static_plan(bc, k)
    table = dynamic_plans(bc, k).table
    shapes = list(table)
    plans = [table[s] for s in shapes]
    return {
        "static_parents": np.array(static.parents, dtype=np.int64),
        "static_mask": static.tree_mask,
        "static_positions": static.positions,
        "dynamic_shapes": np.array(shapes, dtype=np.int64).reshape(len(shapes), k),
        "dynamic_parents": np.stack([np.array(p.parents, dtype=np.int64) for p in plans]),
        "dynamic_masks": np.stack([p.tree_mask for p in plans]),
        "dynamic_positions": np.stack([p.positions for p in plans]),
    }


def plan_entry(bc: int, k: int) -> dict:
    """The manifest's description of one budget's plans."""
    static = static_plan(bc, k)
    dyn = dynamic_plans(bc, k)
    return {"bc": bc, "k": k, "T": static.bc, "n_nodes": static.n_nodes,
            "static_counts": list(static.counts), "dynamic_shapes": len(dyn),
            "file": plan_file(bc, k)}


def _check_plan_file(root: Path, entry: dict) -> None:
    # the file must hold exactly the plans the runtime compiles for this budget, with the T
    # the manifest (and so the graph's plan shapes) declares
    bc, k, t, name = entry["bc"], entry["k"], entry["T"], entry["file"]
    label = f"plan bc={bc} k={k} ({name})"
    path = root / name
    if not path.is_file():
        raise ModelLoadError(f"{label} is missing from the package {str(root)!r}")
    try:
        with np.load(path) as f:
            arrays = {key: f[key] for key in f.files}
    except (OSError, ValueError, EOFError) as e:
        raise ModelLoadError(f"{label} cannot be read: {_first_line(e)}") from None
    want = plan_arrays(bc, k)
    if set(arrays) != set(want):
        raise ModelLoadError(f"{label} holds arrays {sorted(arrays)}; expected {sorted(want)}")
    got_t = arrays["static_mask"].shape[-1]
    if got_t != t or arrays["dynamic_masks"].shape[-1] != t:
        raise ModelLoadError(f"{label} has T={got_t} positions but the manifest says T={t} "
                             f"(= (k+1)*N = {want['static_mask'].shape[-1]}); re-export")
    for key, value in want.items():
        if arrays[key].shape != value.shape or not np.array_equal(arrays[key], value):
            raise ModelLoadError(f"{label}: {key} {list(arrays[key].shape)} does not match the "
                                 f"plan this runtime compiles {list(value.shape)}; re-export")


# -- manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    """A validated package folder and its manifest."""

    root: Path
    manifest: dict

    @property
    def graph_path(self) -> Path:
        return self.root / self.manifest["graph"]["file"]

    @property
    def np_dtype(self):
        return NP_DTYPES[self.manifest["dtype"]]

    def kv_cache_bytes(self, rows: int | None = None, dtype: str | None = None) -> int:
        """K and V for every layer at ``rows`` cache rows (default: the max context)."""
        m = self.manifest
        itemsize = np.dtype(NP_DTYPES[dtype or m["dtype"]]).itemsize
        return (2 * m["num_layers"] * (rows or m["max_context"]) * m["num_kv_heads"]
                * m["head_dim"] * itemsize)

    def weight_bytes(self) -> int:
        g = self.manifest["graph"]
        files = [g["file"]] + ([g["external_data"]] if g.get("external_data") else [])
        return sum((self.root / f).stat().st_size for f in files if (self.root / f).is_file())


REQUIRED = {
    "format_version": int, "family": str, "hidden_size": int, "num_layers": int,
    "num_heads": int, "num_kv_heads": int, "head_dim": int, "vocab_size": int,
    "eos_token_ids": list, "dtype": str, "max_context": int, "graph": dict, "cache": dict,
    "plans": list, "embeddings": dict, "topk": int,
}


def load_package(path, check_plans: bool = True) -> Package:
    """Read and validate a package folder; one-line :class:`ModelLoadError` when it is bad."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"package folder {str(path)!r} does not exist")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ModelLoadError(f"{str(path)!r} has no {MANIFEST}; expected a folder written by "
                             f"'edgemtp export'")
    try:
        m = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"the manifest {str(mpath)!r} is corrupt: {_first_line(e)}") from None
    if not isinstance(m, dict):
        raise ModelLoadError(f"the manifest {str(mpath)!r} is corrupt: expected a JSON object, "
                             f"got {type(m).__name__}")
    version = m.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ModelLoadError(f"the package {str(path)!r} has format version {version}; this "
                             f"edgemtp reads format version {FORMAT_VERSION} or older (upgrade "
                             f"edgemtp or re-export)")
    for key, kind in REQUIRED.items():
        if not isinstance(m.get(key), kind):
            raise ModelLoadError(f"the manifest {str(mpath)!r} is corrupt: {key!r} should be a "
                                 f"{kind.__name__}, got {m.get(key)!r:.60}")
    if m["dtype"] not in NP_DTYPES:
        raise ModelLoadError(f"the manifest dtype must be one of {', '.join(NP_DTYPES)}, "
                             f"got {m['dtype']!r}")
    pkg = Package(root, m)
    if not pkg.graph_path.is_file():
        raise ModelLoadError(f"the package {str(path)!r} has no {m['graph'].get('file')}; "
                             f"re-export it")
    ext = m["graph"].get("external_data")
    if ext and not (root / ext).is_file():
        raise ModelLoadError(f"the package {str(path)!r} is missing the external weights {ext}")
    layers = m["num_layers"]
    if (m["graph"].get("inputs") != graph_inputs(layers)
            or m["graph"].get("outputs") != graph_outputs(layers)):
        raise ModelLoadError(f"the manifest's graph inputs/outputs do not follow the contract "
                             f"for {layers} layers (input_ids, position_ids, tree_mask, "
                             f"mask_embeds, past_key_i/past_value_i)")
    for entry in m["plans"]:
        if entry.get("n_nodes", 0) > m["topk"]:
            raise ModelLoadError(f"plan bc={entry.get('bc')} k={entry.get('k')} has "
                                 f"{entry['n_nodes']} nodes but the graph exports top-{m['topk']} "
                                 f"candidates; re-export the package")
        if check_plans:
            _check_plan_file(root, entry)
    return pkg


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- inspect ----------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe(pkg: Package) -> str:
    """What ``edgemtp inspect`` prints: manifest summary, plans, memory estimate."""
    m = pkg.manifest
    g, check = m["graph"], m.get("self_check", {})
    lines = [
        f"package   {pkg.root}",
        f"format    {m['format_version']} (edgemtp {m.get('edgemtp_version', '?')}), "
        f"from {m.get('source', '?')}",
        f"model     {m['family']} ({', '.join(m.get('architectures') or []) or m['family']}): "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads x {m['head_dim']}, vocab {m['vocab_size']}",
        f"dtype     {m['dtype']}   max context {m['max_context']}   EOS "
        f"{m['eos_token_ids']}   tokenizer {'yes' if m.get('tokenizer', True) else 'no'}",
        f"graph     {g['file']}{' + ' + g['external_data'] if g.get('external_data') else ''}, "
        f"opset {g.get('opset', '?')}, top-K {m['topk']}, {len(g['inputs'])} inputs, "
        f"{len(g['outputs'])} outputs",
        f"cache     {m['cache']['layout']}",
    ]
    if check:
        lines.append(f"checked   max |logit diff| {check.get('token_rows_max_logit_diff', 0):.1e} "
                     f"token rows, {check.get('mask_rows_max_logit_diff', 0):.1e} mask rows "
                     f"(logit scale {check.get('logit_scale', 1):.3g})")
    lines += ["", f"plans     {'bc':>4} {'k':>3} {'T':>4} {'N':>4}  {'static counts':<14} "
                  f"{'dynamic shapes':>14}"]
    for e in m["plans"]:
        lines.append(f"          {e['bc']:>4} {e['k']:>3} {e['T']:>4} {e['n_nodes']:>4}  "
                     f"{str(e['static_counts']):<14} {e['dynamic_shapes']:>14}")
    weights = pkg.weight_bytes()
    lines += ["", f"memory    weights {_size(weights)} ({m['dtype']}, on disk)"]
    for dt in NP_DTYPES:
        kv, size = pkg.kv_cache_bytes(dtype=dt), np.dtype(NP_DTYPES[dt]).itemsize
        lines.append(f"          KV cache at {m['max_context']} tokens, {dt}: {_size(kv)} "
                     f"(2 x {m['num_layers']} layers x {m['max_context']} x "
                     f"{m['num_kv_heads']} x {m['head_dim']} x {size} B)")
    lines.append(f"          total ({m['dtype']} cache): "
                 f"{_size(weights + pkg.kv_cache_bytes())}")
    return "\n".join(lines)
