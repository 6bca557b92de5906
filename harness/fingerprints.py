"""``preload-gate fingerprints``: two checkpoints under every anchor scheme,
or every row of the mutation catalogue against a base (``--mutations``).

The schemes are :mod:`preload.identity.anchors`; the rows and what each
scheme is expected to conclude are the catalogue (:mod:`fixtures.mutations`),
which is why the verb lives above both.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pgbase.cliargs import positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fingerprints",
        help="compare two checkpoints under every anchor scheme (header_only, sampled_1k, ...)",
    )
    p.add_argument("--base", required=True, help="the checkpoint a cache holds")
    p.add_argument("--candidate", help="the checkpoint an engine asks for")
    p.add_argument(
        "--mutations",
        default=None,
        help="instead of --candidate: build each mutation row (all|NAME,..) from --base in a "
        "temporary directory and print the matrix; exit 1 if a scheme departs from the table",
    )
    p.add_argument(
        "--header-impl",
        choices=("auto", "vllm", "reimpl"),
        default="auto",
        help="header_only: vLLM's own hash_checkpoint (auto: when vLLM imports) or our reimplementation",
    )
    p.add_argument("--workers", type=positive_int, default=None, help="hashing threads for content")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_fingerprints)


def _fingerprints(args: argparse.Namespace) -> int:
    from pgbase.errors import PreloadGateError
    from preload.identity.anchors import fingerprints
    from preload.preflight import check_checkpoint

    if (args.candidate is None) == (args.mutations is None):
        raise PreloadGateError("give exactly one of --candidate B or --mutations all|NAME,..")
    # A missing or unreadable folder is refused before vLLM is imported for its file set (~20 s).
    for folder in (args.base, args.candidate):
        if folder is not None:
            check_checkpoint(folder)
    if args.mutations is not None:
        return _fingerprint_matrix(args)
    schemes = fingerprints(args.base, args.candidate, header_impl=args.header_impl, workers=args.workers)
    if args.json:
        print(json.dumps({"base": args.base, "candidate": args.candidate, "schemes": schemes}, indent=2))
        return 0
    print(f"base       {args.base}")
    print(f"candidate  {args.candidate}")
    print(f"{'scheme':<12} {'verdict':<9} {'base':<16} {'candidate':<16} implementation")
    for name, row in schemes.items():
        verdict = "same" if row["equal"] else "DIFFERENT"
        print(
            f"{name:<12} {verdict:<9} {str(row['base'])[:16]:<16} {str(row['candidate'])[:16]:<16} "
            f"{row['implementation']}"
        )
    return 0


def _fingerprint_matrix(args: argparse.Namespace) -> int:
    """Every mutation row against --base: what each scheme concluded, and
    whether that is what the table expects."""
    import tempfile

    from fixtures.mutations import MUTATIONS, by_name
    from preload.identity.anchors import SCHEMES, fingerprints, validate_checkpoint

    validate_checkpoint(args.base)
    results: list[dict[str, Any]] = []
    rows = MUTATIONS if args.mutations == "all" else tuple(by_name(n) for n in args.mutations.split(","))
    with tempfile.TemporaryDirectory(prefix="pg-matrix-") as work:
        for row in rows:
            staged = row.stage(args.base, work)
            before: dict[str, dict[str, object]] = {}
            if row.in_place:
                # The base is overwritten by apply: fingerprint it first.
                before = fingerprints(staged, staged, header_impl=args.header_impl, workers=args.workers)
            candidate = row.apply(staged, work)
            schemes = fingerprints(staged, candidate, header_impl=args.header_impl, workers=args.workers)
            if row.in_place:
                for name, r in schemes.items():
                    r["base"] = before[name]["base"]
                    r["equal"] = r["base"] == r["candidate"]
            for name, r in schemes.items():
                r["expected_equal"] = row.expected[name]
                r["as_expected"] = r["equal"] == row.expected[name]
            results.append({"mutation": row.name, "weights_equal": row.weights_equal,
                            "in_place": row.in_place, "schemes": schemes})
    ok = all(r["as_expected"] for res in results for r in res["schemes"].values())
    if args.json:
        print(json.dumps({"base": args.base, "matrix": results, "as_expected": ok}, indent=2))
        return 0 if ok else 1
    print(f"{'mutation':<24} {'weights':<8} " + " ".join(f"{s:<12}" for s in SCHEMES))
    for res in results:
        cells = []
        for s in SCHEMES:
            r = res["schemes"][s]
            if r["equal"] == res["weights_equal"]:
                cell = "ok" if res["weights_equal"] else "caught"
            else:
                cell = "MISSED" if r["equal"] else "false-alarm"
            cells.append(f"{cell + ('' if r['as_expected'] else '!'):<12}")
        weights = "equal" if res["weights_equal"] else "differ"
        print(f"{res['mutation']:<24} {weights:<8} " + " ".join(cells))
    impl = results[0]["schemes"]["header_only"]["implementation"] if results else ""
    print(f"header_only: {impl}")
    print("every cell as the table expects" if ok else "'!' marks a cell that departs from the table")
    return 0 if ok else 1
