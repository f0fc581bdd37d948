"""Generation options, validated once at the boundary."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields, replace

import numpy as np

from . import drafters
from .budgets import check_bc, is_int
from .errors import ConfigError
from .drafters.tree_cost import TREE_COSTS
from .latency import LatencyCurve

TREES = ("static", "dynamic")
MASK_INITS = ("mean", "sample", "last-k", "vector")


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate: budget, probing plan, mask embeddings, sampling and stopping.

    ``calibrate`` corrects the dynamic tree's scores with the acceptance it observes per depth
    and rank (:class:`edgemtp.tree.RankCalibration`); ``False`` is the paper's Algorithm 1.
    Neither changes the output tokens, only how many forward calls they take.

    ``tree_cost`` (hybrid, STAND, and auto's hybrids and STAND): ``"budget"`` grows a tree to
    BC nodes; ``"measured"`` stops where one more node adds fewer expected tokens than its
    measured share of a step costs (:mod:`edgemtp.drafters.tree_cost`), for tokens/s rather
    than block efficiency. Outputs are the same either way.

    ``lookahead`` is lookahead decoding's ``(L, W, G)`` (``drafter="lade"``); by default the
    paper's for BC 10 / 30 / 60 and the same proportions otherwise
    (:func:`edgemtp.budgets.lade_shape`).

    ``drafter`` names an entry of :data:`edgemtp.drafters.REGISTRY`, whose budget rule is
    checked here, before any model is loaded. Left out it is ``"auto"`` -- plain decoding,
    probing or lookup per step by expected tokens/s on this device, so a default generation
    is never much slower than plain decoding (probing at BC 30 costs ~5x a token on a 2-core
    CPU) -- or ``"probe"`` where a probing option is given (``mask_tokens``, or
    ``tree="static"``): asking for mask tokens means asking for probing.

    ``temperature == 0`` means greedy decoding; ``> 0`` samples losslessly from the model's
    processed distribution (temperature, then top-k, then top-p, as ``transformers`` does).
    """

    max_new_tokens: int = 128
    bc: int = 30
    mask_tokens: int | None = None  # None: 1 (and the drafter, if left out, is not "probe")
    tree: str = "dynamic"
    branching: tuple[int, ...] | None = None
    mask_init: str = "mean"
    mask_vector: tuple[float, ...] | None = None
    ema: float = 0.1
    prune: bool = True
    calibrate: bool = True
    drafter: str | None = None  # None: "auto", or "probe" given probing options (see above)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = field(default=())
    latency: LatencyCurve | None = None  # for drafter="auto"; None: measured once per model
    lookahead: tuple[int, int, int] | None = None  # LADE's (L, W, G); None: from the budget
    heads: str | None = None  # drafter="heads": the kind to run; None: the package's first
    tree_cost: str = "budget"  # hybrid, stand (and auto's): grow to BC, or while nodes pay
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("branching", "stop", "eos_token_ids", "mask_vector", "lookahead"):  # lists -> tuples
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                object.__setattr__(self, name, tuple(value.tolist() if isinstance(value, np.ndarray)
                                                     else value))
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if is_int(self.eos_token_ids):  # one id, as transformers' eos_token_id takes it
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        # what was left out, so that with_() chooses again (mask_tokens=2 means probing)
        object.__setattr__(self, "_left_out", frozenset(
            name for name in ("drafter", "mask_tokens") if getattr(self, name) is None))
        for name, low in (("max_new_tokens", 1), ("top_k", 0), ("seed", 0)):
            self._integer(name, low)
        if self.mask_tokens is not None:
            self._integer("mask_tokens", 1)
        for name in ("temperature", "top_p", "ema"):
            value = getattr(self, name)
            _check(isinstance(value, numbers.Real) and not isinstance(value, bool),
                   f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("prune", "calibrate"):
            _check(isinstance(getattr(self, name), (bool, np.bool_)),
                   f"{name} must be True or False, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        _check(isinstance(self.stop, tuple),
               f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.eos_token_ids is not None:
            _check(isinstance(self.eos_token_ids, tuple)
                   and all(is_int(i) and i >= 0 for i in self.eos_token_ids),
                   f"eos_token_ids must be token ids (integers >= 0), got {self.eos_token_ids!r}")
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.mask_vector is not None:
            _check(isinstance(self.mask_vector, tuple)
                   and all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                           and np.isfinite(v) for v in self.mask_vector),
                   "mask_vector must be a list of finite numbers")
        object.__setattr__(self, "bc", check_bc(self.bc))
        _check(self.drafter is None or isinstance(self.drafter, str),
               f"drafter must be a name (a string), got {self.drafter!r}")
        if self.drafter is None:
            probing = self.mask_tokens is not None or self.tree == "static"
            object.__setattr__(self, "drafter", "probe" if probing else "auto")
        if self.mask_tokens is None:
            object.__setattr__(self, "mask_tokens", 1)
        _check(self.tree in TREES, f"tree must be one of {', '.join(TREES)}, got {self.tree!r}")
        spec = drafters.get(self.drafter)
        _check(self.mask_init in MASK_INITS,
               f"mask_init must be one of {', '.join(MASK_INITS)}, got {self.mask_init!r}")
        _check((self.mask_init == "vector") == (self.mask_vector is not None),
               "mask_init='vector' and mask_vector go together: give both or neither")
        _check(0.0 <= self.ema <= 1.0, f"ema (lambda) must be in [0, 1], got {self.ema!r}")
        _check(self.temperature >= 0.0 and np.isfinite(self.temperature),
               f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        from .tokenizer import undecodable_at

        for j, text in enumerate(self.stop):  # (bytes that were not UTF-8: it can never match)
            at = undecodable_at(text)
            _check(at is None, f"stop string {j} is not valid UTF-8 text (an undecodable byte "
                               f"at character {at}); give UTF-8 text")
        if self.branching is not None:
            _check(self.tree == "static", "a branching only applies to tree='static'")
            _check(isinstance(self.branching, tuple)
                   and all(is_int(b) and b >= 1 for b in self.branching),
                   f"branching must be a list of integers >= 1, got {self.branching!r}")
            _check(len(self.branching) == self.mask_tokens,
                   f"branching needs one count per mask token ({self.mask_tokens}), "
                   f"got {list(self.branching)}")
            object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        _check(self.latency is None or isinstance(self.latency, LatencyCurve),
               "latency must be a LatencyCurve (see edgemtp profile)")
        if self.lookahead is not None:
            _check("lookahead" in spec.options,
                   "lookahead (L, W, G) only applies to drafter='lade'")
            _check(isinstance(self.lookahead, tuple) and len(self.lookahead) == 3
                   and all(is_int(v) for v in self.lookahead),
                   f"lookahead needs three integers (L, W, G), got {self.lookahead!r}")
            object.__setattr__(self, "lookahead", tuple(int(v) for v in self.lookahead))
        if self.heads is not None:
            _check("heads" in spec.options,
                   "heads (a kind) only applies to drafter='heads', 'hybrid' or 'auto'")
            _check(self.heads in ("medusa", "residual"),
                   f"heads must be medusa or residual, got {self.heads!r}")
        _check(self.tree_cost in TREE_COSTS,
               f"tree_cost must be one of {', '.join(TREE_COSTS)}, got {self.tree_cost!r}")
        if self.tree_cost != "budget":
            _check("tree_cost" in spec.options,
                   "tree_cost only applies to drafter='hybrid', 'stand' or 'auto'")
        spec.budget(self)  # the drafter's budget rule: fail before any model is loaded

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0.0

    def _integer(self, name: str, low: int) -> None:
        value = getattr(self, name)
        _check(is_int(value) and value >= low,
               f"{name} must be an integer >= {low}{' (0 = off)' if name == 'top_k' else ''}, "
               f"got {value!r}")
        object.__setattr__(self, name, int(value))

    def with_(self, **changes) -> "GenerationConfig":
        """A copy with some fields changed (validated again). A drafter or mask-token count
        left out of this config is chosen again from the new options (``with_(mask_tokens=2)``
        of a default config means probing, as ``GenerationConfig(mask_tokens=2)`` does)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        _check(not unknown, f"unknown generation option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}; the options are "
                            f"{', '.join(f.name for f in fields(self))}")
        for name in self._left_out:
            changes.setdefault(name, None)
        return replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
