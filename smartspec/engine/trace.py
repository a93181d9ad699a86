"""Step traces: every step's shape, choices and timings, written to Parquet (the cost model's raw material).

A path ending in .parquet is one file, complete when the writer closes (a benchmark's run). Any other path is a
directory of part files, each complete as soon as it is written: a serving replica is stopped, not closed, and
its trace must be readable while it serves (pyarrow and pandas read the directory as one table)."""
from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

from smartspec.types.step_record import StepRecord


@functools.cache
def trace_schema():
    """One schema for every write: a chunk whose steps all lack a prediction must not make the column null-typed
    (the parts of a directory must agree, and a file's later chunks are cast to its first)."""
    import pyarrow as pa

    ints = pa.list_(pa.int64())
    return pa.schema([("step", pa.int64()), ("batch_size", pa.int64()), ("ks", ints), ("proposed", ints),
                      ("accepted", ints), ("request_ids", pa.list_(pa.string())), ("num_batched_tokens", pa.int64()),
                      ("num_prefill_tokens", pa.int64()), ("num_context_tokens", pa.int64()), ("draft_s", pa.float64()),
                      ("verify_s", pa.float64()), ("total_s", pa.float64()), ("predicted_s", pa.float64()),
                      ("draft_catchup_tokens", pa.int64()), ("methods", pa.list_(pa.string())), ("time", pa.float64()),
                      ("policy", pa.string()), ("forward_tokens", pa.int64()), ("num_tokens", ints),
                      ("probes", pa.list_(pa.string()))])


class StepTraceWriter:
    def __init__(self, path: str | Path, policy_name: str, flush_every: int = 2000,
                 flush_interval_s: float = 10.0) -> None:
        """flush_every: rows buffered before a write; flush_interval_s: for a directory, also write the rows
        buffered this long (so a lightly loaded server's steps show up within seconds)."""
        self.path = Path(path)
        self.parts = self.path.suffix != ".parquet"
        self.policy_name = policy_name
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.rows: list[dict] = []
        self._writer = None
        self._num_parts = 0
        self._last_flush = time.monotonic()

    def add(self, record: StepRecord) -> None:
        row = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name != "trees"}
        # the proposer per request where the policy chose them (empty where one proposer serves every request)
        row["methods"] = list(record.methods or [])
        row["time"] = time.time()
        row["policy"] = self.policy_name
        self.rows.append(row)
        if len(self.rows) >= self.flush_every or (
                self.parts and time.monotonic() - self._last_flush >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self.rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self.rows, schema=trace_schema())
        if self.parts:
            self.path.mkdir(parents=True, exist_ok=True)
            name = f"part-{self._num_parts:05d}.parquet"
            hidden = self.path / f".{name}"  # readers skip dot files: none ever sees half a part
            pq.write_table(table, hidden)
            hidden.rename(self.path / name)
            self._num_parts += 1
        else:
            if self._writer is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._writer = pq.ParquetWriter(self.path, table.schema)
            self._writer.write_table(table)
        self.rows = []

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
