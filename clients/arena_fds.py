"""A client's side of the arena's fds: fetching them over the fd channel and mapping what they
hold, slab by slab (host arena) or page by page, lazily (CUDA arena).

This module owns how a session turns fds into mappings (``attach_slabs``, ``import_pages``);
the session (``clients.session``) decides when, under its mapping lock. On a CUDA arena fds
come ``MAX_FDS_PER_MESSAGE`` at a time and each is closed once imported, so a process never
holds more than one message's fds, whatever the arena's size (a whole GPU is ~70,000 pages,
more than ``RLIMIT_NOFILE`` allows). It must not import torch, gRPC or the daemon.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from memory_broker.clients.fd_channel import FdChannelError, fetch_fds, fetch_slab_range, prove_session
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.mapping.host import HostArenaView
from memory_broker.proto.wire.mapping.view import page_runs
from memory_broker.proto.wire.status import code_of

# Pages of a CUDA arena asked for in one fd channel request (their fds come 200 at a time and
# are imported and closed as they come, so this bounds the request's time, not fds).
FETCH_PAGES = 4096


def fetch(path: str, token: str, first: int, count: int | None, consume: Callable[[list[int]], None], timeout: float):
    """``fetch_fds``, its refusals as BrokerError (the fd channel's code)."""
    try:
        return fetch_fds(path, token, first, count, consume, timeout=timeout)
    except FdChannelError as e:
        raise BrokerError(code_of(e.code), f"fd channel {path}: {e}") from None


def prove(path: str, token: str, timeout: float) -> str:
    """``prove_session``: this process takes the session and its proof key (refusals as
    BrokerError, the fd channel's code)."""
    try:
        return prove_session(path, token, timeout=timeout)
    except FdChannelError as e:
        raise BrokerError(code_of(e.code), f"fd channel {path}: {e}") from None


def attach_slabs(view, path: str, token: str, num_slabs: int, timeout: float) -> None:
    """Map slabs ``view.mapped_slabs..num_slabs`` (the caller holds the map lock or owns ``view``).

    A host view fetches and maps the slabs' memfds now. A CUDA view (one fd per page) only
    learns that the slabs exist: its pages are imported when the process is first given them
    (``import_pages``). The session is proven first (``prove``), by the session.
    """
    first = view.mapped_slabs
    if view.fd_unit == "page":
        view.extend(num_slabs)
        return
    try:
        start, fds = fetch_slab_range(path, token, first, timeout=timeout)
    except FdChannelError as e:
        raise BrokerError(code_of(e.code), f"fd channel {path}: {e}") from None
    try:
        # With tenant pools the broker sends this session's pool only: the slabs before
        # ``start`` and after the last sent (up to ``num_slabs``) are others', left unmapped.
        for i in range(first, start):
            view.attach_hole(i)
        for i, fd in enumerate(fds):
            # Page tables filled at once: a KV copy into fresh pages then takes no page faults
            # (0.4 against 2.2 ms per MiB written; ops/bench/results/*-host-populate.md).
            view.attach_slab(start + i, fd, populate=True)
        for i in range(start + len(fds), num_slabs):
            view.attach_hole(i)
    finally:
        for fd in fds:
            os.close(fd)
    if isinstance(view, HostArenaView) and fds:
        # Host pages start read-only here and become writable where this process is given
        # them to write (allocate, prepare). Granting write costs an mprotect and no more;
        # taking it away also flushes the TLBs of every CPU the process runs on, which a
        # lookup of another process's pages would otherwise pay each time.
        pps = view.geometry.pages_per_slab
        view.set_page_access(range(start * pps, (start + len(fds)) * pps), True)


def missing_pages(view, pages: Sequence[int]) -> list[int]:
    """The pages of ``pages`` a CUDA view lacks (none on a host view: its slabs map whole).

    Raises:
        BrokerError: INTERNAL, a page outside the arena as this process knows it.
    """
    if view.fd_unit != "page" or not pages:
        return []
    try:
        return view.missing_pages(pages)
    except ValueError as e:
        raise BrokerError(Code.INTERNAL, f"the broker named pages this client cannot map: {e}") from None


def import_pages(view, path: str, token: str, pages: Sequence[int], readonly: bool, timeout: float) -> None:
    """Import and map the pages of ``pages`` a CUDA view lacks, with the access asked for from
    the start, in runs of consecutive pages (the caller holds the map lock)."""
    for _, first, n in page_runs(missing_pages(view, pages)):
        for start in range(first, first + n, FETCH_PAGES):
            count = min(FETCH_PAGES, first + n - start)
            at = [start]

            def consume(fds: list[int], at=at) -> None:
                first_page = at[0]
                at[0] += len(fds)
                view.attach_pages(first_page, fds, readonly=readonly)

            fetch(path, token, start, count, consume, timeout)
