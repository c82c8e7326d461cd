"""``python -m visattn.report RUN_DIRS... --out DIR``: write DIR/REPORT.md and its PNG plots."""

from __future__ import annotations

import argparse
import logging

from .document import write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m visattn.report", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories (holding results.json) or folders of them")
    parser.add_argument("--out", required=True, help="output folder for REPORT.md and the plots")
    parser.add_argument("--title", default="visattn benchmark report")
    parser.add_argument("--note", default=None, help="a line quoted under the title")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(write_report(args.run_dirs, args.out, title=args.title, note=args.note))


if __name__ == "__main__":
    main()
