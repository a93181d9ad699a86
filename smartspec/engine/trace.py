"""Step traces: every step's shape, choices and timings, written to Parquet (the cost model's raw material)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from smartspec.policy.base import StepRecord


class StepTraceWriter:
    def __init__(self, path: str | Path, policy_name: str, flush_every: int = 2000) -> None:
        self.path = Path(path)
        self.policy_name = policy_name
        self.flush_every = flush_every
        self.rows: list[dict] = []
        self._writer = None

    def add(self, record: StepRecord) -> None:
        row = dataclasses.asdict(record)
        row.pop("extra")
        row["time"] = time.time()
        row["policy"] = self.policy_name
        self.rows.append(row)
        if len(self.rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self.rows)
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table.cast(self._writer.schema))
        self.rows = []

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
