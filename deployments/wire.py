"""The typed wire between the HTTP front and the replicas: the call that starts one generation (`GenerateCall`)
and the events its stream sends back (`Event`).

A replica's stream is `Accepted` or `Refused` first, so the front knows the status code before it sends
headers; then `Delta`s, the last one with `finished` set. Failover (placement/failover.py) adds `Restart` where
a generation is retried whole and its earlier tokens are void. A streamed generation asked with `channel` may have
its deltas carried instead by the caller's channel to that replica (`ChannelCall`): one `DeltaBatch` a step for
all the caller's streams there (replica/channels.py, http/channels.py). Beside them: what a replica tells the router
(`RoutingStats`) and the goodput controller (`ReplicaReport`), and what the controller shows (`ControllerStatus`).
Every part of the serving layer reads these fields by name; none reads a dict of the wire."""
from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, fields, replace

from smartspec.types.sampling_params import SamplingParams


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class GenerateCall:
    """One generation (one choice of a request) as the front asks a replica for it."""
    params: SamplingParams
    prompt: str | list[int] | None = None  # a completion's prompt: text or token ids
    messages: list[dict] | None = None  # a chat's messages as chat templates read them
    tools: list[dict] | None = None  # the tools the chat template shows the model
    # parallel_tool_calls false with tools the model may call on its own ("auto"): its answer ends with its first
    # call (the replica stops at the closing tag where that is a token; the front keeps one call in any case)
    one_tool_call: bool = False
    # the prompt as prefix keys are computed on (placement/latency.py): the messages' roles and text, or the
    # prompt; the router and the replica both key it, never the templated prompt
    prefix_text: str = ""
    echo: bool = False  # a completion that starts with its prompt
    until_context_end: bool = False  # no max_tokens was given: the replica sets it to its context's end
    # the caller passes each token on as it comes (a streamed answer); False, an answer sent whole: after the
    # first, the replica sends its tokens in batches (LLMServer.generate), each of which costs the front a message
    streamed: bool = True
    request_id: str = field(default_factory=new_request_id)
    retry_of: str | None = None  # the request id of the attempt this one retries (the router avoids its replica)
    caller: str | None = None  # the asking ingress replica's actor id: a replica aborts the generation once it dies
    # the caller reads a channel from the replica that takes it (ChannelCall): the replica sends the deltas there
    # while one is open, on this stream otherwise
    channel: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a GenerateCall holds a prompt or messages, not both")

    def retry(self) -> GenerateCall:
        """The same generation under a new request id that names this one."""
        return replace(self, request_id=new_request_id(), retry_of=self.request_id)

    @property
    def output_tokens_bound(self) -> int | None:
        """The most tokens it may generate, where the caller said; None: up to the context's end."""
        return None if self.until_context_end else self.params.max_tokens


@dataclass(frozen=True)
class TokenEntry:
    """One token's logprob with its text, and its most likely alternatives (text, logprob)."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PredictionUsage:
    """A predicted output's draft tokens that verification accepted and rejected (OpenAI's
    usage.completion_tokens_details)."""
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def __add__(self, other: PredictionUsage) -> PredictionUsage:
        return PredictionUsage(self.accepted_prediction_tokens + other.accepted_prediction_tokens,
                               self.rejected_prediction_tokens + other.rejected_prediction_tokens)


@dataclass(frozen=True)
class Accepted:
    """The replica took the generation."""
    prompt_tokens: int
    prompt_text: str = ""  # echo: the prompt as text
    prompt_first_token: str | None = None  # echo: the first token's text (it has no logprob)
    replica_id: str = ""  # the replica that took it
    # a call with `channel`: its deltas go by the caller's channel to this replica while one is open, and none is
    # open now (the caller opens one: ChannelCall)
    open_channel: bool = False


@dataclass(frozen=True)
class Refused:
    """The replica did not take the generation: the status and message the caller gets, the field to blame."""
    status: int
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Delta:
    """Tokens generated since the last delta; the last one has `finished` set and the generation's reports."""
    text: str
    token_ids: list[int]
    completion_tokens: int  # all tokens generated so far
    first: bool = False
    finished: bool = False
    finish_reason: str | None = None
    speculation: dict | None = None  # finished: the choice's draft counters, sent to the client as they are
    prediction: PredictionUsage | None = None  # finished: a predicted output's accepted and rejected tokens
    logprobs: list[TokenEntry] | None = None  # of token_ids, when asked
    prompt_logprobs: list[TokenEntry | None] | None = None  # the first delta's, when asked (the first is None)
    # finish_reason "error": the engine ended the generation because its part of a step failed; what failed, for
    # the caller (a 500's message, or a stream's error event)
    error: str | None = None

    def then(self, later: Delta) -> Delta:
        """This delta and the next of the same generation, as one (what the later one reports at its end)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return replace(later, text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
                       first=self.first or later.first, logprobs=logprobs,
                       prompt_logprobs=self.prompt_logprobs if self.first else later.prompt_logprobs)


@dataclass(frozen=True)
class Restart:
    """A generation retried whole on another replica: the tokens it streamed so far are void."""


Event = Accepted | Refused | Delta | Restart


@dataclass(frozen=True)
class ChannelCall:
    """An ingress replica (`caller`, its actor id) opens its channel to one LLMServer replica: the router sends the
    call to that replica alone. The channel's stream is `ChannelOpen`, then `DeltaBatch`es."""
    caller: str
    replica_id: str


@dataclass(frozen=True)
class ChannelOpen:
    """The replica took the channel: deltas of the caller's streams come by it from now on."""


@dataclass(frozen=True)
class DeltaBatch:
    """The deltas a replica had for one caller's streams at a step (request id, delta): one message for all."""
    deltas: tuple[tuple[str, Delta], ...]


@dataclass(frozen=True)
class RoutingStats:
    """What a replica tells the goodput router (LLMServer.record_routing_stats); Serve carries it as a dict."""
    time: float  # when it was taken (time.time())
    ongoing: int
    max_num_seqs: int
    request_speed: dict[int, float] | None = None  # batch size -> tokens/s of one request (Policy.load.request_speed)
    prefill_s_per_token: float | None = None
    chars_per_token: float | None = None
    request_s: float | None = None  # a request's mean time from acceptance to its end
    # the prefix keys of the prompts it served lately: thousands, passed on as they are, never copied per request
    prefix_keys: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain values only: Serve's controller, which relays the stats, may not hold this package."""
        return asdict(self)

    @staticmethod
    def from_dict(stats: dict | None) -> RoutingStats | None:
        """What Serve hands the router for a replica; None before its first report."""
        if not stats:
            return None
        known = {f.name for f in fields(RoutingStats)}
        values = {k: v for k, v in stats.items() if k in known}
        speed = values.get("request_speed")
        values["request_speed"] = {int(b): float(v) for b, v in speed.items()} if speed else None
        values["prefix_keys"] = values.get("prefix_keys") or []
        return RoutingStats(**values)


@dataclass(frozen=True)
class ReplicaGauges:
    """The figures of a replica that /metrics renders (control/metrics.py), read once from its engine's snapshot;
    None: the replica has no such figure yet."""
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # proposer -> (drafts, draft tokens, accepted tokens)
    by_source: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    chosen_k: dict[int, int] = field(default_factory=dict)  # speculation length -> decoding requests that ran it
    goodput_tokens_per_s: float | None = None
    step_time_error: float | None = None  # mean |predicted - measured| / measured step time
    prefix_queries: int = 0
    prefix_hits: int = 0
    alpha_prior: float | None = None
    alpha_prior_later: float | None = None
    prior_strength: float | None = None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica tells the goodput controller every controller_interval_s (control/controller.py)."""
    replica_id: str
    gauges: ReplicaGauges
    # the replica's /status view of itself (LLMServer.stats less the policy state): shown to the operator as it
    # comes, never read
    view: dict
    # its policy's shared evidence (Policy.shared.export_state: acceptance counts, cost fit), merged across the
    # replicas of one key; None: the policy shares none
    policy_state: dict | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the controller last heard from it."""
    age_s: float  # since its last report
    gauges: ReplicaGauges
    view: dict


@dataclass(frozen=True)
class ControllerStatus:
    """The controller's status view: every replica that reports, and the policy state merged across them."""
    replicas: dict[str, ReplicaStatus]
    merged_policy: dict | None

    def as_dict(self) -> dict:
        """/v1/smartspec/status: per replica its own view, with the hit rate and the shared acceptance estimates."""
        return {"replicas": {rid: {"age_s": r.age_s, **r.view,
                                   "prefix_cache_hit_rate": r.gauges.prefix_cache_hit_rate,
                                   "alpha_prior": r.gauges.alpha_prior,
                                   "alpha_prior_later": r.gauges.alpha_prior_later,
                                   "prior_strength": r.gauges.prior_strength}
                             for rid, r in self.replicas.items()},
                "merged_policy": self.merged_policy}
