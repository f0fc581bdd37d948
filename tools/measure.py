"""One timed measurement of a generation config over a prompt list, shared by the bench, the
profile and the bench scripts so that every figure they print is measured the same way; the
untimed warm-up that comes before any of them (:func:`warm_up`), and the check, before any
forward pass, that a loaded model can run a config's steps at all (:func:`misfit`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgemtp.config import GenerationConfig
from edgemtp.engine import GenerationResult, step_topk
from edgemtp.errors import ConfigError
from edgemtp.latency import LatencyCurve

# the warm-up's prompt: none of the scored ones, so no drafter learns on a prompt before
# it is scored on it
WARM_TEXT = "Once there was a little robot who liked to count the stars at night."
WARM_TOKENS = 32  # new tokens per warm-up generation (fewer where the config asks fewer)
# a curve as slow as a big model's: auto then builds every drafter it can weigh (a curve of
# a fast device leaves some out), so its widest step is what the check sees
_SLOW = LatencyCurve((1, 2), (1.0, 1.0))


@dataclass(frozen=True)
class Measured:
    """``repeats`` runs over the same prompts, back to back.

    results: [run][prompt]; seconds: the wall time of each run. Counts and outputs come from
    the first run: later ones would have learned (calibration, hit rates) on the very prompts
    they are scored on.
    """

    results: list[list[GenerationResult]]
    seconds: list[float]

    @property
    def outputs(self) -> list[list[int]]:
        return [r.token_ids for r in self.results[0]]

    @property
    def tokens(self) -> int:
        return sum(r.stats.new_tokens for r in self.results[0])

    @property
    def forward_calls(self) -> int:
        return sum(r.stats.forward_calls for r in self.results[0])

    @property
    def rates(self) -> list[float]:
        """Tokens per second of each run."""
        return [sum(r.stats.new_tokens for r in run) / s
                for run, s in zip(self.results, self.seconds)]


def measure(model, prompts: list, config: GenerationConfig, bar, repeats: int) -> Measured:
    """Generate every prompt ``repeats`` times, ticking ``bar`` once per generation."""
    results, seconds = [], []
    for _ in range(repeats):
        run, t0 = [], time.perf_counter()
        for p in prompts:
            run.append(model.generate(p, config))
            bar.update()
        seconds.append(time.perf_counter() - t0)
        results.append(run)
    return Measured(results, seconds)


def warm_prompt(model) -> list[int]:
    """The warm-up's prompt ids: :data:`WARM_TEXT` (a few token ids for a model without a
    tokenizer), cut to a quarter of the context (a package with a tiny context still takes
    it)."""
    ids = (model.encode(WARM_TEXT) if model.tokenizer is not None
           else [i % model.backend.vocab_size for i in range(1, 9)])
    return ids[:max(1, model.backend.max_context // 4)]


def warm_up(model, configs: list[GenerationConfig], bar=None) -> None:
    """One untimed generation of :data:`WARM_TOKENS` new tokens (at most) on
    :func:`warm_prompt` with each config, before anything is timed: a runtime's first runs of
    a block shape (onnxruntime: session and buffer set-up, ~3x slower on stories260K) would
    otherwise land in the first method measured, and ``auto``'s one-time latency curve
    (measured at its first generation on a loaded model, kept in the model's memory) in its
    first timed task. Ticks ``bar`` once per config."""
    prompt = warm_prompt(model)
    for config in configs:
        model.generate(prompt, config.with_(max_new_tokens=min(config.max_new_tokens,
                                                               WARM_TOKENS)))
        if bar is not None:
            bar.update()


def _step_check(backend):
    """``check(topk, hidden)`` of a package backend (raises what a forward pass would),
    or None where any step runs (a Hugging Face folder on PyTorch)."""
    own = getattr(backend, "check_step", None)
    if own is not None:
        return own
    if getattr(backend, "package", None) is not None and getattr(backend, "topk", None):
        from edgemtp.runtimes.package import check_step

        return lambda topk, hidden: check_step(backend, topk, hidden)
    return None


def misfit(backend, config: GenerationConfig) -> str | None:
    """Why ``backend`` cannot run ``config``'s steps, found without a forward pass: the
    drafter is built (on a throwaway memory; ``auto`` on a slow curve, so with every drafter
    it may weigh) and the candidates and hidden states its steps ask for are checked against
    what a package's graph exports. None where it can run them.

    The reason reads "needs top-X candidates a row, but the package's graph exports top-Y
    (its plans: ...)" for a top-K that is too small."""
    from edgemtp.drafters import make_drafter

    check = _step_check(backend)
    if check is None:
        return None
    if config.drafter == "auto" and config.latency is None:
        config = config.with_(latency=_SLOW)  # (the real curve is measured at the warm-up)
    try:
        drafter = make_drafter(backend, config, {})
    except ConfigError as e:
        return str(e)
    topk = step_topk(drafter)
    limit = getattr(backend, "topk", None)
    if limit and topk > limit:
        meta = getattr(getattr(backend, "package", None), "meta", None)
        plans = ", ".join(f"bc {p.bc} k {p.k}" for p in meta.plans) if meta else "?"
        return (f"needs top-{topk} candidates a row, but the package's graph exports "
                f"top-{limit} (its plans: {plans})")
    try:
        check(topk, bool(getattr(drafter, "hidden", False)))
    except ConfigError as e:
        return str(e)
    return None
