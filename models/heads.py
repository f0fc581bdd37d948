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


class MedusaHeads(nn.Module):
    def __init__(self, lm_head: torch.Tensor, heads: int) -> None:
        super().__init__()
        v, d = lm_head.shape
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.heads = heads
        self.weight = nn.Parameter(torch.zeros(heads, d, d))  # zero: starts as the base head
        self.bias = nn.Parameter(torch.zeros(heads, d))

    def states(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [N, d] -> [N, H, d]
        z = torch.einsum("nd,hed->nhe", hidden, self.weight) + self.bias
        return hidden[:, None, :] + F.silu(z)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.states(hidden) @ self.lm_head.T                   # [N, H, V]


class ResidualHeads(nn.Module):
    """``table``: the whole input embedding, for teacher-forced tokens outside ``lm_head``'s
    rows (a vocabulary subset); default ``lm_head`` (tied, whole vocabulary)."""

    def __init__(self, lm_head: torch.Tensor, heads: int, width: int | None = None,
                 table: torch.Tensor | None = None) -> None:
        super().__init__()
        v, d = lm_head.shape
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.register_buffer("table", self.lm_head if table is None else table.detach().float(),
                             persistent=False)
        self.heads, self.width = heads, width or 2 * d
        self.up = nn.Linear(2 * d, self.width)
        self.down = nn.Linear(self.width, d)
        nn.init.zeros_(self.down.weight)  # zero: h(t + j) starts as h(t)
        nn.init.zeros_(self.down.bias)

    def step(self, h: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        # h, token_embed: [N, d] -> h of the next row
        return h + self.down(F.silu(self.up(torch.cat([h, token_embed], dim=-1))))

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


class HeadsGraph(nn.Module):
    """What ``heads/<kind>.onnx`` computes: hidden ``[N, d]`` (and, residual kind, the
    embeddings of the roots ``[N, d]``, the tokens the base model chose after each row) ->
    the top-K ids (rows of ``lm_head``) and log-probs of every head, ``[N, H, K]``. The LM
    head is the graph *input* ``lm_head [M, d]``: the runtime binds rows of the package's own
    embedding table (tied models), so the heads graph holds no copy of it. The residual kind
    feeds each step's argmax to the next step in-graph (top-1 expansion)."""

    def __init__(self, heads: nn.Module, topk: int) -> None:
        super().__init__()
        self.heads, self.topk = heads, topk

    def forward(self, hidden, root_embeds, lm_head):
        if isinstance(self.heads, MedusaHeads):
            logits = self.heads.states(hidden) @ lm_head.T                # [N, H, M]
        else:
            per, h, e = [], hidden, root_embeds
            for _ in range(self.heads.heads):
                h = self.heads.step(h, e)
                step = h @ lm_head.T                                      # [N, M]
                e = lm_head[step.argmax(dim=-1)]  # tied: the LM head row is the embedding
                per.append(step)
            logits = torch.stack(per, dim=1)
        top, ids = logits.topk(self.topk, dim=-1)
        return ids, top - torch.logsumexp(logits, dim=-1, keepdim=True)
