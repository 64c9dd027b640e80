"""Adapters' page images in the tier (docs/tier.md, "Adapters' images"): two brokers with
separate run and state directories stand for two hosts over one tier (a real Valkey, then a
real Mooncake Store master). The image broker A converted from an adapter's files, broker B
reads from the tier under its content key, digest checked, instead of converting the files;
a corrupted image is a miss and B converts the files; another layout never shares it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from adapter_fixtures import copy_adapter, peft_dirs  # noqa: F401 - fixture
from conftest import start_broker
from tier_servers import KINDS, start_tier_server
from valkey import Valkey

from memory_broker.clients import BrokerClient

ADAPTER = ["--pool-size", "64MiB", "--slab-size", "4MiB", "--page-size", "512KiB", "--adapter-dtype", "float32"]
TIER = ["--tier-deadline", "2s", "--tier-mooncake-segment-size", "64MiB", "--tier-adapters"]


@pytest.fixture(params=sorted(KINDS))
def tier(request):
    s = start_tier_server(request.param)
    yield s
    s.stop()


@pytest.fixture
def valkey():
    s = start_tier_server("valkey")
    yield s
    s.stop()


def broker(tier, *extra):
    b = start_broker(*tier.flags(), *TIER, *ADAPTER, *extra)
    return b, BrokerClient.connect(b.socket, client_name="host")


def load(c: BrokerClient, adapter_id: str, path: str) -> str:
    """Register and acquire the adapter (cold -> hot): the checksum of its pages."""
    c.register_adapter(adapter_id, path)
    with c.acquire_adapters([adapter_id]) as lease:
        assert [a.found_in for a in lease.adapters] == ["cold"]
    (check,) = c.verify_adapters([adapter_id]).checks
    assert check.ok and check.checksum.startswith("sha256:"), check
    return check.checksum


def written(c: BrokerClient, n: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while c.stats().tier.written < n:
        assert time.monotonic() < end, c.stats().tier
        time.sleep(0.05)


def stop(*pairs) -> None:
    for b, c in pairs:
        c.close()
        b.stop(timeout=60.0)


def test_b_reads_the_image_a_converted_from_the_tier_instead_of_converting(tier, peft_dirs, tmp_path):  # noqa: F811
    a = broker(tier)
    b = broker(tier)
    try:
        mine = load(a[1], "r8", peft_dirs["r8"])
        written(a[1], 1)
        # Another id and another directory on B: the key is the content (files and layout).
        theirs = load(b[1], "sql-r8", copy_adapter(peft_dirs["r8"], str(tmp_path / "copy")))
        assert theirs == mine
        st = b[1].stats().tier
        assert st.hits == 1 and st.corrupt == 0 and st.bytes_read > 0
        assert "adapter_image_from_tier" in b[0].log()
        # B keeps it in its own image cache too, and wrote nothing back (it converted nothing).
        assert b[1].stats().tier.written == 0
        assert "adapter_image_from_tier" not in a[0].log()
        # The operator sees each side in GetStats, the status line and the metrics.
        ta, tb = a[1].stats().tier, b[1].stats().tier
        assert (ta.adapter_images, ta.adapter_images_written, ta.adapter_images_read) == (True, 1, 0)
        assert (tb.adapter_images, tb.adapter_images_written, tb.adapter_images_read) == (True, 0, 1)
        out = subprocess.run(
            [sys.executable, "-m", "memory_broker.broker.cli", "status", "--socket", b[0].socket],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "adapter images 0 written, 1 read" in out, out
    finally:
        stop(a, b)


def test_a_corrupted_image_in_the_tier_is_a_miss_and_b_converts_the_files(valkey, peft_dirs):  # noqa: F811
    a = broker(valkey)
    b = broker(valkey)
    try:
        mine = load(a[1], "r4", peft_dirs["r4"])
        written(a[1], 1)
        v = Valkey(port=valkey.port)
        (name,) = [k for k in v.keys("mb/shared/adapter.*") if not k.endswith(b"#meta")]
        value = bytearray(v.get(name))
        value[len(value) // 2] ^= 0xFF
        v.set(name, bytes(value))
        theirs = load(b[1], "r4", peft_dirs["r4"])
        assert theirs == mine  # from the files
        st = b[1].stats().tier
        assert st.corrupt == 1 and st.hits == 0
        assert "adapter_image_from_tier" not in b[0].log()
    finally:
        stop(a, b)


def test_another_layout_never_shares_an_image(valkey, peft_dirs):  # noqa: F811
    a = broker(valkey)
    b = broker(valkey, "--adapter-dtype", "float16")
    try:
        load(a[1], "r16", peft_dirs["r16"])
        written(a[1], 1)
        load(b[1], "r16", peft_dirs["r16"])
        written(b[1], 1)  # B converted the files, and wrote its own image
        st = b[1].stats().tier
        assert st.hits == 0 and st.corrupt == 0
        names = [k for k in Valkey(port=valkey.port).keys("mb/shared/adapter.*") if not k.endswith(b"#meta")]
        assert len(names) == 2
    finally:
        stop(a, b)


def test_without_tier_adapters_no_image_goes_to_the_tier(valkey, peft_dirs):  # noqa: F811
    b = start_broker(*valkey.flags(), *ADAPTER)
    c = BrokerClient.connect(b.socket, client_name="host")
    try:
        load(c, "r4", peft_dirs["r4"])
        time.sleep(0.5)
        assert c.stats().tier.written == 0
        assert Valkey(port=valkey.port).keys("*") == []
    finally:
        stop((b, c))
