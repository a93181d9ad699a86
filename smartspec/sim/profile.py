"""What the simulator knows of a machine and a proposer: a step-cost model fitted on measured step traces
(Parquet from EngineConfig(trace_path=...)) and the acceptance rates of the measured requests."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from smartspec.policy.cost_model import CostFitSettings, StepCostModel


def trace_rows(paths: list[str | Path]) -> list[dict]:
    """The steps of the traces (files, or a server replica's folder of part files), each tagged with the index of
    its trace under "run": request ids repeat across runs."""
    import pyarrow.parquet as pq

    return [{**r, "run": i} for i, p in enumerate(paths) for r in pq.read_table(p).to_pylist()]


@dataclass
class SimProfile:
    cost: StepCostModel
    alphas: list[float] = field(default_factory=list)  # per measured request: accepted / (accepted + rejections)
    source: str = ""
    # the target's forward runs on a device while the host goes on (a GPU): host work beside it costs what it
    # outlasts the forward (engine/step_observer.py); False: a CPU, where the host runs the forward
    asynchronous: bool = False

    @classmethod
    def from_traces(cls, paths: list[str | Path], min_proposals: int = 3) -> SimProfile:
        rows = trace_rows(paths)
        if not rows:
            raise ValueError(f"no steps in {paths}")
        cost = StepCostModel(CostFitSettings(window=len(rows), forget=1.0))  # every measured step counts the same
        counts: dict[str, list[float]] = {}
        for r in rows:
            cost.observe(r["num_batched_tokens"], r["num_context_tokens"], max(r["proposed"], default=0),
                         sum(r["proposed"]), r["draft_s"], r["total_s"] - r["draft_s"],
                         catchup=r.get("draft_catchup_tokens") or 0, refit=False)
            for rid, proposed, accepted in zip(r["request_ids"], r["proposed"], r["accepted"]):
                if proposed:
                    c = counts.setdefault(f"{r['run']}/{rid}", [0.0, 0.0, 0])
                    c[0] += accepted
                    c[1] += 1.0 if accepted < proposed else 0.0
                    c[2] += 1
        cost.refit()  # one fit over all steps, not one per step
        if not cost.ready:
            raise ValueError(f"too few steps in {paths} to fit a step-cost model")
        alphas = [a / (a + rej) for a, rej, n in counts.values() if n >= min_proposals and a + rej > 0]
        return cls(cost, alphas, ", ".join(str(p) for p in paths))

    def sample_alpha(self, rng: np.random.Generator) -> float:
        return float(rng.choice(self.alphas)) if self.alphas else 0.0

    def step_time(self, n: int, c: int, depth: int, sum_k: int, catchup: int = 0) -> float:
        return float(self.cost.predict(n, c, depth, sum_k)) + self.cost.d[2] * catchup

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"cost": self.cost.export_state(), "alphas": self.alphas,
                                          "source": self.source, "asynchronous": self.asynchronous}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        data = json.loads(Path(path).read_text())
        cost = StepCostModel()
        cost.import_state(data["cost"])  # a model with no samples of its own adopts the saved coefficients
        return cls(cost, list(data["alphas"]), data.get("source", str(path)), bool(data.get("asynchronous", False)))
