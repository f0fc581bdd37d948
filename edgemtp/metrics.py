"""Per-generation measurements: BE, forward calls, accept lengths and where time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    bc: int = 1
    mask_tokens: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_calls: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft nodes per step
    time_prefill: float = 0.0
    time_draft: float = 0.0    # propose a tree, pick its plan, update mask embeddings
    time_forward: float = 0.0  # forward passes after prefill: the runtime's own run call
                               # where the backend reports it (``last_run_s``), else all of it
    time_bind: float = 0.0     # host work around that run inside the backend's forward
                               # (binding inputs, output copies)
    time_verify: float = 0.0
    time_commit: float = 0.0   # cache commit, emission, stop checks
    # decode steps per kind of step, for a drafter that chooses one per step (auto: plain,
    # mask, pld, probe, stand or a whole drafter's name); empty for the others
    steps_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def block_efficiency(self) -> float:
        """Committed tokens per forward call, prefill included (plain decoding: 1.0)."""
        return self.new_tokens / self.forward_calls if self.forward_calls else 0.0

    @property
    def total_time(self) -> float:
        return (self.time_prefill + self.time_draft + self.time_forward + self.time_bind
                + self.time_verify + self.time_commit)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def host_overhead(self) -> float:
        """Share of decode time spent outside the model's forward passes (the runtime's run
        call where the backend reports it; binding counts as overhead)."""
        decode = self.total_time - self.time_prefill
        return 1.0 - self.time_forward / decode if decode > 0 else 0.0

    def accept_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))

    def to_dict(self) -> dict:
        return {
            "bc": self.bc, "mask_tokens": self.mask_tokens,
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "forward_calls": self.forward_calls,
            "block_efficiency": round(self.block_efficiency, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "accept_histogram": {str(k): v for k, v in self.accept_histogram().items()},
            "time_s": {name: round(getattr(self, f"time_{name}"), 6)
                       for name in ("prefill", "draft", "forward", "bind", "verify",
                                    "commit")},
            "host_overhead": round(self.host_overhead, 4),
            **({"steps_by_kind": dict(self.steps_by_kind)} if self.steps_by_kind else {}),
        }

    def summary(self) -> str:
        # auto picks a plan per step: its BC is a ceiling and its mask count varies (its
        # steps say what ran); a drafter without mask tokens has no k to show
        shape = (f"BC <= {self.bc}" if self.steps_by_kind else
                 f"BC {self.bc}, k {self.mask_tokens}" if self.mask_tokens else f"BC {self.bc}")
        line = (f"{self.new_tokens} tokens in {self.forward_calls} forward calls "
                f"(BE {self.block_efficiency:.2f}, {shape}) | "
                f"{self.tokens_per_second:.1f} tok/s | host overhead {100 * self.host_overhead:.0f}%")
        if self.steps_by_kind:  # what auto chose, most used first
            kinds = sorted(self.steps_by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
            line += " | steps: " + ", ".join(f"{k} {n}" for k, n in kinds)
        return line
