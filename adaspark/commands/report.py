"""`adaspark report DIR`: Markdown tables and PNG figures from a bench directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from adaspark.bench.report import write_report


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="a directory written by `adaspark bench`")
    parser.add_argument("--boot", type=int, default=2000,
                        help="bootstrap resamples per interval (default: %(default)s)")
    parser.add_argument("--include-capped", action="store_true",
                        help="keep replies that reached the cap (a cap below normal reply "
                             "lengths cuts replies off; by default they count as loops)")


def run(args: argparse.Namespace) -> int:
    path = write_report(args.dir, n_boot=args.boot, include_capped=args.include_capped)
    print(f"wrote {path}")
    return 0
