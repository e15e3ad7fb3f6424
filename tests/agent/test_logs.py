"""Worker output: straight to the console by default; --redirects/--tee write
<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log; tee'd lines reach the console
whole, with a prefix; --local_ranks_filter limits which ranks reach the console."""

import os
import re
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import DDPLAUNCH, PYTHON, LaunchTestCase, kill_group, main  # noqa: E402

# Every worker writes LINES long lines in three pieces each, flushing between pieces, all at the
# same time, on stdout, and one line on stderr.
PIECES = """
import os, sys
rank = os.environ["LOCAL_RANK"]
for i in range(int(os.environ.get("LINES", "200"))):
    body = ("%s-%d-" % (rank, i)) + rank * 3000
    third = len(body) // 3
    for piece in (body[:third], body[third:2 * third], body[2 * third:] + "\\n"):
        sys.stdout.write(piece)
        sys.stdout.flush()
sys.stderr.write("err from %s\\n" % rank)
sys.stdout.write("no newline at the end %s" % rank)
"""


def read(path):
    with open(path) as f:
        return f.read()


class WorkerLogs(LaunchTestCase):
    def logs(self):
        return os.path.join(self.tmp, "logs")

    def worker_file(self, run_id, attempt, local_rank, name):
        return os.path.join(self.logs(), run_id, "attempt_%d" % attempt, str(local_rank), name)

    def test_teed_lines_are_whole_and_prefixed_and_log_files_hold_the_raw_output(self):
        script = self.script("pieces.py", PIECES)
        result = self.launch(["--nproc_per_node=4", "--tee=3", "--log_dir", self.logs(), "--rdzv_id=teejob",
                              "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        pattern = re.compile(r"^\[default(\d)\]:(\d)-(\d+)-(\d+)$")
        seen = {r: [] for r in range(4)}
        for line in result.stdout.splitlines():
            if "no newline" in line:
                self.assertRegex(line, r"^\[default(\d)\]:no newline at the end \1$")
                continue
            m = pattern.match(line)
            self.assertIsNotNone(m, "a console line was cut or mixed: %r" % line[:120])
            prefix_rank, rank, idx, body = m.groups()
            self.assertEqual(prefix_rank, rank)
            self.assertEqual(body, rank * 3000)
            seen[int(rank)].append(int(idx))
        for r in range(4):
            self.assertEqual(seen[r], list(range(200)), "rank %d lost or reordered lines" % r)
            self.assertIn("[default%d]:err from %d" % (r, r), result.stderr)
            raw = read(self.worker_file("teejob", 0, r, "stdout.log"))
            self.assertTrue(raw.startswith("%d-0-" % r))
            self.assertTrue(raw.endswith("no newline at the end %d" % r), raw[-200:])
            self.assertNotIn("[default", raw)
            self.assertEqual(read(self.worker_file("teejob", 0, r, "stderr.log")), "err from %d\n" % r)

    def test_redirects_keep_output_off_the_console(self):
        script = self.script("pieces.py", PIECES)
        result = self.launch(["--nproc_per_node=2", "--redirects=1", "--log_dir", self.logs(), "--rdzv_id=rjob",
                              "--python", PYTHON, script], env={"LINES": "5"})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertNotIn("-0-", result.stdout)
        for r in range(2):
            self.assertIn("%d-4-" % r, read(self.worker_file("rjob", 0, r, "stdout.log")))
            self.assertIn("err from %d" % r, result.stderr)  # stderr was not redirected
            self.assertFalse(os.path.exists(self.worker_file("rjob", 0, r, "stderr.log")))

    def test_per_rank_tee_and_the_prefix_template(self):
        script = self.script("pieces.py", PIECES)
        result = self.launch(["--nproc_per_node=2", "--tee=1:1", "--log_dir", self.logs(), "--rdzv_id=pjob",
                              "--python", PYTHON, script],
                             env={"LINES": "3", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("<default|1|1> 1-2-", result.stdout)
        # Rank 0 was not tee'd: its output reaches the console unprefixed, and has no log file.
        # It writes the console itself, in pieces, so the agent's whole prefixed lines of rank 1
        # can land between two of its pieces (as with torchrun); without them its lines are whole.
        rank0 = re.sub(r"<default\|1\|1> [^\n]*\n", "", result.stdout)
        self.assertRegex(rank0, r"(?m)^0-2-0+$")
        self.assertFalse(os.path.exists(self.worker_file("pjob", 0, 0, "stdout.log")))

    def test_the_prefix_template_can_name_the_host(self):
        result = self.launch(["--nproc_per_node=2", "--tee=3", "--log_dir", self.logs(), "--no_python", "/bin/echo", "hi"],
                             env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${hostname}:${rank}]:"})
        self.assertEqual(result.returncode, 0, result.describe())
        host = socket.gethostname()
        self.assertEqual(sorted(l for l in result.stdout.splitlines() if l.endswith("hi")),
                         ["[%s:0]:hi" % host, "[%s:1]:hi" % host])

    def test_local_ranks_filter_limits_the_console_to_those_ranks(self):
        script = self.script("pieces.py", PIECES)
        result = self.launch(["--nproc_per_node=3", "--tee=3", "--local_ranks_filter=1", "--log_dir", self.logs(),
                              "--rdzv_id=fjob", "--python", PYTHON, script], env={"LINES": "3"})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("[default1]:1-2-", result.stdout)
        self.assertNotIn("[default0]", result.stdout + result.stderr)
        self.assertNotIn("[default2]", result.stdout + result.stderr)
        self.assertNotIn("err from 0", result.stderr)
        # Filtered ranks still write their log files.
        for r in range(3):
            self.assertIn("%d-2-" % r, read(self.worker_file("fjob", 0, r, "stdout.log")))

    def test_each_restart_logs_into_its_own_attempt_directory(self):
        script = self.script("flaky.py", "import os, sys\n"
                             "n = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                             "print('attempt', n)\n"
                             "sys.exit(1 if n < 1 else 0)\n")
        result = self.launch(["--nproc_per_node=1", "--max_restarts=1", "--redirects=3", "--log_dir", self.logs(),
                              "--rdzv_id=ajob", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual(read(self.worker_file("ajob", 0, 0, "stdout.log")), "attempt 0\n")
        self.assertEqual(read(self.worker_file("ajob", 1, 0, "stdout.log")), "attempt 1\n")

    def test_by_default_output_goes_straight_to_the_console_unprefixed(self):
        script = self.script("hello.py", "import os, sys\nsys.stdout.write('hello from %s\\n' % os.environ['RANK'])\n")
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual(sorted(result.stdout.splitlines()), ["hello from 0", "hello from 1"])
        self.assertIn("log directory:", result.stderr)

    def test_a_closed_console_does_not_stop_the_job(self):
        # ddplaunch's stdout is a pipe whose reader is gone: tee'd lines cannot be written, but
        # the workers still run to the end and their log files are complete.
        import subprocess
        script = self.script("pieces.py", PIECES)
        r, w = os.pipe()
        os.close(r)
        try:
            proc = subprocess.Popen(["%s" % DDPLAUNCH, "--nproc_per_node=2", "--tee=1", "--log_dir", self.logs(),
                                     "--rdzv_id=cjob", "--python", PYTHON, script], stdout=w,
                                    stderr=subprocess.DEVNULL, env=dict(os.environ, LINES="50"), cwd=self.tmp,
                                    start_new_session=True)
        finally:
            os.close(w)
        self.addCleanup(kill_group, proc.pid)
        self.assertEqual(proc.wait(timeout=60), 0)
        for r in range(2):
            self.assertIn("%d-49-" % r, read(self.worker_file("cjob", 0, r, "stdout.log")))


if __name__ == "__main__":
    main()
