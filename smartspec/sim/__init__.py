"""Discrete-event simulation of serving: the real scheduler, block manager, planning, commit and policies, with step
times from a cost model fitted on measured traces and acceptance sampled from measured requests."""
from smartspec.sim.profile import SimProfile
from smartspec.sim.simulator import Arrivals, ReplicaSize, simulate

__all__ = ["Arrivals", "ReplicaSize", "SimProfile", "simulate"]
