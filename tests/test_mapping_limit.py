"""A client refuses, before the broker allocates, contiguous objects that would take the
process past its mapping limit (vm.max_map_count), and says which sysctl raises it."""

from __future__ import annotations

import errno

import pytest

from memory_broker.clients import BrokerClient, BrokerError, Spec
from memory_broker.clients.mappings import MappingBudget, count_mappings, read_limit


def test_the_limit_is_read_from_the_sysctl_and_mappings_are_counted():
    assert read_limit() >= 1024
    assert read_limit("/nonexistent") == 65530
    assert count_mappings() > 10


def test_contiguous_allocations_are_refused_before_the_broker_allocates(broker):
    with BrokerClient.connect(broker.socket, client_name="many-windows") as c:
        c.mappings = MappingBudget(limit=count_mappings() + 2048 + 60, headroom=2048)
        made = 0
        with pytest.raises(BrokerError) as e:
            for _ in range(400):
                before = c.stats().allocations_total
                c.allocate([Spec(1, contiguous=True)])
                made += 1
        assert e.value.code.name == "RESOURCE_EXHAUSTED"
        assert "vm.max_map_count" in e.value.message and "sysctl -w vm.max_map_count=" in e.value.message
        assert 10 <= made < 400
        # The refused call allocated nothing at the broker; other allocations still work.
        assert c.stats().allocations_total == before
        objs = c.allocate([Spec(2)])  # not contiguous: no window mapping, not refused
        assert c.stats().allocations_total == before + 1 and len(objs[0].pages) == 2


def test_a_mapping_that_fails_with_enomem_becomes_a_clear_error(broker, monkeypatch):
    with BrokerClient.connect(broker.socket, client_name="enomem") as c:
        c.allocate([Spec(1)])  # slabs attached

        def fail(*a, **kw):
            raise OSError(errno.ENOMEM, "mmap(...): Cannot allocate memory")

        monkeypatch.setattr(c.view, "map_window", fail)
        with pytest.raises(BrokerError) as e:
            c.allocate([Spec(1, contiguous=True)])
        assert e.value.code.name == "RESOURCE_EXHAUSTED" and "vm.max_map_count" in e.value.message
