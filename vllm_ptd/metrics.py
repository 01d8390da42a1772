"""Speculative-decoding metrics, per request and aggregated.

One record per target forward ("step") of one request: tokens committed (accepted + bonus,
after any cut at EOS/length), accepted draft tokens k, draft rows and verify rows.

Definitions (PTD paper 4.1, checked against its Table 5: HR 0.71, AL 2.74 give
DE = 0.71 * 2.74 + 0.29 = 2.23 as reported, so AL counts the bonus token):
* HR  (hit rate): fraction of steps with k >= 1 (at least one draft token accepted).
* AL  (accept length): mean committed tokens over hit steps (k + 1 unless cut short).
* DE  (decoding efficiency): committed tokens per step = total committed / steps. Every miss
  step commits exactly its bonus token, so DE = HR * AL + (1 - HR) holds exactly.
* tau (PCTree paper: mean acceptance length incl. bonus per round): the same quantity as DE.
* Dft / Ver: mean draft rows / verify rows per step (the extra rows the forward carries).
* S(d) (survival): fraction of steps with k >= d, d = 0..max k (S(0) = 1).
* util (verified-node utilisation): accepted draft tokens / verify rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class SpecMetrics:
    steps: int = 0
    committed: int = 0
    accepted: int = 0
    hits: int = 0
    hit_committed: int = 0
    draft_rows: int = 0
    verify_rows: int = 0
    accept_hist: dict[int, int] = field(default_factory=dict)  # k -> number of steps

    def record(self, committed: int, accepted: int, draft_rows: int = 0,
               verify_rows: int = 0) -> None:
        """One step of one request."""
        if committed < 0 or accepted < 0 or draft_rows < 0 or verify_rows < 0:
            raise ValueError("metric counts must be >= 0")
        self.steps += 1
        self.committed += committed
        self.accepted += accepted
        if accepted > 0:
            self.hits += 1
            self.hit_committed += committed
        self.draft_rows += draft_rows
        self.verify_rows += verify_rows
        self.accept_hist[accepted] = self.accept_hist.get(accepted, 0) + 1

    def record_outcome(self, outcome) -> None:
        """One step from a ``StepOutcome`` (rows counted from the tree that ran)."""
        t = outcome.tree
        self.record(len(outcome.committed), len(outcome.accepted),
                    t.num_nodes - t.num_verify, t.num_verify)

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        """Add ``other``'s steps into this one (in place); returns self."""
        self.steps += other.steps
        self.committed += other.committed
        self.accepted += other.accepted
        self.hits += other.hits
        self.hit_committed += other.hit_committed
        self.draft_rows += other.draft_rows
        self.verify_rows += other.verify_rows
        for k, n in other.accept_hist.items():
            self.accept_hist[k] = self.accept_hist.get(k, 0) + n
        return self

    @classmethod
    def merged(cls, parts: Iterable["SpecMetrics"]) -> "SpecMetrics":
        out = cls()
        for p in parts:
            out.merge(p)
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def hit_rate(self) -> float:
        return self.hits / self.steps if self.steps else 0.0

    @property
    def accept_length(self) -> float:
        return self.hit_committed / self.hits if self.hits else 0.0

    @property
    def decoding_efficiency(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def tau(self) -> float:
        return self.decoding_efficiency

    @property
    def draft_per_step(self) -> float:
        return self.draft_rows / self.steps if self.steps else 0.0

    @property
    def verify_per_step(self) -> float:
        return self.verify_rows / self.steps if self.steps else 0.0

    @property
    def utilisation(self) -> float:
        return self.accepted / self.verify_rows if self.verify_rows else 0.0

    def survival(self) -> list[float]:
        """S(d) = P[k >= d] for d = 0..max k."""
        if not self.steps:
            return []
        top = max(self.accept_hist)
        out, ge = [], self.steps
        for d in range(top + 1):
            out.append(ge / self.steps)
            ge -= self.accept_hist.get(d, 0)
        return out

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.committed,
            "accepted": self.accepted,
            "HR": self.hit_rate,
            "AL": self.accept_length,
            "DE": self.decoding_efficiency,
            "tau": self.tau,
            "Dft": self.draft_per_step,
            "Ver": self.verify_per_step,
            "util": self.utilisation,
            "survival": self.survival(),
        }

    def summary(self) -> str:
        """One log line."""
        share = self.accepted / self.verify_rows if self.verify_rows else 0.0
        return (f"steps={self.steps} tokens={self.committed} DE={self.decoding_efficiency:.3f} "
                f"HR={self.hit_rate:.3f} AL={self.accept_length:.3f} "
                f"Dft/Ver={self.draft_per_step:.1f}/{self.verify_per_step:.1f} "
                f"accepted={self.accepted}/{self.verify_rows} verify nodes ({share:.1%}) "
                f"draft_rows={self.draft_rows}")


class MetricsByRequest:
    """Per-request metrics plus their aggregate."""

    def __init__(self) -> None:
        self.requests: dict[str, SpecMetrics] = {}

    def record(self, req_id: str, committed: int, accepted: int, draft_rows: int = 0,
               verify_rows: int = 0) -> None:
        self.requests.setdefault(req_id, SpecMetrics()).record(
            committed, accepted, draft_rows, verify_rows)

    def get(self, req_id: str) -> SpecMetrics:
        return self.requests.get(req_id, SpecMetrics())

    def total(self) -> SpecMetrics:
        return SpecMetrics.merged(self.requests.values())

    def as_dict(self) -> dict:
        return {"total": self.total().as_dict(),
                "requests": {r: m.as_dict() for r, m in self.requests.items()}}
