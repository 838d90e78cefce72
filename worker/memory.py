"""Hold a trainer to its memory limit: the private memory (RssAnon) of its whole process tree, sampled every
`every_s`; past the limit the tree is killed and the attempt fails with `out_of_memory`.

RssAnon, not RSS: the tokenized stores are memory-mapped files whose pages the kernel can drop at any time,
so they do not count against a trainer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import psutil


def rss_anon(pid: int) -> int:
    """RssAnon of one process in bytes (0 once it is gone)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_rss_anon(pid: int) -> int:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    return rss_anon(pid) + sum(rss_anon(c.pid) for c in children)


class MemoryWatch(threading.Thread):
    """Watches the process group led by `pid` until stopped or until it is over `limit` bytes."""

    def __init__(self, pid: int, limit: int, every_s: float = 0.1) -> None:
        super().__init__(daemon=True, name=f"memory-{pid}")
        self.pid, self.limit, self.every_s = pid, limit, every_s
        self.peak = 0
        self.exceeded = False
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            used = tree_rss_anon(self.pid)
            self.peak = max(self.peak, used)
            if used > self.limit:
                self.exceeded = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                return

    def stop(self) -> int:
        """Stop watching; the peak seen."""
        self.stopped.set()
        self.join(timeout=2)
        return self.peak
