"""Issue 26, the adapter wing: no adapter config stalls the broker (target patterns matched in
linear time), absurd numbers in a config are INVALID_ARGUMENT, an adapter above the per-adapter
size limit is refused at registration before any conversion, and a full disk answers
RESOURCE_EXHAUSTED naming the path and the free bytes. A refusal changes nothing."""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import threading
import time

import grpc
import pytest
from adapter_fixtures import AdapterHarness, copy_adapter, edit_config, peft_dirs, run  # noqa: F401 - fixture
from conftest import short_tmpdir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_broker.broker.adapters import inspect_peft_dir
from memory_broker.clients import BrokerClient
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

# Catastrophic backtracking for Python's re: every character of a module name after "model"
# doubles the time (5 s for "model.layers.0.self_attn.q_proj" on this machine).
REDOS = "model(?:[a-z_.0-9]|[a-z_.0-9])*Z"


def _adapter(peft_dirs, name: str = "r4", **config) -> str:  # noqa: F811
    d = copy_adapter(peft_dirs[name], os.path.join(short_tmpdir(), "adapter"))
    if config:
        edit_config(d, **config)
    return d


# ------------------------------------------------------------------- 2. ReDoS


def test_redos_patterns_are_answered_within_100ms_and_a_bystander_keeps_its_latency(broker_factory, peft_dirs):  # noqa: F811
    b = broker_factory()
    evil = [
        _adapter(peft_dirs, target_modules=REDOS),
        _adapter(peft_dirs, rank_pattern={REDOS: 4}),
        _adapter(peft_dirs, exclude_modules=REDOS),
    ]
    with BrokerClient.connect(b.socket, client_name="owner") as owner, BrokerClient.connect(b.socket) as by:
        owner.register_adapter("warm-up", peft_dirs["r4"])  # first-call costs (imports) out of the way
        by.stats()
        stop = threading.Event()
        lat: list[float] = []

        def bystander():
            while not stop.is_set():
                t = time.perf_counter()
                by.stats()
                lat.append(time.perf_counter() - t)

        t = threading.Thread(target=bystander)
        t.start()
        took, answers = [], []
        try:
            for i in range(5):
                for j, d in enumerate(evil):
                    t0 = time.perf_counter()
                    try:
                        owner.register_adapter(f"evil-{i}-{j}", d)
                        answers.append("OK")
                    except BrokerError as e:
                        answers.append(e.code)
                        assert e.code == Code.INVALID_ARGUMENT and "target_modules" in e.message, e
                    took.append(time.perf_counter() - t0)
        finally:
            stop.set()
            t.join()
        # target_modules selects nothing (no module name ends in Z): refused; the rank pattern
        # matches no module (the default rank applies) and nothing is excluded: registered.
        assert answers[:3] == [Code.INVALID_ARGUMENT, "OK", "OK"], answers
        assert statistics.median(took) < 0.1 and max(took) < 1.0, took
        assert len(lat) > 10 and max(lat) < 0.5, (len(lat), max(lat))
        want = sorted([f"evil-{i}-{j}" for i in range(5) for j in (1, 2)] + ["warm-up"])
        assert [a.adapter_id for a in owner.list_adapters().adapters] == want


def test_patterns_keep_peft_semantics_and_unmatchable_ones_are_refused(peft_dirs):  # noqa: F811
    # A full match of the string, as PEFT's re.fullmatch: both modules selected.
    meta = inspect_peft_dir(_adapter(peft_dirs, target_modules=r".*\.(q_proj|v_proj)"))
    assert meta.target_modules == ("q_proj", "v_proj")
    # A rank_pattern key matches the end of the name after a dot, as PEFT's get_pattern_key.
    meta = inspect_peft_dir(_adapter(peft_dirs, "pattern"))
    assert {(w.layer, w.module): w.rank for w in meta.weights}[(1, "q_proj")] == 4
    for cfg, words in [
        (dict(target_modules=r"(?=.*q_proj).*"), "no lookaround"),
        (dict(target_modules=r"(q)\1"), "backreferences"),
        (dict(target_modules="x" * 5000), "at most 4096"),
        (dict(rank_pattern={"a{1000}{1000}": 4}), "repetition"),
        # Python reads {,2} as {0,2}, RE2 as text: refused, never read differently from PEFT.
        (dict(target_modules=r".*\.q_proj{,2}"), "write {0,n}"),
        (dict(rank_pattern={"q{,2}": 4}), "rank_pattern key 'q{,2}' uses {,n}"),
        (dict(rank_pattern={f"k{i}": 4 for i in range(2000)}), "at most 1024"),
    ]:
        with pytest.raises(BrokerError) as e:
            inspect_peft_dir(_adapter(peft_dirs, **cfg))
        assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value.message


# ----------------------------------------------------------- 4. absurd numbers


@pytest.mark.parametrize(
    "text, words",
    [
        ('"r": ' + "9" * 500_000, "number too long"),
        ('"r": ' + "9" * 4000, "r is 9999"),
        ('"lora_alpha": ' + "9" * 4000, "lora_alpha is 9999"),
        ('"lora_alpha": 1e999', "lora_alpha is inf"),
        ('"r": 1e3', "r is 1000.0"),
        ('"rank_pattern": {"q_proj": ' + "9" * 400 + "}", "rank_pattern['q_proj'] is 999"),
        ('"alpha_pattern": {"q_proj": ' + "9" * 400 + "}", "alpha_pattern['q_proj'] is 999"),
        ('"layers_to_transform": [[1]]', "layers_to_transform is [[1]]"),
        ('"layers_to_transform": {"a": 1}', "layers_to_transform is"),
        ('"exclude_modules": 7', "exclude_modules must be"),
    ],
)
def test_absurd_numbers_and_types_in_a_config_are_invalid_argument(peft_dirs, text, words):  # noqa: F811
    d = _adapter(peft_dirs)
    path = os.path.join(d, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    key = text.split('"')[1]
    cfg.pop(key, None)
    body = json.dumps(cfg)
    with open(path, "w") as f:
        f.write(body[:-1] + ", " + text + "}")
    with pytest.raises(BrokerError) as e:
        inspect_peft_dir(d)
    assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value.message
    assert len(e.value.message) < 2000


# A config value of any JSON shape, biased towards the keys' real types and their edges.
_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.sampled_from([0, 1, -1, 4, 8, 2**31, 2**63, 10**300, 10**4000, -(10**4000)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["q_proj", "v_proj", "all-linear", ".*", "(", REDOS, r".*\.q_proj", "none", "LORA", "x" * 5000]),
    st.text(max_size=12),
)
_VALUE = st.recursive(
    _LEAF,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["q_proj", "v_proj", "(", ""]) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_KEYS = (
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "exclude_modules",
    "bias",
    "peft_type",
    "use_dora",
    "base_model_name_or_path",
)
_IDS = ("f0", "f1", "held", "x" * 300, "", "a\x00b")
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["register", "unregister", "list", "acquire"]), st.lists(st.sampled_from(_IDS), max_size=3)
    ),
    min_size=1,
    max_size=6,
)


@pytest.fixture(scope="module")
def fuzz_broker(peft_dirs):  # noqa: F811
    from conftest import start_broker

    b = start_broker()
    holder = BrokerClient.connect(b.socket, client_name="holder")
    holder.register_adapter("held", peft_dirs["r4"])
    holder.acquire_adapters(["held"])  # pinned: its unregister is FAILED_PRECONDITION
    caller = BrokerClient.connect(b.socket, client_name="fuzz")
    channel = grpc.insecure_channel(f"unix:{b.socket}")
    try:
        yield b, caller, broker_pb2_grpc.MemoryBrokerStub(channel)
    finally:
        channel.close()
        caller.close()
        holder.close()
        b.stop()


def _rpc(stub, op: str, ids: list[str], path: str, meta: tuple):
    if op == "register":
        req = pb.RegisterAdapterRequest(adapter_id=(ids or ["f0"])[0], path=path)
        return stub.RegisterAdapter(req, metadata=meta, timeout=10)
    if op == "unregister":
        return stub.UnregisterAdapter(pb.UnregisterAdapterRequest(adapter_ids=ids), metadata=meta, timeout=10)
    if op == "list":
        req = pb.ListAdaptersRequest(prefix=(ids or [""])[0], limit=len(ids) * 40)
        return stub.ListAdapters(req, metadata=meta, timeout=10)
    req = pb.AcquireAdaptersRequest(adapter_ids=ids, max_adapters=len(ids))
    return stub.AcquireAdapters(req, metadata=meta, timeout=10)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _VALUE, max_size=4), huge=st.booleans(), ops=_OPS)
def test_fuzz_configs_and_registry_states_never_answer_internal(fuzz_broker, peft_dirs, changes, huge, ops):  # noqa: F811
    b, caller, stub = fuzz_broker
    d = os.path.join(os.path.dirname(b.socket), "fuzz-adapter")
    if not os.path.exists(d):
        copy_adapter(peft_dirs["r4"], d)
    with open(os.path.join(peft_dirs["r4"], "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    text = json.dumps(cfg)
    if huge:  # an integer of more digits than Python converts
        text = text[:-1] + ', "lora_alpha": ' + "7" * 5000 + "}"
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write(text)
    meta = caller.metadata
    # Every example starts from one registry state (the held adapter only); its ops make others.
    for aid in ("f0", "f1"):
        # An acquire the last example gave up on (DEADLINE_EXCEEDED on a loaded machine) may
        # still complete at the broker and leave a pin: release until it can be unregistered.
        for _ in range(100):
            try:
                stub.ReleaseAdapters(pb.ReleaseAdaptersRequest(adapter_ids=[aid]), metadata=meta, timeout=10)
            except grpc.RpcError as e:  # not registered, or not held
                assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), e.details()
            try:
                _rpc(stub, "unregister", [aid], d, meta)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    break
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "is acquired" in e.details(), e.details()
                time.sleep(0.1)
        else:
            raise AssertionError(f"{aid} stayed acquired after 100 releases")
    for op, ids in ops:
        try:
            _rpc(stub, op, ids, d, meta)
        except grpc.RpcError as e:
            assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (op, ids, e.details())
    # What holds on every path: the held adapter is still registered and held.
    listed = stub.ListAdapters(pb.ListAdaptersRequest(prefix="held", limit=10), metadata=meta, timeout=10)
    assert [a.adapter_id for a in listed.adapters] == ["held"]


# ------------------------------------------------------- 3. size bound at registration


def sparse_adapter(d: str, layers: int = 128, rank: int = 8, width: int = 1 << 19) -> str:
    """A PEFT directory whose weights declare ``layers`` x (A [rank, width], B [width, rank])
    F32, written sparse (a header, then ``truncate``): 4 GiB declared, nothing on disk."""
    os.makedirs(d)
    header, off = {}, 0
    for layer in range(layers):
        for kind, shape in (("A", [rank, width]), ("B", [width, rank])):
            n = rank * width * 4
            key = f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{kind}.weight"
            header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
            off += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + off)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}, f)
    return d


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_4gib_sparse_adapter_is_refused_at_registration_before_any_conversion(broker_factory, peft_dirs):  # noqa: F811
    b = broker_factory("--pool-size", "256MiB")
    d = sparse_adapter(os.path.join(os.path.dirname(b.socket), "huge"))
    assert os.stat(os.path.join(d, "adapter_model.safetensors")).st_blocks * 512 < 1 << 20  # sparse
    images = os.path.join(os.path.dirname(b.socket), "state", "images")
    with BrokerClient.connect(b.socket) as c:
        c.register_adapter("small", peft_dirs["r4"])  # under the limit: registered, converted
        before = rss_bytes(b.proc.pid)
        with pytest.raises(BrokerError) as e:
            c.register_adapter("huge", d)
        assert e.value.code == Code.RESOURCE_EXHAUSTED, e.value
        msg = e.value.message
        for words in ("256 tensors", "4294967296 bytes in the file", "2147483648 bytes in pages", "268435456 bytes"):
            assert words in msg, msg
        assert "adapters.max_bytes" in msg and "--adapter-max-bytes" in msg
        assert [a.adapter_id for a in c.list_adapters().adapters] == ["small"]
        c.stats()  # a round trip after the refusal: any conversion would have been queued by now
        assert abs(rss_bytes(b.proc.pid) - before) < 32 << 20
        assert not any("huge" in name for name in os.listdir(images))


def test_the_adapter_size_limit_defaults_to_what_the_hot_tier_can_hold():
    from memory_broker.broker.server.options import SETTINGS, ServeOptions, adapter_size_limit

    assert adapter_size_limit(ServeOptions(pool_size=1 << 30)) == 1 << 30
    assert adapter_size_limit(ServeOptions(pool_size=1 << 30, hot_tier_pages=16)) == 32 << 20
    assert adapter_size_limit(ServeOptions(pool_size=1 << 30, hot_tier_pages=4096)) == 1 << 30
    assert adapter_size_limit(ServeOptions(adapter_max_bytes=5 << 20, hot_tier_pages=1)) == 5 << 20
    s = SETTINGS["adapter_max_bytes"]
    assert (s.yaml, s.flag) == ("adapters.max_bytes", "--adapter-max-bytes")


# ------------------------------------------------------------------ 5. a full disk


@pytest.fixture
def small_disk():
    """A 600 KiB tmpfs (needs root and mount; skipped with the reason otherwise)."""
    d = short_tmpdir()
    mnt = os.path.join(d, "disk")
    os.mkdir(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def test_a_full_disk_answers_resource_exhausted_with_the_path_and_free_bytes(broker_factory, peft_dirs, small_disk):  # noqa: F811
    state = os.path.join(small_disk, "state")
    b = broker_factory("--state-dir", state)
    codes: dict[str, int] = {}
    full: list[BrokerError] = []
    registered: list[str] = []

    def register(aid: str) -> None:
        try:
            c.register_adapter(aid, peft_dirs["r4"])
            registered.append(aid)
            codes["OK"] = codes.get("OK", 0) + 1
        except BrokerError as e:
            codes[e.code.value] = codes.get(e.code.value, 0) + 1
            if e.code == Code.RESOURCE_EXHAUSTED:
                full.append(e)

    with BrokerClient.connect(b.socket) as c:
        for i in range(20):
            register(f"a{i:03d}")
        # Conversions ahead of use kept off the registry's reserve: no image was written.
        assert os.listdir(os.path.join(state, "images")) == [] and codes == {"OK": 20}
        # Something else fills the disk.
        fd = os.open(os.path.join(small_disk, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"x" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        for i in range(20, 400):
            register(f"a{i:03d}")
            if len(full) >= 20:
                break
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
        msg = full[0].message
        assert state in msg and "bytes free" in msg and "adapters.sqlite3" in msg, msg
        assert {a.adapter_id for a in c.list_adapters(limit=1000).adapters} == set(registered)
        # Unregistering still works on the full disk (the registry's reserve), never half done.
        for aid in registered[:10]:
            c.unregister_adapters([aid])
        assert {a.adapter_id for a in c.list_adapters(limit=1000).adapters} == set(registered[10:])
        os.unlink(os.path.join(small_disk, "filler"))
        c.register_adapter("after", peft_dirs["r4"])  # room again


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_conversion_ahead_of_use_streams_into_the_image_file(broker_factory):
    # 12 layers x (A [8, 2^19], B [2^19, 8]) F32: 384 MiB declared, a 192 MiB bfloat16 image.
    b = broker_factory("--pool-size", "512MiB", "--page-size", "2MiB")
    d = sparse_adapter(os.path.join(os.path.dirname(b.socket), "big"), layers=12)
    images = os.path.join(os.path.dirname(b.socket), "state", "images")
    with BrokerClient.connect(b.socket) as c:
        c.stats()
        base = peak = rss_anon(b.proc.pid)
        c.register_adapter("big", d)
        while not any(n.startswith("big-") and n.endswith(".img") for n in os.listdir(images)):
            peak = max(peak, rss_anon(b.proc.pid))
            assert b.proc.poll() is None
        size = max(os.path.getsize(os.path.join(images, n)) for n in os.listdir(images))
        assert size > 192 << 20
    # The copies take a matrix at a time (16 MiB here), never the whole 192 MiB image.
    assert peak - base < 64 << 20, (base >> 20, peak >> 20)
