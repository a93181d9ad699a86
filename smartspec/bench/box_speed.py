"""How fast the box is right now: a probe that benchmarks log beside their runs.

A shared VM can lose tens of percent of memory bandwidth within an hour, and decoding here is bound by memory
bandwidth, so two configurations run half an hour apart are compared on different machines. The probe takes
about a second; a spread wider than 10% over a benchmark is flagged, since it is then larger than the differences
the benchmark is asked to resolve."""
from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path

from smartspec.engine.profile_cache import cpu_name


def cpu_description() -> str:
    """The CPU as benchmark figures name it: model name, family and model, the int8 instructions decode leans on, and
    the logical CPUs (a VM's model name alone, "Intel(R) Xeon(R) Processor", does not tell Zen 4 from Sapphire
    Rapids)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    parts = [fields.get("model name") or cpu_name()]
    if "cpu family" in fields:
        parts.append(f"family {fields['cpu family']} model {fields.get('model', '?')}")
    parts += [name for flag, name in (("avx512_vnni", "AVX-512 VNNI"), ("amx_int8", "AMX")) if flag in flags]
    return ", ".join(parts) + f"; {os.cpu_count()} logical CPUs"


def speed_probe() -> dict:
    """Median of 5: GB/s reading 512 MiB of fp32, and GFLOP/s of a 1024^3 fp32 matmul, on torch's threads."""
    import torch

    data = torch.ones(128 * 2**20)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def median_s(fn) -> float:
        fn()
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    return {"read_gb_s": data.numel() * 4 / median_s(data.sum) / 1e9,
            "matmul_gflop_s": 2 * 1024**3 / median_s(lambda: a @ b) / 1e9}


def record_probe(out: Path, before: str) -> dict:
    """Probe, append the figures to <out>/speed_probe.csv, print them, and return them."""
    probe = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "before": before, **speed_probe()}
    path = out / "speed_probe.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(probe))
        if new:
            writer.writeheader()
        writer.writerow(probe)
    print(f"  box speed before {before}: {probe['read_gb_s']:.1f} GB/s read, {probe['matmul_gflop_s']:.0f} GFLOP/s "
          "matmul", flush=True)
    return probe


def print_probe_spread(folders: list[Path]) -> None:
    rows = [row for folder in folders if (folder / "speed_probe.csv").exists()
            for row in csv.DictReader((folder / "speed_probe.csv").open())]
    if len(rows) < 2:
        return
    for key, unit in (("read_gb_s", "GB/s read"), ("matmul_gflop_s", "GFLOP/s matmul")):
        values = [float(r[key]) for r in rows]
        spread = max(values) / min(values) - 1
        flag = "  <- wider than 10%: rankings closer than this are not settled" if spread > 0.10 else ""
        print(f"box speed over the run: {min(values):.1f}-{max(values):.1f} {unit} (spread {spread:.0%}){flag}")
