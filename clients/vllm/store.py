"""The KV connector's side of the broker: one session per process, failure handling, and the
byte copies between vLLM's KV cache and the broker's pages.

``BrokerKV`` owns the process's session with the broker (shared by the scheduler-side and
worker-side connectors when they live in one process), reconnects after a broker restart,
logs an outage once and counts errors; a broker that is away makes every call here return
"nothing" so that vLLM recomputes. The copy helpers place a block's layers back to back in
an object's pages and read or write them through this process's own mapping.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from memory_broker.clients import discovery
from memory_broker.clients.client import BrokerClient, BrokerObject, Spec
from memory_broker.proto.wire import gpus
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.gpus import SOCKET_NAME

# A child of vLLM's logger, so these lines show among vLLM's own.
log = logging.getLogger("vllm.memory_broker." + __name__.rsplit(".", 1)[-1])

DEFAULT_SOCKET = discovery.DEFAULT_SOCKET

# Codes that mean the session or the broker is gone (the client maps gRPC's CANCELLED,
# DEADLINE_EXCEEDED, UNKNOWN and UNAUTHENTICATED to INTERNAL): drop the session, reconnect later.
_BROKEN = {Code.UNAVAILABLE, Code.INTERNAL, Code.PERMISSION_DENIED, Code.FAILED_PRECONDITION}


def default_socket() -> str:
    """This process's broker, as ``BrokerClient.connect()`` finds it (``discovery.find_socket``:
    ``MEMORY_BROKER_SOCKET``, the broker of this process's GPU, or the host's single socket)."""
    return discovery.find_socket()[0]


def rank_socket(socket: str | None, gpu_uuid: str | None, rank: int) -> tuple[str, str | None]:
    """(socket, GPU UUID it must serve) of tensor-parallel rank ``rank``'s broker: with a
    directory of per-GPU brokers (``socket``, ``MEMORY_BROKER_SOCKET`` naming one, or
    ``/run/memory-broker`` holding them) the broker of ``gpu_uuid``, the rank's GPU; with one
    socket, that socket for every rank. The broker need not run yet (``BrokerKV`` retries)."""
    directory = discovery.broker_dir(socket)
    if directory is None:
        return socket or default_socket(), None
    if gpu_uuid is None:
        raise ValueError(
            f"{directory} holds a broker per GPU but tensor-parallel rank {rank}'s GPU is unknown "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "set kv_connector_extra_config's socket to one broker's socket"
        )
    return os.path.join(directory, gpu_uuid, SOCKET_NAME), gpu_uuid


class BrokerKV:
    """This process's session with one broker, for KV. Thread-safe; never raises BrokerError
    from ``client()``: a broker that is away yields ``None`` until ``retry_s`` has passed."""

    def __init__(
        self,
        socket: str,
        *,
        client_name: str = "vllm-kv",
        timeout_s: float = 5.0,
        retry_s: float = 2.0,
        gpu_uuid: str | None = None,
    ):
        self.socket = socket
        # The GPU the broker must serve (a per-GPU broker's), or None where any will do.
        self.gpu_uuid = gpu_uuid
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._lock = threading.RLock()
        self._client: BrokerClient | None = None
        self.incarnation: str = ""
        # Sessions that broke while pins of theirs were still in use: incarnation -> [client, holds].
        self._stale: dict[str, list] = {}
        self._holds: dict[str, int] = {}
        self._next_try = 0.0
        self._down_since: float | None = None
        self.errors = 0
        self.connects = 0
        # Whether the broker has a tier past the host, asked once per session (incarnation).
        self._tier: tuple[str, bool] = ("", False)

    # ------------------------------------------------------------- session

    def client(self) -> BrokerClient | None:
        with self._lock:
            c = self._client
            if c is not None and (c.session_ended.is_set() or c.closed):
                self._drop("the session with the broker ended")
                c = None
            if c is not None:
                return c
            now = time.monotonic()
            if now < self._next_try:
                return None
            try:
                # A short wait for a broker that is not there (vLLM recomputes meanwhile) and
                # no client-side reconnect: this store retries every retry_s itself and tells
                # sessions apart by incarnation.
                c = BrokerClient.connect(
                    self.socket,
                    client_name=self.client_name,
                    timeout=self.timeout_s,
                    wait_s=min(1.0, self.timeout_s),
                    reconnect_s=0.0,
                )
                try:
                    discovery.check_device(c.arena.device, self.gpu_uuid, self.socket)
                except BrokerError:
                    c.close()
                    raise
            except (BrokerError, OSError, ValueError) as e:
                self._next_try = time.monotonic() + self.retry_s
                self._outage(f"cannot connect: {e}")
                return None
            self._client = c
            self.incarnation = uuid.uuid4().hex
            self._holds[self.incarnation] = 0
            self.connects += 1
            if self._down_since is not None:
                log.warning(
                    "memory broker at %s is back after %.1f s: KV is stored and loaded again",
                    self.socket,
                    now - self._down_since,
                )
                self._down_since = None
            return c

    def tiered(self, client: BrokerClient) -> bool:
        """Whether this broker has a tier past the host (docs/tier.md): asked once per
        session; a failed ask is a no (and recorded)."""
        with self._lock:
            inc = self.incarnation
            if self._tier[0] != inc:
                try:
                    has = bool(client.stats().tier.backend)
                except BrokerError as e:
                    self.failed(client, e, "stats")
                    return False
                self._tier = (inc, has)
            return self._tier[1]

    def _outage(self, why: str) -> None:
        self.errors += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "memory broker at %s is unavailable (%s): vLLM recomputes KV until it is back; retrying every %.0f s",
                self.socket,
                why,
                self.retry_s,
            )
        else:
            log.debug("memory broker at %s still unavailable: %s", self.socket, why)

    def _drop(self, why: str) -> None:
        c, inc = self._client, self.incarnation
        self._client = None
        self.incarnation = ""
        self._next_try = time.monotonic() + self.retry_s
        self._outage(why)
        if c is None:
            return
        if self._holds.get(inc, 0) > 0:
            # Pinned pages are read through this mapping yet: keep it until they are let go.
            self._stale[inc] = [c, self._holds.pop(inc)]
        else:
            self._holds.pop(inc, None)
            c.close()

    def failed(self, client: BrokerClient | None, e: BaseException, what: str) -> None:
        """Record an error from a call made with ``client``; drop the session if it is broken."""
        with self._lock:
            if (
                isinstance(e, BrokerError)
                and e.code not in _BROKEN
                and client is not None
                and not client.session_ended.is_set()
            ):
                self.errors += 1
                log.debug("memory broker refused %s: %s", what, e)
                return
            if client is not None and client is self._client:
                self._drop(f"{what}: {e}")
            else:
                self.errors += 1

    def client_for(self, incarnation: str) -> BrokerClient | None:
        """The session named ``incarnation`` if this process holds it (current or stale)."""
        with self._lock:
            if incarnation and incarnation == self.incarnation:
                return self._client
            s = self._stale.get(incarnation)
            return s[0] if s else None

    def hold(self, incarnation: str, n: int) -> None:
        with self._lock:
            if incarnation in self._holds:
                self._holds[incarnation] += n

    def _releasable(self, incarnation: str, objs: Sequence[BrokerObject]) -> list[BrokerObject]:
        """Account ``objs`` (pinned through session ``incarnation``) as let go; returns those
        to unpin through the current session (none for an ended session: the broker dropped its
        pins with it)."""
        if not objs:
            return []
        with self._lock:
            stale = self._stale.get(incarnation)
            if stale is not None:
                stale[1] -= len(objs)
                if stale[1] <= 0:
                    del self._stale[incarnation]
                    stale[0].close()
                return []
            if not incarnation or incarnation != self.incarnation or self._client is None:
                return []
            self._holds[incarnation] = max(0, self._holds.get(incarnation, 0) - len(objs))
            return list(objs)

    def release(self, incarnation: str, objs: Sequence[BrokerObject]) -> None:
        """Unpin ``objs`` (pinned through session ``incarnation``); never raises."""
        self.lookup_many(None, [], False, [(incarnation, objs)])

    def lookup_many(
        self,
        client: BrokerClient | None,
        key_lists: Sequence[Sequence[bytes]],
        pin: bool,
        releases: Sequence[tuple[str, Sequence[BrokerObject]]] = (),
    ) -> list[list[BrokerObject]]:
        """Let ``releases`` go ((incarnation, pinned objects) pairs) and look up ``key_lists``
        through ``client`` (this broker's current session), all in one round trip. A refused
        or failed call is recorded (``failed``) and raised; the releases are never raised."""
        unpin: list[BrokerObject] = []
        for inc, objs in releases:
            unpin += self._releasable(inc, objs)
        if not key_lists:
            if unpin:
                with self._lock:
                    c = self._client
                try:
                    if c is not None:
                        c.unpin(unpin)
                except BrokerError as e:
                    self.failed(c, e, "unpin")
            return []
        try:
            return client.lookup_many(key_lists, pin=pin, unpin=unpin)
        except BrokerError as e:
            self.failed(client, e, "lookup")
            raise

    def close(self) -> None:
        with self._lock:
            for c, _ in self._stale.values():
                c.close()
            self._stale.clear()
            if self._client is not None:
                self._client.close()
            self._client = None
            self.incarnation = ""


_shared: dict[str, BrokerKV] = {}
_shared_lock = threading.Lock()


def shared(socket: str, **kw: Any) -> BrokerKV:
    """The one ``BrokerKV`` for ``socket`` in this process (the scheduler and worker sides
    of an engine that run in one process share its session and mapping)."""
    with _shared_lock:
        b = _shared.get(socket)
        if b is None:
            b = _shared[socket] = BrokerKV(socket, **kw)
        return b


def rank_brokers(socket: str | None, tp_size: int, **kw: Any) -> list[BrokerKV]:
    """The scheduler's broker of each tensor-parallel rank (rank r: the r-th visible GPU's)."""
    uuids = gpus.visible_gpu_uuids() if discovery.broker_dir(socket) is not None else []
    out = []
    for r in range(tp_size):
        path, gpu = rank_socket(socket, uuids[r] if r < len(uuids) else None, r)
        out.append(shared(path, gpu_uuid=gpu, **kw))
    return out


def worker_broker(socket: str | None, tp_rank: int, **kw: Any) -> BrokerKV:
    """A worker's broker: its own GPU's (``gpus.rank_gpu_uuid``), or the one socket."""
    gpu = gpus.rank_gpu_uuid(tp_rank) if discovery.broker_dir(socket) is not None else None
    path, gpu = rank_socket(socket, gpu, tp_rank)
    return shared(path, gpu_uuid=gpu, **kw)


# ------------------------------------------------------------- data plane


def pages_for(nbytes: int, page_size: int) -> int:
    return max(1, -(-nbytes // page_size))


def segments(pages: Sequence[int], page_size: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    """(physical-view offset, length, offset in the range) of bytes [offset, offset+nbytes)
    of an object made of ``pages`` in order."""
    if offset < 0 or nbytes < 0 or offset + nbytes > len(pages) * page_size:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) outside an object of {len(pages)} pages")
    out = []
    done = 0
    while done < nbytes:
        pos = offset + done
        i, within = divmod(pos, page_size)
        n = min(page_size - within, nbytes - done)
        out.append((pages[i] * page_size + within, n, done))
        done += n
    return out


def kv_specs(keys: Sequence[bytes], nbytes: int, page_size: int) -> list[Spec]:
    n = pages_for(nbytes, page_size)
    return [Spec(n, content_type="kv_cache", key=k) for k in keys]


def write_bytes(phys, pages: Sequence[int], page_size: int, offset: int, src) -> None:
    """Copy the flat uint8 tensor ``src`` into the object at ``offset`` (``phys``: the
    physical view as a uint8 tensor)."""
    for po, n, so in segments(pages, page_size, offset, src.numel()):
        phys[po : po + n].copy_(src[so : so + n])


def read_bytes(phys, pages: Sequence[int], page_size: int, offset: int, dst) -> None:
    """Copy bytes of the object at ``offset`` into the flat uint8 tensor ``dst``."""
    for po, n, so in segments(pages, page_size, offset, dst.numel()):
        dst[so : so + n].copy_(phys[po : po + n])
