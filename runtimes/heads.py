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
"""

from __future__ import annotations

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
    gen_minutes: float
    threads: int
    date: str


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
                     f"{t.gen_minutes:.1f} min generating, {t.date}")
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
    inputs: tuple[str, ...] = field(init=False)
    _run: object = field(init=False, repr=False)

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

    @property
    def needs_embedding(self) -> bool:
        """The graph takes the root as its embedding (a vocabulary subset), not its id."""
        return "root_embeds" in self.inputs

    @staticmethod
    def rows(info: HeadsInfo, lm_head: np.ndarray) -> dict[str, np.ndarray]:
        """The LM-head rows by graph name: ``lm_chain`` is a view of ``lm_head``'s first
        ``C`` rows (contiguous, so the same memory)."""
        return {"lm_head": lm_head, "lm_chain": lm_head[:info.chain or len(lm_head)]}

    @classmethod
    def load(cls, package, kind: str | None = None, threads: int = 1,
             k: int | None = None) -> "HeadsRunner":
        info = pick(package.meta.heads, kind, f"the package {str(package.root)!r}")
        path = package.root / info.file
        st = path.stat()
        lm_head, vocab = _table(package, info.vocab_file)
        supplied = {k_: v for k_, v in cls.rows(info, lm_head).items() if k_ in info.supplied}
        session = _graph(path, (st.st_size, st.st_mtime_ns), threads, supplied)
        return cls(info, session, lm_head, vocab, k)

    def run(self, hidden: np.ndarray, root: int = 0, root_embed: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        # hidden [d]; root: the token the base model chose there; root_embed [d]: its
        # embedding, where the graph takes that (needs_embedding) -> ids, logprobs [H, k]
        self._hidden[0] = hidden
        self._root_id[0] = root
        if root_embed is not None:
            self._root[0] = root_embed
        self._run()
        ids = self._ids[0]
        return (ids.copy() if self.vocab is None else self.vocab[ids]), self._lp[0].copy()
