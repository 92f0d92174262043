"""The main job: a built-in encoder served to 64 concurrent callers, one request at a
time and through ``@batched`` (the same warm-up for both, then timed rounds in
alternating order); batched results are checked equal to the one-at-a-time ones within
a tolerance, and throughput, latency, speed-up and why batches left are printed. Runs
on the core install (a numpy model; torch's when torch is installed).

Same as ``batchkit demo`` (see ``batchkit/tools/demo.py``):

    python examples/demo.py
"""

from batchkit.tools.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
