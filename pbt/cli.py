"""The ``pbt`` command line.

    pbt train [MANIFEST]   train one member (the built-in quickstart without a manifest)
    pbt check MANIFEST     validate a manifest and print the resolved configuration

User errors print one clear message and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pbt import __version__
from pbt.errors import PbtError
from pbt.manifest import load_manifest


def _check(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    print(json.dumps(dataclasses.asdict(manifest), indent=2))
    print(f"{args.manifest}: valid", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    from pbt import train

    train.run_member(train.resolve_manifest(args), resume=args.resume)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``pbt`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="pbt", description="Population-based training for LLM RL."
    )
    parser.add_argument("--version", action="version", version=f"pbt-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from pbt.train import build_parser as train_parser

    train_parser(sub.add_parser("train", help="train one member")).set_defaults(func=_train)
    check = sub.add_parser("check", help="validate a manifest")
    check.add_argument("manifest")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pbt`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PbtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
