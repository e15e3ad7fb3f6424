"""Checkpoint lineage with real `train` processes: every checkpoint records the environment
fingerprint, the program's sha256, the ddplaunch version and the world size; a resume names each
field that differs, and under DDPLAUNCH_ENV_CHECK=strict refuses another environment's checkpoint
with exit 3 and one line that says how to go on."""
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import sdk_harness as h

ARGS = ["--samples", "256", "--batch-size", "32", "--log-every", "0"]
ENV_A, ENV_B = "a" * 64, "b" * 64


def env(fingerprint, check):
    return {"DDPLAUNCH_ENV_FINGERPRINT": fingerprint, "DDPLAUNCH_ENV_CHECK": check}


def newest(ckpt):
    return sorted(glob.glob(os.path.join(ckpt, "ckpt-*.ddpckpt")))[-1]


def lineage_lines(out):
    return [line for line in out.splitlines() if "lineage" in line]


def project_version():
    with open(os.path.join(h.BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_PROJECT_VERSION:"):
                return line.strip().split("=", 1)[1]
    raise AssertionError("CMAKE_PROJECT_VERSION not in %s/CMakeCache.txt" % h.BUILD)


class LineageTest(unittest.TestCase):
    def train(self, ckpt, epochs, extra_env, world=1, expect=0, program=None):
        results = h.run(world, ARGS + ["--checkpoint-dir", ckpt, "--epochs", str(epochs)],
                        single=world == 1, extra_env=extra_env, program=program)
        for r in results:
            self.assertEqual(r.returncode, expect, r)
        return results

    def test_a_resume_in_another_environment_is_named_and_refused_under_strict(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1, env(ENV_A, "strict"))
            written = newest(ckpt)
            with open(h.TRAIN, "rb") as f:
                program = hashlib.sha256(f.read()).hexdigest()
            recorded = h.checkpoint_scalars(written)
            self.assertEqual(recorded["ddp.lineage.env_fingerprint"], ENV_A.encode())
            self.assertEqual(recorded["ddp.lineage.program_sha256"], program.encode())
            self.assertEqual(recorded["ddp.lineage.version"], project_version().encode())
            self.assertEqual(recorded["ddp.world_size"], 1)

            # The same environment: resumed, nothing to say.
            same = self.train(ckpt, 2, env(ENV_A, "strict"))[0].stdout
            self.assertEqual(h.value(same, "resumed_from_step"), "8")
            self.assertEqual(lineage_lines(same), [])

            # Another environment under warn: resumed, the field named with both values.
            warned = self.train(ckpt, 3, env(ENV_B, "warn"))[0].stdout
            self.assertEqual(h.value(warned, "resumed_from_step"), "16")
            self.assertEqual(lineage_lines(warned), [
                "[ddp] lineage of checkpoint %s: env_fingerprint was %s, now %s: it was written in another "
                "environment (Python, torch, CUDA, NCCL or --env_lock differ); resuming (--env_check=strict "
                "would refuse)" % (os.path.join(ckpt, "ckpt-000000000016.ddpckpt"), ENV_A[:16], ENV_B[:16])])

            # Its checkpoints are environment B's now; under strict, A's process refuses them, at
            # once, in one line on stderr, and writes nothing.
            before = {f: os.path.getmtime(f) for f in glob.glob(os.path.join(ckpt, "*"))}
            refused = self.train(ckpt, 4, env(ENV_A, "strict"), expect=3)[0]
            errors = refused.stderr.strip().splitlines()
            self.assertEqual(len(errors), 1, refused)
            self.assertEqual(errors[0],
                             "train: error: Trainer: refusing to resume from checkpoint %s: it was written in "
                             "another environment (env_fingerprint was %s, now %s: Python, torch, CUDA, NCCL or "
                             "--env_lock differ) and --env_check=strict is set; resume with the environment that "
                             "wrote it, start from a fresh checkpoint directory, or pass --env_check=warn to "
                             "resume anyway" % (newest(ckpt), ENV_B[:16], ENV_A[:16]))
            self.assertNotIn("resumed_from_step", refused.stdout)
            self.assertEqual({f: os.path.getmtime(f) for f in glob.glob(os.path.join(ckpt, "*"))}, before)

            # Without an environment check (--env_check=off, no ddplaunch) nothing is refused: the
            # fingerprint is named as unknown here.
            unchecked = self.train(ckpt, 4, {})[0].stdout
            self.assertEqual(h.value(unchecked, "resumed_from_step"), "24")
            lines = lineage_lines(unchecked)
            self.assertEqual(len(lines), 1, unchecked)
            self.assertIn("env_fingerprint was %s, now none: this run has no environment check" % ENV_B[:16],
                          lines[0])

    def test_another_build_of_the_program_and_a_checkpoint_without_lineage_are_named(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1, env(ENV_A, "strict"))
            # Another build: the same program with one more byte at the end of the file.
            rebuilt = os.path.join(d, "train")
            shutil.copy2(h.TRAIN, rebuilt)
            with open(rebuilt, "ab") as f:
                f.write(b"\0")
            with open(h.TRAIN, "rb") as f:
                old = hashlib.sha256(f.read()).hexdigest()
            with open(rebuilt, "rb") as f:
                new = hashlib.sha256(f.read()).hexdigest()
            out = self.train(ckpt, 2, env(ENV_A, "strict"), program=rebuilt)[0].stdout
            self.assertEqual(h.value(out, "resumed_from_step"), "8")
            self.assertEqual(lineage_lines(out), [
                "[ddp] lineage of checkpoint %s: program_sha256 was %s, now %s: another build of the program "
                "wrote it; resuming" % (os.path.join(ckpt, "ckpt-000000000008.ddpckpt"), old[:16], new[:16])])

            # A checkpoint written before checkpoints had a lineage: loaded, said once.
            path = newest(ckpt)
            for key in ("ddp.lineage.env_fingerprint", "ddp.lineage.program_sha256", "ddp.lineage.version"):
                h.rename_checkpoint_key(path, key, key.replace("lineage", "lineagX"))
            self.assertNotIn("ddp.lineage.version", h.checkpoint_scalars(path))
            out = self.train(ckpt, 3, env(ENV_B, "strict"))[0].stdout
            self.assertEqual(h.value(out, "resumed_from_step"), "16")
            self.assertEqual(lineage_lines(out), [
                "[ddp] checkpoint %s carries no lineage (written before checkpoints recorded one): its environment, "
                "program and ddplaunch version are not compared" % path])

    def test_a_world_size_change_is_named_and_a_refusal_is_taken_by_every_rank(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1, env(ENV_A, "strict"), world=2)
            self.assertEqual(h.checkpoint_scalars(newest(ckpt))["ddp.world_size"], 2)
            out = self.train(ckpt, 2, env(ENV_A, "strict"), world=1)[0].stdout
            self.assertEqual(h.value(out, "resumed_from_step"), "4")
            self.assertEqual(lineage_lines(out), [
                "[ddp] lineage of checkpoint %s: world_size was 2, now 1: resuming; the sampler splits the rest of "
                "the epoch over 1 rank, every sample once" % os.path.join(ckpt, "ckpt-000000000004.ddpckpt")])
            self.assertIn("written at world size 2, now 1", out)

            # Rank 0 refuses (strict); rank 1 alone would resume (warn), yet stops with it, instead of
            # waiting for rank 0 in a collective.
            results = h.run(2, ARGS + ["--checkpoint-dir", ckpt, "--epochs", "3"],
                            extra_env={"DDPLAUNCH_ENV_FINGERPRINT": ENV_B},
                            rank_env={0: {"DDPLAUNCH_ENV_CHECK": "strict"}, 1: {"DDPLAUNCH_ENV_CHECK": "warn"}})
            for r in results:
                self.assertEqual(r.returncode, 3, r)
            self.assertIn("refusing to resume from checkpoint", results[0].stderr)
            self.assertRegex(results[1].stderr, re.escape(
                "train: error: Trainer: another rank refused to resume from checkpoint %s (written in another "
                "environment, and --env_check=strict is set); its error says more" % newest(ckpt)))

    def test_under_ddplaunch_another_env_lock_is_refused_at_once_or_with_warn_named(self):
        ddplaunch = os.path.join(h.BUILD, "bin", "ddplaunch")
        self.assertTrue(os.path.exists(ddplaunch), "ddplaunch not built: %s" % ddplaunch)
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            locks = []
            for name in ("a", "b"):  # --env_lock is part of the environment fingerprint
                locks.append(os.path.join(d, "lock-" + name))
                with open(locks[-1], "w") as f:
                    f.write("numpy==1.%s\n" % name)

            def launch(*flags, epochs):
                proc = subprocess.run([ddplaunch, "--nproc_per_node=2", "--max_restarts=3"] + list(flags)
                                      + [h.TRAIN] + ARGS + ["--checkpoint-dir", ckpt, "--epochs", str(epochs)],
                                      env=h.clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=120)
                return proc.returncode, proc.stdout

            rc, out = launch("--env_lock=" + locks[0], epochs=1)
            self.assertEqual(rc, 0, out)
            recorded = h.checkpoint_scalars(newest(ckpt))["ddp.lineage.env_fingerprint"].decode()
            self.assertRegex(recorded, "^[0-9a-f]{64}$")

            # Refused, and not restarted although --max_restarts=3 allows it: a restart would refuse
            # the same checkpoint (one attempt: each of the two ranks says one error).
            rc, out = launch("--env_lock=" + locks[1], epochs=2)
            self.assertEqual(rc, 1, out)
            self.assertIn("refusing to resume from checkpoint %s: it was written in another environment "
                          "(env_fingerprint was %s, now " % (newest(ckpt), recorded[:16]), out)
            self.assertEqual(out.count("train: error:"), 2, out)
            self.assertRegex(out, r"worker \d exited with code 3 and said a restart would fail the same way")

            rc, out = launch("--env_lock=" + locks[1], "--env_check=warn", epochs=2)
            self.assertEqual(rc, 0, out)
            self.assertIn("[ddp] lineage of checkpoint %s: env_fingerprint was %s, now " % (
                os.path.join(ckpt, "ckpt-000000000004.ddpckpt"), recorded[:16]), out)
            self.assertEqual(h.value(out, "resumed_from_step"), "4")


if __name__ == "__main__":
    unittest.main()
