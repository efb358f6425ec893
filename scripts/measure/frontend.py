"""Where a knee look's latency came from: the engine, or the front end in front of it (issue 50). Pure functions on
what serving/watch.LookWatch read around the look; the knee stage stores the result in the look's row (`frontend`).

On an H200 a stock `vllm serve` (one API-server process) was the bottleneck near the knee: the client's p95 TTFT
was 0.9-1.6 s while the engine logged Waiting 0 and the server's per-token p95 stayed <= 10 ms. So every look
compares two counts of requests over the SLO's TTFT, like with like (TTFT only, every request of the look that
completed, each side by its own clock):
- the client's: `vllm bench serve`'s own per-request TTFT (send to first streamed token, in this process);
- the server's: the difference of /metrics' `vllm:time_to_first_token_seconds` histogram between the look's start
  and stop (its count, less its cumulative bucket at the SLO's ttft_ms, which must be a bucket edge). vLLM 0.32's
  clock starts when the API process renders the request (renderers/base.py render_cmpl_async: arrival_time, before
  tokenization) and stops when the API process's output loop takes the engine core's output (v1/metrics/stats.py
  IterationStats.iteration_timestamp, time.time() in async_llm's output_handler). What it leaves out is what the
  front end adds before the renderer (HTTP accept and parsing, a busy or stopped event loop) and after the output
  loop (detokenizing, streaming, the client's own loop). vLLM bench serve's one test request before the timed run
  is in the server's count only: `server_counted` says so (it can only make the server's count fail, never pass).
The look is `bound` outside the engine when it failed on what TTFT shows while the server's count passes by the
rule a look is judged by (probing.slo_evidence at the look's confidence) and the engine never queued a request
(`vllm:num_requests_waiting` peak 0); which side added it: "client" when the client's busiest thread ran at least
BUSY_SHARE of a core and no API server's did, else "front end". "engine" where the engine queued and the server's
own count fails on evidence too.
"""
from __future__ import annotations

import math

from measure import probing
from measure.evidence import look_confidence

BUSY_SHARE = 0.9  # a thread at this share of one core is saturated: asyncio and the GIL give it no more
STALL_S = 1.0  # a /metrics GET this slow (or failing) during a look: the API server's event loop stalled
MIN_WALL_S = 1.0  # thread CPU times tick in 10 ms: over a shorter look a share is mostly rounding
OUTSIDE = ("front end", "client")  # the bounds that say the latency was added outside the engine


# ---------------------------------------------------------------- the server's count (its TTFT histogram)
def over_edge(before: dict | None, after: dict | None, edge_s: float) -> dict:
    """The server's requests over `edge_s` between two snapshots of a cumulative histogram ({upper edge: count},
    math.inf for +Inf; vllm_compat.histogram): {counted, over, reason}. `over` is None with the reason where a
    snapshot is missing or `edge_s` is not one of its edges (a bucket cannot be split)."""
    if before is None or after is None:
        return {"counted": None, "over": None, "reason": "the server's TTFT histogram was not read at start and stop"}
    edge = next((e for e in after if math.isclose(e, edge_s, rel_tol=1e-9)), None)
    if edge is None:
        edges = ", ".join(f"{e:g}" for e in sorted(after) if math.isfinite(e))
        return {"counted": None, "over": None,
                "reason": f"the SLO's TTFT {edge_s:g} s is not an edge of the server's histogram ({edges} s)"}
    counted = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    within = after[edge] - before.get(edge, 0.0)
    if counted < 0 or within < 0 or within > counted:  # a restarted server resets its counters
        return {"counted": None, "over": None, "reason": "the server's TTFT histogram went backwards (restarted?)"}
    return {"counted": round(counted), "over": round(counted - within), "reason": None}


def client_over(reqs: list[dict], ttft_ms: float) -> tuple[int, int]:
    """(completed, over): the look's completed requests by the client's own TTFT, and how many of them took longer
    than `ttft_ms` to their first token (the server's histogram counts `> edge` as over, so does this)."""
    done = [r for r in reqs if r.get("ok") and r.get("ttft") is not None]
    return len(done), sum(1 for r in done if r["ttft"] * 1000 > ttft_ms)


# ---------------------------------------------------------------- the busiest thread's share of a core
def thread_share(samples: list[tuple[float, dict[int, float]]]) -> float | None:
    """The busiest thread's CPU share of one core over the samples [(monotonic s, {thread id: CPU s})]: for each
    thread, its last CPU time less its first (0 for a thread first seen after the first sample: it started since),
    over the wall from the first sample to the last. None where under MIN_WALL_S of samples."""
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < MIN_WALL_S:
        return None
    first, wall = samples[0][1], samples[-1][0] - samples[0][0]
    last: dict[int, float] = {}
    for _, threads in samples:
        last.update(threads)
    used = [cpu - first.get(tid, 0.0) for tid, cpu in last.items()]
    return round(max(max(used, default=0.0), 0.0) / wall, 3)


def busiest(per_process: list[list[tuple[float, dict[int, float]]]]) -> float | None:
    """thread_share's maximum over processes (the API servers: the one saturated is the bound)."""
    shares = [s for s in map(thread_share, per_process) if s is not None]
    return max(shares) if shares else None


# ---------------------------------------------------------------- one look
def look(raw: dict, reqs: list[dict], ttft_ms: float) -> dict:
    """A look's front-end figures (records.knee.FrontEndLook's fields) from what the watcher read (`raw`:
    serving/watch.LookWatch.stop) and the look's requests; `bound` is set once the look is judged (mark)."""
    counted, over = client_over(reqs, ttft_ms)
    server = over_edge(raw.get("ttft_start"), raw.get("ttft_stop"), ttft_ms / 1000)
    cut = sum(1 for r in reqs if r.get("cut"))
    if cut and server["counted"] is not None:  # a cut request's first token may be in the server's count only
        server = {"counted": None, "over": None,
                  "reason": f"{cut} requests were cut in flight: the server's TTFT count holds some the client's "
                            "does not"}
    return {"counted": counted, "client_over_ttft": over, "server_counted": server["counted"],
            "server_over_ttft": server["over"], "server_reason": server["reason"],
            "waiting_peak": raw.get("waiting_peak"), "running_peak": raw.get("running_peak"),
            "api_processes": len(raw.get("api") or []), "api_thread_share": busiest(raw.get("api") or []),
            "client_thread_share": thread_share(raw.get("client") or []),
            "api_stall_s": raw.get("longest_scrape_s"), "scrapes": raw.get("scrapes", 0),
            "bound": None, "why": None}


def _verdict(counted: int | None, over: int | None, percentile: float, phi: float, confidence: float) -> str | None:
    if counted is None or over is None or not counted:
        return None
    return probing.slo_evidence(counted, min(over, counted), percentile, confidence, phi)["verdict"]


def side(fe: dict) -> tuple[str, str]:
    """Which side of the engine added the latency: the client (its busiest thread saturated, no API server's) or
    the front end (an API server saturated or stalled, or neither saturated: between the client and the engine)."""
    api, client, stall = fe.get("api_thread_share"), fe.get("client_thread_share"), fe.get("api_stall_s")
    api_busy = api is not None and api >= BUSY_SHARE
    stalled = stall is not None and stall >= STALL_S
    shares = (f"the client's busiest thread ran {_pct(client)} of a core, the API servers' {_pct(api)} "
              f"({fe.get('api_processes') or 0} processes)" + (f"; a /metrics GET took {stall:.1f} s" if stalled
                                                               else ""))
    if client is not None and client >= BUSY_SHARE and not api_busy and not stalled:
        return "client", f"the load generator was the bottleneck: {shares}"
    cause = ("an API server was CPU-saturated" if api_busy else "an API server stalled" if stalled else
             "no thread saturated")
    return "front end", f"{cause}: {shares}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def flag(fe: dict, row: dict, percentile: float, phi: float = 1.0, looks: int = 1) -> tuple[str | None, str]:
    """A judged look's `bound` and why. Each count is judged alone, by probing.slo_evidence at the confidence each
    look of a visit is judged at (look_confidence(looks), the requests' dispersion `phi`): the client's over the
    look's completed requests, the server's over its own. A look that passed is never bound."""
    if row.get("passed"):
        return None, "the look passed"
    conf = look_confidence(looks)
    client = _verdict(fe.get("counted"), fe.get("client_over_ttft"), percentile, phi, conf)
    server = _verdict(fe.get("server_counted"), fe.get("server_over_ttft"), percentile, phi, conf)
    counts = (f"client {fe.get('client_over_ttft')} of {fe.get('counted')} over the TTFT SLO ({client}), server "
              f"{fe.get('server_over_ttft')} of {fe.get('server_counted')} ({server}), waiting peak "
              f"{fe.get('waiting_peak')}")
    if server is None:
        return None, fe.get("server_reason") or "the server's TTFT count was not read"
    if fe.get("waiting_peak") is None:
        return None, f"the engine's queue was never read (/metrics): {counts}"
    if client == "pass" and not row.get("failed") and not row.get("backlog"):
        return None, f"failed on what its TTFT does not show (TPOT): {counts}"
    if server == "pass" and fe["waiting_peak"] == 0:
        who, words = side(fe)
        return who, f"the latency was added outside the engine, {words}: {counts}"
    if server == "fail" and fe["waiting_peak"] > 0:
        return "engine", f"the engine queued requests and its own count fails too: {counts}"
    return None, f"neither the engine's nor the front end's on this evidence: {counts}"


def mark(rows: list[dict], percentile: float, phi: float = 1.0, looks: int = 1) -> list[dict]:
    """Each judged row's `frontend` given its bound (flag), once its visit's verdict is final; the rows marked."""
    marked = []
    for row in rows:
        fe = row.get("frontend")
        if fe:
            fe["bound"], fe["why"] = flag(fe, row, percentile, phi, looks)
            marked.append(row)
    return marked


# ---------------------------------------------------------------- the knee's summary
def summary(rows: list[dict], first_fail_rps: float | None) -> tuple[int | None, str | None]:
    """(looks bound outside the engine, words) over a knee's rows; (None, None) where no look was instrumented.
    Where the knee's boundary look (the first look that failed at its first fail) was bound outside the engine,
    the words say the knee is not the engine's."""
    fes = [(r, r["frontend"]) for r in rows if r.get("frontend")]
    if not fes:
        return None, None
    out = [(r, fe) for r, fe in fes if fe.get("bound") in OUTSIDE]
    n_client = sum(1 for _, fe in out if fe["bound"] == "client")
    words = (f"{len(out)} of {len(fes)} looks' latency was added outside the engine"
             + (f" ({len(out) - n_client} the front end's, {n_client} the client's)" if out else ""))
    edge = next((fe for r, fe in fes if r["offered_rps"] == first_fail_rps and not r.get("passed")), None)
    if edge and edge.get("bound") == "front end":
        words = f"this knee is the front end's, not the engine's ({edge['why']}); " + words
    elif edge and edge.get("bound") == "client":
        words = f"this knee is the load generator's, not the engine's ({edge['why']}); " + words
    return len(out), words
