"""``python -m linattn.experiments NAME``: run a study and write its results file (see the package docstring)."""
from __future__ import annotations

import argparse
import sys

from . import STUDIES, run_study, study


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linattn.experiments",
                                     description="Run a study of the book and write its results with provenance.")
    parser.add_argument("name", nargs="?", help="the study (omit to list them)")
    parser.add_argument("--workers", type=int, default=1, help="processes in parallel, one thread each (default 1)")
    parser.add_argument("--cells", default=None, help="comma-separated grid indices (a partial run; prints only)")
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
    cells = None if args.cells is None else [int(c) for c in args.cells.split(",") if c.strip()]
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
