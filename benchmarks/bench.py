"""The benchmark harness's command (`make bench`, `make bench-quick`; benchmarks/README.md): the
harness itself is the package benchmarks/harness/, this file only runs its `main`, so that the
command stays a path a user can type from anywhere."""

import sys
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, not the repository root the
# package `benchmarks` lives in.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main

if __name__ == "__main__":
    sys.exit(main())
