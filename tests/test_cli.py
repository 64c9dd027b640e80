"""The ``memory-broker`` command as a person meets it: options in any position, ``--version``,
help on every option, one-line errors with the status name, size units, log formats, and the
adapter conversion backlog it shows."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import pytest
from conftest import ROOT, short_tmpdir, start_broker

from memory_broker.broker.cli import _fill_defaults, _list, build_parser, main
from memory_broker.broker.server.logs import configure
from memory_broker.broker.server.values import parse_size

ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXE = shutil.which("memory-broker", path=os.path.dirname(sys.executable))


def write_adapter(path: str, rank: int = 4, hidden: int = 64, layers: int = 2) -> str:
    """A small PEFT LoRA directory (config + safetensors) written with numpy: no torch needed."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": "tiny-llama",
            },
            f,
        )
    rng = np.random.default_rng(rank)
    tensors = {}
    for layer in range(layers):
        for mod in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden), dtype=np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((hidden, rank), dtype=np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the command in this process: (exit code, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, starts: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(starts), lines[0]


@pytest.fixture(scope="module")
def broker_with_adapter():
    """A broker with one registered adapter (`a1`), its page image converted."""
    b = start_broker()
    try:
        d = short_tmpdir()
        rc = main(["adapters", "register", "a1", write_adapter(os.path.join(d, "a1")), "--socket", b.socket])
        assert rc == 0
        yield b
    finally:
        b.stop()


# ----------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "argv",
    [
        ["--socket", "S", "--timeout", "7", "--json", "adapters", "list"],
        ["adapters", "--socket", "S", "--timeout", "7", "--json", "list"],
        ["adapters", "list", "--socket", "S", "--timeout", "7", "--json"],
        ["--json", "adapters", "--timeout", "7", "list", "--socket", "S"],
    ],
)
def test_common_options_are_accepted_in_any_position(argv):
    a = build_parser().parse_args(argv)
    _fill_defaults(a)
    assert (a.command, a.action, a.socket, a.timeout, a.json) == ("adapters", "list", "S", 7.0, True)


def test_options_left_out_take_their_defaults_and_an_early_option_is_not_reset_by_the_command():
    a = build_parser().parse_args(["--socket", "S", "status"])
    _fill_defaults(a)
    assert (a.socket, a.timeout, a.json, a.wait) == ("S", 5.0, False, False)
    a = build_parser().parse_args(["adapters"])
    _fill_defaults(a)
    assert (a.action, a.prefix, a.limit, a.timeout) == ("list", "", 0, 60.0)
    a = build_parser().parse_args(["--socket", "/x.sock", "serve", "--pool-size", "2GiB"])
    _fill_defaults(a)
    assert a.socket == "/x.sock" and a.pool_size == "2GiB" and not hasattr(a, "page_size")


def test_every_option_and_command_has_help_text():
    missing = []

    def walk(p: argparse.ArgumentParser) -> None:
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in act._choices_actions}
                for name, sub in act.choices.items():
                    if not helps.get(name):
                        missing.append(f"{p.prog} {name}")
                    walk(sub)
            elif not act.help or act.help == argparse.SUPPRESS:
                missing.append(f"{p.prog} {'/'.join(act.option_strings) or act.dest}")

    walk(build_parser())
    assert not missing, f"options without help: {missing}"


def test_version_is_the_installed_distributions(capsys):
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"memory-broker {version('memory-broker')}"
    assert EXE, "the memory-broker command is not installed in this environment"
    r = subprocess.run([EXE, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"memory-broker {version('memory-broker')}"


def test_a_usage_error_is_one_line_naming_where_help_is(capsys):
    rc, _, err = cli(capsys, "adapters", "lst")
    assert rc == 2
    assert_one_line_error(rc, err, "memory-broker: ")
    assert "invalid choice: 'lst'" in err and "memory-broker adapters --help" in err
    rc, _, err = cli(capsys, "status", "--timeout", "0")
    assert_one_line_error(rc, err, "memory-broker: ")
    assert "--timeout" in err and "more than 0" in err


def test_client_options_given_to_serve_are_refused_in_one_line(capsys):
    rc, _, err = cli(capsys, "--timeout", "3", "serve")
    assert rc == 2
    assert_one_line_error(rc, err, "memory-broker: --timeout is for status and adapters, not serve")


# ----------------------------------------------------------------- sizes and start-up errors


@pytest.mark.parametrize(
    "text,n",
    [
        ("2MiB", 2 << 20),
        ("512KiB", 512 << 10),
        ("1GiB", 1 << 30),
        ("1G", 1 << 30),
        ("1.5KiB", 1536),
        ("4096", 4096),
        (" 3 mib ", 3 << 20),
        ("1TiB", 1 << 40),
    ],
)
def test_sizes_are_binary(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text,hint", [("1GB", "1GiB"), ("512MB", "512MiB"), ("4kB", "4KiB"), ("2TB", "2TiB")])
def test_decimal_units_are_refused_with_the_binary_spelling_to_use(text, hint):
    with pytest.raises(ValueError) as e:
        parse_size(text, "--pool-size")
    msg = str(e.value)
    assert msg.startswith("--pool-size: ") and f"write {hint}" in msg and "decimal units" in msg


def test_a_fraction_of_a_byte_is_refused():
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size("0.3KiB")


def test_a_bad_size_flag_is_named_once(capsys):
    d = short_tmpdir()
    rc, _, err = cli(capsys, "serve", "--pool-size", "lots", "--socket", os.path.join(d, "b.sock"))
    assert rc == 2
    assert_one_line_error(rc, err, "memory-broker: --pool-size: cannot read 'lots' as a size")
    assert err.count("pool-size") == 1 and err.count("pool_size") == 0
    rc, _, err = cli(capsys, "serve", "--pool-size", "1GB", "--socket", os.path.join(d, "b.sock"))
    assert_one_line_error(rc, err, "memory-broker: --pool-size: '1GB': decimal units")
    assert not os.path.exists(os.path.join(d, "b.sock"))


def test_a_missing_socket_directory_is_named_with_what_to_do(capsys):
    d = short_tmpdir()
    missing = os.path.join(d, "not-there")
    rc, _, err = cli(
        capsys,
        "serve",
        "--socket",
        os.path.join(missing, "b.sock"),
        "--arena",
        "host",
        "--state-dir",
        os.path.join(d, "state"),
    )
    assert rc == 2
    assert_one_line_error(rc, err, "memory-broker: socket: the directory")
    assert f"{missing} does not exist" in err and f"mkdir -p {missing}" in err
    assert "Errno" not in err and not os.path.exists(missing)


# ----------------------------------------------------------------- talking to a broker


def test_no_broker_is_one_unavailable_line_that_says_what_to_do(capsys):
    sock = os.path.join(short_tmpdir(), "none.sock")
    rc, _, err = cli(capsys, "adapters", "--socket", sock)
    assert rc == 1
    assert_one_line_error(rc, err, f"memory-broker: UNAVAILABLE: no broker answered on {sock}")
    assert f"memory-broker serve --socket {sock}" in err and "--wait" in err
    rc, _, err = cli(capsys, "status", "--socket", sock, "--json")
    assert_one_line_error(rc, err, "memory-broker: UNAVAILABLE:")


def test_adapters_without_an_action_lists_them_with_tier_image_state_and_backlog(capsys, broker_with_adapter):
    sock = broker_with_adapter.socket
    deadline = time.monotonic() + 20
    while True:  # the image is converted ahead of use, in the background
        rc, out, err = cli(capsys, "adapters", "--socket", sock)
        assert rc == 0, err
        if "conversion backlog: none" in out or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    lines = out.splitlines()
    assert lines[0].startswith("1 registered: 0 hot")
    assert lines[1].startswith("conversion backlog: none; 1 page images on disk")
    assert lines[2].split() == ["adapter", "tier", "rank", "pins", "gen", "image", "modules"]
    assert lines[3].split() == ["a1", "cold", "4", "0", "0", "ready", "q_proj,v_proj"]
    # The same listing with the options after the action, and as JSON.
    rc, out2, _ = cli(capsys, "adapters", "list", "--socket", sock)
    assert rc == 0 and out2 == out
    rc, out, _ = cli(capsys, "--json", "adapters", "--socket", sock, "list", "--prefix", "a")
    doc = json.loads(out)
    assert rc == 0 and doc["convert_backlog"] == 0
    assert [(r["adapter_id"], r["image_state"]) for r in doc["adapters"]] == [("a1", "ADAPTER_IMAGE_STATE_READY")]


def test_broker_refusals_are_one_line_with_the_status_name(capsys, broker_with_adapter):
    sock = broker_with_adapter.socket
    rc, _, err = cli(capsys, "adapters", "show", "nope", "--socket", sock)
    assert_one_line_error(rc, err, "memory-broker: NOT_FOUND: ")
    assert "nope" in err
    rc, _, err = cli(capsys, "adapters", "register", "a1", "/no/such/dir", "--socket", sock)
    assert_one_line_error(rc, err, "memory-broker: ALREADY_EXISTS: ")
    rc, _, err = cli(capsys, "adapters", "register", "b1", "/no/such/dir", "--socket", sock)
    assert_one_line_error(rc, err, "memory-broker: INVALID_ARGUMENT: /no/such/dir: no such directory")
    rc, _, err = cli(capsys, "adapters", "--socket", sock, "unregister", "ghost")
    assert_one_line_error(rc, err, "memory-broker: NOT_FOUND: ")


def test_register_says_the_adapter_waits_for_conversion_and_where_to_watch_it(capsys, broker_with_adapter):
    sock = broker_with_adapter.socket
    rc, out, err = cli(
        capsys,
        "adapters",
        "register",
        "a2",
        write_adapter(os.path.join(short_tmpdir(), "a2"), rank=8),
        "--socket",
        sock,
    )
    try:
        assert rc == 0, err
        lines = out.splitlines()
        assert lines[0].startswith("registered a2: rank 8, 2 module types over 2 layers")
        assert lines[1].startswith("  page image queued (conversion backlog: ")
        assert lines[1].endswith("`memory-broker adapters` shows progress")
        rc, out, _ = cli(capsys, "--socket", sock, "status")
        assert rc == 0 and out.startswith(f"broker on {sock}")
    finally:
        assert cli(capsys, "adapters", "unregister", "a2", "--socket", sock)[0] == 0


def test_the_installed_command_lists_adapters_with_common_options_after_the_action(broker_with_adapter):
    r = subprocess.run(
        [EXE, "adapters", "list", "--socket", broker_with_adapter.socket, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert [a["adapter_id"] for a in json.loads(r.stdout)["adapters"]] == ["a1"]
    r = subprocess.run(
        [EXE, "adapters", "show", "ghost", "--socket", broker_with_adapter.socket],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("memory-broker: NOT_FOUND: ") and len(r.stderr.strip().splitlines()) == 1


def test_wait_says_it_waits_for_a_broker_then_answers():
    d = short_tmpdir()
    sock = os.path.join(d, "late.sock")
    waiter = subprocess.Popen(
        [EXE, "status", "--wait", "--timeout", "60", "--socket", sock],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = waiter.stderr.readline()  # printed before the broker exists
        assert first.startswith(f"memory-broker: waiting up to 60s for a broker on {sock}"), first
        b = start_broker(socket=sock)
        try:
            out, err = waiter.communicate(timeout=60)
        finally:
            b.stop()
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert f"broker on {sock} is up after" in err
    assert out.startswith(f"broker on {sock}") and "pool" in out


def test_a_call_that_takes_long_says_it_is_waiting_and_a_quick_one_says_nothing(capsys):
    import grpc

    from memory_broker.broker.cli import _PatientStub

    class Slow:
        """A grpc future that answers after ``delay`` seconds."""

        def __init__(self, delay: float):
            self.done_at = time.monotonic() + delay

        def result(self, timeout=None):
            left = self.done_at - time.monotonic()
            if timeout is not None and left > timeout:
                time.sleep(timeout)
                raise grpc.FutureTimeoutError()
            time.sleep(max(0.0, left))
            return "answer"

    class Stub:
        def __init__(self, delay):
            self.RegisterAdapter = argparse.Namespace(future=lambda req, timeout: Slow(delay))

    assert _PatientStub(Stub(0.0), "S", notice_after=0.2).RegisterAdapter(None, timeout=60) == "answer"
    assert capsys.readouterr() == ("", "")
    assert _PatientStub(Stub(0.5), "S", notice_after=0.2).RegisterAdapter(None, timeout=60) == "answer"
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == "memory-broker: waiting for the broker on S to answer RegisterAdapter (up to 60s, --timeout) ...\n"
    )


def test_wait_gives_up_after_the_timeout_in_one_line(capsys):
    sock = os.path.join(short_tmpdir(), "never.sock")
    t0 = time.monotonic()
    rc, _, err = cli(capsys, "status", "--socket", sock, "--wait", "--timeout", "0.5")
    assert rc == 1 and time.monotonic() - t0 < 10
    lines = err.strip().splitlines()
    assert lines[0].startswith("memory-broker: waiting up to 0.5s")
    assert lines[1] == f"memory-broker: UNAVAILABLE: no broker came up on {sock} within 0.5s (--timeout)"


# ----------------------------------------------------------------- the conversion backlog


def test_the_listing_shows_queued_and_converting_adapters_and_the_backlog_count(capsys):
    from memory_broker.proto.wire.v1 import broker_pb2 as pb

    S = pb.AdapterImageState

    class Stub:
        def ListAdapters(self, req, timeout, metadata=None):
            return pb.ListAdaptersResponse(
                adapters=[
                    pb.Adapter(
                        adapter_id="x",
                        tier=pb.ADAPTER_TIER_COLD,
                        rank=8,
                        image_state=S.Value("ADAPTER_IMAGE_STATE_CONVERTING"),
                    ),
                    pb.Adapter(
                        adapter_id="y",
                        tier=pb.ADAPTER_TIER_COLD,
                        rank=8,
                        image_state=S.Value("ADAPTER_IMAGE_STATE_QUEUED"),
                    ),
                    pb.Adapter(
                        adapter_id="z",
                        tier=pb.ADAPTER_TIER_HOT,
                        rank=8,
                        image_state=S.Value("ADAPTER_IMAGE_STATE_READY"),
                    ),
                ],
                total=3,
            )

        def GetStats(self, req, timeout):
            return pb.Stats(adapters=pb.AdapterStats(registered=3, hot=1, cold=2, convert_queued=2, image_count=1))

    b = argparse.Namespace(stub=Stub(), pb=pb, session=())
    a = argparse.Namespace(prefix="", limit=0, timeout=5.0, json=False, socket="S")
    assert _list(a, b) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("conversion backlog: 2 adapters waiting for a page image")
    assert [line.split() for line in out[3:]] == [
        ["x", "cold", "8", "0", "0", "converting"],
        ["y", "cold", "8", "0", "0", "queued"],
        ["z", "hot", "8", "0", "0", "ready"],
    ]


def test_the_manager_reports_each_adapters_image_state_while_conversions_wait(tmp_path):
    from adapter_fixtures import AdapterHarness

    from memory_broker.broker.adapters import AdapterConfig

    srcs = [write_adapter(str(tmp_path / f"src{i}"), rank=4 + i) for i in range(3)]

    async def go() -> None:
        h = AdapterHarness(str(tmp_path / "state"), config=AdapterConfig(dtype="float32"))
        release = threading.Event()
        real = h.manager.image_service.convert_one

        def slow(meta, layout):
            assert release.wait(30)
            return real(meta, layout)

        h.manager.image_service.convert_one = slow
        try:
            for i, src in enumerate(srcs):
                await h.manager.register(f"a{i}", src)
            for _ in range(200):  # the convert task picks up the first one as soon as the loop lets it
                if h.manager.image_state("a0") == "converting":
                    break
                await asyncio.sleep(0.05)
            states = [h.manager.image_state(f"a{i}") for i in range(3)]
            assert states == ["converting", "queued", "queued"]
            assert h.manager.stats().as_dict()["images"]["convert_queued"] == 3
            release.set()
            await asyncio.wait_for(h.manager.wait_conversions(), 30)
            assert [h.manager.image_state(f"a{i}") for i in range(3)] == ["ready"] * 3
            assert h.manager.stats().as_dict()["images"]["convert_queued"] == 0
        finally:
            release.set()
            await h.close()
        off = AdapterHarness(str(tmp_path / "state-off"), config=AdapterConfig(dtype="float32", image_cache=False))
        try:
            await off.manager.register("b", srcs[0])
            assert off.manager.image_state("b") == "off"
        finally:
            await off.close()

    asyncio.run(go())


def test_a_broker_that_does_not_convert_ahead_lists_no_image(capsys):
    b = start_broker("--no-adapter-convert-ahead")
    try:
        rc, out, err = cli(
            capsys,
            "adapters",
            "register",
            "n1",
            write_adapter(os.path.join(short_tmpdir(), "n1")),
            "--socket",
            b.socket,
        )
        assert rc == 0, err
        assert out.startswith("registered n1: rank 4") and "page image" not in out
        rc, out, _ = cli(capsys, "adapters", "--socket", b.socket)
        assert out.splitlines()[3].split() == ["n1", "cold", "4", "0", "0", "none", "q_proj,v_proj"]
    finally:
        b.stop()


# ----------------------------------------------------------------- logs


def _render(fmt: str, tty: bool) -> str:
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    s = Stream()
    configure("info", fmt, stream=s).info("pool_ready", pages=64)
    configure("info", "json")  # leave the process's logging as the other tests expect it
    return ANSI.sub("", s.getvalue())


@pytest.mark.parametrize(
    "fmt,tty,json_out", [("auto", True, False), ("auto", False, True), ("console", False, False), ("json", True, True)]
)
def test_log_format_auto_is_console_on_a_terminal_and_json_otherwise(fmt, tty, json_out):
    text = _render(fmt, tty)
    assert "pool_ready" in text and "pages" in text and "64" in text
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if json_out:
        assert doc["event"] == "pool_ready" and doc["pages"] == 64 and doc["level"] == "info"
    else:
        assert doc is None and "pages=64" in text


def test_a_reload_that_changes_the_level_keeps_the_format():
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return False

    s = Stream()
    configure("info", "console", stream=s)
    configure("debug", stream=s).debug("after_reload", n=1)
    configure("info", "json")
    assert "after_reload" in s.getvalue() and "n=1" in s.getvalue()


def test_log_format_is_refused_when_unknown_and_json_flag_conflicts(capsys):
    rc, _, err = cli(capsys, "serve", "--log-format", "fancy")
    assert_one_line_error(rc, err, "memory-broker: argument --log-format: invalid choice")
    d = short_tmpdir()
    rc, _, err = cli(capsys, "serve", "--json", "--log-format", "console", "--socket", os.path.join(d, "b.sock"))
    assert_one_line_error(rc, err, "memory-broker: --json means --log-format json")


def _serve_on_a_terminal(*extra: str) -> str:
    """Start the broker with stdout on a pseudo-terminal; what it printed until it served."""
    d = short_tmpdir()
    sock = os.path.join(d, "b.sock")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            EXE,
            "serve",
            "--socket",
            sock,
            "--arena",
            "host",
            "--state-dir",
            os.path.join(d, "s"),
            "--page-size",
            "512KiB",
            "--slab-size",
            "2MiB",
            "--pool-size",
            "32MiB",
            *extra,
        ],
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
    )
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while b"serving" not in out and time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.5)
            if r:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(master)
    return ANSI.sub("", out.decode(errors="replace"))


def test_the_daemon_logs_human_readable_lines_on_a_terminal_and_json_when_forced():
    text = _serve_on_a_terminal()
    lines = [line for line in text.splitlines() if "serving" in line]
    assert lines, text
    assert not lines[0].lstrip().startswith("{") and "[info" in lines[0]
    text = _serve_on_a_terminal("--log-format", "json")
    lines = [line for line in text.splitlines() if "serving" in line]
    assert lines and json.loads(lines[0])["level"] == "info", text
