"""speculative_config, in the ecosystem's shape: {"method", "model", "num_speculative_tokens", ...}."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from smartspec.policy.base import Policy
from smartspec.policy.factory import make_policy
from smartspec.types.numbers import is_int
from smartspec.types.tree import MAX_TREE_NODES

METHODS = ("draft_model", "ngram", "suffix")
MIXES = ({"draft_model", "suffix"},)  # proposers that can be chosen per request


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
            if not is_int(v) or v < 1:
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


DRAFT_QUANTIZATIONS = (None, "gguf", "gguf_exact", "gguf_q4")  # models/loader.py: QUANTIZATIONS

@dataclass
class SpeculativeConfig:
    """How requests speculate: the proposer, k_max, the policy that picks each request's k, and where a served draft
    model runs. One type for the offline engine and the Serve application; parse() takes a user's dict."""
    # "draft_model", "ngram" (prompt lookup), "suffix" (suffix speculation), or ["draft_model", "suffix"]: the
    # proposer chosen per request and step; parse() reads "none" as no speculation
    method: str | list[str] = "draft_model"
    model: str | None = "qwen2.5-coder-0.5b"  # the draft model, for method "draft_model" (same tokenizer as target)
    # the draft model's quantization (models/loader.py): None, the target's; "gguf_q4", its GGUF blocks re-quantized
    # to 4 bits at load, a cheaper draft token on a CPU bound by memory bandwidth
    draft_quantization: str | None = None
    num_speculative_tokens: int = 4  # the most any request speculates in one step: k_max below, in code
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # "smartspec" (goodput), "off", "fixed" (k = k_max), "fixed:K", "batch_table", or a Policy instance
    policy: str | Policy = "smartspec"
    batch_table: dict[int, int] | None = None  # for policy "batch_table": {batch size: k}
    policy_options: dict | None = None  # for policy "smartspec": GoodputOptions' fields by name
    tree: TreeConfig | dict | None = None  # token trees instead of chains
    # Served only (the offline engine runs the draft in-process): the draft model in its own Ray actor, restarted
    # if it dies, with these Ray CPUs and torch threads (None: the replica's num_threads)
    draft_actor: bool = True
    draft_num_cpus: float = 0.25
    draft_num_threads: int | None = None
    suffix_cache_tokens: int = 65536  # method "suffix": the most tokens of finished outputs it looks up in
    # the drafts requests carry (spec_decode/hints.py): tokens a grammar forces, a predicted output's continuation
    request_hints: bool = True

    def __post_init__(self) -> None:
        self.tree = TreeConfig.parse(self.tree)
        if isinstance(self.method, (list, tuple)):
            if len(self.method) == 1:
                self.method = self.method[0]
            elif set(self.method) in MIXES and len(self.method) == len(set(self.method)):
                self.method = sorted(self.method)
            else:
                raise ValueError(f"speculative methods can be mixed as {[sorted(m) for m in MIXES]}, got "
                                 f"{self.method!r}")
        if isinstance(self.method, list):
            if self.tree:
                raise ValueError(f"speculative method {self.method} drafts chains: 'tree' is not supported with it")
        elif self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, a list of {[sorted(m) for m in MIXES]} "
                             f"(or 'none'), got {self.method!r}")
        if "draft_model" in self.all_methods and not self.model:
            raise ValueError("speculative method 'draft_model' needs speculation.model (the draft model)")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {DRAFT_QUANTIZATIONS}, "
                             f"got {self.draft_quantization!r}")
        if not is_int(self.suffix_cache_tokens) or self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be an integer >= 0, got {self.suffix_cache_tokens!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        if not isinstance(self.policy, (str, Policy)):
            raise ValueError(f"policy must be a name or a Policy, got {type(self.policy).__name__}")
        if not isinstance(self.request_hints, bool):
            raise ValueError(f"request_hints must be true or false, got {self.request_hints!r}")
        if not isinstance(self.draft_actor, bool):
            raise ValueError(f"draft_actor must be true or false, got {self.draft_actor!r}")
        if isinstance(self.draft_num_cpus, bool) or not isinstance(self.draft_num_cpus, (int, float)) \
                or not self.draft_num_cpus > 0:
            raise ValueError(f"draft_num_cpus must be a number > 0, got {self.draft_num_cpus!r}")
        if self.draft_num_threads is not None and not (is_int(self.draft_num_threads) and self.draft_num_threads >= 1):
            raise ValueError(f"draft_num_threads must be an integer >= 1, got {self.draft_num_threads!r}")
        self.make_policy()  # names and options checked now

    def make_policy(self) -> Policy:
        """The policy this config names, built with its table, options, prior key and tree depth."""
        drafts_trees = self.tree is not None and self.method in ("draft_model", "ngram")
        return make_policy(self.policy, self.k_max, self.batch_table, key=self.key, options=self.policy_options,
                           tree_depth=self.tree.max_depth if drafts_trees else None)

    @property
    def all_methods(self) -> tuple[str, ...]:
        return tuple(self.method) if isinstance(self.method, list) else (self.method,)

    @property
    def methods(self) -> tuple[str, ...]:
        """The proposers chosen per request; () for one proposer."""
        return tuple(self.method) if isinstance(self.method, list) else ()

    def single(self, method: str) -> SpeculativeConfig:
        """This config with one of its proposers alone."""
        return replace(self, method=method, tree=asdict(self.tree) if self.tree else None)

    def draft_only(self) -> SpeculativeConfig:
        """The draft model's part of this config, as it travels to a draft actor: no policy object (a policy
        instance may not be importable there, and the draft needs none)."""
        return replace(self, method="draft_model", policy="off", batch_table=None, policy_options=None,
                       tree=asdict(self.tree) if self.tree else None)

    @property
    def k_max(self) -> int:
        """The most any request speculates in one step: draft tokens for chains, nodes for trees. The one place the
        public num_speculative_tokens (and a tree's size) becomes the code's k_max."""
        return self.tree.max_nodes if self.tree else self.num_speculative_tokens

    @property
    def max_depth(self) -> int:
        """The longest draft path: a tree's depth, or a chain's k_max."""
        return self.tree.max_depth if self.tree else self.num_speculative_tokens

    @property
    def key(self) -> str:
        """What acceptance priors are shared by: the proposer and, for a draft model, which one."""
        if self.methods:
            return "+".join(f"{m}:{self.model}" if m == "draft_model" else m for m in self.methods)
        key = f"{self.method}:{self.model}" if self.method == "draft_model" else self.method
        if self.method == "draft_model" and self.draft_quantization:  # another draft's acceptance
            key = f"{key}:{self.draft_quantization}"
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
        out["method"] = list(self.method) if isinstance(self.method, list) else self.method
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

