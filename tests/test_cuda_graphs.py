"""Decode and verify steps in padded buckets (runtime/cuda_graphs.py), run eagerly on the CPU: everything a CUDA
graph replays except the capture itself. The padded steps give the eager steps' logits and greedy output (plain,
draft chains, token trees), every decode and verify step runs in a bucket laid out at start (none is added while
serving), a step reads nothing back to the host (a capture would fail there), and a failed capture turns graphs off
at start without failing a step."""
import logging

import pytest
import torch
from lossless import assert_greedy_equal
from transformers import AutoModelForCausalLM
from engines import PARAMS, PROMPTS, MixedPolicy, run_staggered
from host_reads import HostReads

from smartspec import LLM
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.cuda_graphs import GraphBackend, bucket_for
from smartspec.runtime.graph_buckets import Bucket, BucketLimits, plan_buckets
from smartspec.runtime.model_runner import ForwardItem, ModelRunner, prepare_step
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree


def make(path, spec=None):
    """The torch path (no CPU kernels), as on a GPU."""
    return LLM(path, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec, use_kernels=False,
               warmup_profile=False)


# the steps of a_step below: up to 16 rows, 8 tokens a row, 256 cache positions, trees
LIMITS = BucketLimits(max_rows=16, max_width=8, max_kv=256, block_size=4, trees=True)


def padded(llm):
    """The engine's runners (the target's and a draft model's) swapped for runners of padded steps, before any step,
    their buckets planned as the engine plans them."""
    eng = llm.engine
    eng.runner = ModelRunner(eng.model, eng.blocks, False, "cpu", step_graphs="padded",
                             bucket_limits=eng.bucket_limits())
    proposer = eng.speculation.proposer
    if hasattr(proposer, "runner"):
        proposer.runner = ModelRunner(proposer.model, proposer.blocks, False, "cpu", step_graphs="padded",
                                      bucket_limits=eng.bucket_limits(draft=True))
    return llm


def eager_widths(runner: ModelRunner) -> list[int]:
    """Records, from now on, the widest row of every step the runner's padded backend hands to its eager one."""
    backend, widths = runner.backend, []
    execute = backend.eager.execute

    def recorded(inputs, kv_caches):
        widths.append(int(torch.bincount(inputs.seq_of).max()))
        return execute(inputs, kv_caches)
    backend.eager.execute = recorded
    return widths


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
    backend = llm.engine.runner.backend
    laid_out, eager = dict(backend.steps), eager_widths(llm.engine.runner)
    assert set(laid_out) == set(backend.plan.buckets())
    got = run_staggered(llm, PROMPTS, PARAMS)
    assert backend.steps == laid_out  # nothing added while serving
    # every step ran in a bucket but those with a row wider than the widest (a prefill chunk)
    assert eager and min(eager) > backend.plan.widths[-1]
    buckets = backend.uses
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
    padded_runner = ModelRunner(llm.engine.model, eager.blocks, False, "cpu", step_graphs="padded",
                                bucket_limits=LIMITS)
    for runner in (eager, padded_runner):  # the same requests, prefilled in each runner's cache
        runner.blocks = BlockManager(eager.blocks.num_blocks, eager.blocks.block_size)
    want = eager.forward(a_step(eager, with_tree))
    got = padded_runner.forward(a_step(padded_runner, with_tree))
    assert Bucket(rows=4, width=8 if with_tree else 4, kv_width=128, trees=with_tree) in padded_runner.backend.uses
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
    runner = ModelRunner(llm.engine.model, llm.engine.blocks, False, "cpu", step_graphs="padded",
                         bucket_limits=LIMITS)
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

    plan = plan_buckets(LIMITS)
    assert plan.rows == (1, 2, 4, 8, 12, 16) and plan.widths == (1, 2, 4, 8) and plan.kv_widths == (128, 256)
    assert bucket_for(inputs([1, 1, 1]), plan) == Bucket(4, 1, 128, False)
    assert bucket_for(inputs([5, 1]), plan) == Bucket(2, 8, 128, False)
    assert bucket_for(inputs([9]), plan) is None  # a row wider than a verify step's: a prefill chunk, run eagerly
    assert bucket_for(inputs([1] * 17), plan) is None  # more rows than the scheduler runs
    long = BlockManager(1024, 4)
    r = Request("long", list(range(300)), SamplingParams())
    long.allocate(r, 300)
    assert bucket_for(prepare_step([ForwardItem(r, [7], 299, 1)], long), plan) is None  # past max_model_len


def test_a_failed_capture_turns_graphs_off_at_start_and_steps_run_eagerly(tiny_qwen, caplog):
    """On a CPU build, capture fails at its first CUDA call, at start: graphs are off before any step, and steps get
    the eager logits."""
    llm = make(tiny_qwen)
    eager = llm.engine.runner
    runner = ModelRunner(llm.engine.model, eager.blocks, False, "cpu", step_graphs="padded", bucket_limits=LIMITS)
    runner.backend = GraphBackend(runner.backend.eager, plan_buckets(LIMITS), eager.blocks.block_size,
                                  scratch_block=eager.blocks.num_blocks, capture=True)
    with caplog.at_level(logging.WARNING):
        runner.backend.warm_up(runner.kv_caches)
    assert "CUDA graphs turned off" in caplog.text
    assert not runner.backend.enabled and not runner.backend.steps and runner.padded_shapes is None
    items = a_step(runner, with_tree=False)
    want = runner.backend.eager.execute(prepare_step(items, runner.blocks), runner.kv_caches)
    torch.testing.assert_close(runner.forward(items), want, rtol=0, atol=0)


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
    # fed to the fit as the buckets' cells: 16 x 1, 16 x 2 and 16 x 3 (the widest rung is 1 + k_max, not a power of 2)
    assert {(max(r.ks), r.forward_tokens) for r in served} == {(0, 16), (1, 32), (2, 48)}


def test_a_wider_speculation_set_while_idle_gets_its_buckets(tiny_qwen, eager_outputs):
    """An engine started without speculation plans one-token rows; a speculation swapped in later (benchmarks do)
    plans its verify rows and trees then, so its steps run padded, not eagerly, and the output is the eager one."""
    from smartspec.policy import make_policy
    from smartspec.spec_decode.ngram import NgramProposer
    llm = padded(make(tiny_qwen))
    runner = llm.engine.runner
    assert runner.backend.plan.widths == (1,) and runner.backend.plan.trees == (False,)
    llm.engine.set_speculation(NgramProposer(4, 1), make_policy("fixed:3", 3), 3)
    plan = runner.backend.plan
    assert plan.widths[-1] == 4 and plan.trees[-1] and set(runner.backend.steps) == set(plan.buckets())
    got = run_staggered(llm, PROMPTS, PARAMS)
    assert any(b.width > 1 for b in runner.backend.uses)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    for prompt, ours, want in zip(PROMPTS, got, eager_outputs):
        assert_greedy_equal(ours, want, llm.engine.tokenize(prompt), ref)
