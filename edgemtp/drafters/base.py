"""The interface every drafter fits, so the decode loop and the lossless verifier never change
when a drafter does; and plain decoding, the drafter that proposes nothing."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..backend import StepOut
from ..plans import Plan

ROOT_ONLY = Plan.root_only()


class Drafter(Protocol):
    mask_tokens: int  # mask slots per node the block carries (0: the drafter uses none)
    topk: int         # candidates per block row the drafter reads from a step
    # optional ``hidden: bool``: steps return the rows' last hidden states (learned heads)

    def start(self, prompt_ids: np.ndarray) -> None: ...

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        """The plan of the next step and its node tokens [N], root first."""
        ...

    def mask_embeds(self) -> np.ndarray | None: ...

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        """Learn from a step: the accepted node's mask rows, the tokens just committed
        (accepted nodes + bonus) and the block rows of the root and accepted nodes (whose
        outputs are the model's own distributions at committed positions; for prefill, the
        prompt's rows)."""
        ...


def fitted_topk(backend, want: int) -> int:
    """``want`` candidates a block row, or as many as a package's graph exports
    (``backend.topk``) where that is fewer: candidates only steer the drafting (verification
    reads the argmax or the logits), so a drafter with fewer of them is as lossless. A package
    exported with ``--bc 10,30`` exports top-16; the hybrid reads 20 where it can."""
    limit = getattr(backend, "topk", None)
    return want if not limit else max(1, min(want, int(limit)))


class NoDrafter:
    """Plain autoregressive decoding, the BE = 1.0 reference: one position per step."""

    mask_tokens = 0
    topk = 0
    prompt_rows = False  # reads none of the prefill's prompt rows (Engine._prefill)

    def start(self, prompt_ids: np.ndarray) -> None:
        pass

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        return ROOT_ONLY, np.array([root], dtype=np.int64)

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        pass
