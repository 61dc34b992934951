"""The ``kiln`` command: ``kiln demo`` (and, with later issues, ``bench`` and ``explain``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln, a PyTorch compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a small model, check it, time it")
    demo.add_argument("--backend", default="eager", help="backend to run the graph on")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kiln.backends import backend_names
        from kiln.demo import run_demo

        if args.backend not in backend_names():
            print(
                f"kiln: unknown backend {args.backend!r} (have: {', '.join(backend_names())})",
                file=sys.stderr,
            )
            return 2
        return 0 if run_demo(args.backend) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
