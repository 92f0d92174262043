"""An editable install of this checkout (the README's `pip install -e ".[test,ray,jax]"`)
is one type checkers see: mypy, run from another folder with no flag, finds the
package (setuptools' import-hook kind of editable install hides it from them)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def editable_install_of_this_checkout() -> bool:
    """Whether the installed distribution is an editable install of this very folder
    (not of another checkout, nor a regular install)."""
    # Every copy of the metadata: the build's egg-info in the checkout's root, on the
    # path too, carries no direct_url.json; the installed dist-info does.
    for dist in importlib.metadata.distributions(name="batchkit-ml"):
        direct_url = dist.read_text("direct_url.json")
        if direct_url is not None:
            break
    else:
        return False
    origin = json.loads(direct_url)
    if not origin.get("dir_info", {}).get("editable", False):
        return False
    url = urllib.parse.urlparse(origin.get("url", ""))
    return url.scheme == "file" and Path(urllib.request.url2pathname(url.path)).resolve() == ROOT


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (the test extra)"
)
@pytest.mark.skipif(
    not editable_install_of_this_checkout(),
    reason="batchkit-ml is not installed editable from this checkout (CI installs it so)",
)
def test_mypy_finds_the_editable_install_from_another_folder(tmp_path: Path) -> None:
    (tmp_path / "uses_batchkit.py").write_text("import batchkit\n")
    # What a user's shell has: no PYTHONPATH pointing into the checkout, another folder.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--follow-imports=skip",  # only whether the module is found, not its analysis
            "--config-file=",
            "uses_batchkit.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
