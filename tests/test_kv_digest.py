"""Digests of committed keyed objects (issue 26, item 9): a read-only mapping is advisory, so a
process that maps another session's KV writable again and overwrites it is caught by
VerifyObjects, and the object is withdrawn (its key no longer resolves)."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import run_child, start_broker

from memory_broker.broker.store.digests import KeyDigests
from memory_broker.clients.client import BrokerClient
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.mapping.host import host_buffer
from memory_broker.proto.wire.spec import Spec

KEY = b"kv-block-1"


def commit_keyed(c: BrokerClient, key: bytes, fill: int):
    txn = c.prepare([Spec(1, key=key)])
    (obj,) = txn.objects
    for addr in obj.page_addresses():
        buf = host_buffer(addr, c.geometry.page_size)
        buf[:] = bytes([fill]) * len(buf)
    ((committed,),) = c.commit([txn])
    return committed


def digested(c: BrokerClient, key: bytes, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        (check,) = c.verify_objects([key]).checks
        if check.checked or time.monotonic() > deadline:
            return check
        time.sleep(0.05)


OVERWRITE = """
from memory_broker.clients.client import BrokerClient
from memory_broker.proto.wire.mapping import host
c = BrokerClient.connect(SOCKET, fast_path=False)
(obj,) = c.lookup([{key!r}], pin=True)
addr, ps = obj.page_addresses()[0], c.geometry.page_size
try:
    host.host_buffer(addr, 1)  # mapped read-only: a plain write would fault
    host._mprotect(addr, ps, host.PROT_READ | host.PROT_WRITE)
    host.host_buffer(addr, 16)[:] = b"\\xee" * 16
    out(wrote=True)
finally:
    c.unpin([obj])
    c.close()
"""


def test_an_object_overwritten_through_a_mapping_made_writable_is_reported_and_no_longer_served():
    b = start_broker("--kv-digest")
    try:
        owner = BrokerClient.connect(b.socket, fast_path=False)
        obj = commit_keyed(owner, KEY, 0x5A)
        first = digested(owner, KEY)
        assert first.checked and first.ok and first.digest.startswith("blake2b:"), first
        assert first.object_id == obj.object_id
        # Another process, which may only read the object, writes over it anyway.
        assert run_child(b.socket, OVERWRITE.format(key=KEY)) == [{"wrote": True}]
        # A key listed twice is refused before anything is digested (each copy would hash the
        # whole object again); nothing is checked or withdrawn.
        with pytest.raises(BrokerError) as e:
            owner.verify_objects([KEY, b"no-such-key", KEY])
        assert e.value.code == Code.INVALID_ARGUMENT and "keys[2] repeats" in e.value.message
        resp = owner.verify_objects([KEY, b"no-such-key"])
        bad, missing = resp.checks
        assert resp.corrupt == 1
        assert bad.checked and not bad.ok and "withdrawn" in bad.detail and bad.digest == first.digest
        assert not missing.checked and missing.ok and missing.object_id == 0
        # Never served again: the key does not resolve, for anyone.
        assert owner.lookup([KEY], pin=False) == []
        assert run_child(b.socket, "c = BrokerClient.connect(SOCKET)\nout(n=len(c.lookup([%r])))\n" % KEY) == [{"n": 0}]
        assert any(e.get("event") == "object_corrupted" for e in b.log_events())
        # The key may be written again, and the new object is digested afresh.
        again = commit_keyed(owner, KEY, 0x11)
        assert again.object_id != obj.object_id
        assert digested(owner, KEY).ok
        owner.close()
    finally:
        b.stop()


def test_verify_objects_says_how_to_turn_digests_on_when_they_are_off():
    b = start_broker()
    try:
        c = BrokerClient.connect(b.socket, fast_path=False)
        commit_keyed(c, KEY, 1)
        with pytest.raises(BrokerError) as e:
            c.verify_objects([KEY])
        c.close()
    finally:
        b.stop()
    assert e.value.code.value == "FAILED_PRECONDITION" and "--kv-digest" in e.value.message


def test_the_background_sample_finds_a_corrupt_object_without_being_asked(tmp_path):
    b = start_broker("--kv-digest", "--kv-verify-interval", "0.05")
    try:
        owner = BrokerClient.connect(b.socket, fast_path=False)
        commit_keyed(owner, KEY, 0x33)
        assert digested(owner, KEY).ok
        run_child(b.socket, OVERWRITE.format(key=KEY))
        deadline = time.monotonic() + 10
        while owner.lookup([KEY], pin=False) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.lookup([KEY], pin=False) == []
        assert any(e.get("event") == "object_corrupted" for e in b.log_events())
        owner.close()
    finally:
        b.stop()


def test_an_object_allocated_with_a_key_is_digested_at_its_first_check_and_a_later_write_reported():
    """Issue 48, item 7: every keyed object gets a digest. One made by ``Allocate`` with its
    key has no commit to take it at (its creator writes it after), so its first VerifyObjects
    takes it, and a write after that is reported and the object withdrawn."""
    b = start_broker("--kv-digest")
    try:
        c = BrokerClient.connect(b.socket, fast_path=False)
        (obj,) = c.allocate([Spec(1, key=b"direct")])
        host_buffer(obj.page_addresses()[0], 16)[:] = b"\x5a" * 16  # its creator writes it
        (first,) = c.verify_objects([b"direct"]).checks
        assert not first.checked and first.ok and first.digest.startswith("blake2b:"), first
        assert "taken now" in first.detail and "Allocate" in first.detail
        (same,) = c.verify_objects([b"direct"]).checks
        assert same.checked and same.ok and same.digest == first.digest
        host_buffer(obj.page_addresses()[0], 16)[:] = b"\xee" * 16  # a write after the digest
        resp = c.verify_objects([b"direct"])
        (bad,) = resp.checks
        assert resp.corrupt == 1 and bad.checked and not bad.ok and "withdrawn" in bad.detail
        assert c.lookup([b"direct"], pin=False) == []
        c.close()
    finally:
        b.stop()


# The creator of a keyed object: it prepares, writes and commits, then writes again through its
# own mapping (the commit made it read-only: the process dies of SIGSEGV before printing more).
SEALED = """
from memory_broker.clients.client import BrokerClient
from memory_broker.proto.wire.mapping.host import host_buffer
c = BrokerClient.connect(SOCKET, fast_path=False)
txn = c.prepare([Spec(1, key=b"sealed"), Spec(1)])
kv, anon = txn.objects
for o in (kv, anon):
    host_buffer(o.page_addresses()[0], 16)[:] = b"\\x5a" * 16
c.commit([txn])
ro = c.view.readonly_pages()
out(kv_readonly=set(kv.pages) <= ro, anon_writable=not set(anon.pages) & ro)
host_buffer(anon.page_addresses()[0], 16)[:] = b"\\x11" * 16  # its own anonymous object: still its to write
out(anon_written=True)
host_buffer(kv.page_addresses()[0], 16)[:] = b"\\xee" * 16
out(kv_written=True)
"""


def test_the_creator_of_a_keyed_object_loses_write_access_at_commit():
    """Issue 48, item 7: a committed keyed object is read-only in its creator's process too (its
    anonymous objects stay writable), so a stray write faults instead of changing shared KV."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT, child_code

    b = start_broker("--kv-digest")
    try:
        r = subprocess.run(
            [sys.executable, "-c", child_code(b.socket, SEALED)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert lines[:2] == ['{"kv_readonly": true, "anon_writable": true}', '{"anon_written": true}'], r
        assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr[-2000:])
        with BrokerClient.connect(b.socket, fast_path=False) as c:
            check = digested(c, b"sealed")
            assert check.checked and check.ok  # the write never landed
    finally:
        b.stop()


def test_a_digest_taken_for_an_object_freed_meanwhile_is_dropped():
    # In-process: the store frees the object before its digest comes back from the thread.
    from test_store_interface import make_store

    store, _ = make_store()

    class Log:
        def warning(self, *a, **k):
            pass

    async def run() -> str:
        d = KeyDigests(store, None, 4096, Log())
        gate = asyncio.Event()

        async def slow(obj):
            await gate.wait()
            return "blake2b:00"

        d._digest = lambda obj: asyncio.ensure_future(slow(obj))  # type: ignore[method-assign]
        s = store.open_session()
        t = store.prepare(s, [Spec(1, key=b"k")], [], 5.0)
        store.commit(s, [t.txn_id])
        obj = store.keys.get(b"k")
        store.free(s, [obj.object_id])
        gate.set()
        await asyncio.sleep(0.05)
        return obj.digest

    assert asyncio.run(run()) == ""


def test_withdraw_unkeys_a_pinned_object_keeps_every_figure_true_and_frees_with_the_last_pin():
    from store_invariants import check_invariants
    from test_store_interface import make_store

    store, _ = make_store()
    owner, reader = store.open_session(), store.open_session()
    t = store.prepare(owner, [Spec(2, key=b"k")], [], 5.0)
    store.commit(owner, [t.txn_id])
    obj = store.keys.get(b"k")
    store.pin(owner, [obj.object_id])
    store.lookup(reader, [b"k"], pin=True)
    used = store.stats().used_pages
    assert store.withdraw(obj)
    check_invariants(store)
    assert store.lookup(reader, [b"k"], pin=False) == [] and b"k" not in store.keys
    assert store.stats().used_pages == used  # the reader's pin holds the pages
    assert not store.withdraw(obj)  # once
    store.unpin(reader, [obj.object_id])
    check_invariants(store)
    assert store.stats().used_pages == used - 2 and obj.object_id not in store.objects
    # The key is free to be written again.
    t2 = store.prepare(owner, [Spec(1, key=b"k")], [], 5.0)
    ((again, dedup),) = store.commit(owner, [t2.txn_id])[0].result
    assert not dedup and again is not obj
    check_invariants(store)


def test_a_digest_that_cannot_be_started_never_fails_the_commit():
    from test_store_interface import make_store

    store, _ = make_store()
    warned: list[str] = []

    class Log:
        def warning(self, event, **k):
            warned.append(event)

    d = KeyDigests(store, None, 4096, Log())

    def broken(obj):
        raise RuntimeError("cannot schedule new futures after shutdown")

    d._digest = broken  # type: ignore[method-assign]
    s = store.open_session()
    t = store.prepare(s, [Spec(1, key=b"k")], [], 5.0)
    ((obj, dedup),) = store.commit(s, [t.txn_id])[0].result
    assert store.keys.get(b"k") is obj and not obj.digest and warned == ["object_digest_failed"]
