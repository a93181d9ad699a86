"""Decode and verify steps in padded buckets (runtime/cuda_graphs.py), run eagerly on the CPU: everything a CUDA
graph replays except the capture itself. The padded steps give the eager steps' logits and greedy output (plain,
draft chains, token trees), read nothing back to the host inside a step (a capture would fail there), and a failed
capture turns graphs off without failing the step."""
import logging

import pytest
import torch
from lossless import assert_greedy_equal
from transformers import AutoModelForCausalLM
from engines import PARAMS, PROMPTS, MixedPolicy, run_staggered
from host_reads import HostReads

from smartspec import LLM
from smartspec.engine import profile
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.cuda_graphs import GRAPH_SHAPES, Bucket, GraphBackend, bucket_for
from smartspec.runtime.model_runner import ForwardItem, ModelRunner, prepare_step
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree


def make(path, spec=None):
    """The torch path (no CPU kernels), as on a GPU."""
    return LLM(path, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec, use_kernels=False,
               warmup_profile=False)


def padded(llm):
    """The engine's runners (the target's and a draft model's) swapped for runners of padded steps, before any step."""
    eng = llm.engine
    eng.runner = ModelRunner(eng.model, eng.blocks, False, "cpu", step_graphs="padded")
    proposer = eng.speculation.proposer
    if hasattr(proposer, "runner"):
        proposer.runner = ModelRunner(proposer.model, proposer.blocks, False, "cpu", step_graphs="padded")
    return llm


@pytest.fixture(scope="module")
def eager_outputs(tiny_qwen):
    return run_staggered(make(tiny_qwen), PROMPTS, PARAMS)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "self-tree"])
def test_padded_steps_give_the_eager_greedy_output(method, tiny_qwen, tiny_qwen_draft, eager_outputs):
    spec = None
    if method != "plain":
        spec = {"method": method, "num_speculative_tokens": 4, "policy": MixedPolicy()}
    if method in ("draft_model", "self-tree"):
        spec.update(method="draft_model", model=tiny_qwen_draft if method == "draft_model" else tiny_qwen)
    if method == "self-tree":
        spec["tree"] = {"max_nodes": 8, "max_depth": 3, "branching": 2}
    llm = padded(make(tiny_qwen, spec))
    got = run_staggered(llm, PROMPTS, PARAMS)
    buckets = llm.engine.runner.backend.steps
    assert buckets and all(b.rows * b.width <= GRAPH_SHAPES.max_cells for b in buckets)
    if method == "self-tree":
        assert any(b.trees for b in buckets)
        assert llm.engine.speculation.metrics.accepted_per_position[2] > 0  # deep tree paths were verified
    if method != "plain":
        assert any(b.width > 1 for b in buckets)  # verify steps went through the padded path
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    for prompt, ours, want in zip(PROMPTS, got, eager_outputs):
        assert_greedy_equal(ours, want, llm.engine.tokenize(prompt), ref)


def a_step(runner: ModelRunner, with_tree: bool) -> list[ForwardItem]:
    """Prefilled requests, then one step of decodes, a chain and (optionally) a token tree."""
    items = []
    for i, context in enumerate((5, 11, 30)):
        r = Request(f"r{i}", list(range(3, 3 + context + 8)), SamplingParams())
        runner.blocks.allocate(r, context + 8)
        runner.forward([ForwardItem(r, r.token_ids[:context], 0, 1)])
        items.append((r, context))
    step = [ForwardItem(items[0][0], [40], 5, 1), ForwardItem(items[1][0], [41, 42, 43, 44], 11, 4)]
    r, c = items[2]
    if with_tree:
        tree = TokenTree([50, 51, 52, 53], [-1, -1, 0, 2], [0.5] * 4)
        step.append(ForwardItem(r, [45] + tree.tokens, c, 5, positions=[c] + [c + d for d in tree.depths()],
                                tree_base=c, tree_masks=tree.ancestor_masks()))
    else:
        step.append(ForwardItem(r, [45], c, 1))
    return step


@pytest.mark.parametrize("with_tree", [False, True])
def test_a_padded_step_gives_the_eager_logits(tiny_qwen, with_tree):
    llm = make(tiny_qwen)
    eager = llm.engine.runner
    padded_runner = ModelRunner(llm.engine.model, eager.blocks, False, "cpu", step_graphs="padded")
    for runner in (eager, padded_runner):  # the same requests, prefilled in each runner's cache
        runner.blocks = BlockManager(eager.blocks.num_blocks, eager.blocks.block_size)
    want = eager.forward(a_step(eager, with_tree))
    got = padded_runner.forward(a_step(padded_runner, with_tree))
    assert Bucket(rows=4, width=8 if with_tree else 4, kv_width=128, trees=with_tree) in padded_runner.backend.steps
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_detector_sees_host_reads():
    with HostReads() as reads:
        x = torch.arange(4.0)
        x.sum().item()
        _ = x[x > 1]
    assert "_local_scalar_dense" in reads.seen and "index" in reads.seen


@pytest.mark.parametrize("with_tree", [False, True])
def test_a_padded_step_reads_nothing_back_to_the_host(tiny_qwen, with_tree):
    llm = make(tiny_qwen)
    runner = ModelRunner(llm.engine.model, llm.engine.blocks, False, "cpu", step_graphs="padded")
    runner.forward(a_step(runner, with_tree))
    step = runner.backend.steps[Bucket(rows=4, width=8 if with_tree else 4, kv_width=128, trees=with_tree)]
    with torch.inference_mode(), HostReads() as reads:
        step.forward()
    assert reads.seen == []


def test_buckets():
    def inputs(lengths, tree=False):
        bm = BlockManager(1024, 4)
        items = []
        for i, n in enumerate(lengths):
            r = Request(f"b{i}", list(range(20 + n)), SamplingParams())
            bm.allocate(r, 20 + n)
            items.append(ForwardItem(r, r.token_ids[20:], 20, n))
        return prepare_step(items, bm)

    assert bucket_for(inputs([1, 1, 1]), 4, 256) == Bucket(4, 1, 128, False)
    assert bucket_for(inputs([5, 1]), 4, 256) == Bucket(2, 8, 128, False)
    assert bucket_for(inputs([65]), 4, 256) is None  # a prefill chunk runs eagerly
    assert bucket_for(inputs([40] * 33), 4, 256) is None  # 48 rows x 64 wide: past the largest bucket's cells
    assert bucket_for(inputs([1]), 4, 16) is None  # past the cache the runner holds


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(tiny_qwen, caplog):
    """On a CPU build, capture fails at its first CUDA call: the step still gets the eager logits, and later steps
    do not try again."""
    llm = make(tiny_qwen)
    eager = llm.engine.runner
    runner = ModelRunner(llm.engine.model, eager.blocks, False, "cpu", step_graphs="padded")
    runner.backend = GraphBackend(runner.backend.eager, eager.blocks.block_size, scratch_block=eager.blocks.num_blocks,
                                  max_kv_width=eager.blocks.num_blocks * eager.blocks.block_size, capture=True)
    items = a_step(runner, with_tree=False)
    want = runner.backend.eager.execute(prepare_step(items, runner.blocks), runner.kv_caches)
    with caplog.at_level(logging.WARNING):
        got = runner.forward(items)
    assert "CUDA graphs turned off" in caplog.text
    assert not runner.backend.enabled and not runner.backend.steps
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class CountingRunner(ModelRunner):
    """A CPU runner that says it captures graphs (or not), and counts its forwards."""

    def __init__(self, *args, captures: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.captures, self.forwards = captures, 0

    @property
    def captures_graphs(self) -> bool:
        return self.captures

    def forward(self, items):
        self.forwards += 1
        return super().forward(items)


def test_the_warm_up_profile_measures_a_capturing_runner_on_its_second_pass(tiny_qwen, monkeypatch):
    """A shape's first step on a capturing runner includes its capture: the profile runs every shape twice there,
    and hands the cost model the second pass only (as many records as one pass, twice the forwards). The warm-up
    request before the shapes is not counted: its steps depend on what its prompt's drafts happen to accept."""
    warm_up = profile.warm_up_forwards

    def profiled(captures: bool):
        llm = LLM(tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256, warmup_profile=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2, "policy": "smartspec"})
        eng = llm.engine
        eng.runner = CountingRunner(eng.model, eng.blocks, True, "cpu", captures=captures)
        warm_up_forwards = []

        def counted_warm_up(engine, context=64):
            before = engine.runner.forwards
            steps = warm_up(engine, context)
            warm_up_forwards.append(engine.runner.forwards - before)
            return steps
        monkeypatch.setattr(profile, "warm_up_forwards", counted_warm_up)
        records = eng.profile_steps(batches=(1, 2))
        assert len(warm_up_forwards) == 1
        return records, eng.runner.forwards - warm_up_forwards[0]

    once, forwards_once = profiled(False)
    twice, forwards_twice = profiled(True)
    assert len(once) == len(twice) > 0
    assert forwards_twice == 2 * forwards_once


def test_a_padded_runner_is_profiled_up_to_the_batch_it_serves(tiny_qwen):
    """Padded steps cost their bucket's cells, and a 16-row bucket is one that batches 1 and 4 never ran: on a padded
    runner the warm-up profile also runs the served batch (max_num_seqs), drafting, so the cost fit has measured
    what drafting costs there. An unpadded runner keeps the two small batches."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "policy": "smartspec"}

    def profiled(pad: bool):
        llm = LLM(tiny_qwen, num_kv_blocks=512, block_size=4, max_model_len=256, max_num_seqs=16,
                  speculative_config=spec, use_kernels=False, warmup_profile=False)
        if pad:
            padded(llm)
        return llm.engine.profile_batches(), llm.engine.profile_steps()

    unpadded_batches, unpadded_records = profiled(False)
    batches, records = profiled(True)
    assert unpadded_batches == (1, 4) and max(r.batch_size for r in unpadded_records) == 4
    assert batches == (1, 4, 16)
    served = [r for r in records if r.batch_size == 16]
    assert {max(r.ks) for r in served} == {0, 1, 2}  # every profiled k at the served batch
    # fed to the fit as the buckets' cells: 16 x 1, 16 x 2, and 16 x 4 for a row of 3 tokens
    assert {(max(r.ks), r.forward_tokens) for r in served} == {(0, 16), (1, 32), (2, 64)}
