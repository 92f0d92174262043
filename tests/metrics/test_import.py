"""batchkit never imports prometheus_client; batchkit.metrics without it names the extra."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_importing_batchkit_does_not_import_prometheus_client() -> None:
    done = run("import sys, batchkit; assert 'prometheus_client' not in sys.modules")
    assert done.returncode == 0, done.stderr


def test_missing_prometheus_client_raises_an_import_error_naming_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None  # as if not installed\n"
        "try:\n"
        "    import batchkit.metrics\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    done = run(code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "batchkit-ml[metrics]" in done.stdout
