"""``python -m batchkit``: the ``batchkit`` command."""

from batchkit.cli import main

raise SystemExit(main())
