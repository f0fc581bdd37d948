"""``edgemtp train-heads``: learned draft heads for an exported package, by self-distillation
on CPU (the Medusa-2 recipe: the model's own generations, no external data).

Stages: training prompts (never the evaluation prompts: :func:`training_prompts` asserts the
split) -> generate with the package itself (a short sampled prefix for variety, then greedy)
-> one forward over each whole sequence caches its hidden states and argmax -> train the
heads (``models.heads``) against the model's own greedy tokens with its frozen LM head ->
export ``heads/<kind>.onnx`` and check it against PyTorch -> list it in the manifest.

Training targets (``models.heads`` for the indices): a row ``t`` is used when the tokens
after it are the model's own greedy ones, the only case in which depth ``j`` of a tree hung
under the top-1 chain can be accepted; head ``j``'s label is the model's argmax at
``t + j``. Generation, caching and checkpoints live in a work folder beside the package, so
a run can be stopped and resumed (``--steps`` more than the checkpoint's continues it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgemtp.errors import ConfigError
from edgemtp.runtimes.heads import (HEAD_KINDS, HEADS_DIR, ROW_INPUTS, HeadsInfo,
                                     HeadsTraining, heads_session)
from edgemtp.runtimes.package import MANIFEST, Manifest, load_package, record_files

# The evaluation prompts (tests, benches) are the first EVAL_STORIES story prompts and the
# first EVAL_PER_CATEGORY Spec-Bench questions of every category; training never sees them.
# 5 (not 10): the 8 MT-bench categories have 10 questions each, so training sees 5 of each
# of them and the evaluation the other 5 (with 10, those categories were never trained on).
EVAL_STORIES = 24
EVAL_PER_CATEGORY = 5
HEADS_TOPK = 32      # candidates per head in the graph (see bench/results/heads_stories260K.md: 32 vs 64)
FULL_VOCAB = 32768   # above this vocabulary, heads score only the most frequent tokens
SUBSET = 8192        # ... this many of them (FR-Spec's frequency-ranked draft vocabulary)
CHAIN = 1024         # residual heads over a subset: the chain's top-1 reads the first rows
# peak learning rates at d = 64 (stories260K, inputs RMS-normalised, 300 steps): medusa reached
# val top-1 0.39/0.56/0.62/0.65 for head 1 at 3e-3/1e-2/3e-2/1e-1, residual 0.71/0.80/0.83 at
# 3e-3/1e-2/3e-2 (0.88 either way after 1500 steps). A wider model wants less (Adam moves every
# weight by ~lr, and a row of W sums d of them), so the default is scaled by sqrt(64 / d): on
# SmolLM2 (d = 576, 150 steps x 64 rows) residual val top-1 of head 1 was 0.44 at 3e-3 and 0.18
# at 1e-2 (main's unnormalised module: 0.30 and 0.07), bench/results/heads_SmolLM2.md.
LR = {"medusa": 3e-2, "residual": 1e-2}


def default_lr(kind: str, width: int) -> float:
    """The peak learning rate for heads on a ``width``-wide model.

    >>> default_lr("residual", 64), round(default_lr("residual", 576), 5)
    (0.01, 0.00333)
    """
    return LR[kind] * min(1.0, (64 / width) ** 0.5)


@dataclass(frozen=True)
class TrainOptions:
    kind: str = "medusa"
    heads: int = 4
    steps: int = 1500
    batch: int = 256
    lr: float | None = None   # None: default_lr(kind, the model's width)
    seed: int = 0
    repeats: int = 3          # generations per training prompt (sampled prefix of 0..8 tokens)
    bos_samples: int = 128    # generations from BOS alone (a sampled prefix of 1..16 tokens)
    new_tokens: int = 160     # greedy tokens per generation
    threads: int = 2
    vocab: int | None = None  # tokens the heads score (None: all up to FULL_VOCAB, else SUBSET)
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"--kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        for name, low in (("heads", 1), ("steps", 1), ("batch", 1), ("threads", 1),
                          ("new_tokens", 8), ("repeats", 1), ("bos_samples", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name.replace('_', '-')} must be an integer >= {low}, "
                                  f"got {value!r}")
        if self.lr is not None and not (isinstance(self.lr, float) and 0 < self.lr < 1):
            raise ConfigError(f"--lr must be a number in (0, 1), got {self.lr!r}")
        if self.heads > 10:
            raise ConfigError(f"--heads must be at most 10 (tree depths), got {self.heads}")
        for name, low in (("vocab", 2), ("max_prompts", 1)):  # (None: all)
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, "
                                  f"got {value!r}")


# -- prompts -------------------------------------------------------------------------------


def training_prompts(chat: bool, limit: int | None = None) -> tuple[list[str], str, list[str]]:
    """``(training prompts, what they are, evaluation prompts)``: story prompts after the first
    ``EVAL_STORIES``; for a chat model Spec-Bench questions after the first
    ``EVAL_PER_CATEGORY`` of each category; the first ``limit`` of them (None: all). The two
    sets share no prompt (asserted)."""
    from edgemtp.tools.prompts import SPEC_BENCH, load_prompts

    if not chat:
        stories = load_prompts(None, 10_000)
        train, held = stories[EVAL_STORIES:], stories[:EVAL_STORIES]
        train = train[:limit] if limit else train
        what = f"story prompts {EVAL_STORIES}-{EVAL_STORIES + len(train) - 1} and BOS"
    else:
        seen: dict[str, int] = {}
        by_cat: dict[str, list[str]] = {}
        held = []
        with open(SPEC_BENCH) as f:
            for line in f:
                row = json.loads(line)
                i = seen[row["category"]] = seen.get(row["category"], -1) + 1
                (held if i < EVAL_PER_CATEGORY else by_cat.setdefault(row["category"], [])
                 ).append(row["turns"][0])
        # round-robin over the categories, so the first N training prompts mix them all
        pools = [c for c in by_cat.values() if c]
        train = [c[i] for i in range(max(map(len, pools), default=0)) for c in pools
                 if i < len(c)]
        total = len(train)
        train = train[:limit] if limit else train
        what = (f"{'the first ' + str(len(train)) + ' of the ' if len(train) < total else ''}"
                f"Spec-Bench questions after the first {EVAL_PER_CATEGORY} of each category, "
                f"categories interleaved (chat template)")
    assert not set(train) & set(held), "training and evaluation prompts overlap"
    return train, what, held


# -- generation and caching ------------------------------------------------------------------


def generate_cache(model, prompts: list[list[int]], opt: TrainOptions, path: Path,
                   progress: bool = True) -> dict:
    """Generate from every prompt with the package itself, run one forward over each whole
    sequence and keep ``tokens, argmax [L]``, ``hidden [L, d]`` and the first greedy row.
    Saved to ``path`` (``.npz``); a saved cache is reused, and an interrupted run resumes
    from ``path``'s ``.part.npz`` (rewritten every few sequences).

    The greedy part is drafted by prompt lookup (BC 10): lossless, so the same tokens, and
    on a model whose one-row step reads all its weights (SmolLM2 fp32 on CPU) a tree step
    costs about as much as a one-row step, so the tokens come ~1.15x faster."""
    if path.is_file():
        with np.load(path) as z:
            return dict(z)
    from tqdm import tqdm

    from edgemtp.config import GenerationConfig

    rng = np.random.default_rng(opt.seed)
    bos = model.backend.package.meta.bos_token_id
    jobs = [(p, int(rng.integers(0, 9)) if r else 0) for p in prompts for r in range(opt.repeats)]
    if bos is not None:
        jobs += [([bos], int(rng.integers(1, 17))) for _ in range(opt.bos_samples)]
    b = model.backend
    session = b.session()
    parts: dict[str, list] = {k: [] for k in ("tokens", "argmax", "hidden", "greedy", "seq")}
    partial, before = path.with_suffix(".part.npz"), 0.0
    if partial.is_file():
        with np.load(partial) as z:
            lengths = z["lengths"].tolist()
            edges = np.cumsum([0] + lengths)
            for k in ("tokens", "argmax", "hidden", "seq"):
                parts[k] = [z[k][x:y] for x, y in zip(edges[:-1], edges[1:])]
            parts["greedy"] = list(z["greedy"])
            before = float(z["seconds"])
    t0 = time.perf_counter()

    def gathered() -> dict:
        return {"tokens": np.concatenate(parts["tokens"]),
                "argmax": np.concatenate(parts["argmax"]),
                "hidden": np.concatenate(parts["hidden"]), "seq": np.concatenate(parts["seq"]),
                "greedy": np.array(parts["greedy"]),
                "lengths": np.array([len(t) for t in parts["tokens"]]),
                "seconds": np.float64(before + time.perf_counter() - t0)}  # for the record

    room = b.max_context - 1
    done = len(parts["tokens"])
    for i, (ids, sampled) in enumerate(tqdm(jobs[done:], desc="generating", initial=done,
                                            total=len(jobs), disable=not progress), start=done):
        ids = list(ids)[: room // 2]
        if sampled:
            cfg = GenerationConfig(drafter="none", temperature=1.0, max_new_tokens=sampled,
                                   seed=opt.seed * 100_003 + i)
            ids += model.generate(ids, cfg).token_ids
        start = len(ids)  # the first greedy token
        cfg = GenerationConfig(drafter="pld", bc=10, max_new_tokens=min(opt.new_tokens,
                                                                        room - len(ids)))
        ids += model.generate(ids, cfg).token_ids
        seq = np.array(ids, dtype=np.int64)
        session.reset()
        n = len(seq)
        out = session.forward(seq, np.arange(n), np.tril(np.ones((n, n), dtype=bool)), None,
                              hidden=True)
        parts["tokens"].append(seq)
        parts["argmax"].append(out.argmax.astype(np.int64))
        parts["hidden"].append(np.array(out.hidden, dtype=np.float32))
        parts["greedy"].append(np.int64(start))
        parts["seq"].append(np.full(n, i, dtype=np.int64))
        if (i + 1) % 10 == 0 and i + 1 < len(jobs):
            partial.parent.mkdir(parents=True, exist_ok=True)
            np.savez(partial.with_suffix(".tmp.npz"), **gathered())
            partial.with_suffix(".tmp.npz").replace(partial)
    session.reset()
    cache = gathered()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **cache)
    partial.unlink(missing_ok=True)
    return cache


def rows(cache: dict, heads: int) -> np.ndarray:
    """Global row indices ``t`` whose next ``heads`` tokens are greedy (see the module doc):
    after the generation's greedy start, and (where the cache has tokens) each equal to the
    argmax of the row before it in the one-pass forward.

    >>> c = {"lengths": np.array([6]), "greedy": np.array([2])}
    >>> rows(c, 2).tolist()       # tokens 2..5 greedy: t + 1 >= 2 and t + 2 <= 5
    [1, 2, 3]
    >>> c.update(tokens=np.array([7, 7, 3, 4, 9, 6]), argmax=np.array([0, 3, 4, 5, 6, 0]))
    >>> rows(c, 2).tolist()       # token 4 (9) is not the argmax of row 3 (5)
    [1]
    """
    out, offset = [], 0
    for n, g in zip(cache["lengths"].tolist(), cache["greedy"].tolist()):
        first, last = max(g - 1, 0), n - 1 - heads
        out.append(np.arange(offset + first, offset + last + 1))
        offset += n
    t = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if "tokens" in cache and len(t):
        tokens, argmax = cache["tokens"], cache["argmax"]
        ok = np.ones(len(t), dtype=bool)
        for j in range(1, heads + 1):
            ok &= tokens[t + j] == argmax[t + j - 1]
        t = t[ok]
    return t


# -- training ------------------------------------------------------------------------------


def _vocab(cache: dict, v: int, opt: TrainOptions) -> np.ndarray | None:
    """The M most frequent argmax tokens of the training text, most frequent first (None: the
    whole vocabulary)."""
    m = opt.vocab if opt.vocab is not None else (v if v <= FULL_VOCAB else SUBSET)
    if m >= v:
        return None
    counts = np.bincount(cache["argmax"], minlength=v)
    return np.argsort(-counts, kind="stable")[:m]


def train(model_heads, cache: dict, opt: TrainOptions, vocab, checkpoint: Path,
          progress: bool = True) -> dict:
    """Train ``model_heads`` (resuming from ``checkpoint``); returns the loss history and the
    held-out top-1 accuracy per head."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    torch.set_num_threads(opt.threads)
    torch.manual_seed(opt.seed)
    h = opt.heads
    all_rows = rows(cache, h)
    perm = np.random.default_rng(opt.seed).permutation(len(all_rows))
    n_val = max(min(len(all_rows) // 20, 2000), 1)
    val, fit = all_rows[perm[:n_val]], all_rows[perm[n_val:]]
    hidden = torch.from_numpy(cache["hidden"])
    tokens, argmax = torch.from_numpy(cache["tokens"]), torch.from_numpy(cache["argmax"])
    offs = torch.arange(1, h + 1)
    remap = None
    if vocab is not None:  # labels as rows of the subset; -100: a token the heads cannot score
        remap = torch.full((int(argmax.max()) + 1,), -100, dtype=torch.long)
        keep = torch.from_numpy(vocab)
        remap[keep[keep < len(remap)]] = torch.arange(len(keep))[keep < len(remap)]
    weights = torch.tensor([0.8 ** j for j in range(h)])

    def batch(idx):
        t = torch.from_numpy(idx)
        later = t[:, None] + offs                       # [B, H]: rows t+1 .. t+H
        labels = argmax[later]
        if remap is not None:
            labels = remap[labels]
        return hidden[t], tokens[later], labels

    def loss_of(x, toks, labels):
        logits = model_heads.logits(x, toks)           # [B, H, M]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             reduction="none", ignore_index=-100).view(labels.shape)
        return (ce.mean(0) * weights).sum() / weights.sum()

    params = [p for p in model_heads.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opt.lr, weight_decay=0.0)
    # a one-cycle schedule warming up over 5 % of the steps; under 40 steps (a warm-up of one
    # step, which OneCycleLR divides by zero on) the peak rate throughout
    sched = (torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=opt.lr, total_steps=opt.steps,
                                                 pct_start=0.05) if opt.steps >= 40 else
             torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0))
    history, step, before = [], 0, 0.0  # before: seconds spent by earlier (resumed) runs
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["steps"] == opt.steps and state["kind"] == opt.kind:
            model_heads.load_state_dict(state["model"])
            optim.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            history, step = state["history"], state["step"]
            before = state.get("seconds", 0.0)
    rng = np.random.default_rng(opt.seed + step)
    t0 = time.perf_counter()
    bar = tqdm(total=opt.steps, initial=step, desc=f"training {opt.kind}", disable=not progress)
    every = max(opt.steps // 10, 50)
    while step < opt.steps:
        loss = loss_of(*batch(fit[rng.integers(0, len(fit), opt.batch)]))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        step += 1
        history.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{np.mean(history[-50:]):.3f}")
        if step % every == 0 or step == opt.steps:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model_heads.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "history": history, "step": step,
                        "steps": opt.steps, "kind": opt.kind,
                        "seconds": before + time.perf_counter() - t0}, checkpoint)
    bar.close()
    with torch.no_grad():
        x, toks, labels = batch(val)
        pred = model_heads.logits(x, toks).argmax(-1)
        top1 = (pred == labels).float().mean(0).tolist()
    return {"history": history, "val_top1": tuple(round(a, 4) for a in top1),
            "minutes": (before + time.perf_counter() - t0) / 60}


def plot_loss(history: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    y = np.asarray(history)
    ax.plot(y, lw=0.6, alpha=0.4, label="batch")
    w = max(len(y) // 50, 1)
    if len(y) > w:
        ax.plot(np.arange(w - 1, len(y)), np.convolve(y, np.ones(w) / w, "valid"), label=f"mean of {w}")
    ax.set(xlabel="step", ylabel="cross-entropy (weighted over heads)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- export --------------------------------------------------------------------------------


def export_heads(model_heads, lm_head: np.ndarray, path: Path, topk: int,
                 chain: int | None = None, opset: int = 17, by_id: bool = False) -> float:
    """Trace :class:`models.heads.HeadsGraph` to ``path``; returns the largest log-prob
    difference of the graph in onnxruntime against PyTorch on random hidden states (top-K ids
    must be equal where the log-probs are clearly apart). ``chain``: the residual kind's
    chain rows, the first ``chain`` of ``lm_head`` (None: all). ``by_id`` (residual, no
    ``chain``): ``lm_head`` is the whole vocabulary in id order, so the graph takes the roots'
    ids (``root_ids``) and reads the chain from ``lm_head`` itself; else the roots'
    embeddings (``root_embeds``) and a separate ``lm_chain``. The top-K's ``K`` becomes a
    graph input ``k`` (at most ``topk``: the rows are sorted, so a smaller ``k`` is a prefix)."""
    import torch

    from edgemtp.models.heads import HeadsGraph, MedusaHeads

    residual = not isinstance(model_heads, MedusaHeads)
    by_id = residual and by_id and chain is None
    table = torch.from_numpy(np.ascontiguousarray(lm_head, dtype=np.float32))
    rows_c = table[:chain or len(table)].clone() if residual else None
    graph = HeadsGraph(model_heads, topk, rows_c).eval()
    d = lm_head.shape[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, d, generator=gen)
    if by_id:
        names = ["hidden", "root_ids", "lm_head"]
        feeds = [x, torch.randint(0, len(table), (3,), generator=gen), table]
    elif residual:
        names = ["hidden", "root_embeds", "lm_head", "lm_chain"]
        feeds = [x, torch.randn(3, d, generator=gen), table, rows_c]
    else:
        names, feeds = ["hidden", "lm_head"], [x, table]
    axes = {"hidden": {0: "N"}, "root_embeds": {0: "N"}, "root_ids": {0: "N"},
            "lm_head": {0: "M"}, "lm_chain": {0: "C"}, "ids": {0: "N"}, "logprobs": {0: "N"}}

    class _Graph(torch.nn.Module):  # the signature each kind exports with
        def __init__(self):
            super().__init__()
            self.g = graph

        def forward(self, *a):
            if not residual:
                return self.g(a[0], None, a[1])
            return self.g(a[0], a[1], a[2], None if by_id else a[3])

    wrapped = _Graph().eval()
    with torch.no_grad():
        torch.onnx.export(wrapped, tuple(feeds), str(path), input_names=names,
                          output_names=["ids", "logprobs"],
                          dynamic_axes={k: v for k, v in axes.items() if k in names
                                        or k in ("ids", "logprobs")},
                          opset_version=opset, dynamo=False)
        ref_ids, ref_lp = (t.numpy() for t in wrapped(*feeds))
    rows = {n: a.numpy() for n, a in zip(names, feeds) if n in ROW_INPUTS}
    _rows_as_initializers(path, rows)
    _k_as_input(path)
    sess = heads_session(path, 1, rows)
    run = {n: a.numpy() for n, a in zip(names, feeds) if n not in rows}
    ids, lp = sess.run(None, {**run, "k": np.array([topk], dtype=np.int64)})
    diff = float(np.abs(lp - ref_lp).max())
    # relative to the log-prob scale: the residual kind chains H steps of float32 sums, and
    # a 576-wide model's log-probs differ by ~5e-3 on a scale of ~30 (SmolLM2)
    limit = 3e-4 * max(10.0, float(np.abs(ref_lp).max()))
    clear = (ref_lp[..., 0] - ref_lp[..., 1]) > 2 * limit  # the top-1 where not a near-tie
    same = (ids[..., 0] == ref_ids[..., 0]) | ~clear
    if diff > max(limit, 1e-3) or not same.all():
        raise ConfigError(f"the exported heads graph differs from PyTorch: max |log-prob diff| "
                          f"{diff:.2e} (limit {max(limit, 1e-3):.1e}), top-1 ids equal: "
                          f"{bool(same.all())}")
    small = sess.run(None, {**run, "k": np.array([2], dtype=np.int64)})
    if small[0].shape[-1] != 2 or not np.array_equal(small[0], ids[..., :2]):
        raise ConfigError("the exported heads graph's k input does not select a prefix of "
                          "its candidates")
    return diff


def _k_as_input(path: Path) -> None:
    """Make the TopK's ``K`` the graph input ``k`` (int64 ``[1]``), and the outputs' last
    axis dynamic: a tree of ``N`` nodes never reads more than ``N`` candidates of a head, and
    onnxruntime's TopK over ``[H, M]`` costs ~2 us at ``K = 8`` against ~5 us at 32 (a
    stories260K heads run is ~40 us)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    [topk] = [n for n in g.node if n.op_type == "TopK"]
    old = topk.input[1]
    topk.input[1] = "k"
    g.input.append(onnx.helper.make_tensor_value_info("k", onnx.TensorProto.INT64, [1]))
    if not any(old in n.input for n in g.node):  # the constant fed only the TopK
        keep = [n for n in g.node if old not in n.output]
        del g.node[:]
        g.node.extend(keep)
        keep = [t for t in g.initializer if t.name != old]
        del g.initializer[:]
        g.initializer.extend(keep)
    for out in g.output:
        dims = out.type.tensor_type.shape.dim
        if len(dims):
            dims[-1].Clear()
            dims[-1].dim_param = "K"
    onnx.save(model, str(path))


def _rows_as_initializers(path: Path, rows: dict[str, np.ndarray]) -> None:
    """Turn the graph inputs named in ``rows`` into initializers whose data is external and
    absent: the runtime supplies it (:func:`runtimes.heads.heads_session`)."""
    import onnx

    model = onnx.load(str(path))
    keep = [i for i in model.graph.input if i.name not in rows]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    for name, a in rows.items():
        t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=a.shape,
                             data_location=onnx.TensorProto.EXTERNAL)
        for k, v in (("location", f"{name}.supplied-by-edgemtp"), ("offset", "0"),
                     ("length", str(a.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        model.graph.initializer.append(t)
    onnx.save(model, str(path))


# -- the command -----------------------------------------------------------------------------


def work_folder(package: Path) -> Path:
    """Where generation caches and checkpoints go: beside the package, never inside it."""
    return package.parent / f".{package.name}.heads-train"


def train_heads(package, opt: TrainOptions, prompts: list | None = None, data: str | None = None,
                work: Path | None = None, progress: bool = True) -> HeadsInfo:
    """Train ``opt.kind`` heads for ``package`` and add them to it (replacing heads of that
    kind). ``prompts``: text or token ids (default: :func:`training_prompts`)."""
    import torch

    from edgemtp.api import Model
    from edgemtp.models.heads import build

    root = Path(package)
    model = Model.load(str(root), backend="onnxruntime", threads=opt.threads)
    pkg, b = model.backend.package, model.backend
    if not b.supports_hidden:
        raise ConfigError(f"the package {str(root)!r} does not output hidden states; export it "
                          f"again with --hidden-states to train heads")
    if not pkg.weights.tied_embedding:
        raise ConfigError(f"the package {str(root)!r} has an LM head separate from its input "
                          f"embedding; heads read the tied table, and untied models are not "
                          f"supported yet")
    if opt.lr is None:
        opt = replace(opt, lr=default_lr(opt.kind, pkg.meta.hidden_size))
    chat = model.tokenizer is not None and model.tokenizer.chat_template is not None
    if prompts is None:
        prompts, data, _ = training_prompts(chat, opt.max_prompts)  # (qa9 D5: named all)
    prompts = prompts[:opt.max_prompts] if opt.max_prompts else prompts
    ids = [p if not isinstance(p, str) else
           model.encode_chat([{"role": "user", "content": p}]) if chat else model.encode(p)
           for p in prompts]
    if opt.new_tokens >= b.max_context:  # (each generation stops at the context's end)
        raise ConfigError(f"--new-tokens must be below the package's context of "
                          f"{b.max_context}, got {opt.new_tokens}")
    work = Path(work) if work is not None else work_folder(root)
    try:
        work.mkdir(parents=True, exist_ok=True)
        probe = work / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--work {str(work)!r} cannot hold the training cache: "
                          f"{e.strerror or e}") from None
    key = f"s{opt.seed}_r{opt.repeats}_b{opt.bos_samples}_n{opt.new_tokens}_p{len(ids)}"
    reused = (work / f"cache_{key}.npz").is_file()  # (an earlier run's generations, whole)
    cache = generate_cache(model, ids, opt, work / f"cache_{key}.npz", progress)
    gen_minutes = float(cache.get("seconds", 0.0)) / 60

    table = pkg.embedding_table().rows(np.arange(pkg.meta.vocab_size, dtype=np.int64))
    vocab = _vocab(cache, pkg.meta.vocab_size, opt)
    lm_head = table if vocab is None else table[vocab]
    options = {} if opt.kind == "medusa" else {"table": torch.from_numpy(table)}
    heads = build(opt.kind, torch.from_numpy(np.ascontiguousarray(lm_head)), opt.heads,
                  **options)  # residual: teacher-forced tokens embedded from the whole table
    heads.set_scale(torch.from_numpy(cache["hidden"][rows(cache, opt.heads)]))
    result = train(heads, cache, opt, vocab, work / f"{opt.kind}_{key}_h{opt.heads}.pt",
                   progress)

    # every file is written and checked in a staging folder beside the heads, then moved in
    # with the manifest (SIGINT held off for those few renames): a run stopped or failing
    # before then leaves the package's heads as they were
    (root / HEADS_DIR).mkdir(exist_ok=True)
    staged = _staging(root, opt.kind)
    topk = min(HEADS_TOPK, len(lm_head))
    chain = CHAIN if opt.kind == "residual" and vocab is not None and len(vocab) > CHAIN else None
    by_id = opt.kind == "residual" and vocab is None
    export_heads(heads, lm_head, staged / f"{opt.kind}.onnx", topk, chain, by_id=by_id)
    vocab_file = None
    if vocab is not None:
        vocab_file = f"{HEADS_DIR}/{opt.kind}.vocab.npy"
        np.save(staged / Path(vocab_file).name, vocab)
    plot = f"{HEADS_DIR}/{opt.kind}_loss.png"
    hist = result["history"]
    plot_loss(hist, staged / Path(plot).name, f"{opt.kind} heads, {root.name}")
    info = HeadsInfo(
        kind=opt.kind, file=f"{HEADS_DIR}/{opt.kind}.onnx", heads=opt.heads, topk=topk,
        vocab=len(lm_head), vocab_file=vocab_file, chain=chain,
        supplied=ROW_INPUTS if opt.kind == "residual" and not by_id else ROW_INPUTS[:1],
        width=getattr(heads, "width", None), loss_plot=plot,
        training=HeadsTraining(
            data=data or "given prompts", prompts=len(ids) + 1, sequences=len(cache["lengths"]),
            positions=int(len(rows(cache, opt.heads))), steps=opt.steps, batch=opt.batch,
            lr=opt.lr, seed=opt.seed, loss_first=float(np.mean(hist[:20])),
            loss_last=float(np.mean(hist[-50:])), val_top1=result["val_top1"],
            minutes=round(result["minutes"], 2), gen_minutes=round(gen_minutes, 2),
            threads=opt.threads, date=time.strftime("%Y-%m-%d"), gen_reused=reused))
    _move_in(root, staged, info)
    load_package(root).check_heads(info)  # what was written must load
    return info


def _staging(root: Path, kind: str) -> Path:
    """An empty staging folder for ``kind``'s new heads files (an interrupted run's is
    dropped)."""
    import shutil

    staged = root / HEADS_DIR / f".{kind}.staged"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    return staged


def _move_in(root: Path, staged: Path, info: HeadsInfo) -> None:
    """Replace ``info.kind``'s heads files by the staged ones and record them in the
    manifest, with SIGINT held until done; the kind's old files the new heads do not have
    (a vocabulary file) are removed."""
    import signal
    import threading

    hold = threading.current_thread() is threading.main_thread()
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for f in info.files():
            (staged / Path(f).name).replace(root / f)
        for old in (root / HEADS_DIR).glob(f"{info.kind}.*"):
            if f"{HEADS_DIR}/{old.name}" not in info.files():
                old.unlink()
        _write_manifest(root, info)
        staged.rmdir()
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _write_manifest(root: Path, info: HeadsInfo) -> None:
    # the other kinds' heads stay; this kind's entry and files are replaced
    raw = json.loads((root / MANIFEST).read_text())
    meta = Manifest.from_dict(raw)
    heads = tuple(h for h in meta.heads if h.kind != info.kind) + (info,)
    files = dict(meta.files or {})
    files = {k: v for k, v in files.items() if not k.startswith(f"{HEADS_DIR}/{info.kind}")}
    recorded = record_files(root)
    files.update({f: recorded[f] for f in info.files()})
    meta = replace(meta, heads=heads, files=files)
    tmp = root / f".{MANIFEST}.part"
    tmp.write_text(json.dumps(meta.to_dict(), indent=1) + "\n")
    tmp.replace(root / MANIFEST)
