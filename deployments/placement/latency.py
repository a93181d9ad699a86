"""Where a request should run: the goodput router's estimate (placement/router.py), apart from Ray.

The router ranks the LLMServer replicas by the expected latency of the request on each:

    latency(r) = ahead(r) + prefill(r) + decode(r) + wait(r)
    ahead(r)   = the prefill seconds still queued on r (`PrefillBacklog`)
    prefill(r) = (prompt tokens - the tokens r holds in its prefix cache) * P
    decode(r)  = expected output tokens / request speed at r's batch with this request in it
    wait(r)    = requests beyond r's max_num_seqs * r's mean request time / max_num_seqs

P is the seconds a prompt token's prefill costs. A replica prefills the requests sent to it in turn, so the
router keeps a fluid account of each replica's prefill work: each request it sends adds its own expected prefill
seconds, and the account drains at one second per second. `ahead` is what spreads a burst of new conversations
over the replicas, and what moves a conversation off its replica once that replica has more prefill queued than
its cache saves; a burst of next turns, each mostly cached, adds little and stays where its prefixes are. The
request speed at batch b comes from the goodput policy (`Policy.load.request_speed`): the fitted step cost and the
measured acceptance at the k the policy would choose there, so a replica with a small batch, which can still
afford to speculate, draws new requests.

P and the speed table are each replica's own fits, pooled (the median over the replicas, per batch size): a
deployment's replicas run one model on one kind of resource, and their fits on identical hardware differ
several times over, which would steer requests by the noise of the fits.

Prefix affinity: a prompt's text is cut into CHUNK_CHARS chunks, each keyed by a hash chained over all chunks
before it, so a key stands for the whole prefix up to it (as the engine's block hashes do for tokens). A replica
reports the keys of the prompts it served most recently, about as many as its KV cache holds (`ServedPrefixes`);
the router adds the keys of every request it sends, so a conversation's next turn finds its replica before the
next report (`PrefixIndex`)."""
from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from deployments.placement.autoscaling import interpolate
from deployments.wire import GenerateCall, RoutingStats

CHUNK_CHARS = 256  # prompt characters per prefix key (about 64 tokens)
OUTPUT_TOKENS_GUESS = 128  # a request without max_tokens is counted as this long
OUTPUT_TOKENS_CAP = 512  # ... and none as longer: a long max_tokens is an upper bound, not an estimate
# what a replica that has not reported yet is assumed to do: every replica starts equal on these, so only the
# prefix cache and the queue tell fresh replicas apart
DEFAULT_SPEED = 20.0  # tokens per second of one request alone
DEFAULT_SLOWDOWN_PER_REQUEST = 0.05  # each further request in the batch slows each one by this fraction
DEFAULT_PREFILL_S_PER_TOKEN = 2e-3
DEFAULT_CHARS_PER_TOKEN = 4.0


# ---- the request --------------------------------------------------------------------------------------------
def prefix_text(messages: list[tuple[str, str]] | None, prompt: str | list[int] | None) -> str:
    """The text prefix keys are computed on: each message's role and text, or the prompt (token ids as text)."""
    if messages is not None:
        return "".join(f"\x1e{role}\x1f{content}" for role, content in messages)
    return prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt or ())


def prefix_keys(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    """One key per full chunk of text, each a hash of everything before its end (stable across processes)."""
    keys, running = [], hashlib.blake2b(digest_size=8)
    for end in range(chunk, len(text) + 1, chunk):
        running.update(text[end - chunk:end].encode("utf-8", "surrogatepass"))
        keys.append(int.from_bytes(running.copy().digest(), "little", signed=True))
    return keys


@dataclass(frozen=True)
class RoutedRequest:
    """What the router knows of a request: its prefix keys, its size, and a replica to avoid (a retry's first)."""
    keys: list[int]
    prompt_chars: int
    prompt_tokens: int | None  # known for token-id prompts
    output_tokens: int
    avoid: str | None = None

    @classmethod
    def of(cls, call: GenerateCall, avoid: str | None = None) -> RoutedRequest:
        bound = call.output_tokens_bound
        return cls(prefix_keys(call.prefix_text), len(call.prefix_text),
                   len(call.prompt) if isinstance(call.prompt, list) else None,
                   min(OUTPUT_TOKENS_CAP, bound or OUTPUT_TOKENS_GUESS), avoid)


# ---- prefix memories ----------------------------------------------------------------------------------------
class ServedPrefixes:
    """A replica's most recently served prefix keys, at most `capacity` (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[int, None] = OrderedDict()

    def add(self, keys: list[int]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def snapshot(self) -> list[int]:
        return list(self.keys)


@dataclass
class _ReplicaPrefixes:
    reported: frozenset = frozenset()
    reported_at: float | None = None
    recent: dict[int, float] = field(default_factory=dict)  # key -> when the router sent a request with it


class PrefixIndex:
    """The router's view of which replica holds which prefix: each replica's last report, plus the keys of the
    requests sent to it in the last `recent_s` seconds (which its next reports will carry, or have dropped)."""

    def __init__(self, recent_s: float = 30.0) -> None:
        self.recent_s = recent_s
        self.replicas: dict[str, _ReplicaPrefixes] = {}

    def report(self, replica: str, keys: list[int], reported_at: float) -> None:
        entry = self.replicas.setdefault(replica, _ReplicaPrefixes())
        if entry.reported_at != reported_at:
            entry.reported, entry.reported_at = frozenset(keys), reported_at

    def sent(self, replica: str, keys: list[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        entry = self.replicas.setdefault(replica, _ReplicaPrefixes())
        entry.recent.update(dict.fromkeys(keys, now))
        if len(entry.recent) > 4 * max(64, len(entry.reported)):  # expire now and then, not on every call
            entry.recent = {k: t for k, t in entry.recent.items() if now - t <= self.recent_s}

    def matched(self, replica: str, keys: list[int], now: float | None = None) -> int:
        """How many of the leading keys the replica is believed to hold."""
        entry = self.replicas.get(replica)
        if entry is None:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        for k in keys:
            t = entry.recent.get(k)
            if k not in entry.reported and (t is None or now - t > self.recent_s):
                break
            n += 1
        return n

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)


# ---- the replica ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaEstimate:
    """One replica as the router weighs it: its load now and what its reports say it costs."""
    replica: str
    ongoing: int  # requests sent to it and not finished
    max_num_seqs: int = 16
    request_speed: dict[int, float] | None = None  # batch size -> tokens/s of one request (Policy.load.request_speed)
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    request_s: float | None = None  # measured: a request's mean time from acceptance to its last token
    backlog_s: float = 0.0  # prefill seconds queued on it, from the router's own account (PrefillBacklog)

    @classmethod
    def of(cls, replica: str, ongoing: int | None, stats: RoutingStats | None,
           backlog_s: float = 0.0) -> ReplicaEstimate:
        """From a replica's routing stats (None before its first report)."""
        if stats is None:
            return cls(replica, ongoing or 0, backlog_s=backlog_s)
        return cls(replica, ongoing if ongoing is not None else stats.ongoing, stats.max_num_seqs,
                   stats.request_speed or None, stats.prefill_s_per_token or DEFAULT_PREFILL_S_PER_TOKEN,
                   stats.chars_per_token or DEFAULT_CHARS_PER_TOKEN, stats.request_s, backlog_s)

    def speed(self, batch: int) -> float:
        """Tokens per second of one request in a batch of `batch`: the reported table, linear between its sizes."""
        if not self.request_speed:
            return DEFAULT_SPEED / (1 + DEFAULT_SLOWDOWN_PER_REQUEST * (batch - 1))
        return interpolate(self.request_speed, batch)


class PrefillBacklog:
    """The prefill seconds queued on each replica, as the router sent them: each request adds its expected
    prefill, and the account drains at one second per second (the replica works it off). It never exceeds the
    prefill of the requests still in flight there: a request that has finished has no prefill left, however
    slowly the account drained."""

    def __init__(self) -> None:
        self.queued: dict[str, tuple[float, float]] = {}  # replica -> (seconds queued, as of when)
        self.in_flight: dict[str, dict[str, list[float]]] = {}  # replica -> request key -> their prefill seconds

    def ahead(self, replica: str, now: float) -> float:
        seconds, since = self.queued.get(replica, (0.0, now))
        return max(0.0, seconds - (now - since))

    def add(self, replica: str, seconds: float, now: float, key: str = "") -> None:
        self.queued[replica] = (self.ahead(replica, now) + seconds, now)
        self.in_flight.setdefault(replica, {}).setdefault(key, []).append(seconds)

    def done(self, replica: str, now: float, key: str = "") -> None:
        requests = self.in_flight.get(replica, {})
        if requests.get(key):
            requests[key].pop()
            if not requests[key]:
                del requests[key]
        cap = sum(sum(v) for v in requests.values())
        self.queued[replica] = (min(self.ahead(replica, now), cap), now)

    def forget(self, replica: str) -> None:
        self.queued.pop(replica, None)
        self.in_flight.pop(replica, None)


@dataclass(frozen=True)
class Choice:
    replica: str
    latency_s: float
    cached_tokens: float
    prefill_s: float = 0.0  # of which its own prefill
    reason: str = "load"  # why it ranks where it does: "affinity" (its prefix cache), "load", "retry"


def expected_latency(request: RoutedRequest, replica: ReplicaEstimate,
                     matched_keys: int) -> tuple[float, float, float]:
    """(seconds, cached prompt tokens, its own prefill seconds) of the request on the replica (the module
    docstring's formula)."""
    cpt = replica.chars_per_token
    tokens = request.prompt_tokens if request.prompt_tokens is not None else request.prompt_chars / cpt
    cached = min(tokens, matched_keys * CHUNK_CHARS / cpt)
    prefill = (tokens - cached) * replica.prefill_s_per_token
    batch = replica.ongoing + 1
    decode = request.output_tokens / max(replica.speed(min(batch, replica.max_num_seqs)), 1e-9)
    beyond = batch - replica.max_num_seqs  # requests ahead of this one waiting for a slot, this one included
    wait = beyond * (replica.request_s or prefill + decode) / replica.max_num_seqs if beyond > 0 else 0.0
    return replica.backlog_s + prefill + decode + wait, cached, prefill


def pooled(replicas: list[ReplicaEstimate]) -> list[ReplicaEstimate]:
    """The replicas with one prefill cost and one speed table: the medians of what they report (see above)."""
    prefill = [r.prefill_s_per_token for r in replicas if r.prefill_s_per_token != DEFAULT_PREFILL_S_PER_TOKEN]
    tables = [r.request_speed for r in replicas if r.request_speed]
    sizes = sorted(set().union(*tables)) if tables else []
    table = {b: statistics.median(t[b] for t in tables if b in t) for b in sizes} or None
    p = statistics.median(prefill) if prefill else DEFAULT_PREFILL_S_PER_TOKEN
    return [replace(r, prefill_s_per_token=p, request_speed=table) for r in replicas]


def rank(request: RoutedRequest, replicas: list[ReplicaEstimate], matched: dict[str, int]) -> list[Choice]:
    """The replicas, best first. matched: replica -> leading prefix keys it holds. A retry's failed replica goes
    last. Ties go to the one with fewer requests, then to the order given (the caller shuffles)."""
    scored = []
    for i, r in enumerate(pooled(replicas)):
        latency, cached, prefill = expected_latency(request, r, matched.get(r.replica, 0))
        scored.append((r.replica == request.avoid, latency, r.ongoing, i, r.replica, cached, prefill))
    scored.sort()
    most_cached = max((s[5] for s in scored), default=0.0)
    choices = []
    for avoided, latency, _, _, replica, cached, prefill in scored:
        if request.avoid is not None and not avoided and not choices:
            reason = "retry"
        elif cached > 0 and cached >= most_cached and not math.isclose(cached, min(s[5] for s in scored)):
            reason = "affinity"
        else:
            reason = "load"
        choices.append(Choice(replica, latency, cached, prefill, reason))
    return choices
