"""One timed measurement of a generation config over a prompt list, shared by the bench, the
profile and the bench scripts so that every figure they print is measured the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgemtp.config import GenerationConfig
from edgemtp.engine import GenerationResult


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
