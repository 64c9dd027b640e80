"""The host arena backend: sealed memfd slabs, a physical view and a window mapped with libc mmap."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.arena.host import HostArena, HostArenaView, host_buffer
from memory_broker.broker.server.options import ServeOptions
from memory_broker.broker.server.values import format_size as options_format_size
from memory_broker.proto.wire.mapping import check_sizes, format_size, host
from memory_broker.proto.wire.mapping.view import page_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PAGE = 64 * 1024
# 4 slabs of 4 pages (16 physical pages, 1 MiB) and a 32-page window.
GEOM = ArenaGeometry(page_size=PAGE, pages_per_slab=4, max_slabs=4, window_pages=32)


@pytest.fixture
def arena() -> Iterator[HostArena]:
    a = HostArena(GEOM, name="test-arena")
    yield a
    a.close()


@pytest.fixture
def full_arena(arena: HostArena) -> HostArena:
    arena.grow(GEOM.max_slabs)
    return arena


def fill_page(view: HostArenaView, page: int, value: int) -> None:
    ctypes.memset(view.page_address(page), value, PAGE)


def page_bytes(address: int) -> bytes:
    return ctypes.string_at(address, PAGE)


def readable(address: int) -> bool:
    """Whether one byte at ``address`` can be read, asked of the kernel so a fault is EFAULT, not SIGSEGV."""
    r, w = os.pipe()
    try:
        os.write(w, host_buffer(address, 1))
        return True
    except OSError as e:
        assert e.errno == errno.EFAULT
        return False
    finally:
        os.close(r)
        os.close(w)


def writable(address: int) -> bool:
    """Whether one byte at ``address`` can be written, asked of the kernel (EFAULT instead of SIGSEGV)."""
    r, w = os.pipe()
    try:
        os.write(w, b"\x00")
        os.readv(r, [host_buffer(address, 1)])
        return True
    except OSError as e:
        assert e.errno == errno.EFAULT
        return False
    finally:
        os.close(r)
        os.close(w)


def maps_perms(address: int) -> str | None:
    """The permissions /proc/self/maps lists for the mapping holding ``address``, or None if unmapped."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    return None


# ------------------------------------------------------------- growth


def test_grow_adds_slabs_one_at_a_time_up_to_max_slabs(arena: HostArena) -> None:
    assert arena.backend == "host"
    assert arena.num_slabs == 0 and arena.capacity_pages == 0
    for n in range(1, GEOM.max_slabs + 1):
        arena.grow(1)
        assert arena.num_slabs == n
        assert arena.view.mapped_slabs == n
        assert arena.capacity_pages == n * GEOM.pages_per_slab
    assert len({arena.slab_fd(i) for i in range(GEOM.max_slabs)}) == GEOM.max_slabs


def test_grow_past_max_slabs_raises_memory_error_with_numbers(full_arena: HostArena) -> None:
    with pytest.raises(MemoryError, match=r"arena at 4 of 4 slabs \(1 MiB\); cannot grow by 1"):
        full_arena.grow(1)
    assert full_arena.num_slabs == 4


def test_grow_that_would_overshoot_creates_no_slab(arena: HostArena) -> None:
    arena.grow(2)
    assert arena.wait_populated(30)  # the populate thread's fds are closed
    fds_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError, match=r"arena at 2 of 4 slabs \(512 KiB\); cannot grow by 3"):
        arena.grow(3)
    assert arena.num_slabs == 2 and arena.view.mapped_slabs == 2
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


def test_grow_that_fails_midway_raises_memory_error_and_leaves_nothing_behind(
    arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    arena.grow(1)
    assert arena.wait_populated(30)  # the populate thread's fds are closed
    fds_before = sorted(os.listdir("/proc/self/fd"))
    real_mmap = host._mmap
    calls = 0

    def fail_second_slab(addr, length, prot, flags, fd, offset):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.ENOMEM, "mmap: out of memory (injected)")
        return real_mmap(addr, length, prot, flags, fd, offset)

    monkeypatch.setattr(host, "_mmap", fail_second_slab)
    with pytest.raises(MemoryError, match=r"mmap\(slab 2 .*from 1 to 3 slabs"):
        arena.grow(2)
    monkeypatch.undo()
    assert arena.num_slabs == 1 and arena.view.mapped_slabs == 1
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert maps_perms(arena.view.page_address(GEOM.pages_per_slab)) == "---p"
    arena.grow(3)
    assert arena.num_slabs == 4


def resident_pages(address: int, length: int) -> int:
    """OS pages of ``[address, address+length)`` backed by memory now (``mincore``: a shared
    mapping reports its file's pages, whether or not this process touched them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    os_page = os.sysconf("SC_PAGE_SIZE")
    vec = (ctypes.c_uint8 * (-(-length // os_page)))()
    if libc.mincore(address, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec)


def test_a_grown_slab_is_populated_before_any_request_touches_it() -> None:
    arena = HostArena(GEOM, name="test-populate")
    try:
        os_pages = GEOM.slab_size // os.sysconf("SC_PAGE_SIZE")
        arena.grow(1)
        assert arena.wait_populated(30)
        assert arena.populated_slabs == 1
        # Every page of the new slab is backed, nobody having touched one.
        assert resident_pages(arena.view.page_address(0), GEOM.slab_size) == os_pages
        # Only what grew: populating never backs more than the slabs the arena holds.
        arena.grow(2)
        assert arena.wait_populated(30) and arena.populated_slabs == 3
        assert resident_pages(arena.view.phys_base, 3 * GEOM.slab_size) == 3 * os_pages
        assert ctypes.string_at(arena.view.phys_base, 3 * GEOM.slab_size) == bytes(3 * GEOM.slab_size)
    finally:
        arena.close()


def test_populate_keeps_what_was_written_first_and_can_be_turned_off() -> None:
    arena = HostArena(GEOM, name="test-populate-race")
    try:
        # Written before (or while) the thread populates: fallocate never clears a page.
        for _ in range(3):
            have = arena.num_slabs
            arena.grow(1)
            fill_page(arena.view, have * GEOM.pages_per_slab, 0x5A)
        assert arena.wait_populated(30)
        for s in range(3):
            assert page_bytes(arena.view.page_address(s * GEOM.pages_per_slab)) == b"\x5a" * PAGE
    finally:
        arena.close()
    off = HostArena(GEOM, name="test-populate-off", populate=False)
    try:
        off.grow(1)
        assert off.wait_populated(1) and off.populated_slabs == 0
        assert resident_pages(off.view.page_address(0), GEOM.slab_size) == 0
    finally:
        off.close()


def mapped_rss(address: int) -> int:
    """Bytes of the mapping holding ``address`` that this process's page tables map now (smaps Rss)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def test_a_client_mapping_a_slab_fills_its_page_tables_at_once(full_arena: HostArena) -> None:
    assert full_arena.wait_populated(30)
    for populate, want in ((False, 0), (True, GEOM.slab_size)):
        view = HostArenaView(GEOM)
        try:
            view.attach_slab(0, full_arena.slab_fd(0), populate=populate)
            # The broker populated the slab; the client's own page tables are another matter.
            assert mapped_rss(view.page_address(0)) == want
        finally:
            view.close()


def test_new_slabs_read_as_zero(full_arena: HostArena) -> None:
    view = full_arena.view
    assert ctypes.string_at(view.phys_base, GEOM.max_pages * PAGE) == bytes(GEOM.max_pages * PAGE)


def test_slab_fds_are_sealed_against_shrink_and_grow(full_arena: HostArena) -> None:
    fd = full_arena.slab_fd(1)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, GEOM.slab_size // 2)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, GEOM.slab_size * 2)
    with pytest.raises(PermissionError):  # F_SEAL_SEAL: nobody can add or change seals later
        fcntl.fcntl(fd, host.F_ADD_SEALS, host.F_SEAL_SHRINK)
    assert os.fstat(fd).st_size == GEOM.slab_size


def test_slab_fds_are_close_on_exec(full_arena: HostArena) -> None:
    assert not any(os.get_inheritable(full_arena.slab_fd(i)) for i in range(full_arena.num_slabs))


def test_slab_fd_out_of_range_raises_value_error(full_arena: HostArena) -> None:
    with pytest.raises(ValueError, match="slab 4 does not exist; the arena has 4 slabs"):
        full_arena.slab_fd(4)


# ------------------------------------------------------------- physical view and window


def test_byte_written_through_physical_view_is_read_through_window(full_arena: HostArena) -> None:
    torch = pytest.importorskip("torch")
    view = full_arena.view
    phys = torch.frombuffer(host_buffer(view.page_address(9), PAGE), dtype=torch.uint8)
    phys[123] = 0x5A
    view.map_window(20, [9])
    window = torch.frombuffer(host_buffer(view.window_address(20), PAGE), dtype=torch.uint8)
    assert int(window[123]) == 0x5A


def test_scattered_pages_form_one_contiguous_window_buffer(full_arena: HostArena) -> None:
    view = full_arena.view
    for p in range(GEOM.max_pages):
        fill_page(view, p, 0x10 + p)
    pages = [7, 2, 12, 5]
    view.map_window(3, pages)
    buf = ctypes.string_at(view.window_address(3), len(pages) * PAGE)
    for i, p in enumerate(pages):
        assert buf[i * PAGE : (i + 1) * PAGE] == bytes([0x10 + p]) * PAGE


def test_write_through_window_lands_in_its_physical_page(full_arena: HostArena) -> None:
    view = full_arena.view
    pages = [7, 2, 12, 5]
    view.map_window(3, pages)
    for i in range(len(pages)):
        ctypes.memmove(view.window_address(3 + i) + PAGE - 2, bytes([0xC0 + i, 0xD0 + i]), 2)
    for i, p in enumerate(pages):
        assert ctypes.string_at(view.page_address(p) + PAGE - 2, 2) == bytes([0xC0 + i, 0xD0 + i])


def test_mapping_a_window_page_again_replaces_the_old_mapping(full_arena: HostArena) -> None:
    view = full_arena.view
    fill_page(view, 1, 0x11)
    fill_page(view, 2, 0x22)
    view.map_window(0, [1])
    view.map_window(0, [2])
    assert page_bytes(view.window_address(0)) == b"\x22" * PAGE


def test_unmap_window_leaves_range_reserved_but_inaccessible(full_arena: HostArena) -> None:
    view = full_arena.view
    view.map_window(4, [0, 1, 2])
    assert all(readable(view.window_address(4 + i)) for i in range(3))
    view.unmap_window(4, 3)
    for i in range(3):
        addr = view.window_address(4 + i)
        assert not readable(addr)
        assert maps_perms(addr) == "---p"  # still ours: no other mmap can land here


def test_unmapped_window_range_can_be_mapped_again(full_arena: HostArena) -> None:
    view = full_arena.view
    fill_page(view, 6, 0x66)
    fill_page(view, 13, 0x13)
    view.map_window(10, [6, 13])
    view.unmap_window(10, 2)
    view.map_window(10, [13, 6])
    assert page_bytes(view.window_address(10)) == b"\x13" * PAGE
    assert page_bytes(view.window_address(11)) == b"\x66" * PAGE


def test_unmapped_window_starts_inaccessible(arena: HostArena) -> None:
    view = arena.view
    assert not readable(view.window_address(0))
    assert not readable(view.window_address(GEOM.window_pages - 1))
    assert not readable(view.page_address(0))  # no slab attached yet


@pytest.mark.parametrize(
    ("window_page", "pages", "message"),
    [
        (-1, [0], "window pages -1..0"),
        (31, [0, 1], "window pages 31..33 .* window of 32 pages"),
        (0, [0, 16], "physical page 16 .* 16 pages of the 4 mapped slabs"),
        (0, [3, -1], "physical page -1"),
    ],
)
def test_map_window_out_of_range_raises_value_error_and_maps_nothing(
    full_arena: HostArena, window_page: int, pages: list[int], message: str
) -> None:
    view = full_arena.view
    fill_page(view, 9, 0x99)
    view.map_window(0, [9])
    with pytest.raises(ValueError, match=message):
        view.map_window(window_page, pages)
    assert page_bytes(view.window_address(0)) == b"\x99" * PAGE
    assert not readable(view.window_address(1))
    assert not readable(view.window_address(31))


def test_map_window_rejects_pages_of_slabs_not_yet_attached(arena: HostArena) -> None:
    arena.grow(2)
    with pytest.raises(ValueError, match="physical page 8 .* 8 pages of the 2 mapped slabs"):
        arena.view.map_window(0, [1, 8])
    assert not readable(arena.view.window_address(0))


@pytest.mark.parametrize(("window_page", "count"), [(-1, 1), (30, 3), (0, 33), (4, -1)])
def test_unmap_window_out_of_range_raises_value_error_and_unmaps_nothing(
    full_arena: HostArena, window_page: int, count: int
) -> None:
    view = full_arena.view
    view.map_window(0, list(range(GEOM.max_pages)))
    view.map_window(16, list(range(GEOM.max_pages)))
    with pytest.raises(ValueError, match="outside the window of 32 pages"):
        view.unmap_window(window_page, count)
    assert all(readable(view.window_address(w)) for w in range(GEOM.window_pages))


def test_attach_slab_out_of_order_raises_value_error_and_attaches_nothing(arena: HostArena) -> None:
    arena.grow(1)
    other = HostArena(GEOM, name="other")
    try:
        other.grow(3)
        view = arena.view
        with pytest.raises(ValueError, match="slab 2 attached out of order: 1 slabs are mapped"):
            view.attach_slab(2, other.slab_fd(2))
        with pytest.raises(ValueError, match="slab 0 attached out of order: 1 slabs are mapped"):
            view.attach_slab(0, other.slab_fd(0))
        assert view.mapped_slabs == 1
        assert maps_perms(view.page_address(2 * GEOM.pages_per_slab)) == "---p"
    finally:
        other.close()


def test_attach_slab_past_max_slabs_raises_value_error(full_arena: HostArena) -> None:
    spare = HostArena(GEOM, name="spare")
    try:
        spare.grow(1)
        with pytest.raises(ValueError, match="slab 4 is past the arena's maximum of 4 slabs"):
            full_arena.view.attach_slab(4, spare.slab_fd(0))
        assert full_arena.view.mapped_slabs == 4
    finally:
        spare.close()


def test_attach_slab_rejects_an_fd_smaller_than_a_slab() -> None:
    view = HostArenaView(GEOM)
    fd = os.memfd_create("too-small", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE)
        with pytest.raises(ValueError, match=f"holds {PAGE} bytes; a slab needs {GEOM.slab_size}"):
            view.attach_slab(0, fd)
        assert view.mapped_slabs == 0
    finally:
        os.close(fd)
        view.close()


def test_view_keeps_mapping_pages_after_the_caller_closes_its_fd(full_arena: HostArena) -> None:
    view = HostArenaView(GEOM)
    try:
        for i in range(2):
            fd = os.dup(full_arena.slab_fd(i))
            view.attach_slab(i, fd)
            os.close(fd)
        fill_page(full_arena.view, 6, 0x6E)
        view.map_window(0, [6])
        assert page_bytes(view.window_address(0)) == b"\x6e" * PAGE
    finally:
        view.close()


def test_readonly_slab_and_window_mappings_refuse_writes(full_arena: HostArena) -> None:
    view = HostArenaView(GEOM)
    try:
        view.attach_slab(0, full_arena.slab_fd(0), readonly=True)
        view.attach_slab(1, full_arena.slab_fd(1))
        view.map_window(0, [1])  # its slab is read-only, so this is too
        view.map_window(1, [5], readonly=True)
        view.map_window(2, [5])
        assert readable(view.page_address(1)) and not writable(view.page_address(1))
        assert readable(view.window_address(0)) and not writable(view.window_address(0))
        assert readable(view.window_address(1)) and not writable(view.window_address(1))
        assert writable(view.window_address(2)) and writable(view.page_address(5))
    finally:
        view.close()


def test_map_window_coalesces_consecutive_pages_in_one_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    geom = ArenaGeometry(page_size=4096, pages_per_slab=64, max_slabs=2, window_pages=256)
    arena = HostArena(geom, name="coalesce")
    try:
        arena.grow(2)
        calls: list[tuple[int, int]] = []
        real_mmap = host._mmap

        def counting(addr, length, prot, flags, fd, offset):
            calls.append((length, offset))
            return real_mmap(addr, length, prot, flags, fd, offset)

        monkeypatch.setattr(host, "_mmap", counting)
        arena.view.map_window(10, list(range(64)))
        assert calls == [(64 * 4096, 0)]
    finally:
        arena.close()


def test_map_window_splits_runs_at_slab_boundaries_and_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    geom = ArenaGeometry(page_size=4096, pages_per_slab=64, max_slabs=2, window_pages=256)
    arena = HostArena(geom, name="coalesce")
    try:
        arena.grow(2)
        calls: list[tuple[int, int]] = []
        real_mmap = host._mmap

        def counting(addr, length, prot, flags, fd, offset):
            calls.append((length // 4096, offset // 4096))
            return real_mmap(addr, length, prot, flags, fd, offset)

        monkeypatch.setattr(host, "_mmap", counting)
        # 60..67 crosses from slab 0 into slab 1; 100 then 3 is a jump back.
        arena.view.map_window(0, [*range(60, 68), 100, 3, 4])
        assert calls == [(4, 60), (4, 0), (1, 36), (2, 3)]
        view = arena.view
        for i, p in enumerate([*range(60, 68), 100, 3, 4]):
            ctypes.memset(view.page_address(p), i + 1, 1)
            assert ctypes.string_at(view.window_address(i), 1) == bytes([i + 1])
    finally:
        arena.close()


# ------------------------------------------------------------- lifecycle


def test_close_is_idempotent_and_later_calls_raise_runtime_error(arena: HostArena) -> None:
    arena.grow(1)
    view = arena.view
    arena.close()
    arena.close()
    view.close()
    for call in (
        lambda: arena.grow(1),
        lambda: arena.slab_fd(0),
        lambda: view.map_window(0, [0]),
        lambda: view.unmap_window(0, 1),
        lambda: view.attach_slab(0, 0),
        lambda: view.phys_base,
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_close_releases_both_reservations_and_slab_fds(arena: HostArena) -> None:
    arena.grow(2)
    view = arena.view
    fds = [arena.slab_fd(0), arena.slab_fd(1)]
    phys, window = view.phys_base, view.window_base
    arena.close()
    assert maps_perms(phys) is None and maps_perms(window) is None
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_importing_the_host_backend_does_not_import_torch() -> None:
    code = "import sys, broker.arena.host; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_the_client_side_of_the_arena_loads_no_daemon_module() -> None:
    # What a client process imports to map a broker's arena, host or CUDA.
    code = textwrap.dedent(
        """
        import sys
        from memory_broker.proto.wire.mapping import ArenaGeometry, open_view
        import memory_broker.proto.wire.mapping.cuda
        view = open_view("host", ArenaGeometry(page_size=65536, pages_per_slab=4, max_slabs=2, window_pages=8))
        view.close()
        loaded = sorted(m for m in sys.modules if m.startswith("memory_broker.broker") or m in ("torch", "grpc"))
        assert not loaded, loaded
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------- sizes, one definition


def test_format_size_writes_the_largest_binary_unit_reached() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1000) == "1000 B"
    assert format_size(512 << 10) == "512 KiB"
    assert format_size(2 << 20) == "2 MiB"
    assert format_size(1536 << 20) == "1.5 GiB"
    assert format_size(3 << 40) == "3 TiB"


def test_the_daemon_settings_format_sizes_with_the_one_format_size() -> None:
    assert options_format_size is format_size


@pytest.mark.parametrize(
    ("page", "slab", "pool", "message"),
    [
        (3 << 20, 6 << 20, 60 << 20, r"page_size: 3145728 bytes; must be a power of two from 512KiB to 4MiB"),
        (256 << 10, 1 << 20, 8 << 20, r"page_size: 262144 bytes"),
        (8 << 20, 8 << 20, 8 << 20, r"page_size: 8388608 bytes"),
        (2 << 20, 3 << 20, 6 << 20, r"slab_size: 3145728 bytes is not a multiple of page_size \(2097152\)"),
        (2 << 20, 8 << 20, 4 << 20, r"pool_size: 4194304 bytes must be a positive multiple of slab_size \(8388608\)"),
        (2 << 20, 8 << 20, 12 << 20, r"pool_size: 12582912 bytes"),
    ],
)
def test_arena_sizes_are_checked_in_one_place_that_names_the_setting(
    page: int, slab: int, pool: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_sizes(page, slab, pool)
    with pytest.raises(ValueError, match=message):
        ServeOptions(page_size=page, slab_size=slab, pool_size=pool).validate()


def test_arena_sizes_a_broker_accepts_pass_the_check() -> None:
    check_sizes(512 << 10, 512 << 10, 512 << 10)
    check_sizes(2 << 20, 64 << 20, 1 << 30)
    check_sizes(4 << 20, 8 << 20, 64 << 20)


def test_host_view_refuses_a_page_size_the_os_cannot_map_and_names_the_nearest() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    message = rf"not a multiple of the OS page size of this machine, {page} bytes.*use a page size of"
    with pytest.raises(ValueError, match=message):
        HostArenaView(ArenaGeometry(page_size=page + 512, pages_per_slab=4, max_slabs=1, window_pages=4))
    with pytest.raises(ValueError, match="geometry needs positive sizes: 4 pages per slab, 0 slabs"):
        HostArenaView(ArenaGeometry(page_size=page, pages_per_slab=4, max_slabs=0, window_pages=4))


def test_page_runs_split_at_gaps_slab_boundaries_and_changes_of_key() -> None:
    pages = [*range(60, 68), 100, 3, 4]
    assert page_runs(pages) == [(0, 60, 8), (8, 100, 1), (9, 3, 2)]
    assert page_runs(pages, 64) == [(0, 60, 4), (4, 64, 4), (8, 100, 1), (9, 3, 2)]
    assert page_runs([1, 2, 3, 4], 64, key=lambda p: p == 3) == [(0, 1, 2), (2, 3, 1), (3, 4, 1)]
    assert page_runs([]) == []


# ------------------------------------------------------------- two processes

CHILD = textwrap.dedent(
    """
    import ctypes, os, socket, sys
    from memory_broker.proto.wire.mapping import ArenaGeometry
    from memory_broker.proto.wire.mapping.host import HostArenaView

    sock = socket.socket(fileno=int(sys.argv[1]))
    _, fds, _, _ = socket.recv_fds(sock, 16, 8)
    geom = ArenaGeometry(page_size={page}, pages_per_slab=4, max_slabs=4, window_pages=32)
    view = HostArenaView(geom)
    for i, fd in enumerate(fds):
        view.attach_slab(i, fd)
        os.close(fd)
    pages = [6, 1, 4, 3]
    view.map_window(5, pages)
    for i, p in enumerate(pages):
        got = ctypes.string_at(view.window_address(5 + i), {page})
        if got != bytes([0x40 + p]) * {page}:
            sock.sendall(f"page {{p}} at window page {{5 + i}} does not hold the parent's pattern".encode())
            sys.exit(1)
        ctypes.memset(view.window_address(5 + i) + 1, 0xA0 + i, 1)
    sock.sendall(b"ok")
    sock.recv(16)  # the parent checks our writes while we are alive, then says done
    view.close()
    """
)


def test_two_processes_share_pages_through_passed_slab_fds(arena: HostArena) -> None:
    arena.grow(2)
    view = arena.view
    for p in range(2 * GEOM.pages_per_slab):
        fill_page(view, p, 0x40 + p)
    parent_sock, child_sock = socket.socketpair()
    parent_sock.settimeout(20)
    with parent_sock:
        with child_sock:
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD.format(root=ROOT, page=PAGE), str(child_sock.fileno())],
                pass_fds=[child_sock.fileno()],
                cwd=ROOT,
                stderr=subprocess.PIPE,
                text=True,
            )
        try:
            socket.send_fds(parent_sock, [b"slabs"], [arena.slab_fd(0), arena.slab_fd(1)])
            reply = parent_sock.recv(200)
            assert reply == b"ok", reply
            for i, p in enumerate([6, 1, 4, 3]):
                assert ctypes.string_at(view.page_address(p), 3) == bytes([0x40 + p, 0xA0 + i, 0x40 + p])
            parent_sock.sendall(b"done")
            assert proc.wait(timeout=20) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
