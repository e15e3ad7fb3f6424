"""The checks of scripts/gpu-check (on a GPU machine, after scripts/setup): `train` under
`ddplaunch --nproc_per_node=gpu`, NCCL chosen by the SDK (Backend::kAuto). One line per check:
"gpu-check: <name>: PASS|FAIL|SKIP <details>". Usage: python gpu_check.py BUILD_DIR"""
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile

import torch

BUILD = sys.argv[1]
DDPLAUNCH = os.path.join(BUILD, "bin", "ddplaunch")
TRAIN = os.path.join(BUILD, "bin", "train")
PYTHON_DDP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "worker_sdk",
                          "python_ddp.py")
GPUS = torch.cuda.device_count()
failures = []


def report(name, ok, details):
    print("gpu-check: %s: %s %s" % (name, "PASS" if ok else "FAIL", details), flush=True)
    if not ok:
        failures.append(name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, args, extra=(), timeout=600):
    cmd = [DDPLAUNCH, "--nproc_per_node=%s" % nproc, "--master_port=%d" % free_port(),
           *extra, "--no_python", TRAIN, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r, r.stdout + r.stderr


def value(text, key):
    m = re.findall(r"\b%s=(\S+)" % key, text)
    return m[-1] if m else None


def floats(path):
    with open(path, "rb") as f:
        data = f.read()
    return struct.unpack("<%df" % (len(data) // 4), data)


def equivalence(d):
    common = ["--samples", "4096", "--epochs", "1", "--max-steps", "20", "--seed", "3",
              "--log-every", "0"]
    per_gpu = 32
    many, out_many = launch("gpu", common + ["--batch-size", str(per_gpu),
                                             "--dump-params", os.path.join(d, "many")])
    one, out_one = launch(1, common + ["--batch-size", str(per_gpu * GPUS),
                                       "--dump-params", os.path.join(d, "one")])
    if many.returncode or one.returncode:
        report("ddp-equivalence", False, "exit %d / %d: %s" % (many.returncode, one.returncode,
                                                               (out_many + out_one)[-2000:]))
        return
    a, b = floats(os.path.join(d, "many")), floats(os.path.join(d, "one"))
    worst = max(abs(x - y) for x, y in zip(a, b))
    backend = re.search(r"backend (\w+)", out_many)
    backend = backend.group(1) if backend else "?"
    ok = len(a) == len(b) and worst < 1e-4 and (backend == "nccl" or GPUS == 1)
    report("ddp-equivalence", ok, "%d GPU workers (backend %s, batch %d each) vs 1 (batch %d): "
           "largest parameter difference %.2g (limit 1e-4)" % (GPUS, backend, per_gpu,
                                                             per_gpu * GPUS, worst))


def restart(d):
    ckpt = os.path.join(d, "ckpt")
    r, out = launch("gpu", ["--samples", "4096", "--epochs", "1", "--max-steps", "30",
                            "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                            "--crash-at-step", "12", "--log-every", "0"], ["--max_restarts=1"])
    resumed = value(out, "resumed_from_step")
    ok = r.returncode == 0 and resumed == "10" and value(out, "steps") == "30"
    report("killed-worker-restart", ok, "a worker exits 13 before step 12; ddplaunch restarts the "
           "group, which resumes from step %s and ends at step %s (exit %d)%s"
           % (resumed, value(out, "steps"), r.returncode, "" if ok else ": " + out[-2000:]))


def throughput():
    features, hidden, classes, batch, steps, samples = 256, 1024, 10, 256, 200, 256 * 200 * GPUS
    r, out = launch("gpu", ["--features", str(features), "--hidden", str(hidden), "--classes",
                            str(classes), "--batch-size", str(batch), "--max-steps", str(steps),
                            "--samples", str(samples), "--epochs", "1", "--log-every", "0"])
    sdk = value(out, "steady_steps_per_s")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([DDPLAUNCH, "--nproc_per_node=gpu", "--master_port=%d" % free_port(),
                        "--python", sys.executable, PYTHON_DDP, str(features), str(hidden),
                        str(classes), str(batch), str(steps), str(samples), "nccl"],
                       capture_output=True, text=True, timeout=600, env=env)
    py = value(p.stdout + p.stderr, "steady_steps_per_s")
    ok = r.returncode == 0 and p.returncode == 0 and sdk is not None and py is not None
    report("steps-per-second", ok, "SDK %s steps/s vs Python DDP (torch %s, NCCL) %s steps/s on %d "
           "GPU(s), MLP %d-%d-%d, batch %d%s" % (sdk, torch.__version__, py, GPUS, features, hidden,
                                                  classes, batch,
                                                  "" if ok else ": " + (out + p.stderr)[-2000:]))


def main():
    if GPUS == 0:
        print("gpu-check: skipped: torch %s sees no GPU (CUDA %s)" % (torch.__version__,
                                                                     torch.version.cuda))
        return 0
    print("gpu-check: %d GPU(s), torch %s, CUDA %s, NCCL %s" % (
        GPUS, torch.__version__, torch.version.cuda, ".".join(map(str, torch.cuda.nccl.version()))))
    with tempfile.TemporaryDirectory() as d:
        for check in (lambda: equivalence(d), lambda: restart(d), throughput):
            try:
                check()
            except subprocess.TimeoutExpired as e:
                report(getattr(check, "__name__", "check"), False, "timed out: %s" % e)
    print("gpu-check: %s" % ("all checks passed" if not failures else "FAILED: " + ", ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
