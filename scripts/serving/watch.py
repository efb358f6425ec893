"""What the server and the client did during one knee look (issue 50): the engine's queue, the busiest thread of each
API-server process and of this process (the client: `vllm bench serve` runs in it), and the server's TTFT histogram
at the look's start and stop. I/O only: measure/frontend.py reads what it returns.

A background thread samples at most once a second (a /metrics GET, then /proc's per-thread CPU times through
psutil): cheap next to a look, and a stalled API server shows as a slow or failed GET rather than stalling the
look. The peaks of `vllm:num_requests_waiting` and `running` are those of the samples: a queue shorter than a
second between two samples can be missed, one that holds a look's latency up cannot.
"""
from __future__ import annotations

import http.client
import os
import threading
import time

import psutil

from serving import vllm_compat

INTERVAL_S = 1.0
GET_TIMEOUT_S = 5.0  # a GET that waits longer is a stall in itself; the look does not wait for it


def threads(p: psutil.Process) -> dict[int, float]:
    """{thread id: user + system CPU s} of process `p`; empty where it is gone."""
    try:
        return {t.id: t.user_time + t.system_time for t in p.threads()}
    except psutil.Error:
        return {}


class LookWatch:
    """Started just before a look, stopped right after it. `metrics()`: the server's /metrics text (Server.metrics);
    `server_pid`: the `vllm serve` process (its API servers are found from it, vllm_compat.api_processes, by the
    title `prefix` its env gives them: Server.title_prefix)."""

    def __init__(self, metrics, server_pid: int, interval: float = INTERVAL_S, prefix: str = "VLLM"):
        self.metrics, self.interval = metrics, interval
        self.api = vllm_compat.api_processes(server_pid, prefix)  # as Server.api_servers counts them
        self.client = psutil.Process(os.getpid())
        self.api_samples: list[list] = [[] for _ in self.api]
        self.client_samples: list = []
        self.waiting = self.running = None
        self.scrapes, self.failed, self.longest = 0, 0, 0.0
        self._stop = threading.Event()
        self.ttft_start = self._scrape()  # the histogram at the look's start: the first sample
        self._sample_threads()
        self._thread = threading.Thread(target=self._loop, name="look-watch", daemon=True)
        self._thread.start()

    def _scrape(self) -> dict | None:
        """One /metrics GET: the queue peaks kept, the TTFT histogram returned (None where the GET failed)."""
        t0 = time.monotonic()
        try:
            text = self.metrics(timeout=GET_TIMEOUT_S)
        except (OSError, http.client.HTTPException):  # URLError, a timeout, a refused or cut connection
            self.failed += 1
            return None
        finally:
            self.longest = max(self.longest, time.monotonic() - t0)
        self.scrapes += 1
        m = vllm_compat.scrape(text)
        for attr, name in (("waiting", vllm_compat.WAITING), ("running", vllm_compat.RUNNING)):
            if name in m:
                setattr(self, attr, max(getattr(self, attr) or 0, m[name]))
        return vllm_compat.histogram(text, vllm_compat.TTFT_HISTOGRAM)

    def _sample_threads(self) -> None:
        t = time.monotonic()
        for p, samples in zip(self.api, self.api_samples):
            samples.append((t, threads(p)))
        self.client_samples.append((t, threads(self.client)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._scrape()
            self._sample_threads()

    def stop(self) -> dict:
        """What was read (measure/frontend.look takes it): the TTFT histogram at start and stop, the queue peaks,
        the scrapes (how many, how many failed, the slowest), and per-thread CPU samples per process."""
        self._stop.set()
        self._thread.join(GET_TIMEOUT_S + 1)
        self._sample_threads()  # the look's end, before the last GET (that takes the server's time, not the look's)
        ttft_stop = self._scrape()
        return {"ttft_start": self.ttft_start, "ttft_stop": ttft_stop, "waiting_peak": self.waiting,
                "running_peak": self.running, "scrapes": self.scrapes, "failed_scrapes": self.failed,
                "longest_scrape_s": round(self.longest, 2), "api_pids": [p.pid for p in self.api],
                "api": self.api_samples, "client": self.client_samples}
