"""Step isolation: what went wrong in one request's part of a step, named by the stage it happened in.

A step runs many requests' parts side by side; an exception in one part (its logits controls, its sampling, its
acceptance, its grammar, its detokenizing, its commit, its output) must end that request alone and leave the batch
going. Each per-request part runs under `stage(name)`, which labels what escapes it; the step's loop catches the
label per request (`fault_of`) and the commit stage ends the request with finish reason "error" and the fault's
message, which names the feature."""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# the stages a request's part of a step goes through, in step order (the forward is the step's own, shared by all)
STAGES = ("logits controls", "grammar", "sampling", "acceptance", "commit", "detokenizing", "output", "forward")


@dataclass(frozen=True)
class RequestFault:
    """Why a request was ended inside a step: the stage, and a message for its caller."""
    stage: str
    message: str

    def __str__(self) -> str:
        return f"the server failed at this request's {self.stage}: {self.message}"


class StageError(RuntimeError):
    """An exception raised inside one request's part of a step, labelled with the stage it escaped from."""

    def __init__(self, stage_name: str, cause: BaseException) -> None:
        super().__init__(f"{stage_name}: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage_name, cause


class stage:  # noqa: N801 (used as `with stage(name):`, like a function)
    """Label what escapes the block with the stage `name` (an inner label, from a nested stage, is kept). A class,
    not a contextlib generator: it is entered for every token a step commits, at a third of the cost."""
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None or isinstance(exc, StageError) or not isinstance(exc, Exception):
            return False
        raise StageError(self.name, exc) from exc


def fault_of(exc: Exception, request_id: str, default_stage: str) -> RequestFault:
    """The fault an exception from a request's part of the step stands for; logged once, with its traceback."""
    name = exc.stage if isinstance(exc, StageError) else default_stage
    cause = exc.cause if isinstance(exc, StageError) else exc
    logger.error("request %s ended by a fault in its %s", request_id, name, exc_info=cause)
    return RequestFault(name, f"{type(cause).__name__}: {str(cause)[:300]}")
