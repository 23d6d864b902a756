"""Progress of `pytest bench/`: as each suite (bench file) starts, its expected time and what is left, from the
times a full run measured on the 2-core CPU (bench/suite_times.json, per mode); at the end, the measured times per
suite in bench/out/suite_times.json (copy it over bench/suite_times.json after a full run to update them)."""
import json
import os
import time

import pytest

EXPECTED_FILE = os.path.join(os.path.dirname(__file__), "suite_times.json")


class SuiteProgress:
    def __init__(self, mode: str, out_dir: str):
        self.mode, self.out_dir = mode, out_dir
        try:
            with open(EXPECTED_FILE) as f:
                self.expected = json.load(f).get(mode, {})
        except (OSError, ValueError):
            self.expected = {}
        self.suites: list[str] = []
        self.current: str | None = None
        self.started = self.suite_start = time.perf_counter()
        self.measured: dict[str, float] = {}

    def _write(self, line: str) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        self.config = session.config
        self.suites = list(dict.fromkeys(os.path.basename(item.location[0]) for item in session.items
                                         if _in_bench(item.location[0])))
        known = [self.expected[s] for s in self.suites if s in self.expected]
        if known:
            self._write(f"bench: {len(self.suites)} suites, expected ~{sum(known) / 60:.1f} min in {self.mode} mode "
                        f"on the 2-core CPU ({len(self.suites) - len(known)} without a measured time)")

    def _close_current(self) -> None:
        if self.current is not None:
            self.measured[self.current] = round(time.perf_counter() - self.suite_start, 1)

    def pytest_runtest_logstart(self, nodeid, location):
        suite = os.path.basename(location[0])
        if suite == self.current or not _in_bench(location[0]):
            return
        self._close_current()
        self.current, self.suite_start = suite, time.perf_counter()
        i = self.suites.index(suite) + 1 if suite in self.suites else 0
        left = sum(self.expected.get(s, 0.0) for s in self.suites[i - 1:])
        expected = self.expected.get(suite)
        self._write(f"\nbench [{i}/{len(self.suites)}] {suite}: expected "
                    f"{f'~{expected:.0f} s' if expected is not None else 'unknown'}; "
                    f"{(time.perf_counter() - self.started) / 60:.1f} min elapsed, ~{left / 60:.1f} min left")

    def pytest_sessionfinish(self, session):
        self._close_current()
        if not self.measured:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "suite_times.json"), "w") as f:
            json.dump({self.mode: self.measured}, f, indent=1)


def _in_bench(path: str) -> bool:
    """A location (relative to the rootdir) in bench/, where the suites are (`make test` collects tests/ too)."""
    return os.path.normpath(path).split(os.sep)[0] == "bench"
