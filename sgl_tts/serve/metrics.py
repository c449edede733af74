"""The server's Prometheus metrics (`GET /metrics`), one registry per service (so test servers do not share).

Counters: requests refused by reason, searches ended by outcome, tokens generated and served from cache, search
and verifier seconds; gauges: searches running and queued, the verifier's share of search time, each runtime up;
a histogram of search latency.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sgl_tts.search.records import SearchResult

REFUSALS = ("busy", "bad_request", "limits", "unavailable", "unauthorized")
OUTCOMES = ("completed", "failed", "cancelled")
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self, running: Callable[[], int], queued: Callable[[], int]):
        self.registry = registry = CollectorRegistry()
        Gauge("sgl_tts_searches_running", "Searches running on the runtimes", registry=registry).set_function(running)
        Gauge("sgl_tts_searches_queued", "Searches accepted, not yet running", registry=registry).set_function(queued)
        self.refused = Counter("sgl_tts_requests_refused", "Chat requests refused, by reason", ["reason"],
                               registry=registry)
        self.searches = Counter("sgl_tts_searches", "Searches ended, by outcome", ["outcome"], registry=registry)
        for name in REFUSALS:
            self.refused.labels(name)
        for name in OUTCOMES:
            self.searches.labels(name)
        self.generated = Counter("sgl_tts_generated_tokens", "Tokens the generator produced for completed searches",
                                 registry=registry)
        self.cached = Counter("sgl_tts_cached_tokens", "Prompt tokens of completed searches served from the "
                                                       "radix cache", registry=registry)
        self.search_s = Counter("sgl_tts_search_seconds", "Time of completed searches", registry=registry)
        self.verifier_s = Counter("sgl_tts_verifier_seconds", "Verifier time of completed searches",
                                  registry=registry)
        Gauge("sgl_tts_verifier_time_share", "Verifier seconds / search seconds of the completed searches",
              registry=registry).set_function(self.verifier_share)
        self.latency = Histogram("sgl_tts_search_latency_seconds", "Search latency, submit to end (every outcome)",
                                 buckets=LATENCY_BUCKETS_S, registry=registry)
        self._search_total = self._verifier_total = 0.0  # the two counters' values, for the share
        self.runtime_up = Gauge("sgl_tts_runtime_up", "1 while the runtime is up", ["runtime"], registry=registry)

    def verifier_share(self) -> float:
        return self._verifier_total / self._search_total if self._search_total > 0 else 0.0

    def search_ended(self, outcome: str, latency_s: float, result: SearchResult | None) -> None:
        self.searches.labels(outcome).inc()
        self.latency.observe(latency_s)
        if result is not None:
            self.generated.inc(result.generated_tokens)
            self.cached.inc(result.cached_tokens)
            self.search_s.inc(result.total_time_s)
            self.verifier_s.inc(result.verifier_time_s)
            self._search_total += result.total_time_s
            self._verifier_total += result.verifier_time_s

    def render(self, health: dict[str, dict[str, Any]] | None = None) -> bytes:
        for name, state in (health or {}).items():
            self.runtime_up.labels(name).set(1.0 if state["state"] == "up" else 0.0)
        return generate_latest(self.registry)
