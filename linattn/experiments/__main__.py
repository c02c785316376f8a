"""``python -m linattn.experiments NAME``: run a study and write its results file (see the package docstring)."""
from __future__ import annotations

import argparse
import sys

from . import STUDIES, check_out, run_study, study


def _workers(text: str) -> int:
    """An argparse ``type``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _cells(text: str) -> list:
    """An argparse ``type``: comma-separated grid indices (ints >= 0)."""
    parts = [c.strip() for c in text.split(",") if c.strip()]
    if not parts or not all(c.isdigit() for c in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated grid indices such as 0,3,4, got {text!r}")
    return [int(c) for c in parts]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linattn.experiments",
                                     description="Run a study of the book and write its results with provenance.")
    parser.add_argument("name", nargs="?", help="the study (omit to list them)")
    parser.add_argument("--workers", type=_workers, default=1,
                        help="processes in parallel, one thread each (default 1)")
    parser.add_argument("--cells", type=_cells, default=None,
                        help="comma-separated grid indices (a partial run; prints only)")
    parser.add_argument("--out", default=None, help="results file (default chapters/results/NAME.json)")
    parser.add_argument("--list-cells", action="store_true", help="print the grid and exit")
    args = parser.parse_args(argv)
    if args.name is None:
        for name in sorted(STUDIES):
            print(f"{name:<24} {getattr(study(name), 'DESCRIPTION', '')}")
        return 0
    try:
        mod = study(args.name)
    except ValueError as err:
        parser.error(str(err))
    if args.list_cells:
        for i, cell in enumerate(mod.grid()):
            print(i, cell)
        return 0
    cells, size = args.cells, len(mod.grid())
    for i in cells or ():
        if i >= size:
            parser.error(f"--cells: grid index {i} is out of range: study {args.name!r} has {size} cells "
                         f"(0 to {size - 1})")
    if args.workers > 1 and getattr(mod, "SERIAL", False):
        parser.error(f"--workers: study {args.name!r} runs its cells one at a time (each starts and times "
                     "processes of its own): pass --workers 1")
    if args.out is not None:
        try:
            check_out(args.out)                                 # before any cell runs, not after all of them
        except ValueError as err:
            parser.error(f"--out: {err}")
    doc = run_study(args.name, workers=args.workers, cells=cells, out=args.out,
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{args.name}: {len(doc['rows'])} cells in {doc['elapsed_s']} s"
          + ("" if cells is not None and args.out is None else f"; wrote {args.out or 'chapters/results/' + args.name + '.json'}"))
    if cells is not None and args.out is None:
        import json
        print(json.dumps(doc["rows"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
