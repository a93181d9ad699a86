"""scripts/bench_gpu.py end to end on the CPU with tiny shapes: the models it builds, every row of its table, the
raw results and the plot. (Its figures are a GPU's to give; lossless equality is tested in test_cuda_graphs.py and
test_speculative.py, with near-ties proven.)"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gpu  # noqa: E402


def test_the_gpu_benchmark_runs_on_a_cpu_with_tiny_shapes(tmp_path, capsys):
    assert bench_gpu.main(["--device", "cpu", "--tiny", "--batches", "1,2", "--max-new", "12", "--cap-s", "0.5",
                           "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert (tmp_path / "bench_gpu.png").stat().st_size > 0
    assert results["dtype"] == "float32" and results["backend"] == "transformers-modules"  # no graphs on a CPU
    for b in (1, 2):
        for name in ("off", "fixed:4", "smartspec", "transformers generate"):
            assert results["runs"][f"b={b} {name}"]["steady_tok_s"] > 0, (b, name)
        assert results["runs"][f"b={b} fixed:4"]["mean_k"] > 0 and results["runs"][f"b={b} off"]["mean_k"] == 0
    assert set(results["lossless"]) == {"float32"} and 0 <= results["lossless"]["float32"] <= 8
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
