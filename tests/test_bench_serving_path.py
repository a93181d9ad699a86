"""scripts/bench_serving_path.py's own logic, without a cluster: the environment each way in starts Ray with, and the
report's table, raw rows, plot and last line over points of both ways in. (Its figures are timings and CPU seconds
of a running cluster, which no test reads.)"""
import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_serving_path  # noqa: E402


def test_direct_ingress_starts_ray_with_serves_flag_on_ports_apart_from_the_proxys():
    proxy, direct = bench_serving_path.ingress_env("proxy"), bench_serving_path.ingress_env("direct")
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in proxy
    assert direct["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    low = int(direct["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    high = int(direct["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    assert bench_serving_path.PORT < low < high  # the proxy keeps its port: an ingress replica never takes it
    assert direct["RAY_AUTH_MODE"] == proxy["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in proxy and "RAY_SERVE_ENABLE_HA_PROXY" not in direct


def test_haproxy_mode_puts_haproxy_on_the_proxys_port_in_front_of_direct_ingress():
    """Serve's HAProxy mode needs direct ingress on (the ingress replicas' ports are its backends): both flags."""
    haproxy, direct = bench_serving_path.ingress_env("haproxy"), bench_serving_path.ingress_env("direct")
    assert haproxy["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert {k: v for k, v in haproxy.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"} == direct


def point(ingress: str, streams: int, delivered: float, us: float, held: bool) -> dict:
    return {"streams": streams, "interval_ms": 0.0, "channels": True, "offered": delivered, "delivered": delivered,
            "p99_gap_ms": 30.0 if held else 90.0, "median_gap_ms": 10.0, "us_per_token": us,
            "engine_us_per_token": 5.0, "proxy_us_per_token": 0.0 if ingress == "direct" else us / 3,
            "ingress_us_per_token": us / 2, "replica_us_per_token": us / 4, "held": held, "errors": 0,
            "window_s": 15.0, "ingress": ingress}


def test_report_gives_each_way_in_its_line_and_ends_with_the_cheaper(tmp_path, capsys):
    rows = [point("proxy", 64, 3000, 360, False), point("proxy", 256, 3500, 300, False),
            point("direct", 64, 6000, 170, True), point("direct", 256, 4000, 180, False)]
    args = argparse.Namespace(stream_interval_ms=[0.0], channels=["on"], ingress=["proxy", "direct"], streams=[64, 256])
    assert bench_serving_path.report(rows, args, tmp_path) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| direct | 64 | 0 | on | 6000 | 6000 | 30.0 | 170 | 0 | 85 | 42 | 5.0 | yes |" in out
    assert "stream_interval_ms 0, channels on, proxy ingress: us per streamed token 330; rate held 0 tok/s " \
           "(0 of 2 points held)" in out
    # the rate held is the least over stream counts: 256 streams held nowhere
    assert "stream_interval_ms 0, channels on, direct ingress: us per streamed token 175; rate held 0 tok/s " \
           "(1 of 2 points held)" in out
    assert out[-1] == "us per streamed token 175; rate held 0 tok/s"
    assert len(pq.read_table(tmp_path / "points.parquet")) == 4
    assert (tmp_path / "gaps.png").stat().st_size > 0
