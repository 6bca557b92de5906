"""Count the stops one gate case makes from the CLI to its verdict.

    python scripts/trace_stops.py OUT.json -- gate CKPT --mutations identical_copy [gate args]
    python scripts/trace_stops.py --fake-ipc OUT.json -- gate CKPT --target ipc_cache --mutations identical_copy

``--fake-ipc``: vLLM's ipc_cache target with the stand-ins of
tests/unit/fake_ipc_vllm.py for ``vllm preload`` and its engines (as
tests/unit/test_targets.py runs it): the walk of a target other than ours,
in seconds, without CUDA.

Runs ``preload_gate.cli.main(ARGS)`` in this process under ``sys.setprofile``
(and ``threading.setprofile`` for the gate's worker threads) and records every
Python function of our own packages (pgbase, preload, fixtures, canaries,
harness, preload_gate) that is called, as a distinct (file, function) pair:
a *stop*. Engines and daemons run in their own processes and are not traced:
what is counted is the gate's own walk. Writes OUT.json with

- ``stops``: the number of distinct (file, function) pairs, and ``files``;
- ``packages``: stops per package (``harness.gate``, ``harness.targets``, ...);
- ``back_and_forth``: how many times a call went from one of the gate's
  packages (harness.gate, harness.targets) into the other and later came
  back into the first from it (A -> B -> A on one stack): the cycle the review
  found between the gate and its targets; ``back_and_forth_calls``: each such
  call as ``caller -> callee``;
- ``walk``: the stops on the way to the case's engines, daemon and verdict:
  every frame on the stack when ``harness.engine.run_engine``,
  ``DaemonProcess.start`` or ``harness.verdict.judge`` is called (the path a
  reader follows from the CLI to the verdict), with ``walk_files``;
- ``pairs``: every stop, for reading.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("pgbase", "preload", "fixtures", "canaries", "harness", "preload_gate")
GATE_PACKAGES = ("harness.gate", "harness.targets")
WALK_ENDS = {("harness.engine", "run_engine"), ("harness.daemon_process", "DaemonProcess.start"),
             ("harness.verdict", "judge")}


def _module(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] not in OURS or rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _gate_package(module: str) -> str | None:
    return next((p for p in GATE_PACKAGES if module == p or module.startswith(p + ".")), None)


def _fake_ipc() -> None:
    here = str(ROOT / "tests" / "unit")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    from harness.targets.ipc_cache import IpcCacheTarget

    IpcCacheTarget.unavailable = lambda self: None  # type: ignore[method-assign]
    IpcCacheTarget.preload_command = (sys.executable, "-m", "fake_ipc_vllm", "preload")
    IpcCacheTarget.engine_worker = IpcCacheTarget.reference_worker = "fake_ipc_vllm"


def main(argv: list[str]) -> int:
    fake = argv[:1] == ["--fake-ipc"]
    argv = argv[1:] if fake else argv
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, args = Path(argv[0]), argv[2:]
    pairs: set[tuple[str, str]] = set()
    lock = threading.Lock()
    back_and_forth = [0]
    crossings: set[str] = set()
    stacks: dict[int, list[str | None]] = {}
    frames: dict[int, list[tuple[str, str] | None]] = {}
    walk: set[tuple[str, str]] = set()

    def profile(frame, event, _arg):  # type: ignore[no-untyped-def]
        if event not in ("call", "return"):
            return
        tid = threading.get_ident()
        stack = stacks.setdefault(tid, [])
        fstack = frames.setdefault(tid, [])
        if event == "return":
            if stack:
                stack.pop()
                fstack.pop()
            return
        module = _module(frame.f_code.co_filename)
        pkg = _gate_package(module) if module else None
        me = (module, frame.f_code.co_qualname) if module is not None else None
        if me is not None:
            with lock:
                pairs.add(me)
            if me in WALK_ENDS:
                with lock:
                    walk.update(f for f in fstack if f is not None)
                    walk.add(me)
        if pkg is not None:
            seen = [p for p in stack if p is not None]
            # A -> B -> A: this call enters A again from B, with A below B on the stack.
            if seen and seen[-1] != pkg and pkg in seen:
                caller = next((f for f in reversed(fstack) if f is not None), None)
                with lock:
                    back_and_forth[0] += 1
                    crossings.add(f"{caller[0]}:{caller[1]} -> {module}:{frame.f_code.co_qualname}"
                                  if caller else f"{module}:{frame.f_code.co_qualname}")
        stack.append(pkg)
        fstack.append(me)

    sys.path.insert(0, str(ROOT))
    from preload_gate.cli import main as cli_main

    if fake:
        _fake_ipc()

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        rc = cli_main(args)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    packages: dict[str, int] = {}
    for module, _ in pairs:
        key = _gate_package(module) or module.split(".")[0]
        packages[key] = packages.get(key, 0) + 1
    doc = {"argv": args, "exit_code": rc, "stops": len(pairs), "files": len({m for m, _ in pairs}),
           "gate_files": len({m for m, _ in pairs if _gate_package(m)}),
           "packages": dict(sorted(packages.items())), "back_and_forth": back_and_forth[0],
           "back_and_forth_calls": sorted(crossings),
           "walk": len(walk), "walk_files": len({m for m, _ in walk}),
           "walk_pairs": sorted(f"{m}:{f}" for m, f in walk),
           "pairs": sorted(f"{m}:{f}" for m, f in pairs)}
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in doc.items() if k != "pairs"}), file=sys.stderr)
    return 0 if rc in (0, 1) else rc


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
