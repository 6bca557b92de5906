"""Every CLI verb against bad input: exit 2, one line on stderr, no traceback,
nothing new on disk.

Each row is a verb and arguments a person could type by mistake (or a
machine could hand them: a busy port, a deep socket root, a read-only or
loose cache). Preflight rows fail before a weight byte is read; "nothing new
on disk" is checked over every place the verbs write: the cache, the socket
root, the temp dir and the working directory.

Controls: the same checker on a good promote (exit 0, writes a manifest)
fails, so the checker tells a refusal from a success; and a deliberately
two-line error fails the one-line rule.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="cli_bad_input")]

REPO = Path(__file__).resolve().parents[2]


def _tree(*roots: Path) -> set[str]:
    out: set[str] = set()
    for root in roots:
        if root.exists():
            out |= {str(p) for p in root.rglob("*")}
            out.add(str(root))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_ckpt):
    base = tmp_path_factory.mktemp("badcli")
    ckpt = base / "ckpt"
    import shutil

    shutil.copytree(tiny_ckpt, ckpt)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    (base / "afile").write_text("x")
    foreign = base / "foreigncache"
    (foreign / "manifests").mkdir(parents=True, mode=0o700)
    os.chown(foreign / "manifests", 65534, 65534)  # another user's (nobody) manifests
    # A grouped-query model: 6 attention heads, 2 key/value heads (only
    # config.json differs; the checks read nothing else). tp 3 divides the
    # heads but not the KV heads; tp 2 divides both.
    gqa = base / "gqa"
    shutil.copytree(tiny_ckpt, gqa)
    cfg = json.loads((gqa / "config.json").read_text())
    (gqa / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 6, "num_key_value_heads": 2}))
    # A malformed checkpoint: a shard whose header is garbage (read without hashing).
    broken = base / "broken"
    shutil.copytree(tiny_ckpt, broken)
    next(broken.glob("*.safetensors")).write_bytes(b"garbage!")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    # A valid golden with a config digest, for the canary rows that must get past reading it.
    from canaries.golden import Golden, GoldenPrompt, Sampling

    golden = Golden("ab" * 32, "0.32.0", Sampling(max_tokens=1, top_logprobs=1),
                    [GoldenPrompt("p", [1, 2], [3], "x", [-0.5], [{"3": -0.5}])], token_texts={"3": "x"},
                    config_digest="c" * 64, tokenizer_digest="d" * 64)
    (base / "golden.json").write_text(json.dumps(golden.to_json()))
    yield {"base": base, "ckpt": ckpt, "port": busy.getsockname()[1], "long": base / ("d" * 60) / ("e" * 40),
           "gqa": gqa, "free": free, "broken": broken}
    busy.close()


def _run(world, argv: list[str], extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, set, set]:
    base = world["base"]
    work = base / "cwd"
    for d in ("cache", "sock", "tmp", "cwd"):
        (base / d).mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(base / "cache"), PRELOAD_GATE_SOCKET_ROOT=str(base / "sock"),
               TMPDIR=str(base / "tmp"), XDG_CACHE_HOME=str(base / "cache"), PYTHONPATH=str(REPO))
    # torch's own compile cache (made under TMPDIR by whichever row first
    # imports vLLM) is not our output: keep it out of the watched tree, so the
    # check does not depend on which row runs first.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(base / "torch-cache")
    env.pop("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", None)
    env.pop("PRELOAD_GATE_EVENTS", None)
    env.update(extra_env or {})
    watched = [base / "cache", base / "sock", base / "tmp", work, base / "foreigncache", world["ckpt"]]
    before = _tree(*watched)
    argv = [a.format(ckpt=world["ckpt"], base=base, port=world["port"], long=world["long"], gqa=world["gqa"],
                     free=world["free"], broken=world["broken"]) for a in argv]
    p = subprocess.run([sys.executable, "-m", "preload_gate", *argv], capture_output=True, text=True,
                       timeout=120, env=env, cwd=work)
    return p, before, _tree(*watched)


def check_refusal(p: subprocess.CompletedProcess, before: set, after: set, needle: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, f"exit {p.returncode}: {p.stderr[-2000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(lines) == 1, f"{len(lines)} stderr lines: {p.stderr[-2000:]}"
    assert needle in lines[0], lines[0]
    assert after == before, f"new on disk: {sorted(after - before)}"


BAD = [
    # verb, argv, env, what the one line must name
    ("fixtures", ["fixtures", "tiny", "{ckpt}"], None, "exists"),
    ("fixtures", ["fixtures", "tiny", "{base}/t", "--shards", "0"], None, "shards"),
    ("fixtures", ["fixtures", "smollm2"], None, "required"),
    # A parent that only looks writable (/proc): mkdir fails after the checks.
    ("fixtures", ["fixtures", "tiny", "/proc/pg-no-such-dir"], None, "choose a writable OUT"),
    ("promote", ["promote", "{base}/nope"], None, "does not exist"),
    ("promote", ["promote", "{ckpt}", "--socket-root", "{base}/missing/deeper/root"], None, "does not exist"),
    ("promote", ["promote", "{ckpt}", "--socket-root", "{long}"], None, "AF_UNIX"),
    ("promote", ["promote", "{ckpt}", "--cache-dir", "{base}/afile/sub"], None, "not a directory"),
    ("promote", ["promote", "{ckpt}", "--cache-dir", "{base}/foreigncache"], None, "owned by uid 65534"),
    # root passes os.access under /proc: the cache is made before hashing, and that fails there.
    ("promote", ["promote", "{ckpt}", "--cache-dir", "/proc/pg-no-such-cache"], None, "cannot be created"),
    ("fingerprints", ["fingerprints", "--base", "{base}/nope", "--candidate", "{ckpt}"], None, "nope"),
    ("fingerprints", ["fingerprints", "--base", "{ckpt}"], None, "exactly one of"),
    ("preload", ["preload", "{base}/nope", "--stage", "raw"], None, "does not exist"),
    # A file where the checkpoint folder should be: said so, not "does not exist".
    ("preload", ["preload", "{base}/afile", "--stage", "raw"], None, "{base}/afile is not a directory"),
    ("promote", ["promote", "{base}/afile"], None, "{base}/afile is not a directory; give the folder"),
    ("preload", ["preload", "{base}/afile/x", "--dry-run"], None, "{base}/afile is not a directory"),
    # A file in the socket root's path: no "mkdir -p" advice that would fail too.
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--socket-root", "{base}/afile/r"], None,
     "{base}/afile is not a directory"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--socket-root", "{base}/afile/sub/r"], None,
     "{base}/afile is not a directory"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--health-port", "{port}"], None, "already in use"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--socket-root", "{long}"], None, "AF_UNIX"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--socket-root", "{base}/missing/r"], None,
     "does not exist"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--unsafe-identity", "header_only"], None,
     "PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS=1"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--expect-digest", "xyz"], None, "64 hex"),
    # A stage no engine on the transport asks for (a resident copy nobody can attach).
    ("preload", ["preload", "{ckpt}", "--stage", "processed"], None, "--stage processed serves no engine on this host"),
    ("preload", ["preload", "{ckpt}", "--stage", "processed", "--dry-run"], None,
     "--stage processed serves no engine on this host"),
    # A digest is read by one rule (pgbase.digest_text): the right length is not enough, nothing is stripped.
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--expect-digest", "g" * 64], None,
     "argument --expect-digest: 'gggg"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/nope.json",
                "--expect-digest", "g" * 64], None, "argument --expect-digest: 'gggg"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/nope.json",
                "--expect-digest", "ab" * 32 + "\n"], None, "surrounding whitespace"),
    # --dry-run runs the start's own checks (the tiny model: 2 heads, 1 KV head).
    ("preload", ["preload", "{ckpt}", "--dry-run", "--health-port", "{port}"], None, "already in use"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "--dtype", "bf16"], None, "is not a dtype vLLM takes"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "-tp", "4"], None, "2 attention heads"),
    ("preload", ["preload", "{ckpt}", "-tp", "4"], None, "choose a tensor-parallel size from [1, 2]"),
    ("preload", ["preload", "{gqa}", "--dry-run", "-tp", "3"], None, "2 key/value heads"),
    ("status", ["status", "--bogus"], None, "unrecognized arguments"),
    # An unknown flag is named by the verb it was given to, with that verb's --help.
    ("preload", ["preload", "{ckpt}", "--frobnicate", "3"], None,
     "preload-gate preload: error: unrecognized arguments: --frobnicate 3 (see: preload-gate preload --help)"),
    # OUT is checked before any work: a file in the way, a place mkdir refuses (smollm2 converted first).
    ("fixtures", ["fixtures", "tiny", "{base}/afile"], None, "OUT {base}/afile is not a directory"),
    ("fixtures", ["fixtures", "smollm2", "/proc/pg-no-such-fixture"], None, "cannot be written"),
    ("gate", ["gate", "{base}/nope", "--mutations", "all"], None, "does not exist"),
    ("gate", ["gate", "{ckpt}", "--mutations", "bogus"], None, "unknown mutation bogus"),
    # --report is checked before any engine starts: a file in the way, a place mkdir refuses.
    ("gate", ["gate", "{ckpt}", "--report", "{base}/afile/r"], None, "is not a directory"),
    ("gate", ["gate", "{ckpt}", "--report", "{base}/afile"], None, "is not a directory"),
    ("gate", ["gate", "{ckpt}", "--report", "/proc/pg-no-such-report"], None, "cannot be written"),
    # Control: a good --report passes that check and the gate stops at its next one.
    ("gate", ["gate", "{ckpt}", "--mutations", "bogus", "--report", "{base}/cwd/report"], None,
     "unknown mutation bogus"),
    ("canary", ["canary", "record", "--model", "{base}/nope", "--out", "{base}/cwd/g.json"], None, "nope"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/nope.json"], None,
     "nope.json"),
    ("bench", ["bench", "--only", "no_such_row"], None, "no_such_row"),
    ("bench", ["bench", "--only", ""], None, "names no row"),  # was: every row, the heavy ones too
    ("bench", ["bench", "--only", ","], None, "names no row"),
    ("bench", ["bench", "--only", "gate_selftest", "--param", "mutations="], None, "is empty"),
    ("bench", ["bench", "--only", "daemon_weight_load", "--param", "model="], None, "is empty"),  # was: the cwd
    # Row parameters (new-user F8): declared per row, refused before any row runs.
    ("bench", ["bench", "--only", "restart_identity", "--param", "shards=abc"], None,
     "bench row restart_identity: --param shards=abc: 'abc' is not an integer; allowed: an integer from 1 to "
     "100000"),
    # Past the upper bound (issue 25: clients=10**9 was a MemoryError in the row): refused first.
    ("bench", ["bench", "--only", "attach_load", "--param", "clients=1000000000"], None,
     "bench row attach_load: --param clients=1000000000: 1000000000 is out of range; allowed: an integer from 1 "
     "to 256"),
    ("bench", ["bench", "--only", "attach_load", "--param", "load_mb=1e-300"], None,
     "bench row attach_load: --param load_mb=1e-300: 1e-300 is out of range; allowed: a number from 0.001 to 65536"),
    ("bench", ["bench", "--size", "2000G", "--only", "restart_identity"], None, "--size: size '2000G' is more than 1T"),
    ("bench", ["bench", "--only", "restart_identity", "--param", "shard=3"], None,
     "bench row restart_identity has no parameter 'shard'"),
    ("bench", ["bench", "--only", "attach_load", "--param", "clients=0"], None, "bench row attach_load: --param clients=0"),
    ("bench", ["bench", "--only", "gate_selftest", "--param", "mutations=bogus"], None, "unknown mutation bogus"),
    ("bench", ["bench", "--param", "clientz=3"], None, "no bench row takes --param clientz"),
    ("bench", ["bench", "--size", "lots", "--only", "restart_identity"], None, "--size: bad size 'lots'"),
    ("demo", ["demo", "--bogus"], None, "unrecognized arguments"),
    ("demo", ["demo", "--report", "{base}/afile/r"], None, "is not a directory"),
    # Numeric flags: one shared argparse type per kind (pgbase.cliargs), so a
    # count <= 0, a negative seed or a port out of range is a usage line.
    ("fixtures", ["fixtures", "tiny", "{base}/t", "--seed", "-1"], None, "argument --seed"),
    ("promote", ["promote", "{ckpt}", "--workers", "-3"], None, "argument --workers"),
    ("promote", ["promote", "{ckpt}", "--workers", "0"], None, "argument --workers"),
    ("fingerprints", ["fingerprints", "--base", "{ckpt}", "--candidate", "{ckpt}", "--workers", "-1"], None,
     "argument --workers"),
    ("gate", ["gate", "{ckpt}", "--jobs", "0"], None, "argument --jobs"),
    ("gate", ["gate", "{ckpt}", "--jobs", "-1"], None, "argument --jobs"),
    ("demo", ["demo", "--engine-timeout", "0"], None, "argument --engine-timeout"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "--max-model-len", "-5"], None, "argument --max-model-len"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "--master-port", "-1"], None, "argument --master-port"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "--health-port", "70000"], None, "argument --health-port"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "-dp", "x"], None, "is not an integer"),
    ("canary", ["canary", "record", "--model", "{ckpt}", "--out", "{base}/cwd/g.json", "--max-tokens", "0"], None,
     "argument --max-tokens"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/g.json",
                "--tolerance", "nan"], None, "argument --tolerance"),
    # Checks before the first weight byte or engine: no CUDA device for the
    # cuda transport, a socket root that only looks creatable, vLLM's own
    # choices, a pipeline stage left without a layer (the tiny model has 2).
    ("preload", ["preload", "{ckpt}", "--transport", "cuda", "--stage", "raw"], {"CUDA_VISIBLE_DEVICES": ""},
     "needs a CUDA device and none is visible"),
    ("preload", ["preload", "{ckpt}", "--stage", "raw", "--socket-root", "/proc/pg-no-such-root"], None,
     "cannot create the socket root"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "-pp", "4"], None, "choose at most 2"),
    ("canary", ["canary", "record", "--model", "{ckpt}", "--out", "/proc/pg-no-such.json"], None, "cannot be written"),
    ("canary", ["canary", "record", "--model", "{ckpt}", "--out", "{base}/cwd"], None, "is a directory"),
    ("canary", ["canary", "record", "--model", "{broken}", "--out", "{base}/cwd/g.json"], None,
     "not a valid safetensors file"),
    ("canary", ["canary", "record", "--model", "{ckpt}", "--out", "{base}/cwd/g.json", "--dtype", "bogus"], None,
     "is not a dtype vLLM takes"),
    ("canary", ["canary", "check", "--base-url", "not-a-url", "--golden", "{base}/g.json"], None,
     "is not an http(s) URL"),
    # --base-url as urllib reads it (its .port too), refused before any request
    # (a port past 65535 was "FAIL ...: ExceptionGroup: unhandled errors in a TaskGroup", exit 1).
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:99999", "--golden", "{base}/golden.json"], None,
     "argument --base-url: 'http://127.0.0.1:99999': Port out of range 0-65535"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:abc", "--golden", "{base}/golden.json"], None,
     "'http://127.0.0.1:abc': Port could not be cast to integer value"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:0", "--golden", "{base}/golden.json"], None,
     "'http://127.0.0.1:0': port 0 is no port a replica listens on"),
    ("canary", ["canary", "check", "--base-url", "ftp://127.0.0.1:8000", "--golden", "{base}/golden.json"], None,
     "(scheme ftp:// is not http or https)"),
    ("canary", ["canary", "check", "--base-url", "127.0.0.1:8000", "--golden", "{base}/golden.json"], None,
     "'127.0.0.1:8000' is not an http(s) URL with a host (no //HOST part)"),
    ("canary", ["canary", "check", "--base-url", "http://:8000", "--golden", "{base}/golden.json"], None,
     "(no host)"),
    # --checkpoint is a folder, or refused by name before the golden is compared
    # (was: "config.json of /nonexistent has config_digest=none; record a golden ...").
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/golden.json",
                "--checkpoint", "{base}/nope"], None, "--checkpoint: checkpoint directory {base}/nope does not exist"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/golden.json",
                "--checkpoint", "{base}/afile"], None, "--checkpoint: checkpoint {base}/afile is not a directory"),
    # The other paths canary takes: a golden that is a folder or not JSON, an events file that is missing.
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/cwd"], None,
     "cannot read golden file {base}/cwd: Is a directory"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/afile"], None,
     "golden file {base}/afile is not JSON"),
    ("canary", ["canary", "check", "--base-url", "http://127.0.0.1:9", "--golden", "{base}/golden.json",
                "--events-file", "{base}/nope"], None, "cannot read events file {base}/nope"),
    ("canary", ["canary", "record", "--model", "{base}/afile", "--out", "{base}/cwd/g.json"], None,
     "checkpoint {base}/afile is not a directory"),
    ("status", ["status", "--socket-root", "{base}/afile"], None, "is not a directory"),
    ("stop", ["stop"], None, "name what to stop"),
    ("stop", ["stop", "{base}/afile"], None, "{base}/afile is not a directory"),
    ("stop", ["stop", "xyz", "--all"], None, "not both"),
    ("stop", ["stop", "--all", "--socket-root", "{base}/afile"], None, "is not a directory"),
    # A typed --socket-root that is not there: a typo would read as "no
    # daemons" / "nothing to stop" (control: test_unset_root_that_is_not_there_yet_is_normal).
    ("status", ["status", "--socket-root", "{base}/no-such-root"], None,
     "--socket-root {base}/no-such-root cannot be used: {base}/no-such-root does not exist; name the directory"),
    ("stop", ["stop", "--all", "--socket-root", "{base}/no-such-root"], None,
     "--socket-root {base}/no-such-root cannot be used: {base}/no-such-root does not exist"),
    ("stop", ["stop", "{ckpt}", "--socket-root", "{base}/gone/root"], None,
     "its directory {base}/gone does not exist"),
    # A real row named: the directory checks refuse before it runs (row names
    # and --param values are checked before them, so no probe precedes a refusal).
    ("bench", ["bench", "--out", "{base}/afile", "--only", "restart_identity"], None, "is not a directory"),
    # Every directory a verb writes is checked before anything runs (it was a
    # traceback after the fixture was written, or after the engines ran).
    ("bench", ["bench", "--workdir", "{base}/afile", "--only", "restart_identity"], None,
     "--workdir {base}/afile is not a directory"),
    ("bench", ["bench", "--workdir", "/proc/pg-no-such-work", "--only", "restart_identity"], None,
     "cannot be written"),
    # Control: a good --workdir passes its check and bench stops at the next flag's.
    ("bench", ["bench", "--workdir", "{base}/cwd/w", "--out", "{base}/afile", "--only", "restart_identity"], None,
     "--out {base}/afile is not a directory"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--workdir", "{base}/afile"], None,
     "--workdir {base}/afile is not a directory"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--workdir", "{base}/afile/sub"], None,
     "its parent {base}/afile is not a directory"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--workdir", "/proc/pg-no-such-work"], None,
     "cannot be written"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--reference-cache", "{base}/afile"], None,
     "--reference-cache {base}/afile is not a directory"),
    ("gate", ["gate", "{ckpt}", "--mutations", "bogus", "--workdir", "{base}/cwd/w",
              "--reference-cache", "{base}/cwd/refs"], None, "unknown mutation bogus"),
    ("demo", ["demo", "--workdir", "{base}/afile"], None, "--workdir {base}/afile is not a directory"),
    ("demo", ["demo", "--reference-cache", "/proc/pg-no-such-refs"], None, "cannot be written"),
    # rollout: every file it is handed is read before either checkpoint is hashed.
    ("rollout", ["rollout", "--to", "{ckpt}"], None, "name the checkpoints: --from CURRENT --to NEW"),
    ("rollout", ["rollout", "--from", "{base}/nope", "--to", "{gqa}", "--replicas", "1", "--port", "{free}"], None,
     "--from {base}/nope is not a directory"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{ckpt}", "--replicas", "1", "--port", "{free}"], None,
     "follows itself in the sequence"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1"], None, "--replicas needs --port"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "0"], None,
     "argument --replicas: 0 is not a positive integer"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}",
                 "--gate-report", "{base}/nope"], None, "cannot read gate report {base}/nope"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}",
                 "--gate-report", "{base}/afile"], None, "gate report {base}/afile refused: not JSON"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}", "--no-gate",
                 "--golden", "{base}/nope.json"], None, "cannot read golden file {base}/nope.json"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}", "--no-gate",
                 "--gate-report", "{base}/nope"], None, "--no-gate and --gate-report contradict"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}", "--",
                 "--port", "9"], None, "engine argument --port is set by the rollout"),
    ("rollout", ["rollout", "--from", "{ckpt}", "--to", "{gqa}", "--replicas", "1", "--port", "{free}",
                 "--memory-budget", "lots"], None, "argument --memory-budget: bad size 'lots'"),
]

# Control for the rows above: the same flags with good values pass those checks.
GOOD_PP = ["preload", "{ckpt}", "--dry-run", "--json", "-pp", "2", "--kv-cache-dtype", "fp8", "--master-port", "29500"]

# Controls for the preload checks above: good inputs pass the same checks
# (exit 0, the plan, nothing on disk), so each refusal is the check's doing.
GOOD_DRY_RUN = [
    ["preload", "{ckpt}", "--dry-run", "--json", "--health-port", "{free}", "--dtype", "BFloat16", "-tp", "2"],
    ["preload", "{gqa}", "--dry-run", "--json", "-tp", "2"],
    ["preload", "{gqa}", "--dry-run", "--json", "-tp", "6"],  # KV heads replicated 3 times
]


@pytest.mark.parametrize("verb,argv,env,needle", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_one_line_exit_2_nothing_written(world, verb, argv, env, needle):
    p, before, after = _run(world, argv, env)
    check_refusal(p, before, after, needle.replace("{base}", str(world["base"])))


# The values vLLM itself decides are asked of vLLM (preload.preflight): these
# rows need it installed, and the unit tier without vLLM skips them.
VLLM_BAD = [
    ("preload", ["preload", "{ckpt}", "--dry-run", "--kv-cache-dtype", "bogus"], None,
     "--kv-cache-dtype 'bogus' is not one vLLM takes"),
    ("preload", ["preload", "{ckpt}", "--dry-run", "--quantization", "bogus"], None,
     "--quantization 'bogus' is not one vLLM takes"),
]


@pytest.mark.parametrize("verb,argv,env,needle", VLLM_BAD, ids=[" ".join(b[1][3:]) for b in VLLM_BAD])
def test_values_vllm_decides_are_refused_by_vllm(world, verb, argv, env, needle):
    pytest.importorskip("vllm")
    p, before, after = _run(world, argv, env)
    check_refusal(p, before, after, needle)


# --ray ADDRESS is read by Ray's own helpers (harness.gate.ray_executor.ray_endpoint):
# these rows need ray installed. Each is refused before the gate connects or
# starts anything; the unreachable ones (a closed port) by a bounded TCP
# probe, not Ray's minutes of retries.
RAY_BAD = [
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "notanaddress"], None,
     "--ray 'notanaddress' is not an address; give HOST:PORT"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", ""], None, "--ray '' is not an address"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "head:abc"], None,
     "has port 'abc', not a number from 1 to 65535"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "head:70000"], None,
     "has port '70000', not a number from 1 to 65535"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", ":6379"], None, "names no host"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "ray://head"], None,
     "--ray 'ray://head' is not an address"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "http://head:8265"], None,
     "has scheme http://, which names no Ray cluster"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "auto"], {"RAY_ADDRESS": "nope"},
     "--ray auto: RAY_ADDRESS 'nope' is not an address"),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "127.0.0.1:{free}"], None,
     "--ray 127.0.0.1:{free}: cannot reach a Ray cluster at "),
    ("gate", ["gate", "{ckpt}", "--mutations", "zeroed_norm", "--ray", "ray://127.0.0.1:{free}"], None,
     "--ray ray://127.0.0.1:{free}: cannot reach a Ray cluster at 127.0.0.1:{free} (Connection refused)"),
]


@pytest.mark.parametrize("verb,argv,env,needle", RAY_BAD, ids=[b[1][-1] or "empty" for b in RAY_BAD])
def test_bad_ray_address_is_refused_before_anything_starts(world, verb, argv, env, needle):
    pytest.importorskip("ray")
    t0 = time.monotonic()
    p, before, after = _run(world, argv, env)
    check_refusal(p, before, after, needle.replace("{free}", str(world["free"])))
    # Ray itself retried a closed GCS port for minutes; the probe gives up in
    # seconds (the rest is importing vLLM for the checkpoint check).
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("argv", GOOD_DRY_RUN, ids=[" ".join(a[2:]) for a in GOOD_DRY_RUN])
def test_good_input_passes_the_dry_run_checks(world, argv):
    p, before, after = _run(world, argv)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert len(plan["ranks"]) == int(argv[argv.index("-tp") + 1])
    assert after == before, f"new on disk: {sorted(after - before)}"


def test_good_pipeline_and_vllm_choices_pass_the_dry_run_checks(world):
    p, before, after = _run(world, GOOD_PP)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["ranks"]) == 2
    assert after == before, f"new on disk: {sorted(after - before)}"


@pytest.mark.parametrize("argv", [["status"], ["stop", "--all"]], ids=["status", "stop"])
def test_unset_root_that_is_not_there_yet_is_normal(world, argv):
    """Control for the typed --socket-root rows: the same missing root from
    PRELOAD_GATE_SOCKET_ROOT (or the default) is where no daemon has started
    yet: exit 0, nothing found, nothing made."""
    missing = str(world["base"] / "no-such-root")
    p, before, after = _run(world, argv, {"PRELOAD_GATE_SOCKET_ROOT": missing})
    assert p.returncode == 0, p.stderr
    assert "cannot be used" not in p.stderr + p.stdout
    if argv == ["status"]:
        assert f"no preload daemons found under {missing}" in p.stdout, p.stdout
    assert not os.path.lexists(missing) and after == before


def test_every_verb_has_a_row():
    from preload_gate.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    assert set(sub.choices) <= {row[0] for row in BAD}, set(sub.choices) - {row[0] for row in BAD}


def test_control_checker_rejects_a_success_and_a_two_line_error(world):
    p, before, after = _run(world, ["promote", "{ckpt}", "--json"])
    assert p.returncode == 0, p.stderr
    with pytest.raises(AssertionError):
        check_refusal(p, before, after, "")
    two = subprocess.CompletedProcess([], 2, "", "preload-gate x: error: a\nTraceback: b\n")
    with pytest.raises(AssertionError):
        check_refusal(two, set(), set(), "")


def test_promote_whose_socket_root_cannot_be_made_writes_no_manifest(tmp_path, capsys) -> None:
    """A root under a parent that only looks writable (/proc): found after hashing,
    so the socket directory is made before the manifest is written, and its
    failure is one line with no manifest (control: a good root writes one)."""
    from fixtures.tiny import write_tiny
    from preload_gate.cli import main as cli_main

    ckpt = write_tiny(tmp_path / "t")
    cache = tmp_path / "cache"
    assert cli_main(["promote", str(ckpt), "--socket-root", "/proc/pg-no-such-root", "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot create the socket directory" in err[0] and "Traceback" not in err[0]
    assert not [p for p in cache.rglob("*") if p.is_file()]
    # Control: the same promote with a writable root writes the manifest.
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    assert cli_main(["promote", str(ckpt), "--socket-root", str(root), "--cache-dir", str(cache)]) == 0
    assert [p for p in cache.rglob("*.json") if p.is_file()]
