"""Prometheus metrics. The ingress measures what clients see (requests, tokens, TTFT, time per output token);
the engine-side figures (spec-decode counters, chosen k, goodput, the policy's step-time prediction error) come
from the replicas' reports to the controller and are rendered per replica."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from deployments.wire import ControllerStatus

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("smartspec_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("smartspec_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.generation_tokens = Counter("smartspec_generation_tokens", "Tokens generated for completed requests",
                                         registry=r)
        self.ttft = Histogram("smartspec_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("smartspec_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.e2e = Histogram("smartspec_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)

        self.retries = Counter("smartspec_failover_retries", "Generations retried on another replica after theirs "
                               "failed (placement/failover.py)", registry=r)

    def failed_over(self, streams) -> None:
        """streams: the request's FailoverStreams; each failure it survived was a retry."""
        self.retries.inc(sum(len(s.failures) for s in streams))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe(self, endpoint: str, prompt_tokens: int, generated: int, start: float, first_token: float | None,
                end: float) -> None:
        self.request_done(endpoint, 200)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.e2e.observe(end - start)
        if first_token is not None:
            self.ttft.observe(first_token - start)
            if generated > 1:
                self.tpot.observe((end - first_token) / (generated - 1))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class RoutingMetrics:
    """The goodput router's decisions, counted in the process it routes from (the ingress renders them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter("smartspec_routing_decisions", "Requests the goodput router sent to a replica, by "
                                 "why it ranked first: affinity (its prefix cache), load, retry (after a failure)",
                                 ["replica", "reason"], registry=self.registry)

    def chosen(self, replica: str, reason: str) -> None:
        self.decisions.labels(replica, reason).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()


ROUTING = RoutingMetrics()  # one per process: Serve builds the router, the ingress in the same process renders it


def _line(name: str, labels: dict, value) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {float(value)}"


# family -> (type, help, the ReplicaGauges attribute that holds the value)
REPLICA_FAMILIES = {
    "smartspec_spec_decode_num_drafts_total": ("counter", "Steps in which a request proposed tokens", "num_drafts"),
    "smartspec_spec_decode_num_draft_tokens_total": ("counter", "Draft tokens proposed", "num_draft_tokens"),
    "smartspec_spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted", "num_accepted_tokens"),
    "smartspec_chosen_k_total": ("counter", "Decoding requests that ran a step with this speculation length",
                                 "chosen_k"),
    "smartspec_goodput_tokens_per_second": ("gauge", "Tokens generated per second of step time",
                                            "goodput_tokens_per_s"),
    "smartspec_step_time_prediction_error": ("gauge", "Mean |predicted - measured| / measured step time",
                                             "step_time_error"),
    "smartspec_requests_running": ("gauge", "Requests running in the engine", "running"),
    "smartspec_requests_waiting": ("gauge", "Requests waiting for the engine", "waiting"),
    "smartspec_kv_blocks_free": ("gauge", "Free KV cache blocks", "free_blocks"),
    "smartspec_prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache",
                                             "prefix_queries"),
    "smartspec_prefix_cache_hits_total": ("counter", "Prompt tokens whose KV the prefix cache held", "prefix_hits"),
    "smartspec_prefix_cache_hit_rate": ("gauge", "Prompt tokens the prefix cache held / prompt tokens looked up",
                                        "prefix_cache_hit_rate"),
    "smartspec_acceptance_prior": ("gauge", "The policy's shared acceptance estimate of a draft's first token",
                                   "alpha_prior"),
    "smartspec_acceptance_prior_later": ("gauge", ("The policy's shared acceptance estimate of each later draft "
                                                   "token, given the one before it was accepted"),
                                         "alpha_prior_later"),
    "smartspec_acceptance_prior_strength": ("gauge", "Outcomes the prior is worth against a request's own, learned "
                                            "from how much finished requests differ", "prior_strength"),
}


# family -> (help, the position of its counter in ReplicaGauges.by_source's triples)
SOURCE_FAMILIES = {
    "smartspec_spec_decode_num_drafts_by_source_total": ("Drafts, by who drafted them", 0),
    "smartspec_spec_decode_num_draft_tokens_by_source_total": ("Draft tokens proposed, by who drafted them", 1),
    "smartspec_spec_decode_num_accepted_tokens_by_source_total": ("Draft tokens accepted, by who drafted them", 2),
}


def render_replica_metrics(status: ControllerStatus) -> str:
    """The controller's status as Prometheus text, one series per replica (chosen k: one per k too; the speculation
    counters by source: one per proposer); a value a replica does not have yet is left out."""
    out = []
    gauges = {replica: r.gauges for replica, r in status.replicas.items()}
    for name, (doc, position) in SOURCE_FAMILIES.items():
        lines = [_line(name, {"replica": replica, "source": source}, counts[position])
                 for replica, g in gauges.items() for source, counts in g.by_source.items()]
        if lines:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter", *lines]
    for name, (kind, doc, attribute) in REPLICA_FAMILIES.items():
        lines = []
        for replica, g in gauges.items():
            value = getattr(g, attribute)
            if isinstance(value, dict):  # chosen_k: {k: count}
                lines += [_line(name, {"replica": replica, "k": k}, n) for k, n in value.items()]
            elif value is not None:
                lines.append(_line(name, {"replica": replica}, value))
        if lines:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""
