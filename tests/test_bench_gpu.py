"""scripts/bench_gpu.py end to end on the CPU with tiny shapes: the models it builds, every row of its table, its
lossless check, the raw results and the plot. (Its speed figures are a GPU's to give.)"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gpu  # noqa: E402


def test_the_gpu_benchmark_runs_on_a_cpu_with_tiny_shapes(tmp_path, capsys):
    assert bench_gpu.main(["--device", "cpu", "--tiny", "--batches", "1,2", "--max-new", "12", "--cap-s", "0.5",
                           "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert (tmp_path / "bench_gpu.png").stat().st_size > 0
    assert results["dtype"] == "float32" and results["backend"] == "transformers-modules"  # no graphs on a CPU
    for b in (1, 2):
        for name in ("off", "fixed:4", "smartspec", "transformers generate"):
            assert results["runs"][f"b={b} {name}"]["steady_tok_s"] > 0, (b, name)
        assert results["runs"][f"b={b} fixed:4"]["mean_k"] > 0 and results["runs"][f"b={b} off"]["mean_k"] == 0
        for name in ("off", "fixed:4", "smartspec"):  # interleaved repeats after a warm-up: no capture timed
            run = results["runs"][f"b={b} {name}"]
            assert run["repeats"] == 2 and len(run["vs_off_each"]) == 2 and run["captures"] == 0
            assert run["tok_s_min"] <= run["steady_tok_s"] <= run["tok_s_max"]
        assert results["runs"][f"b={b} off"]["vs_off"] == 1.0
    greedy = results["lossless"]["float32"]
    assert set(results["lossless"]) == {"float32"} and greedy["wrong"] == 0  # a parting is a proven near-tie
    assert greedy["equal"] + greedy["near_ties"] == 8
    assert results["sampled"]["chain_repeats"] and results["sampled"]["tree_repeats"]  # seeded: the same tokens
    assert results["step_cost"]["verify_ms"] > 0 and results["cost_model"]["predicted_ms"]
    assert 0.0 <= results["built"]["agreement"] <= 1.0
    table = capsys.readouterr().out
    assert "b=2 smartspec" in table and "verify 5 tokens of one stream" in table


def test_a_gpu_asked_for_where_there_is_none_is_a_clear_error(capsys):
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        bench_gpu.main(["--device", "cuda"])
    assert "torch sees no GPU" in capsys.readouterr().err


def test_the_lossless_check_calls_a_token_far_from_the_top_wrong(tmp_path):
    """The diagnosis itself: outputs that part where the two tokens' logits are far apart are a wrong token."""
    import torch
    from transformers import AutoModelForCausalLM

    class Args:
        tiny, device, seed, agreement = True, "cpu", 0, 0.9

    built = bench_gpu.build(Args, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(built["target"]).eval()
    prompt = list(range(40, 57))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    report = bench_gpu.lossless(built["target"], "cpu", "float32", [prompt, prompt], [[best, 5], [best, 5]],
                                [[best, 5], [worst, 5]])
    assert report["equal"] == 1 and report["wrong"] == 1 and report["near_ties"] == 0
    assert report["partings"][0]["at"] == 0 and report["partings"][0]["tokens"] == [best, worst]
