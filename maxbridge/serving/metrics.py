"""The server's Prometheus metrics."""

import prometheus_client


class Metrics:
  """The server's Prometheus metrics, in a registry of its own (several servers may share a process in tests)."""

  def __init__(self, slots: int):
    self.registry = prometheus_client.CollectorRegistry()
    r = self.registry
    self.requests = prometheus_client.Counter(
        "maxbridge_requests", "requests answered, by endpoint and status", ["endpoint", "status"], registry=r
    )
    self._gauges = {
        "queue_depth": prometheus_client.Gauge("maxbridge_queue_depth", "requests waiting for a slot", registry=r),
        "slots_busy": prometheus_client.Gauge("maxbridge_slots_busy", "decode slots holding a request", registry=r),
    }
    prometheus_client.Gauge("maxbridge_slots", "decode slots in all", registry=r).set(slots)
    self._counters = {
        "generated_tokens": prometheus_client.Counter(
            "maxbridge_generated_tokens", "tokens generated (rate() gives tokens/s)", registry=r
        ),
        "decode_steps": prometheus_client.Counter("maxbridge_decode_steps", "engine decode steps", registry=r),
    }
    self._histograms = {
        "ttft": prometheus_client.Histogram(
            "maxbridge_time_to_first_token_seconds", "from admission to the queue to the first token", registry=r
        ),
        "slot_occupancy": prometheus_client.Histogram(
            "maxbridge_slot_occupancy",
            "busy slots per decode step: above 1, requests share steps (continuous batching)",
            buckets=[b + 0.5 for b in range(slots)],
            registry=r,
        ),
    }

  def set(self, name, value):
    self._gauges[name].set(value)

  def inc(self, name, value):
    self._counters[name].inc(value)

  def observe(self, name, value):
    self._histograms[name].observe(value)
