"""The wire package: one definition per wire type, a protocol version both sides check, and
a client that imports nothing of the daemon."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
from conftest import ROOT
from test_structure import find_cycle

from memory_broker.broker.adapters.layout import LoraModuleSpec, plan_layout
from memory_broker.broker.doors import fd_channel as server_fd
from memory_broker.broker.store.eviction import ContentType
from memory_broker.clients import BrokerClient, BrokerError, Code
from memory_broker.clients import fd_channel as client_fd
from memory_broker.proto.wire import fd_channel as wire_fd
from memory_broker.proto.wire import session as wire_session
from memory_broker.proto.wire.layout import row_offsets
from memory_broker.proto.wire.messages import layout_from_proto, layout_to_proto, spec_from_proto, spec_to_proto
from memory_broker.proto.wire.spec import CONTENT_TYPES, Spec
from memory_broker.proto.wire.status import STATUS, error_from_rpc
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

S = grpc.StatusCode
VERSION = wire_session.PROTOCOL_VERSION

# Where each import root's package lives in the checkout.
PACKAGES = {"wire": "proto/wire", "clients": "clients", "broker": "broker", "kernels": "kernels"}


def loaded_after(statement: str) -> list[str]:
    """Modules of this project, and sqlite3, that a fresh interpreter has loaded after ``statement``."""
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('memory_broker') or m == 'sqlite3')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- imports


def test_importing_the_client_package_loads_no_daemon_module_and_no_sqlite():
    loaded = loaded_after("import memory_broker.clients")
    assert "memory_broker.clients" in loaded
    assert [m for m in loaded if m.startswith("memory_broker.broker") or m == "sqlite3"] == []


def test_the_wire_package_loads_neither_the_daemon_nor_the_client():
    mods = ("errors", "fd_channel", "layout", "messages", "session", "spec", "status", "v1.broker_pb2_grpc")
    loaded = loaded_after("\n".join(f"import memory_broker.proto.wire.{m}" for m in mods))
    assert [m for m in loaded if m.startswith("memory_broker.") and not m.startswith("memory_broker.proto")] == []


def test_the_core_pieces_of_the_wire_need_no_grpc():
    # The daemon's core imports these: they must stay free of gRPC (and of protobuf).
    core = ("errors", "spec", "layout", "session", "fd_channel")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; " + "; ".join(f"import memory_broker.proto.wire.{m}" for m in core) + "; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def _imports(path: str) -> list[tuple[str, str]]:
    """Modules a file imports, at any depth (in functions, and for type checking: a module
    that names another's types depends on it), as (module if it is one, else this) pairs:
    ``from pkg import name`` imports the module ``pkg.name`` where there is one, and otherwise
    takes ``name`` from ``pkg`` itself."""
    tree = ast.parse(open(path).read(), path)
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.extend((f"{node.module}.{a.name}", node.module) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(m, other) for m, other in out if other.startswith("memory_broker.")]


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for root, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for d, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
                name = f"memory_broker.{root}" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))
                graph[name] = set(_imports(os.path.join(d, f)))
    known = set(graph)
    resolved = {m: {mod if mod in known else other for mod, other in deps} for m, deps in graph.items()}
    return {m: {i for i in deps if i in known and i != m} for m, deps in resolved.items()}


def test_no_two_packages_import_each_other():
    graph = _module_graph()
    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        packages.setdefault(m.split(".")[1], set()).update(d.split(".")[1] for d in deps)
    packages = {p: deps - {p} for p, deps in packages.items()}
    assert packages["wire"] == set(), packages
    assert "broker" not in packages["clients"], packages
    assert find_cycle(packages) is None, packages


def test_no_module_of_the_client_imports_back_into_a_module_that_imports_it():
    graph = {
        m: d for m, d in _module_graph().items() if m.startswith(("memory_broker.clients", "memory_broker.proto.wire"))
    }
    assert find_cycle(graph) is None


@pytest.mark.parametrize("spelling", ["x-broker-session", "x-broker-key"])
def test_the_session_metadata_keys_are_spelled_once_in_product_code(spelling):
    found = []
    for folder in PACKAGES.values():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    for node in ast.walk(ast.parse(open(path).read(), path)):
                        if isinstance(node, ast.Constant) and node.value == spelling:
                            found.append(os.path.relpath(path, ROOT))
    assert found == ["proto/wire/session.py"]


# ----------------------------------------------------------------- protocol version


def _stats(broker) -> pb.Stats:
    with grpc.insecure_channel(f"unix:{broker.socket}") as ch:
        return broker_pb2_grpc.MemoryBrokerStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def test_the_broker_refuses_a_client_of_another_protocol_version_and_opens_no_session(broker):
    before = _stats(broker).sessions
    with grpc.insecure_channel(f"unix:{broker.socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        hello = pb.Hello(client_name="from-the-future", protocol_version=VERSION + 1)
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Attach(iter([pb.AttachRequest(hello=hello)]), timeout=10))
    assert e.value.code() == S.FAILED_PRECONDITION
    details = e.value.details()
    assert f"this client speaks protocol version {VERSION + 1}" in details
    assert f"the broker speaks version {VERSION}" in details
    assert _stats(broker).sessions == before


def test_the_client_library_of_another_version_gets_the_brokers_refusal(broker, monkeypatch):
    before = _stats(broker).sessions
    monkeypatch.setattr(wire_session, "PROTOCOL_VERSION", VERSION + 1)
    with pytest.raises(BrokerError) as e:
        BrokerClient.connect(broker.socket, wait_s=5, reconnect_s=0)
    assert e.value.code == Code.FAILED_PRECONDITION
    assert f"protocol version {VERSION + 1}" in e.value.message and "same memory-broker release" in e.value.message
    monkeypatch.undo()
    assert _stats(broker).sessions == before
    # The broker itself states its version to a client of its own.
    with BrokerClient.connect(broker.socket, wait_s=5, reconnect_s=0) as c:
        assert c.session_id > 0


def test_a_hello_without_a_version_is_served_for_hand_made_clients(broker):
    with grpc.insecure_channel(f"unix:{broker.socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        stream = stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="grpcurl"))]), timeout=10)
        opened = next(stream).opened
        stream.cancel()
    assert opened.session_id > 0 and opened.protocol_version == VERSION


class _OtherBroker(broker_pb2_grpc.MemoryBrokerServicer):
    """A daemon that opens every session stating ``version``: what an older or newer broker does."""

    def __init__(self, version: int):
        self.version = version
        self.hello: pb.Hello | None = None
        self.ended = threading.Event()

    def Attach(self, request_iterator, context):
        context.add_callback(self.ended.set)
        self.hello = next(request_iterator).hello
        arena = pb.ArenaInfo(
            backend="host",
            page_size=1 << 20,
            pages_per_slab=2,
            max_slabs=4,
            window_pages=8,
            fd_socket_path="/nonexistent/fd.sock",
        )
        yield pb.SessionEvent(
            opened=pb.SessionOpened(session_id=7, token="t", arena=arena, protocol_version=self.version)
        )
        for msg in request_iterator:
            if msg.WhichOneof("msg") == "detach":
                break


@pytest.fixture
def other_broker():
    made = []

    def start(version: int) -> tuple[str, _OtherBroker]:
        d = tempfile.mkdtemp(prefix="mb-", dir="/tmp")
        sock = os.path.join(d, "b.sock")
        fake = _OtherBroker(version)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        broker_pb2_grpc.add_MemoryBrokerServicer_to_server(fake, server)
        server.add_insecure_port(f"unix:{sock}")
        server.start()
        made.append(server)
        return sock, fake

    yield start
    for server in made:
        server.stop(0)


@pytest.mark.parametrize(
    "version, words",
    [(VERSION + 1, f"speaks protocol version {VERSION + 1}"), (0, "states no protocol version")],
    ids=["newer", "older-without-a-version"],
)
def test_the_client_refuses_a_broker_of_another_protocol_version_and_ends_the_session(other_broker, version, words):
    sock, fake = other_broker(version)
    with pytest.raises(BrokerError) as e:
        BrokerClient.connect(sock, wait_s=5, reconnect_s=0)
    assert e.value.code == Code.FAILED_PRECONDITION
    assert f"the broker at {sock} {words}" in e.value.message
    assert f"this client speaks version {VERSION}" in e.value.message
    # It stated its own version, and did not leave the session open.
    assert fake.hello.protocol_version == VERSION
    assert fake.ended.wait(10)


# ----------------------------------------------------------------- one definition per wire type


def test_a_positional_spec_means_the_same_on_both_sides():
    s = Spec(4, "kv_cache", contiguous=True, key=b"k", pin=True)
    assert s.content_type_number == CONTENT_TYPES["kv_cache"] == ContentType.KV_CACHE
    # The daemon reads the client's Spec back field for field, the content type as its number.
    assert spec_from_proto(spec_to_proto(s)) == Spec(4, ContentType.KV_CACHE, contiguous=True, key=b"k", pin=True)
    assert spec_from_proto(spec_to_proto(Spec(2))) == Spec(2, ContentType.TEMP_BUFFER)
    with pytest.raises(TypeError):
        Spec(4, "kv_cache", True)  # contiguous is keyword-only


def test_a_bool_content_type_is_refused_naming_contiguous():
    with pytest.raises(ValueError, match="contiguous=True"):
        Spec(4, True)
    with pytest.raises(ValueError, match="unknown content type 'kv'"):
        Spec(1, "kv")


def test_content_type_numbers_agree_with_the_proto_and_the_daemon():
    for name, number in CONTENT_TYPES.items():
        assert pb.ContentType.Value(f"CONTENT_TYPE_{name.upper()}") == number == ContentType[name.upper()]
    assert len(CONTENT_TYPES) == len(ContentType)


def test_the_daemon_and_the_client_use_the_one_spec():
    from memory_broker import clients
    from memory_broker.broker.store import objects
    from memory_broker.clients import client

    assert objects.Spec is Spec and client.Spec is Spec and clients.Spec is Spec


def test_the_layout_codec_round_trips_a_placement():
    mods = [LoraModuleSpec(layer, name, 8, 96, 160, 2.0) for layer in range(3) for name in ("q_proj", "v_proj")]
    layout = plan_layout(mods, 4096, "float16")
    pages = [9, 3, 17, 4, 2, 30][: layout.num_pages]
    msg = layout_to_proto("a", layout, 5, 11, pages, arena_slabs=2)
    assert (msg.generation, msg.object_id, list(msg.pages), msg.arena_slabs) == (5, 11, pages, 2)
    back = layout_from_proto(msg)
    assert back.modules == layout.modules
    assert (back.page_size, back.dtype, back.elem_size, back.row_align, back.num_pages) == (
        layout.page_size,
        layout.dtype,
        layout.elem_size,
        layout.row_align,
        layout.num_pages,
    )
    want, got = row_offsets(layout, pages), row_offsets(back, pages)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def test_every_code_has_a_status_and_a_status_reads_back_as_its_code():
    class Refusal(grpc.RpcError):
        def __init__(self, status, details):
            self._s, self._d = status, details

        def code(self):
            return self._s

        def details(self):
            return self._d

    assert set(STATUS) == set(Code)
    for code, status in STATUS.items():
        err = error_from_rpc(Refusal(status, "what to do"))
        assert (err.code, err.message) == (code, "what to do")
    err = error_from_rpc(Refusal(S.UNAVAILABLE, "failed to connect to all addresses; last error: unix:/x"), "/x")
    assert err.code == Code.UNAVAILABLE and "unix:" not in err.message and "/x" in err.message


def test_both_ends_of_the_fd_channel_share_one_definition():
    assert server_fd.MAX_FDS_PER_MESSAGE == wire_fd.MAX_FDS_PER_MESSAGE
    assert client_fd.FdChannelError is wire_fd.FdChannelError
    assert issubclass(server_fd.FdRequestRefused, wire_fd.FdChannelError)
    # What the client sends, the server reads; what the server refuses, the client raises.
    assert wire_fd.parse_request(wire_fd.request_line("tok", 3).rstrip(b"\n")) == ("tok", 3, None)
    assert wire_fd.parse_request(wire_fd.request_line("tok", 3, 200).rstrip(b"\n")) == ("tok", 3, 200)
    refusal = wire_fd.parse_reply_line(wire_fd.refusal_line("NOT_FOUND", "no such session").rstrip(b"\n"), "fd")
    with pytest.raises(wire_fd.FdChannelError) as e:
        wire_fd.header_count(refusal, "fd", 0)
    assert (e.value.code, e.value.message) == ("NOT_FOUND", "no such session")
    header = wire_fd.parse_reply_line(wire_fd.header_line(2, 5).rstrip(b"\n"), "fd")
    assert wire_fd.header_count(header, "fd", 2) == 5


def test_a_malformed_fd_request_is_refused_as_invalid_argument():
    for line, words in [
        (b"{", "not a JSON line"),
        (b"[]", "JSON object"),
        (b'{"token": "t", "first": true}', "integer"),
        (b'{"token": "t", "first": -1}', ">= 0"),
        (b'{"token": "t", "first": 0, "count": -2}', ">= 0 or null"),
        (b'{"token": "t", "from_slab": 0}', "protocol version 1"),
    ]:
        with pytest.raises(wire_fd.FdChannelError) as e:
            wire_fd.parse_request(line)
        assert e.value.code == "INVALID_ARGUMENT" and words in e.value.message
