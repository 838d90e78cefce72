"""The JSON-lines event stream: one object per line on the process's original stdout.

`take_stdout` moves everything else printed to stdout (by libraries, or C code) onto stderr, so the
stream a worker parses carries only events.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import IO, Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _clean(value.item())
    return value


class EventStream:
    def __init__(self, out: IO[str]) -> None:
        self.out = out

    @classmethod
    def take_stdout(cls) -> EventStream:
        sys.stdout.flush()
        events_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        return cls(os.fdopen(events_fd, "w", buffering=1))

    @classmethod
    def silent(cls) -> EventStream:
        """For ranks other than 0 of a multi-process job: rank 0 speaks for the job."""
        return cls(open(os.devnull, "w"))

    def emit(self, type: str, **fields: Any) -> None:
        record = {"type": type, "time": time.time(), **{k: _clean(v) for k, v in fields.items()}}
        self.out.write(json.dumps(record, default=str) + "\n")
        self.out.flush()

    def message(self, message: str, *, level: str = "info", **data: Any) -> None:
        self.emit("message", level=level, message=message, **({"data": data} if data else {}))
