"""The benchmarks' comparisons: paired at equal box speed (smartspec.bench.report.plain_forward_ratio, paired_ratio),
and scripts/compare_peer.py's ratios to the peer taken within a cycle."""
import math

import pytest

from smartspec.bench.report import paired_ratio, plain_forward_ratio, speed_adjusted


def _step(batch: int, verify_s: float, proposed: int = 0, prefill: int = 0) -> dict:
    return {"batch_size": batch, "verify_s": verify_s, "proposed": [proposed] + [0] * (batch - 1),
            "num_prefill_tokens": prefill}


def test_plain_forward_ratio_compares_plain_steps_of_equal_batch_size_only():
    slow = [_step(2, 0.2)] * 5 + [_step(4, 0.3)] * 3 + [_step(1, 9.0, proposed=3)] * 4 + [_step(2, 5.0, prefill=90)] * 4
    fast = [_step(2, 0.1)] * 6 + [_step(4, 0.15)] * 4 + [_step(3, 0.01)] * 5 + [_step(1, 0.01, proposed=3)] * 4
    ratio, compared = plain_forward_ratio(slow, fast)
    assert ratio == pytest.approx(2.0)  # drafting and prefill steps, and sizes only one run has, are left out
    assert compared == 5 + 3  # per size, the smaller of the two counts
    inverse, _ = plain_forward_ratio(fast, slow)
    assert inverse == pytest.approx(0.5)


def test_plain_forward_ratio_weights_sizes_by_steps_and_needs_enough_of_them():
    a = [_step(2, 0.2)] * 9 + [_step(5, 0.4)] * 3
    b = [_step(2, 0.1)] * 9 + [_step(5, 0.4)] * 3
    ratio, _ = plain_forward_ratio(a, b)
    assert ratio == pytest.approx(math.exp((9 * math.log(2.0) + 3 * 0.0) / 12))
    assert plain_forward_ratio(a[:2], b) is None  # two steps of size 2 are too few to compare
    assert plain_forward_ratio([_step(1, 0.1)] * 5, [_step(2, 0.1)] * 5) is None  # no shared size


def test_paired_ratio_is_a_geometric_mean_with_its_standard_error():
    mean, se = paired_ratio([2.0, 0.5])
    assert mean == pytest.approx(1.0)
    assert se == pytest.approx(math.log(2.0))  # sd of (ln 2, -ln 2) is ln 2 * sqrt 2; over sqrt 2 repeats
    assert paired_ratio([1.1]) == (pytest.approx(1.1), 0.0)


def test_speed_adjusted_reads_the_ratio_where_both_runs_ran_equally_fast():
    speeds = [0.8, 0.9, 1.1, 1.25, 1.3]
    ratios = [1.02 * s ** 0.5 for s in speeds]  # a policy 2% slower, on a box whose speed it half follows
    at_speed, se, slope = speed_adjusted(ratios, speeds)
    assert at_speed == pytest.approx(1.02) and slope == pytest.approx(0.5)
    assert se == pytest.approx(0.0, abs=1e-9)
    noisy = [r * (1.03 if i % 2 else 0.97) for i, r in enumerate(ratios)]
    assert speed_adjusted(noisy, speeds)[1] > 0.005  # scatter off the line is the estimate's error
    assert speed_adjusted(ratios[:2], speeds[:2]) is None  # two repeats cannot fit a line and its error


def test_the_latency_plot_leaves_out_configurations_whose_requests_all_failed(tmp_path):
    from smartspec.bench.report import plot_latency_vs_rate, summarise

    ok = summarise([{"output_tokens": 4, "latency_s": 1.0, "ttft_s": 0.1, "tpot_s": 0.3}], "ours", 0.0, 1.0)
    failed = summarise([{"error": "400: no model"}], "peer", 0.0, 1.0)
    assert failed["latency_s_mean"] is None
    # pooled summaries (sweep_serving.py --pool) hold NaN there, or lack the column when no run of it succeeded
    pooled = [{**ok, "label": "pooled", "latency_s_mean": float("nan")},
              {k: v for k, v in failed.items() if k != "latency_s_mean"}]
    plot_latency_vs_rate([ok, failed, *pooled], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def _compare_peer():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import compare_peer
    return compare_peer


def _compare_rows(mode, cycle, seconds_per_token, texts=("a", "b", "c", "d"), load="one stream"):
    """One one-stream round and one 4-in-flight run of the four prompts, 10 tokens each."""
    alone = [{"cycle": cycle, "round": 1, "mode": mode, "load": load, "prompt": p, "tag": f"t{p}", "tokens": 10,
              "latency_s": 10 * seconds_per_token, "text": texts[p]} for p in range(4)]
    loaded = [{"cycle": cycle, "round": 1, "mode": mode, "load": "4 in flight", "prompt": p, "tokens": 10,
               "latency_s": 1.0, "wall_s": 20 * seconds_per_token, "text": ""} for p in range(4)]
    return alone + loaded


def test_compare_peer_takes_each_ratio_within_a_cycle_and_pools_the_cycles():
    """The box is twice as fast in cycle 2: our 1.5x holds in both cycles, so the pooled ratio is 1.5 with no
    spread, while the pooled tok/s carry the drift."""
    compare_peer = _compare_peer()
    rows = (_compare_rows("llama.cpp plain", 1, 0.1) + _compare_rows("ours", 1, 0.1 / 1.5)
            + _compare_rows("llama.cpp plain", 2, 0.05) + _compare_rows("ours", 2, 0.05 / 1.5))
    lines, figures = compare_peer.summarize(rows, "llama.cpp plain")
    assert figures["ours"]["one stream"]["ratio"] == pytest.approx(1.5)
    assert figures["ours"]["one stream"]["ratio_se"] == pytest.approx(0.0, abs=1e-12)
    assert figures["ours"]["one stream"]["tok_s"] == pytest.approx((15 + 30) / 2)
    assert figures["ours"]["4 in flight"]["ratio"] == pytest.approx(1.5)  # 40 tokens over the wall time
    assert figures["llama.cpp plain"]["4 in flight"]["tok_s"] == pytest.approx((20 + 40) / 2)
    assert "ratio" not in figures["llama.cpp plain"]["one stream"]
    assert any(line.startswith("| ours | ") and "1.50x" in line for line in lines)


def test_compare_peer_counts_a_speculated_answer_that_differs_from_plain_decode():
    compare_peer = _compare_peer()
    plan = [{"label": "ours", "kind": "ours", "modes": [("ours", None), ("ours, max_k 0", 0)]}]
    checked = _compare_rows("ours", 1, 0.1, texts=("a", "b", "x", "d"), load=compare_peer.CHECK)
    rows = _compare_rows("ours, max_k 0", 1, 0.1) + _compare_rows("ours", 1, 0.1) + checked
    assert compare_peer.greedy_equal(rows, plan) == ["ours: greedy answers equal to max_k 0's in 3 of 4 requests"]


def test_compare_peer_takes_the_first_round_over_the_steady_within_each_cycle():
    """Per prompt, cycle 1's first round takes 1.25x its steady round's time, cycle 2's (on a box twice as fast)
    1.0x, and the short answer's twice that: each cycle's ratio within the cycle, then pooled."""
    compare_peer = _compare_peer()
    plan = [{"label": "ours", "kind": "ours", "modes": [("ours", None), ("ours, max_k 0", 0)]}]
    first = "ours, " + compare_peer.FIRST
    rows = (_compare_rows("ours", 1, 0.1)[:4] + _compare_rows(first, 1, 0.1 / 0.8)[:4]
            + _compare_rows("ours", 2, 0.05)[:4] + _compare_rows(first, 2, 0.05)[:4])
    rows = [{**r, "round": 0} if r["mode"] == first else r for r in rows]
    rows = [{**r, "latency_s": 2 * r["latency_s"]} if r["mode"] == first and r["prompt"] == 1 else r for r in rows]
    [line] = compare_peer.first_round_ratios(rows, plan)
    assert line.startswith("ours: first round / steady, one stream: 0.72x ± 0.08 (cycles: 0.64, 0.80; ")
    assert line.endswith("per prompt: edit 0.90x, short answer 0.45x, code 0.90x, long prompt 0.90x)")
