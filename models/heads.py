"""Learned draft heads on a frozen model's last hidden state (after the final norm, what the
LM head reads), with the model's own frozen LM head. Two kinds, one interface:

- :class:`MedusaHeads` (Medusa-1): head ``j`` maps ``h(t)`` through a residual block
  ``h + SiLU(W_j h + b_j)`` to the LM head, and predicts the token at ``t + 1 + j``. ``W_j``
  starts at zero, so every head starts as the base model's own next-token head.
- :class:`ResidualHeads` (MRP, seed 000, carried over to an autoregressive model): one small
  module predicts the *residual* between adjacent hidden states,
  ``h(t+1) - h(t) = R(h(t), e(x(t+1)))``, conditioned on the token just revealed there
  (MRP's "residual conditioned on the fresh reveals"), and is applied ``j`` times to reach
  ``h(t + j)``; the LM head turns each into the token at ``t + 1 + j``. The token revealed at
  step 1 is the root (known when the next tree is drafted); at step ``j > 1`` it is the
  argmax of step ``j - 1`` (training: the model's own greedy token, teacher forcing),
  exactly the node top-1 expansion hangs depth ``j`` under. The last layer of ``R`` starts
  at zero.

Indices (``x`` tokens, ``h(i)`` the hidden state of row ``i``, ``a(i)`` its argmax, which is
``x(i+1)`` in greedy text)::

    h(t) ──lm──> a(t) = root          known when the tree is drafted
    head j: ─────> a(t + j)           the token at depth j of the next tree

``logits(hidden, tokens)``: hidden ``[N, d]``; tokens ``[N, H]`` the revealed tokens
``x(t+1) .. x(t+H)`` (medusa ignores them); returns ``[N, H, V]``. The LM head is a buffer
(``lm_head [V, d]``, the tied embedding table for tied models), never a parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("medusa", "residual")


def unit(x: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """Rows scaled to RMS 1. The heads read directions, not scales: SmolLM2's final-norm
    state has RMS ~1.9 with a few dimensions near 15, its embedding rows RMS ~0.14, so raw
    inputs made Adam's per-weight step ~45x too large on the hidden state and left the
    token embedding almost unseen (the residual kind's val top-1 stayed at 0.06).
    Written as RMSNorm with a gain of ``ones`` so onnxruntime fuses it into one node (its
    per-node cost is most of a heads run on a model as small as stories260K)."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ones


class _Scaled(nn.Module):
    """The shared part of both kinds: ``scale [d]``, the RMS per dimension of the model's
    hidden states (set from training data by :meth:`set_scale`), so a head's output
    ``scale * f(unit(h))`` lands on the state's own scale whatever the final norm's gains."""

    def __init__(self, lm_head: torch.Tensor, heads: int) -> None:
        super().__init__()
        v, d = lm_head.shape
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.register_buffer("scale", torch.ones(d))
        self.register_buffer("ones", torch.ones(d), persistent=False)
        self.heads = heads

    def set_scale(self, hidden: torch.Tensor) -> None:
        # hidden: [N, d] states of the model on training text
        self.scale.copy_(hidden.float().pow(2).mean(0).sqrt().clamp_min(1e-3))


class MedusaHeads(_Scaled):
    def __init__(self, lm_head: torch.Tensor, heads: int) -> None:
        super().__init__(lm_head, heads)
        d = lm_head.shape[1]
        self.weight = nn.Parameter(torch.zeros(heads, d, d))  # zero: starts as the base head
        self.bias = nn.Parameter(torch.zeros(heads, d))

    def states(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [N, d] -> [N, H, d]; one MatMul for all heads (ONNX Einsum was ~6 ms here)
        hh, d = self.bias.shape
        # the bias inside the linear: one Gemm node in the graph, not MatMul + Add
        z = F.linear(unit(hidden, self.ones), self.weight.reshape(hh * d, d),
                     self.bias.reshape(hh * d)).view(-1, hh, d)
        return hidden[:, None, :] + self.scale * F.silu(z)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.states(hidden) @ self.lm_head.T                   # [N, H, V]


class ResidualHeads(_Scaled):
    """``table``: the whole input embedding, for teacher-forced tokens outside ``lm_head``'s
    rows (a vocabulary subset); default ``lm_head`` (tied, whole vocabulary)."""

    def __init__(self, lm_head: torch.Tensor, heads: int, width: int | None = None,
                 table: torch.Tensor | None = None) -> None:
        super().__init__(lm_head, heads)
        d = lm_head.shape[1]
        self.register_buffer("table", self.lm_head if table is None else table.detach().float(),
                             persistent=False)
        # the module runs once per head, so its weights are read H times a heads run: at
        # d = 576 a 2d-wide one (8 MB) cost more than the LM-head rows; small models keep 2d
        self.width = width or (2 * d if d < 256 else d)
        self.up = nn.Linear(2 * d, self.width)
        self.down = nn.Linear(self.width, d)
        nn.init.zeros_(self.down.weight)  # zero: h(t + j) starts as h(t)
        nn.init.zeros_(self.down.bias)

    def step(self, h: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        # h, token_embed: [N, d] -> h of the next row (the exported graph computes the same
        # step split up, see :class:`HeadsGraph`)
        x = torch.cat([unit(h, self.ones), unit(token_embed, self.ones)], dim=-1)
        y = F.silu(self.up(x))
        return h + self.scale * self.down(y)

    def folded_down(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale * down(y)`` as one linear: ``diag(scale) W_down``, ``scale * b_down`` (one
        Gemm in the exported graph instead of Gemm and Mul; :class:`HeadsGraph`)."""
        return self.down.weight * self.scale[:, None], self.down.bias * self.scale

    def states(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced states ``[N, H, d]``: step ``j`` reads the true token ``tokens[:, j-1]``."""
        out, h = [], hidden
        for j in range(self.heads):
            h = self.step(h, self.table[tokens[:, j]])
            out.append(h)
        return torch.stack(out, dim=1)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.states(hidden, tokens) @ self.lm_head.T           # [N, H, V]


def build(kind: str, lm_head: torch.Tensor, heads: int, **options) -> nn.Module:
    if kind not in KINDS:
        raise ValueError(f"heads kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return (MedusaHeads if kind == "medusa" else ResidualHeads)(lm_head, heads, **options)


BIAS_UNIT = 32.0  # a power of two: b_down / 32 * 32 is b_down exactly


class HeadsGraph(nn.Module):
    """What ``heads/<kind>.onnx`` computes: hidden ``[N, d]`` (and, residual kind, the roots,
    the tokens the base model chose after each row) -> the top-K ids (rows of ``lm_head``)
    and log-probs of every head, ``[N, H, K]``.

    ``lm_head [M, d]`` is the LM head's rows the heads score; the exported graph declares it
    as an initializer whose data the runtime hands to onnxruntime from the package's own
    embedding table when it loads the graph (tied models), so the heads file holds no copy,
    and onnxruntime still treats the rows as constant weights (packed once at load: a
    MatMul whose right side is a graph input re-packs all M rows every run, 2-3x slower).

    The residual kind feeds each step's top-1 token to the next step in-graph (top-1
    expansion); that token is the argmax over ``lm_chain [C, d]``, the first ``C`` rows of
    ``lm_head`` (the same memory; rows are in frequency order), so the chain reads ``C`` rows
    a step instead of ``M``. Its module's first layer is split by input: ``up(cat(unit(h),
    unit(e))) = unit(h) W_h + (unit(e) W_e + b)``, and the token half is a table ``U [C, w]``
    precomputed for the chain's rows (``chain_table``), so a step gathers one row of ``U``
    where it normalised an embedding, concatenated and multiplied (a heads run on a model as
    small as stories260K is mostly onnxruntime's per-node cost). Where the chain reads the
    whole vocabulary in id order (``lm_chain`` None), the root's row of ``U`` is gathered by
    its id (graph input ``root_ids``) and the chain's logits are the heads' logits; else the
    root comes as its embedding (``root_embeds``).

    Every head's logits come from one LM-head product over the ``N * H`` states (or the
    chain's own), then the top-K of the log-softmax; ``K`` is a graph input once exported
    (``export.heads``), so a drafter asks for no more candidates than its tree can use.
    """

    def __init__(self, heads: nn.Module, topk: int,
                 chain_table: torch.Tensor | None = None) -> None:
        super().__init__()
        self.heads, self.topk = heads, topk
        if not isinstance(heads, MedusaHeads):
            if chain_table is None:
                raise ValueError("the residual kind's graph needs the chain's rows (chain_table)")
            d = chain_table.shape[1]
            w, b = heads.up.weight.detach(), heads.up.bias.detach()
            wd, bd = (t.detach() for t in heads.folded_down())
            # the down projection's bias rides on one more hidden unit, held at a constant
            # pre-activation BIAS_UNIT (silu(32) = 32 in float32: sigmoid(32) rounds to 1),
            # with b_down / 32 as its row: the step's residual add then is the down Gemm's C
            # input, one node a step fewer (onnxruntime charges ~0.8 us a node)
            w = torch.cat([w, w.new_zeros(1, w.shape[1])])           # [w + 1, 2d]
            self.register_buffer("wh_t", w[:, :d].t().contiguous())
            self.register_buffer("we_t", w[:, d:].t().contiguous())
            self.register_buffer("b_up", torch.cat([b, b.new_full((1,), BIAS_UNIT)]))
            self.register_buffer("wd_t", torch.cat([wd.t(), bd[None] / BIAS_UNIT]).contiguous())
            with torch.no_grad():  # U [C, w + 1]: the token half of the first layer, per row
                self.register_buffer("u_table", torch.addmm(
                    self.b_up, unit(chain_table.float(), heads.ones), self.we_t))

    def forward(self, hidden, root, lm_head, lm_chain=None):
        # root: the roots' ids [N] (int64, lm_chain None) or their embeddings [N, d]
        # shapes are reshaped with constants only (-1 for N): no shape arithmetic in-graph
        hh, d = self.heads.heads, lm_head.shape[1]
        if isinstance(self.heads, MedusaHeads):
            logits = F.linear(self.heads.states(hidden), lm_head)            # [N, H, M]
        else:
            ones, reuse = self.heads.ones, lm_chain is None
            chain = lm_head if reuse else lm_chain
            u = (self.u_table[root] if not torch.is_floating_point(root)
                 else torch.addmm(self.b_up, unit(root, ones), self.we_t))
            h, per, outs = hidden, [], []
            for j in range(hh):
                y = F.silu(torch.addmm(u, unit(h, ones), self.wh_t))   # [N, w + 1]
                h = torch.addmm(h, y, self.wd_t)   # h + y W_down + b_down (see BIAS_UNIT)
                per.append(h)
                if j + 1 < hh or reuse:
                    scores = F.linear(h, chain)                              # [N, C]
                    outs.append(scores)
                    if j + 1 < hh:
                        u = self.u_table[scores.argmax(dim=-1)]
            if reuse:  # the chain scored every row: those are the heads' logits
                logits = torch.cat(outs, dim=-1).reshape(-1, hh, self.u_table.shape[0])
            else:
                logits = F.linear(torch.cat(per, dim=-1).reshape(-1, hh, d), lm_head)
        # the top-K of the log-softmax: two nodes (LogSoftmax, TopK), where the top-K of the
        # logits minus a logsumexp took eight (ReduceLogSumExp alone was several times
        # slower); a heads run's cost is mostly onnxruntime's per-node overhead
        lp, ids = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
        return ids, lp                                                        # [N, H, K]
