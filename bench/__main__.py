"""`python -m fleet.bench NAME [options]`: run one bench (bench/cli.py)."""

from fleet.bench.cli import main

if __name__ == "__main__":  # not in a multiprocessing child that re-imports the main module
    main()
