"""Prometheus metrics of the server (text format at /metrics), in a registry of its own so several
servers can live in one process (the tests).

Per request, observed when it finishes: TTFT, TPOT and end-to-end latency histograms, finished
requests by finish reason, prompt / generated tokens, decode FLOPs. Engine state, read at each scrape
from AsyncLLM.replica_stats() and labelled `replica` (data-parallel engine cores): running / waiting
requests, KV blocks used and total (per rank: each rank's cache holds that many blocks of its heads),
the parallel layout (tensor_parallel_size, expert parallel on/off), prefix-cache hit rate, preemptions, eager fallbacks (decode steps
that could not replay a CUDA graph), engine steps, requests failed alone and steps with non-finite logits;
with speculative decoding, drafted / accepted tokens, verifications, skipped steps, and per request a histogram
of its mean acceptance length.
Every finished request also gets one log line with its metrics.
"""
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from livemoe.engine.outputs import RequestMetrics

log = logging.getLogger("livemoe.engine.server")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineCollector:
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    GAUGES = {
        "num_running": ("livemoe_num_requests_running", "Sequences being decoded or prefilled"),
        "num_waiting": ("livemoe_num_requests_waiting", "Sequences waiting to be scheduled"),
        "kv_blocks_used": ("livemoe_kv_blocks_used", "KV-cache blocks in use"),
        "kv_blocks_total": ("livemoe_kv_blocks_total", "KV-cache blocks allocated"),
        "kv_blocks_pinned": ("livemoe_kv_blocks_pinned", "KV-cache blocks kept for live sessions between steps"),
        "prefix_cache_hit_rate": ("livemoe_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache, "
                                  "over prompt tokens"),
        "tensor_parallel_size": ("livemoe_tensor_parallel_size", "Processes (GPUs) one model is split over"),
        "expert_parallel": ("livemoe_expert_parallel_enabled", "1: each rank holds whole experts (expert parallel); "
                            "0: the experts are tensor-parallel"),
    }
    COUNTERS = {
        "num_eager_fallbacks": ("livemoe_eager_fallbacks", "Decode steps run eagerly (no CUDA graph fits)"),
        "num_preemptions": ("livemoe_preemptions", "Sequences preempted (for KV blocks, or to seat another request)"),
        "num_failed_requests": ("livemoe_failed_requests", "Requests the engine ended for a fault of their own"),
        "num_nonfinite_logits_steps": ("livemoe_nonfinite_logits_steps", "Steps whose logits held NaN or inf"),
        "prefix_cache_hits": ("livemoe_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache"),
        "prefix_cache_queries": ("livemoe_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
        "num_steps": ("livemoe_engine_steps", "Engine steps run"),
        "spec_num_verifications": ("livemoe_spec_verifications", "Speculative verifications (a sequence's drafts "
                                   "scored in one forward)"),
        "spec_drafted_tokens": ("livemoe_spec_draft_tokens", "Speculative draft tokens verified"),
        "spec_accepted_tokens": ("livemoe_spec_accepted_tokens", "Speculative draft tokens accepted"),
        "spec_disabled_steps": ("livemoe_spec_disabled_steps", "Steps not speculated: more decoding sequences than "
                                "speculative_config's disable_by_batch_size"),
    }

    def __init__(self, replica_stats):
        self.replica_stats = replica_stats

    def collect(self):
        per_replica = self.replica_stats()
        for table, family in ((self.GAUGES, GaugeMetricFamily), (self.COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                metric = family(name, doc, labels=["replica"])
                for i, s in enumerate(per_replica):
                    metric.add_metric([str(i)], float(s.get(key, 0)))
                yield metric


class ServerMetrics:
    def __init__(self, replica_stats):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("livemoe_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("livemoe_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("livemoe_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.finished = Counter("livemoe_requests_finished", "Completions finished", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)  # shown as 0 before the first one
        self.prompt_tokens = Counter("livemoe_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("livemoe_generation_tokens", "Tokens generated by finished requests",
                                         registry=r)
        self.decode_flops = Counter("livemoe_decode_flops", "Decode FLOPs (2 x active parameters x output tokens)",
                                    registry=r)
        self.acceptance_length = Histogram(
            "livemoe_spec_acceptance_length", "Per finished request with speculative decoding: tokens per "
            "verification (accepted drafts + 1)", buckets=ACCEPTANCE_BUCKETS, registry=r)
        r.register(EngineCollector(replica_stats))

    def request_finished(self, request_id: str, finish_reasons: list[str], m: RequestMetrics) -> None:
        for reason in finish_reasons:
            self.finished.labels(reason or "unknown").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        self.decode_flops.inc(m.decode_flops)
        if m.mean_acceptance_length is not None:
            self.acceptance_length.observe(m.mean_acceptance_length)
        log.info("request %s finished (%s): prompt_tokens=%d cached=%d output_tokens=%d ttft=%s tpot=%s "
                 "decode_flops=%.4g", request_id, ",".join(map(str, finish_reasons)), m.num_prompt_tokens,
                 m.num_cached_tokens, m.num_output_tokens, _ms(m.ttft), _ms(m.tpot), m.decode_flops)

    def request_aborted(self, request_id: str, num_choices: int, reason: str) -> None:
        self.finished.labels("abort").inc(num_choices)
        log.info("request %s aborted: %s", request_id, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}ms"
