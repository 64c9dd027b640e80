"""A pytest plugin for the GPU run: a junit file rewritten after every test, so a run cut by its
time limit still leaves one saying what ran (pytest writes its own ``--junitxml`` only when the
session ends, which a killed pytest never reaches).

    PYTHONPATH=ops/gpu python -m pytest -p live_junit --live-junit FILE ...

Every collected test is a ``<testcase>`` whose ``file`` is its path relative to the working
directory (``gpu_ready.py verdict`` tallies by it); a test that has not finished yet is
``<skipped type="notrun">``, so at a cut the file lists what never ran, and names the test that
was running ("not finished"). A module that failed to
collect is an ``<error>`` under its own name. Each write goes to a temporary file renamed over
FILE, so a kill mid-write leaves the previous version whole.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import pytest

NOT_RUN = "notrun"


def pytest_addoption(parser):
    parser.addoption("--live-junit", metavar="FILE", help="junit XML rewritten after every test (live_junit)")


def pytest_configure(config):
    path = config.getoption("--live-junit")
    if path:
        config.pluginmanager.register(LiveJunit(path), "live-junit-writer")


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr or "")[-2000:]


class LiveJunit:
    def __init__(self, path: str) -> None:
        self.path = path
        # nodeid -> [file, outcome ("passed", "failed", "error", "skipped" or NOT_RUN), message, seconds]
        self.cases: dict[str, list] = {}

    def _file(self, nodeid: str, fspath) -> str:
        path = str(fspath) if fspath else nodeid.split("::", 1)[0]
        return os.path.relpath(os.path.abspath(path))

    def pytest_collectreport(self, report):
        if report.failed:
            self.cases[report.nodeid or "collection"] = [
                self._file(report.nodeid, getattr(report, "fspath", None)),
                "error",
                f"collection failed: {_message(report)}",
                0.0,
            ]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        for item in session.items:
            self.cases.setdefault(
                item.nodeid,
                [self._file(item.nodeid, item.path), NOT_RUN, "not run: the run ended before it", 0.0],
            )
        self.write()

    def pytest_runtest_logstart(self, nodeid, location):
        case = self.cases.get(nodeid)
        if case is not None and case[1] == NOT_RUN:
            case[2] = "not finished: it was running when the run ended"
            self.write()

    def pytest_runtest_logreport(self, report):
        case = self.cases.setdefault(report.nodeid, [self._file(report.nodeid, None), NOT_RUN, "", 0.0])
        case[3] += report.duration
        if report.failed:
            if report.when == "call":
                case[1], case[2] = "failed", _message(report)
            elif case[1] != "failed":  # setup, or teardown after the test's own outcome
                case[1], case[2] = "error", f"{report.when}: {_message(report)}"
        elif report.skipped and (report.when == "call" or case[1] == NOT_RUN):
            case[1], case[2] = "skipped", _message(report)
        elif report.passed and report.when == "call":
            case[1], case[2] = "passed", ""

    def pytest_runtest_logfinish(self, nodeid, location):
        self.write()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        self.write()

    def write(self) -> None:
        suite = ET.Element("testsuite", name="pytest")
        counts = dict.fromkeys(("passed", "failed", "error", "skipped", NOT_RUN), 0)
        for nodeid, (path, outcome, message, seconds) in self.cases.items():
            counts[outcome] += 1
            name = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
            classname = path[:-3].replace(os.sep, ".") if path.endswith(".py") else path
            case = ET.SubElement(suite, "testcase", classname=classname, name=name, file=path, time=f"{seconds:.3f}")
            if outcome == "failed":
                ET.SubElement(case, "failure", message=message)
            elif outcome == "error":
                ET.SubElement(case, "error", message=message)
            elif outcome == "skipped":
                ET.SubElement(case, "skipped", message=message)
            elif outcome == NOT_RUN:
                ET.SubElement(case, "skipped", type=NOT_RUN, message=message)
        suite.set("tests", str(len(self.cases)))
        suite.set("failures", str(counts["failed"]))
        suite.set("errors", str(counts["error"]))
        suite.set("skipped", str(counts["skipped"] + counts[NOT_RUN]))
        suite.set(NOT_RUN, str(counts[NOT_RUN]))
        root = ET.Element("testsuites")
        root.append(suite)
        tmp = f"{self.path}.tmp"
        ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
        os.replace(tmp, self.path)
