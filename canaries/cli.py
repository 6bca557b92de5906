"""``preload-gate canary record|check``.

Exit codes of ``check``: 0 every replica matched the golden, 1 at least one
did not (or could not be asked), 2 the check could not run (bad golden,
refused golden, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from canaries.errors import GoldenError
from pgbase.cliargs import (
    digest_arg,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from pgbase.survivor import hold


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("canary", help="record golden answers; check serving replicas against them")
    verbs = p.add_subparsers(dest="canary_verb", metavar="record|check")
    verbs.required = True

    r = verbs.add_parser("record", help="record a golden file from an auto (disk-loaded) engine")
    r.add_argument("--model", required=True, help="checkpoint directory")
    r.add_argument("--out", required=True, help="golden file to write (atomically)")
    r.add_argument("--max-tokens", type=positive_int, default=16, help="greedy tokens per prompt (default 16)")
    r.add_argument("--top-logprobs", type=nonnegative_int, default=5, help="top logprobs per position (default 5)")
    r.add_argument("--prompts", default=None, help="prompts file: one per line, or a JSON list (.json)")
    from preload.deployment import add_arguments

    add_arguments(r.add_argument_group("deployment settings (as vllm serve takes them; recorded in the golden)"))
    r.add_argument("--timeout", type=positive_float, default=600.0, help="seconds for the recording engine")
    r.add_argument("--json", action="store_true", help="print the golden's key as JSON")
    r.set_defaults(func=_record)

    c = verbs.add_parser("check", help="ask replicas the golden prompts; exit 0 only if all match")
    c.add_argument("--base-url", action="append", required=True, dest="base_urls", type=http_url,
                   help="replica's OpenAI base URL (http://host:port or .../v1); repeat for many")
    c.add_argument("--golden", required=True, help="golden file from `canary record`")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--timeout", type=positive_float, default=30.0, help="seconds per attempt per replica (default 30)")
    c.add_argument("--retries", type=nonnegative_int, default=2, help="retries of an unreachable/slow/5xx replica (default 2)")
    c.add_argument("--tolerance", type=nonnegative_float, default=None,
                   help="largest absolute logprob difference accepted (default 0.05)")
    c.add_argument("--model", default=None, help="served model name (default: the replica's only model)")
    c.add_argument("--concurrency", type=positive_int, default=8, help="replicas asked at once")
    c.add_argument("--api-key", default=None, help="bearer token (default $OPENAI_API_KEY or EMPTY)")
    c.add_argument("--no-version-probe", action="store_true",
                   help="do not ask GET /version (a router answering it with its own version); the "
                        "version is then what the completion response says, or unknown")
    c.add_argument("--checkpoint", default=None,
                   help="the checkpoint directory the replicas serve: refuse a golden recorded for "
                        "another config.json or other answer files (tokenizer, chat template, "
                        "generation_config.json, processor), named file by file")
    fit = c.add_argument_group("deployment settings the replicas serve (as vllm serve takes them; "
                               "a golden recorded under others is refused; unstated ones are not compared)")
    add_arguments(fit, stated_only=True)
    claim = c.add_mutually_exclusive_group()
    claim.add_argument("--expect-digest", default=None, type=digest_arg,
                       help="the content digest every replica must serve (64 hex, as promote prints it)")
    claim.add_argument("--events-file", action="append", default=None, dest="events_files",
                       help="a replica's load events file; one for all replicas, or one per --base-url in order")
    claim.add_argument("--metrics-url", action="append", default=None, dest="metrics_urls",
                       help="the daemon's /metrics URL; one for all replicas, or one per --base-url in order")
    c.set_defaults(func=_check)


def _record(args: argparse.Namespace) -> int:
    from canaries.golden import record
    from canaries.prompts import load_prompts
    from preload.deployment import from_args

    settings = from_args(args)
    prompts = load_prompts(args.prompts) if args.prompts else None  # read-only: before the --out probe
    _preflight_record(args.model, args.out, settings.to_json())
    hold("canary record")  # the recording engine ends with us, kill -9 included
    golden = record(
        args.model, args.out, prompts=prompts, max_tokens=args.max_tokens, top_logprobs=args.top_logprobs,
        timeout_s=args.timeout, settings=settings,
        # About a minute on CPU: said as it goes, on stderr (stdout stays the result).
        progress=lambda line: print(f"canary record: {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps({"golden": args.out, **golden.key(), "prompts": len(golden.prompts)}, indent=2))
    else:
        print(f"golden      {args.out}")
        print(f"digest      {golden.digest}")
        print(f"vllm        {golden.vllm_version}")
        print(f"settings    {' '.join(golden.settings.engine_args()) if golden.settings else '-'} "
              f"(dtype {golden.engine.get('resolved_dtype') or golden.engine.get('dtype')})")
        print(f"prompts     {len(golden.prompts)} x {golden.sampling.max_tokens} tokens, "
              f"top {golden.sampling.top_logprobs} logprobs")
    return 0


def _preflight_record(model: str, out: str, engine: dict) -> None:
    """What ``canary record`` can check before its engine starts (as the gate
    checks ``--report`` and ``preload`` its flags): the golden's place, the
    checkpoint's shard headers (no hashing), the dtype and vLLM's choices."""
    from pathlib import Path

    from preload.identity.anchors import validate_checkpoint
    from preload.preflight import (
        check_checkpoint,
        check_dtype,
        check_engine_choices,
        check_output_dir,
    )

    target = Path(out)
    if target.is_dir():
        raise GoldenError(f"--out {out} is a directory; give the golden file's path (e.g. {target / 'golden.json'})")
    check_checkpoint(model)
    validate_checkpoint(model)
    check_dtype(str(engine.get("dtype") or "auto"))
    check_engine_choices(engine)
    check_output_dir(target.parent, "--out")  # last: its probe changes the parent's stat


def http_url(value: str) -> str:
    """``--base-url`` as argparse takes it: an http(s) URL with a host and, if
    it names one, a port from 1 to 65535, refused at parse time (urllib's
    reading, ``.port`` included), before any request is retried against it."""
    from urllib.parse import urlsplit

    example = "give e.g. http://127.0.0.1:8000"
    try:
        u = urlsplit(value)
        port = u.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}; {example}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        why = ("no //HOST part" if not u.netloc else "no host" if not u.hostname
               else f"scheme {u.scheme or '(none)'}:// is not http or https")
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL with a host ({why}); {example}")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{value!r}: port 0 is no port a replica listens on; {example}")
    return value


def _per_replica(values: list[str] | None, urls: list[str], flag: str) -> list[tuple[str, str]]:
    if not values:
        return []
    if len(values) == 1:
        return [(u, values[0]) for u in urls]
    if len(values) != len(urls):
        raise GoldenError(f"give one {flag} for all replicas or one per --base-url ({len(urls)}), not {len(values)}")
    return list(zip(urls, values, strict=True))


def _check(args: argparse.Namespace) -> int:
    import os

    from canaries import claims as claim_sources

    try:
        from canaries.check import check
    except ModuleNotFoundError as exc:
        if exc.name != "openai":
            raise
        raise GoldenError("canary check needs the openai client: pip install 'preload-gate[cpu]' (or openai)") from exc
    from canaries.compare import DEFAULT_TOLERANCE
    from canaries.golden import load_golden

    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # One line per request from the HTTP client would bury the verdicts.
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)
    from canaries.fit import check_fit
    from preload.deployment import stated_args

    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        # Before the golden is compared with it: a missing folder is not "config_digest=none".
        from pgbase.shards import not_a_directory

        raise GoldenError(f"--checkpoint: {not_a_directory(args.checkpoint)}")
    golden = load_golden(args.golden)
    check_fit(golden, stated_args(args), args.checkpoint)
    urls: list[str] = args.base_urls
    claims = {}
    for url, path in _per_replica(args.events_files, urls, "--events-file"):
        claims[url] = claim_sources.from_events_file(path)
    for url, murl in _per_replica(args.metrics_urls, urls, "--metrics-url"):
        claims[url] = claim_sources.from_metrics_url(murl)
    if args.timeout <= 0 or args.retries < 0 or args.concurrency < 1:
        raise GoldenError("--timeout must be > 0, --retries >= 0, --concurrency >= 1")
    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if tolerance < 0:
        raise GoldenError("--tolerance must be >= 0")
    report = check(
        urls, golden, timeout=args.timeout, retries=args.retries, tolerance=tolerance,
        expect_digest=args.expect_digest, claims=claims, model=args.model, concurrency=args.concurrency,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
        version_probe=not args.no_version_probe,
    )
    if args.json:
        print(json.dumps({"golden": args.golden, **report.to_json()}, indent=2))
    else:
        for r in report.results:
            print(r.line())
        n_ok = sum(r.ok for r in report.results)
        n_tie = sum(r.reason == "near_tie" for r in report.results)
        n_unjudged = sum(r.verdict == "CANNOT-JUDGE" for r in report.results)
        print(f"{n_ok}/{len(report.results)} replicas match golden {golden.digest[:16]} "
              f"(vLLM {golden.vllm_version})" + (f", {n_tie} with near-ties only" if n_tie else "")
              + (f", {n_unjudged} could not be judged" if n_unjudged else ""), file=sys.stdout)
    # Only differing answers are what an unkeyed golden cannot judge (the
    # check marks them); an unreachable replica, a version or a digest-claim
    # mismatch is a failure of its own whatever the golden records.
    if not report.judged:
        from canaries.errors import UnjudgedRepliesError
        from canaries.fit import UnkeyedGoldenError
        from canaries.replica import CANNOT_JUDGE

        if any(r.reason == CANNOT_JUDGE for r in report.results):
            raise UnkeyedGoldenError(["config_digest"])
        raise UnjudgedRepliesError([(r.base_url, r.detail) for r in report.results if r.verdict == "CANNOT-JUDGE"])
    if args.checkpoint is None:
        # Without the served folder config.json and the answer files were never compared:
        # an edited chat template passes a token check, and a failure may come from them.
        files = ("config.json and the answer files (tokenizer, chat template, generation_config.json) were not "
                 "compared with the golden's (no --checkpoint)")
        print(f"note: {files}; pass --checkpoint DIR to rule out a change in them" if not report.ok else
              f"note: passed on tokens alone: {files}, so an edit in them passes this check; pass "
              "--checkpoint DIR to compare them", file=sys.stderr)
    return 0 if report.ok else 1
