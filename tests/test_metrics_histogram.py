"""The broker's latency histograms (``LatencyHistogram``): Prometheus's ``le`` buckets, one
series per label values, counts that agree with their buckets, and a clear refusal of a record
with the wrong labels."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from memory_broker.broker.server.metrics import LATENCY_BUCKETS_S, BrokerMetrics


def samples(text: str, name: str) -> dict[tuple, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}(_bucket|_count|_sum)(?:\{{(.*)\}})? (\S+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_buckets_are_prometheus_le_bounds_per_label_series():
    m = BrokerMetrics("host", "GPU-7")
    h = m.rpc_latency
    # A value on a bound counts in that bound's bucket (le: less than or equal).
    for s in (LATENCY_BUCKETS_S[0], 3e-6, 2.5e-6, 0.2, 9.0):
        h.record(s, "Pin", "OK")
    h.record(1e-3, "Pin", "NOT_FOUND")
    got = samples(generate_latest(m.registry).decode(), "memory_broker_rpc_latency_seconds")
    ok = (("code", "OK"), ("gpu_uuid", "GPU-7"), ("method", "Pin"))

    def bucket(le, labels=ok):
        return got[("_bucket", tuple(sorted(labels + (("le", le),))))]

    assert bucket("1e-06") == 1
    assert bucket("2.5e-06") == 2
    assert bucket("5e-06") == 3
    assert bucket("0.1") == 3 and bucket("0.25") == 4 and bucket("2.5") == 4
    assert bucket("+Inf") == 5 == got[("_count", ok)]
    assert got[("_sum", ok)] == pytest.approx(1e-6 + 3e-6 + 2.5e-6 + 0.2 + 9.0)
    nf = (("code", "NOT_FOUND"), ("gpu_uuid", "GPU-7"), ("method", "Pin"))
    assert bucket("0.0005", nf) == 0 and bucket("0.001", nf) == 1 and got[("_count", nf)] == 1


def test_unlabelled_histogram_and_wrong_labels_refused():
    m = BrokerMetrics("host")
    m.allocation_latency.record(2e-5)
    m.allocation_latency.record(4e-5)
    got = samples(generate_latest(m.registry).decode(), "memory_broker_allocation_latency_seconds")
    assert got[("_bucket", (("le", "2.5e-05"),))] == 1
    assert got[("_bucket", (("le", "+Inf"),))] == 2 == got[("_count", ())]
    with pytest.raises(ValueError, match=r"takes the labels \('method', 'code'\)"):
        m.rpc_latency.record(1e-5, "Pin")
    with pytest.raises(ValueError, match="takes the labels"):
        m.allocation_latency.record(1e-5, "Pin")
    # A refused record leaves no series behind.
    assert "Pin" not in generate_latest(m.registry).decode()
