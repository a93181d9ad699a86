"""The one place proposers are built, for the engine, the serving replica and the draft actor alike."""
from __future__ import annotations

from collections.abc import Callable

from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.draft_runtime import DraftRuntime
from smartspec.spec_decode.proposer import Proposer


# builds the draft model's proposer for a single-method draft_model config: in-process by default; the serving
# replica passes one that runs it in a Ray actor
DraftFactory = Callable[[SpeculativeConfig, DraftRuntime], Proposer]


def make_draft_proposer(spec: SpeculativeConfig, runtime: DraftRuntime) -> Proposer:
    """The draft model in this process: chains, or token trees when the config asks for them."""
    if spec.tree:
        from smartspec.spec_decode.draft_tree import DraftTreeProposer
        return DraftTreeProposer(spec.model, runtime, spec.draft_quantization, max_depth=spec.tree.max_depth,
                                 branching=spec.tree.branching)
    from smartspec.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(spec.model, runtime, spec.draft_quantization)


def make_proposer(spec: SpeculativeConfig, runtime: DraftRuntime,
                  draft_factory: DraftFactory = make_draft_proposer) -> Proposer:
    """The proposer a speculative config names. runtime: the draft's build options (used by draft models only)."""
    if spec.methods:  # several proposers, chosen per request
        from smartspec.spec_decode.mixed import MixedProposer
        return MixedProposer(make_proposer(spec.single("draft_model"), runtime, draft_factory),
                             make_proposer(spec.single("suffix"), runtime, draft_factory))
    if spec.method == "suffix":
        from smartspec.spec_decode.suffix import SuffixProposer
        return SuffixProposer(spec.max_depth, spec.tree.branching if spec.tree else 1, spec.suffix_cache_tokens)
    if spec.method == "ngram":
        from smartspec.spec_decode.ngram import NgramProposer, NgramTreeProposer
        if spec.tree:
            return NgramTreeProposer(spec.tree.max_depth, spec.tree.branching, spec.prompt_lookup_max,
                                     spec.prompt_lookup_min)
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    return draft_factory(spec, runtime)


def draft_blocks(spec: SpeculativeConfig, target_blocks: int, max_num_seqs: int, blocks_for) -> int:
    """The draft's KV cache: what the target holds, plus k drafts per running request (a tree's draft also holds
    the nodes it fed: branching per depth). blocks_for(tokens) -> blocks."""
    per_seq = max(spec.k_max, spec.tree.branching * (spec.tree.max_depth - 1) if spec.tree else 0) + 1
    return target_blocks + max_num_seqs * blocks_for(per_seq)
