"""An engine's KV cache as a range it reserves once and never moves, with broker pages mapped in
by group as the engine grows, and unmapped when a whole group is free (docs/engine-pool.md).

The two halves may live in two processes (vLLM's scheduler and its worker). ``KvGroups`` is the
scheduler's: which group slot holds which broker group, growth asked for ahead of need by a
background thread, in batches, off the engine's step (``want``/``take_ready``), or at once when
the step has nothing left (``grow_now``); the retirement of a free group, given back only after
the last step that could read it finished (``retire``/``step_done``); and, for the worker, the
ordered map and unmap operations (``take_ops``), which travel with the next step. ``KvMapper``
is the worker's: ``HostKvRange`` owns the address range (host arena: a ``PROT_NONE``
reservation; a group's page for layer ``l`` is mapped ``MAP_SHARED|MAP_FIXED`` from the slab's
memfd at ``l * layer_stride + group * page_size``, and unmapped by mapping ``PROT_NONE``
anonymous memory over it; CUDA arena: ``CudaKvRange``, a reservation of device address space
where each page, its own allocation, is mapped whole with ``cuMemMap``), and ``apply`` carries
the operations out before the step runs. Which blocks are free is the engine's
(``clients/vllm/engine_pool.py``); the broker's arbitration is ``broker/store/engine_pool.py``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from memory_broker.clients.engine_kv import EngineKvSession
from memory_broker.proto.wire.errors import BrokerError
from memory_broker.proto.wire.mapping.host import (
    _RESERVE_FLAGS,
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_POPULATE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    _mmap,
    _munmap,
    host_buffer,
)

log = logging.getLogger(__name__)

# A retired group is unmapped once this many steps finished after it was retired: the step
# that was being scheduled when it was retired, and one in flight beside it (asynchronous
# scheduling reads a batch's block table one step behind).
RETIRE_STEPS = 2


def kv_geometry(nbytes: int, layer_stride: int, page_size: int) -> tuple[int, int]:
    """(layers, groups) of a KV cache of ``nbytes`` in layers of ``layer_stride`` bytes, in
    groups of one ``page_size`` page per layer.

    Raises:
        ValueError: the layer stride is not whole pages, or the size not whole layers.
    """
    if layer_stride <= 0 or layer_stride % page_size or nbytes % layer_stride:
        raise ValueError(
            f"a KV cache of {nbytes} bytes in layers of {layer_stride} bytes cannot be mapped in "
            f"pages of {page_size} bytes (each layer must be whole pages)"
        )
    return nbytes // layer_stride, layer_stride // page_size


class HostKvRange:
    """``nbytes`` of address space (``num_layers`` layers of ``layer_stride`` bytes), reserved
    once; group ``g`` is ``page_size`` bytes at ``l * layer_stride + g * page_size`` per layer.

    Raises:
        ValueError: the layer stride is not whole pages, or the size not whole layers.
    """

    def __init__(self, nbytes: int, layer_stride: int, page_size: int):
        self.num_layers, self.num_groups = kv_geometry(nbytes, layer_stride, page_size)
        self.nbytes, self.layer_stride, self.page_size = nbytes, layer_stride, page_size
        self.base = _mmap(None, nbytes, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        self._closed = False

    def addresses(self, group: int) -> list[int]:
        """Where group ``group``'s page of each layer is mapped."""
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group {group} is outside 0..{self.num_groups - 1}")
        return [self.base + layer * self.layer_stride + group * self.page_size for layer in range(self.num_layers)]

    def map_group(self, group: int, places: Sequence[tuple[int, int]]) -> None:
        """Map one page per layer: ``places[l]`` is (memfd, offset) of layer ``l``'s page."""
        if len(places) != self.num_layers:
            raise ValueError(f"a group has {self.num_layers} pages (one per layer), got {len(places)}")
        flags = MAP_SHARED | MAP_FIXED | MAP_POPULATE
        for addr, (fd, offset) in zip(self.addresses(group), places):
            _mmap(addr, self.page_size, PROT_READ | PROT_WRITE, flags, fd, offset)

    def map_private(self, group: int) -> None:
        """Map zeroed private memory at the group (what vLLM's warm-up may write before the
        broker's first pages come: they replace it)."""
        for addr in self.addresses(group):
            _mmap(addr, self.page_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)

    def unmap_group(self, group: int) -> None:
        """Put the reservation back over the group's pages (a touch then faults)."""
        for addr in self.addresses(group):
            _mmap(addr, self.page_size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED, -1, 0)

    def tensor(self):
        """The whole range as one int8 tensor (what vLLM's ``torch.zeros`` for the KV cache
        is answered with). Reading an unmapped group faults: the block pool never hands one out."""
        import torch

        return torch.frombuffer(host_buffer(self.base, self.nbytes), dtype=torch.int8)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _munmap(self.base, self.nbytes)


class CudaKvRange:
    """``HostKvRange`` on a CUDA arena: one reservation of device address space
    (``cuMemAddressReserve``); group ``g``'s page of layer ``l`` is the broker page's own
    allocation (a page is one, attached in ``view``, this client's ``CudaArenaView``), mapped
    whole with ``cuMemMap`` and made read-write for this device with ``cuMemSetAccess``; unmapped
    with ``cuMemUnmap`` after the context has finished its work (a kernel still reading a page
    the driver unmapped faults the context). The worker's range on a CUDA arena
    (``clients/vllm/engine_pool.py``'s ``WorkerRange``); never run on a GPU.

    Raises:
        ValueError: the layer stride is not whole pages, or the size not whole layers.
    """

    def __init__(self, view, nbytes: int, layer_stride: int, page_size: int):
        self.num_layers, self.num_groups = kv_geometry(nbytes, layer_stride, page_size)
        self.view, self.nbytes, self.layer_stride, self.page_size = view, nbytes, layer_stride, page_size
        with view.current():
            self.base = view._reserve(nbytes, "an engine's KV cache")
        self._mapped: dict[int, int] = {}  # group -> layers mapped
        # Groups on private memory (``map_private``): their allocations, owned here.
        self._private: dict[int, list] = {}
        self._closed = False

    addresses = HostKvRange.addresses

    def map_group(self, group: int, places: Sequence[int]) -> None:
        """Map one page per layer: ``places[l]`` is the broker page of layer ``l`` (attached in
        the view). A group mapped already (group 0's private memory) is unmapped first, after the
        context's work is done: the driver maps nothing over a mapping, where the host's
        ``MAP_FIXED`` replaces it. Raises CudaError (what was mapped of the group is unmapped)
        or ValueError (nothing changed)."""
        if len(places) != self.num_layers:
            raise ValueError(f"a group has {self.num_layers} pages (one per layer), got {len(places)}")
        self.addresses(group)  # IndexError: outside the range
        handles = [self.view.page_handle(p) for p in places]  # ValueError: one not attached
        self.unmap_group(group)
        self._map_handles(group, handles)

    def map_private(self, group: int) -> None:
        """Map a private allocation of this process per layer at the group (``cuMemCreate``,
        read-write here; vLLM's warm-up may write group 0 before the broker's first pages come,
        and ``map_group`` replaces it then). Device memory outside the broker's budget until
        replaced: one page per layer. Raises CudaError (nothing of it left)."""
        self.addresses(group)
        self.unmap_group(group)
        drv, handles = self.view._drv, []
        with self.view.current():
            try:
                prop = self.view.allocation_prop()
                for _ in range(self.num_layers):
                    handles.append(
                        self.view._check(
                            f"cuMemCreate({self.page_size} bytes, KV group {group}'s private page)",
                            drv.cuMemCreate(self.page_size, prop, 0),
                        )
                    )
                self._map_handles(group, handles)
            except BaseException:
                for h in handles:
                    drv.cuMemRelease(h)
                raise
        self._private[group] = handles

    def _map_handles(self, group: int, handles: list) -> None:
        with self.view.current():
            done = 0
            try:
                for addr, h in zip(self.addresses(group), handles):
                    self.view._map_run(addr, [h], self.page_size, False, f"KV group {group}")
                    done += 1
            except BaseException:
                self._unmap(group, done)
                raise
        self._mapped[group] = done

    def unmap_group(self, group: int) -> None:
        """Unmap the group's pages once the context's work is done (a touch then faults); a
        private group's allocations are released."""
        n = self._mapped.pop(group, 0)
        private = self._private.pop(group, [])
        if n or private:
            with self.view.current():
                if n:
                    self.view._check(
                        "cuCtxSynchronize (before unmapping a KV group)", self.view._drv.cuCtxSynchronize()
                    )
                    self._unmap(group, n)
                for h in private:
                    self.view._check(f"cuMemRelease(KV group {group}'s private page)", self.view._drv.cuMemRelease(h))

    def _unmap(self, group: int, n: int) -> None:
        drv = self.view._drv
        for addr in self.addresses(group)[:n]:
            self.view._check(f"cuMemUnmap(KV group {group})", drv.cuMemUnmap(addr, self.page_size))

    def tensor(self):
        """The whole range as one int8 tensor on the device (unmapped groups are holes the
        block pool never hands out). Group 0 must be mapped: torch may ask the driver about a
        tensor's base address and refuse one not mapped (the physical view's anchor page).

        Raises:
            ValueError: group 0 is not mapped.
            RuntimeError: torch made a copy instead of a view.
        """
        import torch

        from memory_broker.proto.wire.mapping.cuda_mappings import CudaArrayInterface

        if self._mapped.get(0) != self.num_layers:
            raise ValueError("map group 0 first: the KV range's tensor needs its base address mapped")
        dev = torch.device("cuda", self.view.device.ordinal)
        t = torch.as_tensor(CudaArrayInterface(self.base, self.nbytes), device=dev)
        if t.data_ptr() != self.base or t.numel() != self.nbytes:
            raise RuntimeError(f"torch.as_tensor copied the KV range at {self.base:#x} instead of viewing it")
        return t.view(torch.int8)

    def close(self) -> None:
        """Unmap every group and free the reservation (a tensor from ``tensor`` must be gone)."""
        if self._closed:
            return
        self._closed = True
        for g in list(self._mapped):
            self.unmap_group(g)
        with self.view.current():
            self.view._check(
                "cuMemAddressFree(an engine's KV cache)", self.view._drv.cuMemAddressFree(self.base, self.nbytes)
            )


class KvGroups:
    """Group slots of an engine's KV range and the broker groups mapped into them (the
    scheduler's half: it maps nothing itself; ``take_ops`` hands the worker what to map).

    Args:
        kv: the engine's broker registration (its ``group_pages`` is the range's layers).
        num_groups: group slots in the range.
        batch: groups one background grow asks for at most.
    """

    def __init__(self, kv: EngineKvSession, num_groups: int, batch: int = 4):
        self.kv, self.num_groups, self.batch = kv, num_groups, batch
        self._lock = threading.Lock()
        # Slot -> the broker group (object id) mapped there.
        self.backed: dict[int, int] = {}
        # Slots mapped by the background grower, not yet taken by the engine.
        self._ready: list[int] = []
        # (step retired at, slot) waiting for RETIRE_STEPS finished steps.
        self._retiring: list[tuple[int, int]] = []
        # For the worker, in order: ("map", slot, pages) and ("unmap", slot).
        self._ops: list[tuple] = []
        # The broker's arena slabs the worker must have mapped for those pages.
        self.slabs = 0
        self.step = 0
        # The engine went idle (no step since): a background grow landing now goes straight back.
        self._idle = False
        # Figures: groups mapped and given back; grows refused.
        self.grown = self.given = self.refused = 0
        self._want = 0
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ growth

    def _free_slots(self, n: int) -> list[int]:
        retiring = {s for _, s in self._retiring}
        out = []
        for slot in range(self.num_groups):
            if slot not in self.backed and slot not in retiring:
                out.append(slot)
                if len(out) == n:
                    break
        return out

    def grow_now(self, groups: int, wait_ms: int = 0, background: bool = False, least: int = 0) -> list[int]:
        """Take ``groups`` groups now (``least``: as many as the broker has, at least that
        many); the slots (fewer when the range is full). The worker
        maps them before the step they travel with (``take_ops``). A ``background`` grow that
        lands after the engine went idle is given back at once (an idle engine takes no step
        to use or return it).

        Raises:
            BrokerError: refused (RESOURCE_EXHAUSTED: the engine preempts).
        """
        with self._lock:
            groups = min(groups, len(self._free_slots(groups)))
        if groups <= 0:
            return []
        try:
            infos = self.kv.grow(groups, wait_ms, min(least, groups))
        except BrokerError:
            self.refused += 1
            raise
        with self._lock:
            slots = [] if background and self._idle else self._free_slots(len(infos))
            for slot, info in zip(slots, infos):
                self.backed[slot] = info.object_id
                self._ops.append(("map", slot, tuple(info.pages)))
                self.slabs = max(self.slabs, info.arena_slabs)
            self.grown += len(slots)
        if len(infos) > len(slots):  # another grow took the last slots meanwhile, or idle
            self.kv.shrink([i.object_id for i in infos[len(slots) :]])
        return slots

    def want(self, groups: int) -> None:
        """Ask the background grower for ``groups`` more (it batches; ``take_ready`` collects)."""
        with self._lock:
            self._idle = False
            self._want = max(self._want, groups)
            if self._thread is None:
                self._thread = threading.Thread(target=self._grow_loop, name="engine-kv-grow", daemon=True)
                self._thread.start()
            self._wake.notify()

    def take_ready(self) -> list[int]:
        """Slots the background grower took since the last call."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def _grow_loop(self) -> None:
        while True:
            with self._lock:
                while not self._want and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                n, self._want = min(self._want, self.batch), 0
            try:
                slots = self.grow_now(n, background=True)
            except BrokerError as e:
                log.debug("engine KV grow of %d groups refused: %s", n, e.message)
                continue
            except Exception:
                log.exception("engine KV grow failed")
                continue
            with self._lock:
                self._ready.extend(slots)

    # ------------------------------------------------------------ give-back

    def retire(self, slots: Sequence[int]) -> None:
        """The engine stopped handing these groups out (all their blocks free): the worker
        unmaps them before the next step; they are given back once ``RETIRE_STEPS`` more steps
        finished."""
        with self._lock:
            for s in slots:
                if s in self.backed:
                    self._retiring.append((self.step, s))
                    self._ops.append(("unmap", s))

    def step_done(self, idle: bool = False) -> int:
        """One engine step finished: give back what no step can read any more (with ``idle``,
        no request holds a block and nothing runs: everything retired); returns pages given
        back."""
        with self._lock:
            self.step += 1
            self._idle = idle
            if idle:
                self.step += RETIRE_STEPS
                self._want = 0
            due = [s for at, s in self._retiring if self.step - at >= RETIRE_STEPS]
            if not due:
                return 0
            self._retiring = [(at, s) for at, s in self._retiring if self.step - at < RETIRE_STEPS]
            ids = [self.backed.pop(s) for s in due]
        freed = self.kv.shrink(ids)
        self.given += len(ids)
        return freed

    def take_ops(self) -> tuple[list[tuple], int]:
        """The operations for the worker since the last call, in order, and the arena slabs
        their pages need."""
        with self._lock:
            self._idle = False
            ops, self._ops = self._ops, []
        return ops, self.slabs

    def pending(self) -> bool:
        """Operations the worker has not been sent, or groups not yet given back."""
        with self._lock:
            return bool(self._ops or self._retiring)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)


class KvMapper:
    """The worker's half: the reserved range, and the broker's pages to map into it.

    On a host arena a page is placed by its slab's memfd and offset (the slabs are mapped in
    this process first, ``_ensure_slabs``). On a CUDA arena a page is its own allocation,
    placed by its number: the slabs are made known to the view (``_ensure_slabs``), then the
    pages of the operations this process lacks are imported in one batch (``_import_pages``:
    fetched over the fd channel, each fd closed once imported; the view keeps each page's
    handle), and ``CudaKvRange.map_group`` maps those handles.

    Args:
        rng: the range (``HostKvRange`` on a host arena, ``CudaKvRange`` on a CUDA one).
        client: a ``BrokerClient`` of the same broker (its view: the range's on CUDA).
    """

    def __init__(self, rng: HostKvRange | CudaKvRange, client):
        g = client.arena
        if g.page_size != rng.page_size:
            raise ValueError(f"the range is in pages of {rng.page_size} bytes; the broker's are {g.page_size}")
        self.rng, self.client = rng, client
        self.cuda = isinstance(rng, CudaKvRange)
        if self.cuda != (client.view.fd_unit == "page"):
            raise ValueError(f"a {type(rng).__name__} cannot map the broker's {g.backend} arena's pages")
        self._place = (lambda p: p) if self.cuda else host_place(client.view, g.page_size, g.pages_per_slab)
        # Figures: groups mapped and unmapped.
        self.mapped = self.unmapped = 0

    def apply(self, ops: Sequence[tuple], slabs: int) -> None:
        """Carry out ``KvGroups.take_ops``'s operations, in order (before the step they came
        with). An unmap on CUDA waits for the work queued in the context first (the steps
        before this one may still run on the device: ``CudaKvRange.unmap_group``)."""
        if not ops:
            return
        self.client._ensure_slabs(slabs)
        if self.cuda:
            # Imported writable in this process's physical view too (it never writes there);
            # the range's own mapping is granted read-write by ``map_group``.
            self.client._import_pages([p for op in ops if op[0] == "map" for p in op[2]], False)
        for op in ops:
            if op[0] == "unmap":
                self.rng.unmap_group(op[1])
                self.unmapped += 1
            else:
                self.rng.map_group(op[1], [self._place(p) for p in op[2]])
                self.mapped += 1

    def close(self) -> None:
        self.rng.close()
        self.client.close()


def host_place(view, page_size: int, pages_per_slab: int) -> Callable[[int], tuple[int, int]]:
    """Broker page -> (this process's memfd of its slab, offset) on a host arena."""

    def place(page: int) -> tuple[int, int]:
        return view.slab_fd(page // pages_per_slab), (page % pages_per_slab) * page_size

    return place
