"""OpenTelemetry instruments exported on a Prometheus endpoint.

Gauges and cumulative counters are read from a snapshot of the core's stats (a frozen
``StoreStats``) that the event loop refreshes (the scrape runs on the exporter's HTTP thread
and must not walk the core's dicts while the loop changes them). Latencies are recorded where
they happen, on the loop, into ``LatencyHistogram``s: a record is a bisect and two additions
(about a microsecond), read into Prometheus histograms at scrape time. An OpenTelemetry
histogram's ``record`` cost 7 us of the loop's CPU on the development VM, per RPC and per step
op (four a step frame), more than the op itself. Histogram buckets are in seconds and start at
a microsecond: the defaults assume milliseconds and would put every allocation in the first bucket.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.stats import StoreStats

if TYPE_CHECKING:
    from memory_broker.broker.adapters.stats import AdapterStats

PREFIX = "memory_broker"

# 1 us .. 2.5 s, roughly x2.5 per step.
LATENCY_BUCKETS_S = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

POOL_STATES = ("free", "used", "prepared", "pinned", "evictable")


class BrokerMetrics:
    """The broker's instruments. ``snapshot`` is replaced wholesale by the loop."""

    def __init__(self, backend: str, gpu_uuid: str = ""):
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        # What the endpoint serves: every sample of ``inner`` with the broker's gpu_uuid label
        # added (one dashboard over every broker of a host tells them apart by it).
        self.registry = CollectorRegistry()
        inner = CollectorRegistry()
        self.registry.register(_Labelled(inner, {"gpu_uuid": gpu_uuid} if gpu_uuid else {}))
        reader = PrometheusMetricReader(disable_target_info=True, registry=inner)
        self.provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        meter = self.provider.get_meter("memory-broker")
        self.backend = backend
        self.snapshot: StoreStats | None = None
        # The adapter wing's figures, once the server has taken them (None: adapters off or not yet).
        self.adapter_snapshot: AdapterStats | None = None
        # The tier's figures (store/tiering.TierLink.stats), or None: no tier.
        self.tier_snapshot: dict | None = None
        self._http = None

        self._add_store_instruments(meter)
        self._add_adapter_instruments(meter)
        self._add_tier_instruments(meter)
        # Engines' KV figures (engine_pool.EnginePool.stats), taken with the snapshot.
        self.engine_snapshot: list = []
        self._add_engine_instruments(meter)
        # ``record(seconds)``: one granted EngineKvGrow, asking back and zeroing included.
        self.engine_grow_latency = LatencyHistogram(
            f"{PREFIX}_engine_kv_grow_latency_seconds", "time to grant an engine's KV grow"
        )
        # ``record(seconds)``.
        self.allocation_latency = LatencyHistogram(
            f"{PREFIX}_allocation_latency_seconds", "time to serve an Allocate or Prepare in the core"
        )
        # ``record(seconds, method, code)``.
        self.rpc_latency = LatencyHistogram(
            f"{PREFIX}_rpc_latency_seconds", "time to handle an RPC, by method and status", ("method", "code")
        )
        # ``record(seconds, op)``, from the tier's thread (its only recorder).
        self.tier_latency = LatencyHistogram(
            f"{PREFIX}_tier_latency_seconds", "time of one batched call to the tier, by op", ("op",)
        )
        inner.register(self.allocation_latency)
        inner.register(self.rpc_latency)
        inner.register(self.tier_latency)
        inner.register(self.engine_grow_latency)

    def _add_store_instruments(self, meter) -> None:
        """Gauges and counters read from the store's snapshot."""

        def gauge(name: str, desc: str, fn: Callable[[StoreStats], list[Observation]]):
            meter.create_observable_gauge(f"{PREFIX}_{name}", callbacks=[self._cb(fn)], description=desc)

        def counter(name: str, desc: str, fn: Callable[[StoreStats], list[Observation]]):
            meter.create_observable_counter(f"{PREFIX}_{name}", callbacks=[self._cb(fn)], description=desc)

        s = lambda field: lambda st: [Observation(getattr(st, field))]  # noqa: E731
        gauge("pool_utilization", "used pages / most pages the arena may hold", s("utilization"))
        gauge(
            "pool_pages",
            "pages by state",
            lambda st: [Observation(getattr(st, f"{k}_pages"), {"state": k}) for k in POOL_STATES],
        )
        gauge("pool_max_pages", "most pages the arena may hold", s("max_pages"))
        gauge("pool_capacity_pages", "pages backed by slabs now", s("capacity_pages"))
        gauge(
            "eviction_active",
            "1 between crossing the high watermark and reaching the low one",
            lambda st: [Observation(int(st.eviction_active))],
        )
        gauge(
            "window_fragmentation_ratio",
            "1 - largest free window extent / free window pages",
            s("window_fragmentation"),
        )
        gauge(
            "objects",
            "allocations by content type",
            lambda st: [
                Observation(u.objects, {"content_type": ContentType(ct).name.lower()})
                for ct, u in st.by_content.items()
            ],
        )
        gauge("sessions_active", "open sessions", s("sessions"))
        gauge("transactions_open", "prepared transactions not yet committed or aborted", s("open_transactions"))
        counter("evicted_pages_total", "pages evicted", s("evicted_pages"))
        counter("evicted_objects_total", "objects evicted", s("evicted_objects"))
        counter("eviction_runs_total", "watermark eviction runs", s("eviction_runs"))
        counter("allocations_total", "objects allocated", s("allocations_total"))
        counter("allocation_failures_total", "allocation batches refused for lack of room", s("allocation_failures"))
        counter("deduplicated_total", "commits that found their key present", s("deduplicated_total"))
        counter("pin_contention_total", "pins taken on objects another session already pinned", s("pin_contention"))

    def _add_adapter_instruments(self, meter) -> None:
        """Adapter figures (present once the adapter manager reports them)."""
        per_tier, part = self._per_tier, self._part
        meter.create_observable_counter(
            f"{PREFIX}_adapter_hits_total",
            callbacks=[per_tier("hits")],
            description="adapter acquires served from a tier",
        )
        meter.create_observable_counter(
            f"{PREFIX}_adapter_loads_total", callbacks=[per_tier("loads")], description="adapter loads into a tier"
        )
        meter.create_observable_gauge(
            f"{PREFIX}_adapters_resident", callbacks=[per_tier("resident")], description="adapters resident per tier"
        )
        meter.create_observable_gauge(
            f"{PREFIX}_adapter_image_bytes",
            unit="By",
            callbacks=[part("images", "bytes")],
            description="disk taken by converted adapter images",
        )
        meter.create_observable_gauge(
            f"{PREFIX}_adapter_image_budget_bytes",
            unit="By",
            callbacks=[part("images", "budget_bytes")],
            description="disk the converted adapter images may take (0: no limit)",
        )
        meter.create_observable_counter(
            f"{PREFIX}_adapter_image_reads_total",
            callbacks=[
                lambda _o: (
                    [
                        Observation(getattr(self.adapter_snapshot.images, k), {"result": r})
                        for k, r in (("hits", "hit"), ("misses", "miss"), ("rejected", "rejected"))
                    ]
                    if self.adapter_snapshot is not None
                    else []
                )
            ],
            description="cold adapter loads by how the image cache served them",
        )
        meter.create_observable_counter(
            f"{PREFIX}_adapter_conversions_total",
            callbacks=[part("images", "converted_ahead")],
            description="adapters converted into images ahead of use",
        )
        meter.create_observable_gauge(
            f"{PREFIX}_adapter_convert_queue",
            callbacks=[part("images", "convert_queued")],
            description="adapters waiting for conversion ahead of use",
        )
        meter.create_observable_counter(
            f"{PREFIX}_adapter_verifications_total",
            callbacks=[part("checksums", "verifications")],
            description="adapter copies checked against their checksums",
        )
        meter.create_observable_counter(
            f"{PREFIX}_adapter_corruptions_total",
            callbacks=[part("checksums", "corruptions")],
            description="adapter copies found not to match their checksums (dropped, reloaded)",
        )
        meter.create_observable_gauge(
            f"{PREFIX}_adapter_hit_ratio",
            callbacks=[
                lambda _o: [Observation(self.adapter_snapshot.hit_rate)] if self.adapter_snapshot is not None else []
            ],
            description="share of adapter acquires that found the adapter hot",
        )

    def _add_tier_instruments(self, meter) -> None:
        """The tier past one host (present with tier.backend)."""

        def tier(name: str, desc: str, pairs: tuple[tuple[str, str, str], ...], gauge: bool = False):
            def observe(_o):
                t = self.tier_snapshot
                return (
                    [Observation(int(t[key]), {label: value} if label else {}) for key, label, value in pairs]
                    if t
                    else []
                )

            make = meter.create_observable_gauge if gauge else meter.create_observable_counter
            make(f"{PREFIX}_{name}", callbacks=[observe], description=desc)

        tier(
            "tier_blocks_total",
            "blocks asked of the tier, by result (a corrupt one is also a miss)",
            (("hits", "result", "hit"), ("misses", "result", "miss"), ("corrupt", "result", "corrupt")),
        )
        tier(
            "tier_writes_total",
            "blocks written to the tier, by result",
            (("written", "result", "stored"), ("write_failed", "result", "failed")),
        )
        tier(
            "tier_bytes_total",
            "bytes moved to and from the tier",
            (("bytes_written", "direction", "written"), ("bytes_read", "direction", "read")),
        )
        tier(
            "tier_errors_total",
            "tier calls that failed or missed their deadline",
            (("errors", "kind", "error"), ("timeouts", "kind", "timeout"), ("skipped_down", "kind", "down")),
        )
        tier(
            "tier_drops_total",
            "work the tier had no room for: jobs its queue refused, evicted objects not spilled",
            (("drops", "what", "job"), ("spill_dropped", "what", "spill")),
        )
        tier(
            "tier_adapter_images_total",
            "adapters' page images written to the tier, and read from it instead of converting",
            (("adapter_images_written", "direction", "written"), ("adapter_images_read", "direction", "read")),
        )
        tier("tier_queue_depth", "tier jobs waiting", (("queue_depth", "", ""),), gauge=True)
        tier("tier_up", "1 while the tier answers, 0 during a failure's backoff", (("up", "", ""),), gauge=True)

    def _add_engine_instruments(self, meter) -> None:
        """Per engine (label ``engine``): KV pages held, and its grows, give-backs, refusals."""

        def engine(name: str, desc: str, field: str, gauge: bool = False):
            def observe(_o):
                return [Observation(getattr(e, field), {"engine": e.name}) for e in self.engine_snapshot]

            make = meter.create_observable_gauge if gauge else meter.create_observable_counter
            make(f"{PREFIX}_{name}", callbacks=[observe], description=desc)

        engine("engine_kv_pages", "pages of an engine's own KV cache", "held_pages", gauge=True)
        engine("engine_kv_floor_pages", "an engine's floor (pages never asked back)", "floor", gauge=True)
        engine("engine_kv_ceiling_pages", "an engine's ceiling (most pages it may hold)", "ceiling", gauge=True)
        engine("engine_kv_grows_total", "an engine's granted KV grows", "grows")
        engine("engine_kv_grown_pages_total", "pages granted to an engine's KV cache", "grown_pages")
        engine("engine_kv_give_backs_total", "an engine's give-backs of KV groups", "give_backs")
        engine("engine_kv_given_pages_total", "pages an engine gave back", "given_pages")
        engine("engine_kv_refusals_total", "an engine's KV grows refused (it preempts)", "refusals")
        engine("engine_kv_asked_pages_total", "pages an engine was asked to give back", "asked_pages")

    def _per_tier(self, key: str):
        """A callback: one observation per tier of the adapter figures' record ``key``."""

        def observe(_o):
            a = self.adapter_snapshot
            if a is None:
                return []
            rec = getattr(a, key)
            return [Observation(getattr(rec, f.name), {"tier": f.name}) for f in fields(rec)]

        return observe

    def _part(self, section: str, key: str):
        """A callback: the adapter figure ``section.key``."""

        def observe(_o):
            a = self.adapter_snapshot
            return [Observation(getattr(getattr(a, section), key))] if a is not None else []

        return observe

    def _cb(self, fn):
        def callback(options: CallbackOptions):
            snap = self.snapshot
            return fn(snap) if snap is not None else []

        return callback

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Start the Prometheus HTTP endpoint; returns the bound port."""
        from prometheus_client import start_http_server

        self._http, _thread = start_http_server(port, addr=address, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.provider.shutdown()


class LatencyHistogram:
    """A Prometheus histogram of seconds in ``LATENCY_BUCKETS_S``, one series per label
    values, recorded cheaply on one thread (the event loop) and read by the scrape's thread.

    A series is a list: a count per bucket (the last one past the largest bound), then the sum.
    The scrape copies each list in one step (atomic under the GIL), so its buckets and count
    always agree; the sum may lag a record that is half done."""

    def __init__(self, name: str, description: str, labels: tuple[str, ...] = ()):
        self.name = name
        self.description = description
        self.labels = labels
        self._series: dict[tuple[str, ...], list] = {}
        self._les = [floatToGoString(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]

    def record(self, seconds: float, *values: str) -> None:
        """One observation of ``seconds`` for the label ``values`` (in ``labels``' order)."""
        s = self._series.get(values)
        if s is None:
            if len(values) != len(self.labels):
                raise ValueError(f"{self.name} takes the labels {self.labels}, got {values}")
            s = self._series.setdefault(values, [0] * (len(LATENCY_BUCKETS_S) + 1) + [0.0])
        s[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        s[-1] += seconds

    def collect(self):
        family = HistogramMetricFamily(self.name, self.description, labels=self.labels)
        for values, series in list(self._series.items()):
            snap = list(series)
            total, buckets = 0, []
            for le, n in zip(self._les, snap):
                total += n
                buckets.append((le, total))
            family.add_metric(list(values), buckets, sum_value=snap[-1])
        yield family


class _Labelled:
    """A collector that hands out another registry's metrics with constant labels added."""

    def __init__(self, inner, labels: dict[str, str]):
        self.inner = inner
        self.labels = labels

    def collect(self):
        for family in self.inner.collect():
            family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield family
