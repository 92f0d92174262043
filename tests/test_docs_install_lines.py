"""Every install line in the README, the docs and the examples' READMEs names the
project by the distribution name pyproject.toml declares (the package index's
``batchkit`` is an unrelated project), and every extra they name exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME: str = PYPROJECT["project"]["name"]
EXTRAS: set[str] = set(PYPROJECT["project"]["optional-dependencies"])


def documents() -> list[Path]:
    """Where a reader copies install lines from: the README files, the docs pages, the
    examples (their READMEs and scripts) and the library's own messages and docstrings."""
    found = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    for pattern in ("*.md", "*.py"):
        found += sorted((ROOT / "examples").rglob(pattern))
    found += sorted((ROOT / "batchkit").rglob("*.py"))
    return found


def canonical(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# What follows ``pip install`` on its line, up to where the command ends in prose or
# in a shell line (a closing backtick, ``&&``, ``;``, a comment, a closing paren).
INSTALL = re.compile(r"pip install\s+([^`#;&)\n]*)")
# Options whose next word is their value, not a requirement.
TAKES_VALUE = {"-r", "-c", "-d", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
# ``batchkit[extra]`` or ``batchkit-something[extra,...]`` anywhere, e.g. "needs
# `batchkit-ml[ray]`"; a path such as ``.[test,ray]`` is not a name.
EXTRAS_MENTION = re.compile(r"(?<![\w./-])(batchkit[\w-]*)\[([\w,\s-]*)\]", re.I)
REQUIREMENT = re.compile(r"^([A-Za-z0-9][\w.-]*)(?:\[([\w,\s-]*)\])?")


def project_requirements(text: str) -> list[tuple[str, list[str]]]:
    """(name, extras) for each mention of this project by name in ``text``.

    A mention is a requirement in a ``pip install`` command whose name starts with
    "batchkit", or a ``batchkit...[extra]`` anywhere. Paths (``.``, ``".[test]"``)
    install the checkout and name nothing.
    """
    found: list[tuple[str, list[str]]] = []
    for command in INSTALL.findall(text):
        words = [w.strip("\"'") for w in command.split()]
        skip = False
        for word in words:
            if skip:
                skip = False
                continue
            if word in TAKES_VALUE:
                skip = True
                continue
            if word.startswith(("-", ".", "/")):
                continue
            match = REQUIREMENT.match(word)
            if match and canonical(match.group(1)).startswith("batchkit"):
                extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
                found.append((match.group(1), extras))
    for name, extras in EXTRAS_MENTION.findall(text):
        found.append((name, [e.strip() for e in extras.split(",") if e.strip()]))
    return found


def wrong_mentions(text: str) -> list[str]:
    """Each mention of the project that names another distribution or an unknown extra.

    A line that both installs and names extras (``pip install "batchkit[ray]"``) is
    reported once.
    """
    wrong: dict[str, None] = {}
    for name, extras in project_requirements(text):
        if canonical(name) != canonical(NAME):
            wrong[f"{name}: the distribution is {NAME}"] = None
        wrong.update({f"{name}[{e}]: no such extra": None for e in extras if e not in EXTRAS})
    return list(wrong)


@pytest.mark.parametrize(
    "line",
    [
        "pip install batchkit",
        'pip install "batchkit[torch]"        # torch tensors in and out',
        "(`pip install 'batchkit[ray]'`)",
        "needs `batchkit[metrics]`",
        "pip install numpy batchkit==0.1",
        f'pip install "{NAME}[no-such-extra]"',
    ],
)
def test_a_line_that_names_another_distribution_or_extra_is_caught(line: str) -> None:
    assert wrong_mentions(line)


@pytest.mark.parametrize(
    "line",
    [
        f"pip install {NAME}",
        f'pip install "{NAME}[torch]" && batchkit demo',
        'pip install -e ".[test,ray]" && pytest',
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        "pip uninstall batchkit",
        "pip install -e .",
    ],
)
def test_a_line_that_installs_this_project_or_a_peer_passes(line: str) -> None:
    assert not wrong_mentions(line)


def test_the_name_is_not_the_unrelated_batchkit_distribution() -> None:
    assert canonical(NAME) != "batchkit"


def test_extras_that_refer_to_the_project_use_its_name() -> None:
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            match = REQUIREMENT.match(requirement)
            assert match, requirement
            if canonical(match.group(1)).startswith("batchkit"):
                assert canonical(match.group(1)) == canonical(NAME), f"{extra}: {requirement}"


def test_every_install_line_in_the_readmes_and_docs_names_the_distribution() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {problem}"
        for path in documents()
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for problem in wrong_mentions(line)
    ]
    assert not wrong, "\n".join(wrong)
