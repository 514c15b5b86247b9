"""The lighthouse's status page as an operator sees it: rendered by headless Chromium
while groups live, heal, and die (one killed, one hung)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from html.parser import HTMLParser
from pathlib import Path

import pytest

import phalanx

from conftest import HEARTBEAT_TIMEOUT, http_get, is_step, wait_until

#: Every host name but loopback's fails to resolve: a page that fetched anything from
#: elsewhere would render incomplete.
LOOPBACK_ONLY = "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        assert not os.environ.get("PHALANX_CI"), "CI installs Chromium (Debian's chromium)"
        pytest.skip("Chromium is not installed (Debian: apt install chromium)")
    return path


def headless(browser: str, url: str, profile: Path, *what: str) -> str:
    """Runs `browser` headless on `url` once its script had 3 s of (virtual) time."""
    argv = [
        browser,
        "--headless",
        "--no-sandbox",  # the tests may run as root
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--host-resolver-rules={LOOPBACK_ONLY}",
        "--virtual-time-budget=3000",
        "--window-size=1500,1000",
        *what,
        url,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Tables(HTMLParser):
    """The rows of every `<tbody id=…>`: (the row's class, its cells' text)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, list[tuple[str, list[str]]]] = {}
        self.texts: dict[str, str] = {}
        self._body: str | None = None
        self._cell: list[str] | None = None
        self._id: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tbody":
            self._body = a.get("id") or ""
            self.rows[self._body] = []
        elif tag == "tr" and self._body is not None:
            self.rows[self._body].append((a.get("class") or "", []))
        elif tag == "td" and self._body is not None:
            self._cell = []
        if a.get("id") and tag != "tbody":
            self._id = a["id"]
            self.texts[self._id] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._body = None
        elif tag == "td" and self._cell is not None and self._body is not None:
            self.rows[self._body][-1][1].append("".join(self._cell))
            self._cell = None
        elif tag in ("b", "p", "div", "small"):
            self._id = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.texts[self._id] += data


def status(lighthouse: phalanx.LighthouseServer) -> dict:
    return json.loads(http_get(f"http://{lighthouse.address}/status")[1])


def lose_two_groups(lighthouse, start_group) -> None:
    """Two groups step together; then one is killed and the other hangs."""
    killed = start_group("killed", lighthouse.address)
    hung = start_group("hung", lighthouse.address)
    for group in (killed, hung):
        group.expect(is_step, 20.0, "a committed step")
    killed.signal(signal.SIGKILL)
    hung.signal(signal.SIGSTOP)
    wait_until(
        lambda: {lost["replica_id"] for lost in status(lighthouse)["lost"]} == {"killed", "hung"},
        10.0,
        "both groups declared dead",
    )


def manager_server(servers: ExitStack, name: str, lighthouse) -> phalanx.ManagerServer:
    """Group `name`'s manager server, shut down when `servers` closes."""
    return servers.enter_context(
        phalanx.ManagerServer(name, lighthouse.address, heartbeat_interval=0.05)
    )


def quorum_with_one_behind(servers: ExitStack, lighthouse) -> None:
    """Groups a and c at step 10 and b at step 0 in one quorum: b must heal, and since
    nothing here fetches the state, it stays healing."""
    steps = {"a": 10, "b": 0, "c": 10}
    clients = {
        name: phalanx.ManagerClient(manager_server(servers, name, lighthouse).address)
        for name in steps
    }

    def ask(name: str) -> int:
        request = phalanx.QuorumRequest(group_rank=0, step=steps[name], timeout=10.0)
        return clients[name].quorum(request).replica_world_size

    # A quorum already exists (the lost groups'): the lighthouse waits only for its
    # live members. So a forms one alone; then, b and c asking, it waits for a.
    assert ask("a") == 1
    with ThreadPoolExecutor(2) as pool:
        others = pool.map(ask, ["b", "c"])
        wait_until(
            lambda: sum(g["joined"] for g in status(lighthouse)["replicas"]) == 2,
            5.0,
            "b and c asking for a quorum",
        )
        assert ask("a") == 3
        assert list(others) == [3, 3]
    wait_until(
        lambda: [g["healing"] for g in status(lighthouse)["replicas"]] == [False, True, False],
        5.0,
        "b reported healing",
    )


def restart_a_group(servers: ExitStack, lighthouse) -> None:
    """Group d ends its run and comes back under the same replica id (it asks for no
    quorum): it left, which is no failure."""

    def live() -> bool:
        return any(g["replica_id"] == "d" for g in status(lighthouse)["replicas"])

    with phalanx.ManagerServer("d", lighthouse.address, heartbeat_interval=0.05):
        wait_until(live, 5.0, "d heartbeating")
    wait_until(
        lambda: any(lost["replica_id"] == "d" for lost in status(lighthouse)["lost"]),
        5.0,
        "d gone",
    )
    manager_server(servers, "d", lighthouse)
    wait_until(live, 5.0, "d back")


@pytest.mark.slow
def test_the_status_page_shows_live_healing_and_lost_groups_with_nothing_from_outside(
    start_group, tmp_path
):
    browser = chromium()
    # A join timeout long enough to gather b, c and a on two busy cores.
    with (
        phalanx.LighthouseServer(
            bind="127.0.0.1:0", join_timeout=2.0, heartbeat_timeout=HEARTBEAT_TIMEOUT
        ) as lighthouse,
        ExitStack() as servers,
    ):
        lose_two_groups(lighthouse, start_group)
        quorum_with_one_behind(servers, lighthouse)
        restart_a_group(servers, lighthouse)
        page = http_get(lighthouse.status_url)[1]
        metrics = http_get(f"http://{lighthouse.address}/metrics")[1]
        dom = headless(browser, lighthouse.status_url, tmp_path / "profile", "--dump-dom")
        shot = tmp_path / "status.png"
        headless(browser, lighthouse.status_url, tmp_path / "profile", f"--screenshot={shot}")

    # Self-contained: no address of another origin anywhere in the page.
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|@import", page, re.I)
    tables = Tables(dom)
    assert tables.texts["error"] == "", tables.texts["error"]
    live = tables.rows["rows"]
    # Healing first, then outside the quorum, then the rest by name.
    assert [cells[0] for _, cells in live] == ["b", "d", "a", "c"]
    (b_class, b), (_, d), (_, a), _ = live
    assert b_class == "healing"
    assert (b[1], b[3], b[4]) == ("yes", "yes", "0"), b  # in quorum, healing, step
    assert (a[1], a[3], a[4]) == ("yes", "no", "10"), a
    assert (d[1], d[13], d[14]) == ("no", "0", "1"), d  # in quorum, failures, restarts
    lost = {cells[0]: cells for _, cells in tables.rows["lost-rows"]}
    assert set(lost) == {"killed", "hung"}
    assert lost["killed"][2].startswith("stream broken"), lost["killed"]
    assert lost["hung"][2].startswith("heartbeat timeout"), lost["hung"]
    assert "ago" in lost["hung"][1]
    assert (tables.texts["healing"], tables.texts["lost-count"]) == ("1", "2")
    assert "asking for a quorum" in dom
    assert shot.stat().st_size > 10_000, "a screenshot of a rendered page"

    # What an operator alerts on, for the same groups.
    for sample in [
        'phalanx_lighthouse_group_live{replica_id="killed"} 0',
        'phalanx_lighthouse_group_losses_total{replica_id="killed",cause="stream_broken"} 1',
        'phalanx_lighthouse_group_losses_total{replica_id="hung",cause="heartbeat_timeout"} 1',
        'phalanx_lighthouse_group_returns_total{replica_id="d"} 1',
        'phalanx_lighthouse_group_losses_total{replica_id="d",cause="left"} 1',
        'phalanx_lighthouse_group_healing{replica_id="b"} 1',
        'phalanx_lighthouse_group_step{replica_id="a"} 10',
    ]:
        assert f"{sample}\n" in metrics, sample
    promtool = shutil.which("promtool")
    assert promtool or not os.environ.get("PHALANX_CI"), "CI installs promtool (prometheus)"
    if promtool:
        checked = subprocess.run(
            [promtool, "check", "metrics"],
            input=metrics,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
