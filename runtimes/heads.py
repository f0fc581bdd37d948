"""Learned draft heads in a package: their manifest entry (:class:`HeadsInfo`, written by
``edgemtp train-heads``) and :class:`HeadsRunner`, which runs ``heads/<kind>.onnx`` on
onnxruntime (imported when a runner is made, never by the core).

::

    heads/medusa.onnx    hidden [N, d], k                   -> ids, logprobs [N, H, k]
    heads/residual.onnx  hidden [N, d], root_ids [N] (whole vocabulary) or root_embeds
                         [N, d] (a subset), k  -> ids, logprobs
                         supplied rows: lm_head [M, d] (both), lm_chain [C, d] (residual
                         over a subset)
                         (both kinds: k [1], the candidates per head, <= topk; graphs from
                         before it have none and give topk)
    heads/<kind>.vocab.npy  the M token ids the heads score, most frequent first (absent: the
                            whole vocabulary)

The LM head's rows are not stored in the heads graph: it declares ``lm_head`` (and
``lm_chain``, the first ``C`` of the same rows) as initializers with absent external data,
which the runner supplies from the package's own embedding table (the LM head of a tied
model) when it loads the graph. So the heads add no copy of the LM head on disk, and
onnxruntime still sees constant weights, which it packs once at load rather than every run.
(Heads graphs from before that, listed without ``supplied``, take the rows as inputs.)

On a CPU with a C compiler the runner computes the same function with
:mod:`edgemtp.native`'s ``heads.c`` (:class:`NativeHeads`, weights read from the graph's
initializers): a heads run on a model as small as stories260K is ~30 onnxruntime kernels,
mostly per-node overhead. Each file is checked once per process against its onnxruntime
session on random states (the same tolerance as ``train-heads``' export check); a file it
cannot read or that disagrees runs in onnxruntime. ``EDGEMTP_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgemtp.errors import ConfigError, ModelLoadError

HEADS_DIR = "heads"
HEAD_KINDS = ("medusa", "residual")
ROW_INPUTS = ("lm_head", "lm_chain")  # LM-head rows the runtime supplies to a heads graph


@dataclass(frozen=True, kw_only=True)
class HeadsTraining:
    """How the heads were trained (self-distillation on the package's own generations)."""

    data: str                   # where the training text came from, in words
    prompts: int                # training prompts (BOS included as one)
    sequences: int
    positions: int              # hidden states trained on
    steps: int
    batch: int
    lr: float
    seed: int
    loss_first: float
    loss_last: float
    val_top1: tuple[float, ...]  # per head, on held-out training positions
    minutes: float              # training only (generation and caching: gen_minutes)
    gen_minutes: float          # what generating the training data took
    threads: int
    date: str
    gen_reused: bool = False    # the generations came from an earlier run's cache (--work)


@dataclass(frozen=True, kw_only=True)
class HeadsInfo:
    kind: str
    file: str
    heads: int                  # H: depths one run proposes
    topk: int                   # K candidates per head
    vocab: int                  # M tokens scored (== vocab_size: the whole vocabulary)
    vocab_file: str | None = None
    width: int | None = None    # the residual module's inner width
    chain: int | None = None    # residual: rows the in-graph top-1 chain reads (None: all M)
    supplied: tuple[str, ...] = ()  # ROW_INPUTS the graph declares as supplied initializers
    loss_plot: str | None = None
    training: HeadsTraining | None = None

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ModelLoadError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got "
                                 f"{self.kind!r}")
        if self.heads < 1 or self.topk < 1 or self.vocab < self.topk:
            raise ModelLoadError(f"heads {self.kind}: need heads >= 1 and 1 <= topk <= vocab, "
                                 f"got heads {self.heads}, topk {self.topk}, vocab {self.vocab}")

    def files(self) -> list[str]:
        return [f for f in (self.file, self.vocab_file, self.loss_plot) if f]

    def summary(self) -> str:
        t = self.training
        line = (f"{self.kind}: {self.heads} heads, top-{self.topk}, "
                f"{'full vocabulary' if self.vocab_file is None else f'{self.vocab} tokens'}")
        if t is not None:
            acc = "/".join(f"{a:.2f}" for a in t.val_top1)
            line += (f"; {t.steps} steps on {t.positions} positions of {t.sequences} "
                     f"generations ({t.data}), loss {t.loss_first:.3f} -> {t.loss_last:.3f}, "
                     f"top-1 per head {acc}, {t.minutes:.1f} min training + "
                     + (f"generations reused (they took {t.gen_minutes:.1f} min)"
                        if t.gen_reused else f"{t.gen_minutes:.1f} min generating")
                     + f", {t.date}")
        return line


def pick(infos, kind: str | None, where: str) -> HeadsInfo:
    """The heads entry a generation asks for (``None``: the package's first)."""
    if not infos:
        raise ConfigError(f"{where} has no learned heads; train them first: edgemtp train-heads "
                          f"PACKAGE --kind medusa|residual (the package must be exported with "
                          f"--hidden-states)")
    if kind is None:
        return infos[0]
    for info in infos:
        if info.kind == kind:
            return info
    raise ConfigError(f"{where} has heads {', '.join(i.kind for i in infos)}, not {kind!r}")


def heads_session(path, threads: int, rows: dict[str, np.ndarray]):
    """An InferenceSession of a heads graph, with the LM-head ``rows`` it declares supplied
    (onnxruntime reads them from this memory, which must outlive the session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if rows:
        opts.add_external_initializers(
            list(rows), [ort.OrtValue.ortvalue_from_numpy(a) for a in rows.values()])
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise ModelLoadError(f"cannot load the heads graph {str(path)!r}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@dataclass
class NativeHeads:
    """One heads file's weights laid out for ``heads.c`` (row-major, reduction axis
    contiguous), and the run: ``run(hidden [d], root, root_embed, k, ids, lp)`` writes
    ``[H, k]`` row indices and log-probs into ``ids`` / ``lp``."""

    kind: str
    heads: int
    lm_head: np.ndarray                  # [M, d], the runner's rows (kept alive here)
    chain: int                           # C: the chain's rows (residual), M for medusa
    arrays: dict[str, np.ndarray]        # the kernel's weights
    by_id: bool                          # residual: the root's row gathered by id

    def __post_init__(self) -> None:
        from edgemtp import native

        self._lib = native.heads_lib()
        m, d = self.lm_head.shape
        w = self.arrays["wh"].shape[0] if self.kind == "residual" else 0
        # the LM-head rows as panels of 8 ([ceil(M / 8), d, 8], zero rows past M), which
        # heads.c scores without horizontal adds: a second copy of the rows in memory (the
        # heads graph reads the package's own), 128 KiB on stories260K, 18 MiB on SmolLM2
        mp = -(-m // 8) * 8
        pad = np.zeros((mp, d), np.float32)
        pad[:m] = self.lm_head
        self.arrays["panels"] = np.ascontiguousarray(pad.reshape(mp // 8, 8, d).transpose(0, 2, 1))
        self._scratch = (self.heads * (mp + d) + mp + 2 * d + 2 * w + 64, max(w, 1))
        self._ptr = {k: a.ctypes.data for k, a in self.arrays.items()}

    @classmethod
    def from_graph(cls, path: Path, info: HeadsInfo, lm_head: np.ndarray,
                   inputs: tuple[str, ...]) -> "NativeHeads":
        """The kernel's weights from the heads graph's initializers (``KeyError`` or
        ``ValueError`` where the graph is not laid out as ``models.heads.HeadsGraph``
        exports it)."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path), load_external_data=False)
        init = {t.name: t for t in model.graph.initializer
                if t.data_location != onnx.TensorProto.EXTERNAL}

        def arr(name: str) -> np.ndarray:
            return np.ascontiguousarray(numpy_helper.to_array(init[name]), dtype=np.float32)

        m, d = lm_head.shape
        if info.kind == "medusa":
            [gemm] = [n for n in model.graph.node if n.op_type == "Gemm"]
            trans = {a.name: a.i for a in gemm.attribute}.get("transB", 0)
            w1 = arr(gemm.input[1]) if trans else np.ascontiguousarray(arr(gemm.input[1]).T)
            arrays = {"w1": w1, "b1": arr(gemm.input[2]), "scale": arr("g.heads.scale")}
            if w1.shape != (info.heads * d, d) or arrays["b1"].shape != (info.heads * d,):
                raise ValueError(f"medusa weights of shape {w1.shape}")
            return cls("medusa", info.heads, lm_head, m, arrays, False)
        arrays = {"wh": np.ascontiguousarray(arr("g.wh_t").T),
                  "wd": np.ascontiguousarray(arr("g.wd_t").T), "table": arr("g.u_table")}
        if "g.b_down" in init:
            arrays["bd"] = arr("g.b_down")
        by_id = "root_ids" in inputs
        if not by_id:
            arrays["we"] = np.ascontiguousarray(arr("g.we_t").T)
            arrays["bu"] = arr("g.b_up")
        w = arrays["wh"].shape[0]
        chain = info.chain or m
        if (arrays["wh"].shape != (w, d) or arrays["wd"].shape != (d, w)
                or arrays["table"].shape != (chain, w)):
            raise ValueError("residual weights of unexpected shapes")
        return cls("residual", info.heads, lm_head, chain, arrays, by_id)

    def bind(self, hidden: np.ndarray, root_embed: np.ndarray, ids: np.ndarray,
             lp: np.ndarray, k: int):
        """A call of the kernel on these buffers (hidden [d], root_embed [d], ids / lp [H, k],
        all contiguous and kept alive by the caller): ``call(root)`` fills ids and lp and
        returns 0 (else the kernel refused the shapes or the root)."""
        from edgemtp.native import HeadsCall

        p, (m, d) = self._ptr, self.lm_head.shape
        w = self.arrays["wh"].shape[0] if self.kind == "residual" else 0
        # scratch per call, not per file: runners of one heads file may run in parallel
        work, u0 = (np.zeros(n, np.float32) for n in self._scratch)
        args = HeadsCall(kind=int(self.kind == "residual"), d=d, w=w, heads=self.heads,
                         c=self.chain, m=m, k=k, by_id=int(self.by_id), h=hidden.ctypes.data,
                         emb=root_embed.ctypes.data, work=work.ctypes.data,
                         u0=u0.ctypes.data, ids=ids.ctypes.data, lp=lp.ctypes.data,
                         lm=p["panels"], **{n: p.get(n) for n in ("w1", "b1", "scale", "wh",
                                                                    "wd", "bd", "table", "we",
                                                                    "bu")})
        f, addr = self._lib.heads_run, ctypes.addressof(args)

        def call(root: int) -> int:
            return f(addr, root)
        call.args = args, work, u0  # (kept alive with the call)
        return call

    def run(self, hidden: np.ndarray, root: int, root_embed, k: int, ids: np.ndarray,
            lp: np.ndarray) -> None:
        """One run on any buffers (``ids`` / ``lp`` contiguous ``[H, k]``)."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        e = np.ascontiguousarray(h if root_embed is None else root_embed, dtype=np.float32)
        if self.bind(h, e, ids, lp, k)(int(root)):
            raise ValueError(f"heads.c refused the {self.kind} heads' shapes")


def agrees(native: NativeHeads, session, inputs: tuple[str, ...], topk: int,
           seed: int = 0) -> bool:
    """Whether ``native`` gives the graph's candidates on a few random states: log-probs
    within ``train-heads``' export tolerance, the top-1 equal where it is not a near-tie."""
    m, d = native.lm_head.shape
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((4, d)).astype(np.float32)
    roots = rng.integers(0, native.chain if native.by_id else m, 4)
    embeds = rng.standard_normal((4, d)).astype(np.float32)
    feeds = {"hidden": hidden, "root_ids": roots.astype(np.int64), "root_embeds": embeds,
             "k": np.array([topk], np.int64)}
    ref_ids, ref_lp = session.run(None, {n: feeds[n] for n in inputs})
    ids = np.zeros((native.heads, topk), np.int64)
    lp = np.zeros((native.heads, topk), np.float32)
    limit = max(3e-4 * max(10.0, float(np.abs(ref_lp).max())), 1e-3)
    for r in range(4):
        native.run(hidden[r], int(roots[r]), embeds[r], topk, ids, lp)
        clear = ((ref_lp[r, :, 0] - ref_lp[r, :, 1]) > 2 * limit if topk > 1
                 else np.ones(native.heads, bool))
        if (np.abs(lp - ref_lp[r]).max() > limit
                or not ((ids[:, 0] == ref_ids[r, :, 0]) | ~clear).all()):
            return False
    return True


_NATIVE: dict[tuple, NativeHeads | None] = {}


def native_heads(path: Path, stamp: tuple, info: HeadsInfo, lm_head: np.ndarray,
                 session) -> NativeHeads | None:
    """The C kernel for a heads file, checked against its onnxruntime ``session`` once per
    process (None: no compiler, ``EDGEMTP_NATIVE=0``, or a graph it does not reproduce)."""
    from edgemtp import native

    if native.heads_lib() is None:
        return None
    key = (str(path), stamp, id(lm_head))
    if key not in _NATIVE:
        inputs = tuple(x.name for x in session.get_inputs())
        try:
            nh = NativeHeads.from_graph(path, info, lm_head, inputs)
            _NATIVE[key] = nh if agrees(nh, session, inputs, info.topk) else None
        except (KeyError, ValueError):
            _NATIVE[key] = None
    return _NATIVE[key]


class TorchHeads:
    """:class:`NativeHeads`' math in PyTorch on a device (a torch backend on a GPU): the
    weights and LM-head rows moved there once; a run copies the hidden state in and the
    ``[H, k]`` ids and log-probs out, with the residual chain's argmax kept on the device.
    The same ``bind`` / ``run`` interface, so :class:`HeadsRunner` runs either."""

    def __init__(self, nh: NativeHeads, device) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.kind, self.heads, self.chain, self.by_id = nh.kind, nh.heads, nh.chain, nh.by_id
        self.lm_head = nh.lm_head
        self.w = {k: torch.tensor(a, device=self.device) for k, a in nh.arrays.items()
                  if k != "panels"}  # (copies: the graph's arrays are read-only)
        self.lm = torch.tensor(nh.lm_head, device=self.device)

    def _unit(self, x):
        return x / self.torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def compute(self, h, root: int, e, k: int):
        """ids, log-probs ``[H, k]`` (device tensors) for hidden ``h [d]``."""
        torch, w, f = self.torch, self.w, self.torch.nn.functional
        if self.kind == "medusa":
            d = h.shape[0]
            z = (w["w1"] @ self._unit(h) + w["b1"]).view(self.heads, d)
            logits = (h + w["scale"] * f.silu(z)) @ self.lm.T
        else:
            u = (w["table"][root] if self.by_id
                 else w["bu"] + w["we"] @ self._unit(e))
            states, chain = [], self.lm[:self.chain]
            for j in range(self.heads):
                y = f.silu(u + w["wh"] @ self._unit(h))
                h = h + w["wd"] @ y + (w["bd"] if "bd" in w else 0.0)
                states.append(h)
                if j + 1 < self.heads:
                    u = w["table"][torch.argmax(chain @ h)]
            logits = torch.stack(states) @ self.lm.T
        lp, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return ids, lp

    def bind(self, hidden: np.ndarray, root_embed: np.ndarray, ids: np.ndarray,
             lp: np.ndarray, k: int):
        torch, dev = self.torch, self.device

        def call(root: int) -> int:
            with torch.no_grad():
                h = torch.from_numpy(hidden).to(dev)
                e = None if self.by_id or self.kind == "medusa" else \
                    torch.from_numpy(root_embed).to(dev)
                i, p = self.compute(h, root, e, k)
                ids[...] = i.cpu().numpy()
                lp[...] = p.float().cpu().numpy()
            return 0
        return call

    def run(self, hidden: np.ndarray, root: int, root_embed, k: int, ids: np.ndarray,
            lp: np.ndarray) -> None:
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        e = np.ascontiguousarray(h if root_embed is None else root_embed, dtype=np.float32)
        self.bind(h, e, ids, lp, k)(int(root))


def torch_heads(path: Path, stamp: tuple, info: HeadsInfo, lm_head: np.ndarray, session,
                device) -> TorchHeads | None:
    """The heads in PyTorch on ``device``, checked against the onnxruntime ``session`` once
    per process (None where torch is missing or the graph is not reproduced)."""
    key = (str(path), stamp, id(lm_head), str(device))
    if key not in _NATIVE:
        inputs = tuple(x.name for x in session.get_inputs())
        try:
            import torch  # noqa: F401  (the torch backend's own dependency)

            th = TorchHeads(NativeHeads.from_graph(path, info, lm_head, inputs), device)
            _NATIVE[key] = th if agrees(th, session, inputs, info.topk) else None
        except (ImportError, KeyError, ValueError, RuntimeError, AssertionError):
            _NATIVE[key] = None  # (a torch without that device raises the last two)
    return _NATIVE[key]


_FASTER: dict[tuple, bool] = {}


def faster(a: "HeadsRunner", b: "HeadsRunner", rounds: int = 9) -> bool:
    """Whether runner ``a`` runs faster than ``b`` on this machine: the median of ``rounds``
    alternating timings of a few runs each on one random state (~1 ms on stories260K, ~50 ms
    on SmolLM2-135M; once per heads file, thread count and k in a process)."""
    import statistics
    import time

    d = a.lm_head.shape[1]
    h = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    e = h if a.needs_embedding else None
    ratios = []
    for _ in range(rounds):
        t = []
        for r in (a, b):
            t0 = time.perf_counter()
            for _ in range(3):
                r.run(h, 1, e)
            t.append(time.perf_counter() - t0)
        ratios.append(t[0] / t[1])
    return statistics.median(ratios) < 1.0


_SESSIONS: dict[tuple, object] = {}


def _graph(path: Path, stamp: tuple, threads: int, rows: dict[str, np.ndarray]):
    # one InferenceSession per heads file, rows and thread count, shared by every
    # generation; the rows are kept with it (onnxruntime reads their memory), so their id
    # in the key cannot be reused while the entry lasts
    key = (str(path), stamp, threads, tuple(id(a) for a in rows.values()))
    if key not in _SESSIONS:
        _SESSIONS[key] = heads_session(path, threads, rows), rows
    return _SESSIONS[key][0]


_TABLES: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}


def _table(package, vocab_file: str | None) -> tuple[np.ndarray, np.ndarray | None]:
    # the LM head rows the heads score, float32 and contiguous, read once per package file
    emb = package.root / package.meta.embeddings.file
    st = emb.stat()
    key = (str(package.root), vocab_file, st.st_size, st.st_mtime_ns)
    if key not in _TABLES:
        table = package.embedding_table()
        vocab = (None if vocab_file is None
                 else np.load(package.root / vocab_file).astype(np.int64))
        ids = np.arange(package.meta.vocab_size, dtype=np.int64) if vocab is None else vocab
        _TABLES[key] = np.ascontiguousarray(table.rows(ids), dtype=np.float32), vocab
    return _TABLES[key]


@dataclass
class HeadsRunner:
    """Runs one package's heads on the host: ``run(hidden [d], root, root_embed [d])`` ->
    ids and log-probs ``[H, k]`` as vocabulary ids. The session (weights) and the LM head rows
    are shared per package; the binding and output buffers are this runner's (one
    generation). ``k``: the candidates per head it asks for (at most the graph's ``topk``;
    None: all of them), for graphs that take ``k`` as an input (older ones give ``topk``)."""

    info: HeadsInfo
    session: object
    lm_head: np.ndarray          # [M, d] float32
    vocab: np.ndarray | None     # [M] ids of the rows (None: the rows are the vocabulary)
    k: int | None = None
    native: "NativeHeads | TorchHeads | None" = None  # None: onnxruntime runs the graph
    inputs: tuple[str, ...] = field(init=False)
    _run: object = field(init=False, repr=False)
    _call: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        s, i, d = self.session, self.info, self.lm_head.shape[1]
        self.inputs = tuple(x.name for x in s.get_inputs())
        k = i.topk if "k" not in self.inputs or self.k is None else max(1, min(self.k, i.topk))
        self.k = k
        self._hidden = np.zeros((1, d), dtype=np.float32)
        self._root = np.zeros((1, d), dtype=np.float32)
        self._root_id = np.zeros(1, dtype=np.int64)
        self._k = np.array([k], dtype=np.int64)
        self._ids = np.zeros((1, i.heads, k), dtype=np.int64)
        self._lp = np.zeros((1, i.heads, k), dtype=np.float32)
        io = self._io = s.io_binding()
        feeds = {"hidden": self._hidden, "root_embeds": self._root, "root_ids": self._root_id,
                 "k": self._k, **self.rows(i, self.lm_head)}
        for name in self.inputs:
            a = feeds[name]
            io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        for name, a in (("ids", self._ids), ("logprobs", self._lp)):
            io.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        # onnxruntime's C++ session and binding where they are reachable: the public wrapper
        # costs ~0.6 us a run, ~3 % of a heads run on stories260K
        sess_c, io_c = getattr(s, "_sess", None), getattr(io, "_iobinding", None)
        self._run = ((lambda: sess_c.run_with_iobinding(io_c, None))
                     if sess_c is not None and io_c is not None
                     else (lambda: s.run_with_iobinding(io)))
        self._call = (None if self.native is None else
                      self.native.bind(self._hidden[0], self._root[0], self._ids[0],
                                       self._lp[0], k))

    @property
    def needs_embedding(self) -> bool:
        """The graph takes the root as its embedding (a vocabulary subset), not its id."""
        return "root_embeds" in self.inputs

    @staticmethod
    def rows(info: HeadsInfo, lm_head: np.ndarray) -> dict[str, np.ndarray]:
        """The LM-head rows by graph name: ``lm_chain`` is a view of ``lm_head``'s first
        ``C`` rows (contiguous, so the same memory)."""
        return {"lm_head": lm_head, "lm_chain": lm_head[:info.chain or len(lm_head)]}

    @property
    def engine(self) -> str:
        """What runs the heads: ``"C"`` (:class:`NativeHeads`), ``"torch"``
        (:class:`TorchHeads`, on the torch backend's GPU) or ``"onnxruntime"``."""
        if self.native is None:
            return "onnxruntime"
        return "torch" if isinstance(self.native, TorchHeads) else "C"

    @classmethod
    def load(cls, package, kind: str | None = None, threads: int = 1,
             k: int | None = None, native: bool | str = True,
             device=None) -> "HeadsRunner":
        """``native``: True runs the C kernel where it reproduces the graph and is the faster
        here; ``"always"`` wherever it reproduces the graph; False never. ``device``: a torch
        device other than the CPU (a torch backend on a GPU) also tries the heads in PyTorch
        there, and keeps them where they are the faster; ``native="torch"`` forces that."""
        info = pick(package.meta.heads, kind, f"the package {str(package.root)!r}")
        package.check_heads(info)
        path = package.root / info.file
        st = path.stat()
        lm_head, vocab = _table(package, info.vocab_file)
        supplied = {k_: v for k_, v in cls.rows(info, lm_head).items() if k_ in info.supplied}
        stamp = (st.st_size, st.st_mtime_ns)
        session = _graph(path, stamp, threads, supplied)
        if native == "torch" or (native and device is not None and str(device) != "cpu"):
            th = torch_heads(path, stamp, info, lm_head, session, device or "cpu")
            best = cls.load(package, kind, threads, k, native is True)
            if th is None:
                return best
            if native == "torch":
                return cls(info, session, lm_head, vocab, k, th)
            key = (str(path), stamp, id(lm_head), threads, k, str(device))
            if key not in _FASTER:  # the device where it is the faster (a large model)
                _FASTER[key] = faster(cls(info, session, lm_head, vocab, k, th), best)
            return cls(info, session, lm_head, vocab, k, th) if _FASTER[key] else best
        nh = native_heads(path, stamp, info, lm_head, session) if native else None
        if nh is None:
            return cls(info, session, lm_head, vocab, k)
        key = (str(path), stamp, id(lm_head), threads, k)
        if native == "always":
            return cls(info, session, lm_head, vocab, k, nh)
        if key not in _FASTER:  # C where it is the faster here (a small model: ~2x)
            _FASTER[key] = faster(cls(info, session, lm_head, vocab, k, nh),
                                  cls(info, session, lm_head, vocab, k))
        return cls(info, session, lm_head, vocab, k, nh if _FASTER[key] else None)

    def run(self, hidden: np.ndarray, root: int = 0, root_embed: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        # hidden [d]; root: the token the base model chose there; root_embed [d]: its
        # embedding, where the graph takes that (needs_embedding) -> ids, logprobs [H, k]
        self._hidden[0] = hidden
        self._root_id[0] = root
        if root_embed is not None:
            self._root[0] = root_embed
        if self._call is not None:
            if self._call(int(root)):
                raise ValueError(f"heads.c refused the {self.info.kind} heads' shapes")
        else:
            self._run()
        ids = self._ids[0]
        return (ids.copy() if self.vocab is None else self.vocab[ids]), self._lp[0].copy()
