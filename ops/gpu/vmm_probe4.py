"""Open driver questions of the one-allocation-per-page CUDA arena that vmm_probe.py,
vmm_probe2.py and vmm_probe3.py did not measure. Pure cuda-bindings; torch only for Q9. One line
per question, "Qn ...: OK <facts>" or "Qn ...: FAILS <error>". About 20-40 s on an H100/H200
(Q11, the whole-GPU double mapping, only with --full: +10-20 s).

    python3 ops/gpu/vmm_probe4.py [--full]

Q12 writes through a read-only mapping and may leave the context faulted: it runs last.
Written against the cuda-bindings API without a GPU at hand: it has not run on one yet, so a
FAILS line may be the probe's own mistake; read the error before believing it.

Stage 0 of ops/gpu/run_gpu_checks.sh (this is the copy of shared/gpu-probes/vmm_probe4.py that
the project keeps working). Where it cannot run (no cuda-bindings or numpy, no driver library,
no device) it prints one line, "PROBE4 NOT RUN: <why>", and exits 1; it ends "PROBE4 DONE" when
every question was asked. The fake driver's unverified rules name the question that settles
each (tests/test_arena_cuda.py: Q4, one unmap over a run of mappings; Q8, the export error at
the fd limit).
"""

import os
import resource
import statistics
import sys
import time

try:
    import numpy as np
    from cuda.bindings import driver as cu
except ImportError as e:  # said in one line by main(), not as a traceback
    np = cu = None
    MISSING = f"{type(e).__name__}: {e}"

PG = 2 << 20
# Set by init() from the bindings, once they are known to import.
T = OKR = DEV = CTX = PROP = LOC = RELAXED = GLOBAL = None


def name(err):
    return cu.cuGetErrorName(err)[1].decode() if err != OKR else "CUDA_SUCCESS"


def ok(r):
    if r[0] != OKR:
        raise RuntimeError(name(r[0]))
    return None if len(r) == 1 else (r[1] if len(r) == 2 else r[1:])


def item(label, fn):
    t0 = time.perf_counter()
    try:
        v = fn()
        print(f"{label}: OK {v} ({(time.perf_counter() - t0) * 1e3:.0f} ms)", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{label}: FAILS {type(e).__name__}: {e}", flush=True)


def init():
    """Load the driver, take device 0's primary context and set the allocation properties.

    Returns:
        Why the probe cannot run here, as a sentence, or None.
    """
    global T, OKR, DEV, CTX, PROP, LOC, RELAXED, GLOBAL
    if cu is None:
        return f"cuda-bindings (cuda.bindings.driver) and numpy are needed ({MISSING})"
    OKR = cu.CUresult.CUDA_SUCCESS
    try:
        r = cu.cuInit(0)
    except Exception as e:  # noqa: BLE001 - without libcuda.so.1 the bindings raise
        return f"no CUDA driver library on this machine ({type(e).__name__}: {str(e).splitlines()[0]})"
    if r[0] != OKR:
        return f"cuInit(0) failed: {name(r[0])}"
    n = cu.cuDeviceGetCount()
    if n[0] != OKR or n[1] < 1:
        return f"no CUDA device (cuDeviceGetCount: {name(n[0])}, {n[1]} devices)"
    T = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    DEV = ok(cu.cuDeviceGet(0))
    CTX = ok(cu.cuDevicePrimaryCtxRetain(DEV))
    ok(cu.cuCtxSetCurrent(CTX))
    PROP = cu.CUmemAllocationProp()
    PROP.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    PROP.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    PROP.location.id = 0
    PROP.requestedHandleTypes = T
    LOC = cu.CUmemLocation()
    LOC.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    LOC.id = 0
    RELAXED = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    dev_name = ok(cu.cuDeviceGetName(256, DEV))
    dev_name = bytes(dev_name).split(b"\0", 1)[0].decode(errors="replace")
    print(f"device 0: {dev_name}; driver CUDA {ok(cu.cuDriverGetVersion())}", flush=True)
    return None


def desc(ro=False):
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = 0
    f = cu.CUmemAccess_flags
    d.flags = f.CU_MEM_ACCESS_FLAGS_PROT_READ if ro else f.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


def page():
    return ok(cu.cuMemCreate(PG, PROP, 0))


def reserve(n):
    return int(ok(cu.cuMemAddressReserve(n * PG, 0, 0, 0)))


def mapv(va, h):
    ok(cu.cuMemMap(va, PG, 0, h, 0))


def access(va, n, ro=False):
    ok(cu.cuMemSetAccess(va, n * PG, [desc(ro)], 1))


def unmap(va, n=1):
    for i in range(n):
        ok(cu.cuMemUnmap(va + i * PG, PG))


def get_access(va):
    return int(ok(cu.cuMemGetAccess(LOC, va)))  # 1 = PROT_READ, 3 = PROT_READWRITE


def read32(va):
    b = np.zeros(1, np.uint32)
    ok(cu.cuMemcpyDtoH(b.ctypes.data, va, 4))
    return int(b[0])


def maps_lines():
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def p50(xs):
    return f"{statistics.median(xs) * 1e6:.1f}"


def q1():  # one allocation at two VAs of one process, different access (phys view RW, window RO)
    h = page()
    a = reserve(1)
    b = reserve(1)
    mapv(a, h)
    mapv(b, h)
    access(a, 1)
    access(b, 1, ro=True)
    ok(cu.cuMemsetD32(a, 0xA1, PG // 4))
    ok(cu.cuCtxSynchronize())
    first = (get_access(a), get_access(b), hex(read32(b)))
    access(a, 1, ro=True)
    access(b, 1)  # flip
    second = (get_access(a), get_access(b))
    unmap(a)
    unmap(b)
    ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(a, PG))
    ok(cu.cuMemAddressFree(b, PG))
    return f"A rw/B ro -> getAccess {first[0]}/{first[1]}, B reads {first[2]}; flipped -> {second[0]}/{second[1]} (want 3/1, 0xa1, 1/3)"


def q2():  # import, in the same process, an fd it exported; release the import while mapped
    h = page()
    a = reserve(1)
    mapv(a, h)
    access(a, 1)
    ok(cu.cuMemsetD32(a, 0xB2, PG // 4))
    ok(cu.cuCtxSynchronize())
    fd = int(ok(cu.cuMemExportToShareableHandle(h, T, 0)))
    h2 = ok(cu.cuMemImportFromShareableHandle(fd, T))
    os.close(fd)
    c = reserve(1)
    mapv(c, h2)
    access(c, 1)
    v1 = read32(c)
    ok(cu.cuMemRelease(h2))
    v2 = read32(c)  # the mapping keeps it
    unmap(c)
    unmap(a)
    d = reserve(1)
    mapv(d, h)
    access(d, 1)
    v3 = read32(d)  # the creator's handle still maps
    unmap(d)
    ok(cu.cuMemRelease(h))
    for va in (a, c, d):
        ok(cu.cuMemAddressFree(va, PG))
    return f"import handle {'==' if int(h2) == int(h) else '!='} creator's; reads {hex(v1)}, after release {hex(v2)}, creator remaps {hex(v3)}"


def q4():  # one cuMemUnmap over 16 adjacent whole mappings (the fake refuses it)
    hs = [page() for _ in range(16)]
    w = reserve(16)
    for i, h in enumerate(hs):
        mapv(w + i * PG, h)
    access(w, 16)
    r = cu.cuMemUnmap(w, 16 * PG)[0]
    if r != OKR:
        unmap(w, 16)
    for h in hs:
        ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(w, 16 * PG))
    return f"one cuMemUnmap over 16 mappings: {name(r)}"


def q3():  # cost of mapping a window over pages already granted in a physical view (allocate/free churn)
    n = 16
    hs = [page() for _ in range(n)]
    phys = reserve(n)
    win = reserve(n)
    for i, h in enumerate(hs):
        mapv(phys + i * PG, h)
    access(phys, n)
    tm, ta, tu = [], [], []
    for _ in range(50):
        t0 = time.perf_counter()
        for i, h in enumerate(hs):
            mapv(win + i * PG, h)
        t1 = time.perf_counter()
        access(win, n)
        t2 = time.perf_counter()
        unmap(win, n)
        t3 = time.perf_counter()
        tm.append(t1 - t0)
        ta.append(t2 - t1)
        tu.append(t3 - t2)
    fresh = [page() for _ in range(n)]
    w2 = reserve(n)
    for i, h in enumerate(fresh):
        mapv(w2 + i * PG, h)
    t0 = time.perf_counter()
    access(w2, n)
    tf = time.perf_counter() - t0
    unmap(w2, n)
    unmap(phys, n)
    for h in hs + fresh:
        ok(cu.cuMemRelease(h))
    for va in (phys, win, w2):
        ok(cu.cuMemAddressFree(va, n * PG))
    return (
        f"16-page window over granted pages, p50 of 50 (us): map {p50(tm)}, access {p50(ta)}, unmap {p50(tu)}; "
        f"access of 16 never-granted pages {tf * 1e6:.0f} us"
    )


def q5():  # host VMAs per cuMemMap: one allocation at 4096 VAs (kvcached's zero-page pattern)
    n = 4096
    h = page()
    va = reserve(n)
    before = maps_lines()
    for i in range(n):
        mapv(va + i * PG, h)
    mid = maps_lines()
    access(va, n)
    ok(cu.cuMemsetD32(va + (n - 1) * PG, 0x55, 1))
    ok(cu.cuCtxSynchronize())
    alias = hex(read32(va))
    unmap(va, n)
    ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(va, n * PG))
    lim = open("/proc/sys/vm/max_map_count").read().strip()
    return f"/proc/self/maps {before} -> {mid} lines for {n} mappings (vm.max_map_count {lim}); alias read {alias} (want 0x55)"


def q6():  # cuMemMap + cuMemSetAccess while this thread's stream captures (relaxed, then global)
    s = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    h0 = page()
    x = reserve(1)
    mapv(x, h0)
    access(x, 1)
    out = []
    for mode in (RELAXED, GLOBAL):
        h1 = page()
        y = reserve(1)
        ok(cu.cuStreamBeginCapture(s, GLOBAL))
        ok(cu.cuMemsetD32Async(x, 9, PG // 4, s))
        old = ok(cu.cuThreadExchangeStreamCaptureMode(mode))
        rm = cu.cuMemMap(y, PG, 0, h1, 0)[0]
        ra = cu.cuMemSetAccess(y, PG, [desc()], 1)[0] if rm == OKR else rm
        cu.cuThreadExchangeStreamCaptureMode(old)
        res = cu.cuStreamEndCapture(s)
        replay = "-"
        if res[0] == OKR:
            ge = ok(cu.cuGraphInstantiate(res[1], 0))
            ok(cu.cuGraphLaunch(ge, s))
            ok(cu.cuStreamSynchronize(s))
            replay = hex(read32(x))
            ok(cu.cuGraphExecDestroy(ge))
            ok(cu.cuGraphDestroy(res[1]))
        if rm == OKR:
            unmap(y)
        ok(cu.cuMemRelease(h1))
        ok(cu.cuMemAddressFree(y, PG))
        out.append(
            f"{mode.name.rsplit('_', 1)[1]}: map {name(rm)}, access {name(ra)}, end capture {name(res[0])}, replay {replay}"
        )
    unmap(x)
    ok(cu.cuMemRelease(h0))
    ok(cu.cuMemAddressFree(x, PG))
    ok(cu.cuStreamDestroy(s))
    return "; ".join(out)


def q8():  # the error cuMemExportToShareableHandle returns at RLIMIT_NOFILE (the fake says OPERATING_SYSTEM)
    h = page()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds, err = [], "none"
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 3, hard))
    try:
        for _ in range(10):
            r = cu.cuMemExportToShareableHandle(h, T, 0)
            if r[0] != OKR:
                err = name(r[0])
                break
            fds.append(int(r[1]))
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        ok(cu.cuMemRelease(h))
    return f"{len(fds)} exports, then {err}"


def q10():  # map/access/unmap other pages while a stream writes 64 mapped pages (kvcached #465)
    n = 64
    hs = [page() for _ in range(n)]
    x = reserve(n)
    for i, h in enumerate(hs):
        mapv(x + i * PG, h)
    access(x, n)
    s = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    for _ in range(2000):
        ok(cu.cuMemsetD32Async(x, 3, n * PG // 4, s))
    h1 = page()
    y = reserve(1)
    for _ in range(200):
        mapv(y, h1)
        access(y, 1)
        unmap(y)
    busy = name(cu.cuStreamQuery(s)[0])  # CUDA_ERROR_NOT_READY: the edits overlapped the work
    ok(cu.cuStreamSynchronize(s))
    v = read32(x + (n - 1) * PG)
    unmap(x, n)
    for h in hs + [h1]:
        ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(x, n * PG))
    ok(cu.cuMemAddressFree(y, PG))
    ok(cu.cuStreamDestroy(s))
    return f"200 map/access/unmap cycles beside the work; stream after them {busy}; sync OK, data {hex(v)} (want 0x3)"


def q9():  # torch.as_tensor over __cuda_array_interface__ whose first page is unmapped (physical_tensor)
    import torch

    h = page()
    va = reserve(2)
    mapv(va + PG, h)
    access(va + PG, 1)

    class CAI:
        pass

    o = CAI()
    o.__cuda_array_interface__ = {"shape": (2 * PG,), "typestr": "|u1", "data": (va, False), "version": 3}
    try:
        t = torch.as_tensor(o, device="cuda:0")
        res = f"OK, data_ptr matches: {t.data_ptr() == va}"
        del t
    except Exception as e:  # noqa: BLE001
        res = f"refused: {str(e).splitlines()[0]}"
    torch.cuda.synchronize()
    unmap(va + PG)
    ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(va, 2 * PG))
    return f"torch {torch.__version__}: {res}"


def q11():  # a whole GPU mapped twice in one process (client phys view + window; the in-process bench)
    n = int(ok(cu.cuMemGetInfo())[0] * 0.9) // PG
    t0 = time.perf_counter()
    hs = [page() for _ in range(n)]
    t1 = time.perf_counter()
    phys = reserve(n)
    win = reserve(n)
    before = maps_lines()
    for i, h in enumerate(hs):
        mapv(phys + i * PG, h)
        mapv(win + (n - 1 - i) * PG, h)
    for k in range(0, n, 512):
        access(phys + k * PG, min(512, n - k))
        access(win + k * PG, min(512, n - k))
    t2 = time.perf_counter()
    after = maps_lines()
    ok(cu.cuMemsetD32(phys, 0x77, 1))
    ok(cu.cuCtxSynchronize())
    v = hex(read32(win + (n - 1) * PG))
    unmap(phys, n)
    unmap(win, n)
    for h in hs:
        ok(cu.cuMemRelease(h))
    ok(cu.cuMemAddressFree(phys, n * PG))
    ok(cu.cuMemAddressFree(win, n * PG))
    return (
        f"{n} pages, {2 * n} mappings: create {t1 - t0:.1f} s, map+access {t2 - t1:.1f} s, teardown "
        f"{time.perf_counter() - t2:.1f} s; maps lines {before} -> {after}; alias {v} (want 0x77)"
    )


def q12():  # a write (cuMemsetD32) through the RO VA of a page that is RW at another VA
    h = page()
    a = reserve(1)
    b = reserve(1)
    mapv(a, h)
    mapv(b, h)
    access(a, 1)
    access(b, 1, ro=True)
    w = cu.cuMemsetD32(b, 7, 4)[0]
    s = cu.cuCtxSynchronize()[0]
    return f"memset via RO VA: {name(w)}, sync {name(s)} (C1 saw INVALID_VALUE/SUCCESS with one mapping)"


QUESTIONS = [
    ("Q1 one page, two VAs, RW+RO", q1),
    ("Q2 same-process import", q2),
    ("Q4 one unmap over 16 mappings", q4),
    ("Q3 window remap cost", q3),
    ("Q5 VMAs per mapping", q5),
    ("Q6 map during capture", q6),
    ("Q8 export at fd limit", q8),
    ("Q10 map/unmap beside running work", q10),
    ("Q9 torch view at unmapped base", q9),
]


def main(argv):
    why = init()
    if why:
        print(f"PROBE4 NOT RUN: {why}", flush=True)
        return 1
    for label, fn in QUESTIONS:
        item(label, fn)
    if "--full" in argv:
        item("Q11 whole GPU mapped twice", q11)
    item("Q12 write through RO alias", q12)
    print("PROBE4 DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
