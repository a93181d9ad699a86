"""speculative_config, in the ecosystem's shape: {"method", "model", "num_speculative_tokens", ...}."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from smartspec.policy.base import Policy
from smartspec.policy.factory import make_policy
from smartspec.spec_decode.tree import MAX_TREE_NODES

METHODS = ("draft_model", "ngram")


@dataclass
class TreeConfig:
    """Token-tree speculation: each request gets up to max_nodes nodes (its k is a node budget), at most
    max_depth deep, at most `branching` children per node."""
    max_nodes: int = 8
    max_depth: int = 4
    branching: int = 2

    def __post_init__(self) -> None:
        for name in ("max_nodes", "max_depth", "branching"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"tree.{name} must be an integer >= 1, got {v!r}")
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree.max_nodes must be at most {MAX_TREE_NODES} (one 64-bit mask per token with the "
                             f"root), got {self.max_nodes}")
        if self.branching * (self.max_depth - 1) > MAX_TREE_NODES - 1:
            raise ValueError(f"tree.branching * (tree.max_depth - 1) must be at most {MAX_TREE_NODES - 1} (the draft "
                             f"feeds that many nodes per request), got {self.branching} * {self.max_depth - 1}")

    @classmethod
    def parse(cls, value: TreeConfig | dict | None) -> TreeConfig | None:
        return _from_dict(cls, value, "speculative_config['tree']", "tree")


@dataclass
class SpeculativeConfig:
    """How requests speculate: the proposer, K, the policy that picks each request's k, and where a served draft
    model runs. One type for the offline engine and the Serve application; parse() takes a user's dict."""
    method: str = "draft_model"  # "draft_model" or "ngram" (prompt lookup); parse() reads "none" as no speculation
    model: str | None = "qwen2.5-coder-0.5b"  # the draft model, for method "draft_model" (same tokenizer as target)
    num_speculative_tokens: int = 4  # K: the most any request speculates in one step
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # "smartspec" (goodput), "off", "fixed" (k = K), "fixed:K", "batch_table", or a Policy instance
    policy: str | Policy = "smartspec"
    batch_table: dict[int, int] | None = None  # for policy "batch_table": {batch size: k}
    policy_options: dict | None = None  # for policy "smartspec": GoodputPolicy's keyword arguments
    tree: TreeConfig | dict | None = None  # token trees instead of chains
    # Served only (the offline engine runs the draft in-process): the draft model in its own Ray actor, restarted
    # if it dies, with these Ray CPUs and torch threads (None: the replica's num_threads)
    draft_actor: bool = True
    draft_num_cpus: float = 0.25
    draft_num_threads: int | None = None

    def __post_init__(self) -> None:
        self.tree = TreeConfig.parse(self.tree)
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS} (or 'none'), got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs speculation.model (the draft model)")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        if not isinstance(self.policy, (str, Policy)):
            raise ValueError(f"policy must be a name or a Policy, got {type(self.policy).__name__}")
        if not isinstance(self.draft_actor, bool):
            raise ValueError(f"draft_actor must be true or false, got {self.draft_actor!r}")
        if isinstance(self.draft_num_cpus, bool) or not isinstance(self.draft_num_cpus, (int, float)) \
                or not self.draft_num_cpus > 0:
            raise ValueError(f"draft_num_cpus must be a number > 0, got {self.draft_num_cpus!r}")
        if self.draft_num_threads is not None and not (_is_int(self.draft_num_threads) and self.draft_num_threads >= 1):
            raise ValueError(f"draft_num_threads must be an integer >= 1, got {self.draft_num_threads!r}")
        self.make_policy()  # names and options checked now

    def make_policy(self) -> Policy:
        """The policy this config names, built with its table, options, prior key and tree depth."""
        return make_policy(self.policy, self.k_max, self.batch_table, key=self.key, options=self.policy_options,
                           tree_depth=self.tree.max_depth if self.tree else None)

    @property
    def k_max(self) -> int:
        """The most any request speculates in one step: draft tokens for chains, nodes for trees."""
        return self.tree.max_nodes if self.tree else self.num_speculative_tokens

    @property
    def key(self) -> str:
        """What acceptance priors are shared by: the proposer and, for a draft model, which one."""
        key = f"{self.method}:{self.model}" if self.method == "draft_model" else self.method
        return f"{key}:tree" if self.tree else key

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """None, or a dict whose method is "none", means no speculation."""
        if isinstance(value, dict) and value.get("method") == "none":
            return None
        return _from_dict(cls, value, "speculative_config", "speculative_config")

    def as_dict(self) -> dict:
        """The config as a user would write it (a Policy instance stays an object)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tree"] = asdict(self.tree) if self.tree else None
        return out


def _from_dict(cls, value, name: str, keys_of: str):
    """A config dataclass from a user's dict, with unknown keys named (or the instance / None as given)."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {keys_of} keys {unknown}; known: {sorted(known)}")
    return cls(**value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
