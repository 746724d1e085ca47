"""Command line of the compile-time benchmark, `mk.measure.compile_time` (the megakernel against
XLA for one model and one TPU chip); see that module for what it measures and its options.

    .venv/bin/python benchmarks/compile_time.py --chip v6e --preset qwen3-8b \
        --layers 4 8 16 32 64 --json build/compile_time.json

Not here: the benchmark itself (in the package, so notebook 07 runs it from a wheel).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `mk` from a checkout

from mk.measure.compile_time import main  # noqa: E402

if __name__ == "__main__":
    main()
