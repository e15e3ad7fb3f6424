"""The dashboard (docs/dashboard.md) in a real headless browser: Debian's chromium loads `/` of
a ddp-rendezvous daemon's metrics endpoint, runs the page's script against /api/status and
/api/events, and the test reads the DOM it built (--dump-dom). A real job of 2 agents on loopback
whose worker crashes once must show with its restart and the root cause; text from the status
(hosts, job ids, failure messages with workers' error text) must appear as text, never as markup.
A screenshot is kept under the build directory (test-artifacts/dashboard.png).

Skipped (exit 77, ctest SKIP_RETURN_CODE) when chromium is not installed: scripts/setup installs it.
Loopback only; every wait has a deadline."""

import html.parser
import json
import os
import shutil
import socket
import sys
import unittest

from metrics_helpers import (BUILD_DIR, CONF, PYTHON, RENDEZVOUS, MetricsTestCase, processes, wait_for)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rendezvous"))
from test_daemon import frame, hello, node, recv_msg, recv_type  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP = 77
ARTIFACTS = os.path.join(BUILD_DIR, "test-artifacts")
# Markup that would run or show if the page ever parsed data as HTML.
IMG = '<img src=x onerror="document.body.dataset.pwned=1">'
SCRIPT = "<script>document.body.dataset.pwned=2</script><b>bold</b>"

# Rank 1 writes an error file and exits 7 in the first attempt; every worker steps (progress for
# the dashboard's steps per second) until OUT/release.
CRASH_ONCE_WORKER = r"""
import json, os, sys, time
import ddplaunch
out = sys.argv[1]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(out, "started-%d-%d" % (rank, attempt)), "w").close()
for _ in range(20):
    ddplaunch.step()
    time.sleep(0.02)
if rank == 1 and attempt == 0:
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "dashboard test crash " + os.environ["CRASH_TEXT"],
                               "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    sys.exit(7)
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "release")) and time.time() < deadline:
    ddplaunch.step()
    time.sleep(0.05)
"""


class Element:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, pred):
        for c in self.children:
            if isinstance(c, Element):
                if pred(c):
                    yield c
                yield from c.all(pred)

    def field(self, name):
        return [e.text() for e in self.all(lambda e: e.attrs.get("data-field") == name)]


class Dom(html.parser.HTMLParser):
    """The dumped DOM as a tree of Elements (void elements closed at once)."""
    VOID = {"meta", "img", "br", "hr", "input", "link"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Element("#document", {}, None)
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        e = Element(tag, attrs, self.current)
        self.current.children.append(e)
        if tag not in self.VOID:
            self.current = e

    def handle_endtag(self, tag):
        e = self.current
        while e is not None and e.tag != tag:
            e = e.parent
        if e is not None and e.parent is not None:
            self.current = e.parent

    def handle_data(self, data):
        self.current.children.append(data)


class DashboardBrowserTest(MetricsTestCase):
    def chromium(self, *args, timeout=90):
        profile = os.path.join(self.tmp, "chromium-profile")
        r = processes.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                           "--disable-dev-shm-usage", "--user-data-dir=" + profile] + list(args), timeout=timeout)
        self.assertFalse(r.timed_out, r.describe())
        return r

    def dom(self):
        """The DOM of `/` after the page has polled a few times (virtual time: no sleeping)."""
        r = self.chromium("--virtual-time-budget=7000", "--dump-dom", "http://127.0.0.1:%d/" % self.metrics_port)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("updated", r.stdout, "the page never got its status: " + r.stdout[-2000:])
        return r.stdout, Dom(r.stdout).root

    def screenshot(self, name):
        os.makedirs(ARTIFACTS, exist_ok=True)
        path = os.path.join(ARTIFACTS, name)
        if os.path.exists(path):
            os.unlink(path)
        self.chromium("--virtual-time-budget=5000", "--window-size=1280,1400", "--hide-scrollbars",
                      "--screenshot=" + path, "http://127.0.0.1:%d/" % self.metrics_port)
        self.assertTrue(os.path.getsize(path) > 0, path)
        print("dashboard screenshot: %s" % path)

    def status_json(self):
        r = processes.run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % self.port, "--json"], timeout=30)
        self.assertEqual(r.returncode, 0, r.describe())
        return json.loads(r.stdout)

    def assert_no_markup_from_data(self, raw, root):
        self.assertEqual(list(root.all(lambda e: e.tag == "img" or e.text() == "bold")), [])
        self.assertEqual(len(list(root.all(lambda e: e.tag == "script"))), 1)  # the page's own
        body = next(root.all(lambda e: e.tag == "body"))
        self.assertNotIn("data-pwned", body.attrs)
        self.assertNotIn("data-pwned=", raw)

    def card(self, root, job):
        cards = list(root.all(lambda e: e.tag == "section" and e.attrs.get("data-job") == job))
        self.assertEqual(len(cards), 1, "job %s on the page" % job)
        return cards[0]

    def assert_goodput_as_status(self, card, job, before, after):
        """When status carries goodput (see docs/dashboard.md), the page shows the same percent."""
        figures = [next((j.get("goodput") for j in s["jobs"] if j["job_id"] == job), None) for s in (before, after)]
        if figures[0] is None and figures[1] is None:
            self.assertEqual(card.field("goodput-percent"), [], "no goodput in status: no panel")
            print("status has no goodput yet: the goodput panel is hidden, as it must be")
            return
        shown = card.field("goodput-percent")
        self.assertEqual(len(shown), 1)
        self.assertIn(shown[0], ["%.1f" % g["percent"] for g in figures if g], "page %s vs status %s" % (shown, figures))
        print("goodput shown %s %% (status --json: %s)" % (shown[0], [g and g["percent"] for g in figures]))

    def test_a_job_that_crashed_once_shows_its_restart_root_cause_and_progress(self):
        self.start_daemon()
        worker = self.script("crash_once.py", CRASH_ONCE_WORKER)
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % self.port,
                "--rdzv_id=dash-job", "--rdzv_conf", CONF, "--shutdown_timeout=5", "--max_restarts=1",
                "--python", PYTHON, worker, self.out]
        agents = [self.spawn_launch(args, env={"CRASH_TEXT": IMG + SCRIPT}) for _ in range(2)]
        wait_for(lambda: self.started(0, 1) and self.started(1, 1), 120, "both workers of the restarted round")

        def stepping():
            jobs = self.status_json()["jobs"]
            return all("last_step" in n for j in jobs for n in j["nodes"]) and jobs
        wait_for(stepping, 30, "both nodes' steps in status")
        raw, root = self.dom()
        self.screenshot("dashboard.png")
        card = self.card(root, "dash-job")
        self.assertEqual(card.field("state"), ["running"])
        self.assertEqual(card.field("restarts"), ["1 / 1"])
        self.assertEqual(card.field("generation"), ["2"])
        nodes = list(card.all(lambda e: e.tag == "tr" and e.attrs.get("class") == "node"))
        self.assertEqual(len(nodes), 2)
        rates = card.field("steps-per-second")
        self.assertEqual(len(rates), 2)
        for rate in rates:  # two polls apart: a number, not "-"
            self.assertGreaterEqual(float(rate), 0, rates)
        restarts = list(card.all(lambda e: e.tag == "li" and e.attrs.get("data-type") == "restart"))
        self.assertEqual(len(restarts), 1)
        text = restarts[0].text()
        self.assertIn("worker_failure", text)
        cause = [e.text() for e in restarts[0].all(lambda e: "root-cause" in e.attrs.get("class", ""))]
        self.assertEqual(len(cause), 1, text)
        self.assertIn("root cause: failure", cause[0])
        self.assertIn("exited with code 7", cause[0])
        self.assertIn("dashboard test crash " + IMG + SCRIPT, cause[0])  # the worker's text, as text
        self.assert_no_markup_from_data(raw, root)
        self.release()
        for a in agents:
            self.assertEqual(a.wait(90), 0, a.describe())
        wait_for(lambda: any(j["job_id"] == "dash-job" and j["state"] == "succeeded"
                             for j in self.status_json()["jobs"]), 20, "the job's success in status")
        before = self.status_json()
        raw, root = self.dom()
        after = self.status_json()
        card = self.card(root, "dash-job")
        self.assertEqual(card.field("state"), ["succeeded"])
        types = [e.attrs["data-type"] for e in card.all(lambda e: e.tag == "li" and "data-type" in e.attrs)]
        self.assertEqual([t for t in types if t in ("round", "failure", "restart", "job_end")],
                         ["round", "failure", "restart", "round", "job_end"])
        self.assert_goodput_as_status(card, "dash-job", before, after)

    def test_hosts_job_ids_and_failure_messages_are_text_never_markup(self):
        self.start_daemon()
        job = "job" + SCRIPT
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.addCleanup(s.close)
        hello(s, job)
        self.assertEqual(recv_msg(s)["type"], "welcome")
        s.sendall(frame({"type": "join", "node": node(job, IMG, workers=1, max_nodes=1, max_restarts=1)}))
        recv_type(s, "round", 10)
        s.sendall(frame({"type": "failure", "failure": {"host": IMG, "rank": 0, "local_rank": 0, "exit_code": 3,
                                                        "error_file_message": SCRIPT + IMG}}))
        recv_type(s, "restart", 10)
        raw, root = self.dom()
        card = self.card(root, job)
        self.assertEqual(card.field("job-id"), [job])
        self.assertEqual(card.field("host"), [IMG])
        messages = [e.text() for e in card.all(lambda e: "root-cause" in e.attrs.get("class", ""))]
        self.assertEqual(len(messages), 1)
        self.assertIn("on " + IMG, messages[0])
        self.assertIn(SCRIPT + IMG, messages[0])
        self.assert_no_markup_from_data(raw, root)
        self.assertIn("&lt;img src=x onerror=", raw)  # serialized as escaped text


if __name__ == "__main__":
    if not CHROMIUM:
        print("SKIP: no chromium (apt-get install chromium; scripts/setup installs it)")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
