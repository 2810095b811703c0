"""Prometheus metrics (/metrics), names in the manner of vLLM / SGLang under the `dsv4:` prefix. One registry per
app, so several servers in one process (the tests) do not share counters."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dsv4_model.runtime.requests import Request
from dsv4_model.serve.protocol import finish_reason

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
            80.0)


class Metrics:
    def __init__(self, counts, scheduler_stats, speculation=None):
        """counts() -> (running, waiting); scheduler_stats: the Scheduler's stats object, speculation: a speculative
        scheduler's SpeculationStats (both read at scrape)."""
        self.registry = r = CollectorRegistry()
        Gauge("dsv4:num_requests_running", "Requests holding a batch row", registry=r).set_function(
            lambda: counts()[0])
        Gauge("dsv4:num_requests_waiting", "Requests queued for a row", registry=r).set_function(
            lambda: counts()[1])
        Gauge("dsv4:prefix_cache_hits",
              "Requests that reused kept caches: a finished row's, a prefix snapshot's (cumulative)",
              registry=r).set_function(lambda: scheduler_stats.reuse_hits)
        Gauge("dsv4:prefix_cache_reused_tokens", "Prompt tokens not prefilled thanks to reuse (cumulative)",
              registry=r).set_function(lambda: scheduler_stats.reused_tokens)
        Gauge("dsv4:prefix_snapshots", "Prefix snapshots kept in free rows (cumulative)",
              registry=r).set_function(lambda: scheduler_stats.snapshots)
        Gauge("dsv4:prefix_snapshot_hits", "Requests that continued from a copy of a prefix snapshot (cumulative; "
              "also in prefix_cache_hits)", registry=r).set_function(lambda: scheduler_stats.snapshot_hits)
        self.ttft = Histogram("dsv4:time_to_first_token_seconds", "Submission to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("dsv4:inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("dsv4:e2e_request_latency_seconds", "Submission to finish", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("dsv4:request_queue_time_seconds", "Submission to a batch row", buckets=_LATENCY,
                               registry=r)
        self.prompt_tokens = Counter("dsv4:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dsv4:generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("dsv4:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.rejected = Counter("dsv4:rejected_requests", "HTTP requests refused by status", ["status"],
                                registry=r)
        if speculation is not None:
            _speculation_gauges(r, speculation)

    def on_finish(self, req: Request, count_prompt: bool = True) -> None:
        """Called on the scheduler thread as each request ends (count_prompt false: another choice of the same
        prompt counts its tokens, so n > 1 counts them once, as usage does)."""
        t = req.timings
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        if t.queue_s is not None:
            self.queue.observe(t.queue_s)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.submitted)
        times = req.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if count_prompt:
            self.prompt_tokens.inc(len(req.prompt))
        self.generation_tokens.inc(len(req.token_ids))
        # vLLM's labels (stop, length, abort), and error where the scheduler failed the request
        reason = req.finish_reason
        self.finished.labels("error" if reason == "error" else finish_reason(reason)).inc()


def _speculation_gauges(r: CollectorRegistry, spec) -> None:
    """Speculative decoding's counts (cumulative, as vLLM's spec_decode metrics): drafts offered and accepted, per
    draft position too, and where the drafter predicts its acceptance (DSpark's confidence head) the mean prediction
    per position, to set against the measured rate."""
    Gauge("dsv4:spec_decode_num_drafts", "Verification passes of a row (cumulative)",
          registry=r).set_function(lambda: spec.row_steps)
    Gauge("dsv4:spec_decode_num_draft_tokens", "Draft tokens verified (cumulative)",
          registry=r).set_function(lambda: spec.row_steps * spec.k)
    Gauge("dsv4:spec_decode_num_accepted_tokens", "Draft tokens accepted (cumulative)",
          registry=r).set_function(lambda: sum(spec.accepted))
    per_pos = Gauge("dsv4:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each position (cumulative)",
                    ["position"], registry=r)
    predicted = Gauge("dsv4:spec_decode_predicted_acceptance_per_pos", "The drafter's mean predicted chance of "
                      "acceptance at each position, over the rows offered it (NaN: no prediction)", ["position"],
                      registry=r)
    for j in range(spec.k):
        per_pos.labels(str(j)).set_function(lambda j=j: spec.accepted[j])
        predicted.labels(str(j)).set_function(lambda j=j: spec.predicted_acceptance()[j])
