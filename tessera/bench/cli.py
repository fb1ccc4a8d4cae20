"""`tessera bench ...` subcommands, registered by tessera/cli.py through `add_bench_subparsers`.

Each subcommand sets `func(args) -> int` as its parser default. Run standalone as
`python -m tessera.bench.cli serve ...` as well.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Optional, Sequence

from tessera.bench import capacity, hostile, replay, report, serve, storm
from tessera.errors import TesseraError

THROUGHPUT_MODULE = "tessera.bench.throughput"


def add_bench_subparsers(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` with its subcommands (serve, capacity, report, and throughput when present)."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a server (serve, capacity) or the engine (throughput)",
        description="Benchmarks: `serve` and `capacity` measure any OpenAI-compatible server; "
                    "`replay` sends a recorded traffic trace again; `report` turns saved results into markdown tables; `hostile` sends malformed "
                    "and abusive requests; `cancel-storm` cuts many streams and checks nothing leaks.")
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,capacity,replay,report,hostile,...}")
    sub.required = True
    serve.add_parser(sub)
    capacity.add_parser(sub)
    replay.add_parser(sub)
    if importlib.util.find_spec(THROUGHPUT_MODULE) is not None:
        importlib.import_module(THROUGHPUT_MODULE).add_parser(sub)
    report.add_parser(sub)
    hostile.add_parser(sub)
    storm.add_parser(sub)
    return bench


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera")
    add_bench_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except TesseraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
