"""The main job: a built-in encoder served to 64 concurrent callers, one request at a
time and then through ``@batched``; batched results are checked against the
one-at-a-time ones, and throughput, latency and speed-up are printed.

Same as ``batchkit demo`` (see ``batchkit/tools/demo.py``):

    python examples/demo.py
"""

from batchkit.tools.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
