"""Check that mypy rejects what it must: in ``scripts/type_errors/*.py``, the line after each
``# expect: <text>`` comment must get a mypy error containing ``<text>``, and no other line an
error.
A check of the typed options of :func:`funcmeta.adapt`, :func:`funcmeta.adapt_tasks` and the
recipes that cannot pass by accident (a file that type checks cleanly fails it).

    python scripts/check_type_errors.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "type_errors"


def main() -> int:
    files = sorted(FOLDER.glob("*.py"))
    expected: dict[tuple[str, int], str] = {}
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = re.match(r"\s*# expect: (.+)$", line)
            if found:
                expected[(path.name, number + 1)] = found.group(1).strip()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--hide-error-context",
            *map(str, files),
        ],
        capture_output=True,
        text=True,
    )
    errors: dict[tuple[str, int], list[str]] = {}
    for line in run.stdout.splitlines():
        m = re.match(r"(.+?):(\d+): error: (.+)$", line)
        if m:
            errors.setdefault((Path(m.group(1)).name, int(m.group(2))), []).append(m.group(3))
    problems = []
    for where, text in expected.items():
        if not any(text in e for e in errors.get(where, [])):
            problems.append(f"{where[0]}:{where[1]}: mypy did not report {text!r}")
    for where, found in errors.items():
        if where not in expected:
            problems.append(f"{where[0]}:{where[1]}: unexpected mypy error: {found}")
    for line in problems:
        print(line)
    print(
        f"type errors: {len(expected) - len([p for p in problems if 'did not' in p])} of "
        f"{len(expected)} expected errors reported, {len(problems)} problem(s)"
    )
    return 1 if problems or not expected else 0


if __name__ == "__main__":
    sys.exit(main())
