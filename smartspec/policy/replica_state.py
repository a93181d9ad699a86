"""Merging the goodput policy's exported state across replicas (numpy only: the Serve controller that merges
never loads the engine)."""
from __future__ import annotations

import numpy as np


def merge_states(states: list[dict]) -> dict:
    """One state from several replicas' (same key): acceptance evidence summed; cost coefficients averaged,
    weighted by each replica's measured steps."""
    if not states:
        return {}
    key = states[0]["key"]
    same = [s for s in states if s.get("key") == key]
    prior = {stage: {side: sum(s["prior"].get(stage, {}).get(side, 0.0) for s in same)
                     for side in ("accepted", "rejected")} for stage in ("first", "later")}
    fitted = [s["cost"] for s in same if s.get("cost", {}).get("verify")]
    cost = {}
    if fitted:
        weights = [max(1, c["samples"]) for c in fitted]
        total = sum(weights)
        cost = {"verify": [sum(w * c["verify"][j] for w, c in zip(weights, fitted)) / total
                           for j in range(len(fitted[0]["verify"]))],
                "draft": [sum(w * c["draft"][j] for w, c in zip(weights, fitted)) / total for j in range(3)],
                "samples": total}
    calibrations = [s["calibration"] for s in same if s.get("calibration")]
    calibration = ({name: np.sum([c[name] for c in calibrations], axis=0).tolist() for name in ("accepted", "total")}
                   if calibrations else {})
    return {"key": key, "prior": prior, "cost": cost,
            "calibration": calibration, "replicas": len(same)}
