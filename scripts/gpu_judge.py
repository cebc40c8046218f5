"""The verdicts of ``make gpu-check`` (``scripts/gpu_check.sh``): each section's output and exit
status against its target, and the table at the end. Standard library only (no torch), so the
judging runs, and is tested, without a GPU.

A section is one of three kinds:

- ``tests``: pytest; PASS when it exits 0 with at least one test passed (exit 5, "no tests
  ran", and a run where every test skipped are FAIL); its summary line is the measurement.
- ``result``: a script that judges itself and prints a last line ``RESULT PASS ...``,
  ``RESULT FAIL ...`` or ``RESULT SKIP (why) ...`` (see :func:`parse_result`); PASS only when it
  exits 0 *and* says PASS; SKIP when it says SKIP and exits 0 or :data:`NOT_JUDGED`; anything
  else (another exit status, no RESULT line) is FAIL.
- ``none``: a section without a target; it "ran (no target)", ended in an ERROR (a non-zero exit
  status) or was stopped; none of these counts against the check.

Any kind stopped by ``timeout`` (exit status 124, or 137 once its limit had passed) is FAIL
"over its limit" (or "the check's budget ran out" where the budget had cut its limit), and a
section left for lack of time is NOT RUN. The check as a whole passes when every section with a
target passed: a FAIL, a SKIP or a NOT RUN among them makes :func:`exit_status` 1.

    python scripts/gpu_judge.py judge --records R --name N --kind result --target T \\
        --log LOG --rc 0 --seconds 12 --limit 30 [--by-budget]
    python scripts/gpu_judge.py judge --records R --name N --kind result --target T \\
        --not-run "the check's budget of 540 s is spent"
    python scripts/gpu_judge.py table --records R
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: The exit status of a benchmark that could not judge its target here (no JAX, no CUDA).
NOT_JUDGED = 3
KINDS = ("tests", "result", "none")
PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
#: the statuses of a section without a target
NO_TARGET, ERROR, STOPPED = "ran (no target)", "ERROR", "stopped (no target)"

_RESULT = re.compile(r"^RESULT:?\s+(PASS|FAIL|SKIP)\b\s*(?:\(([^)]*)\))?\s*[:;,.-]?\s*(.*)$")
_PYTEST = re.compile(
    r"\b\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b|no tests ran"
)


@dataclass
class Verdict:
    """One section's row: its name and target as the table shows them (``target`` empty for
    a section without one), what it measured, its status and how long it ran."""

    name: str
    target: str
    measured: str
    status: str
    seconds: int = 0

    @property
    def judged(self) -> bool:
        return bool(self.target)

    @property
    def passed(self) -> bool:
        return self.status == PASS


@dataclass
class Result:
    """A parsed ``RESULT`` line: the word (PASS, FAIL or SKIP), the reason in parentheses
    after it (``""`` if none) and the rest of the line."""

    word: str
    reason: str
    details: str


def parse_result(output: str) -> Result | None:
    """The last line of ``output`` that starts with ``RESULT`` followed by PASS, FAIL or SKIP
    (an optional colon after ``RESULT``, an optional ``(reason)`` after the word), else
    ``None``."""
    for line in reversed(output.splitlines()):
        m = _RESULT.match(line.strip())
        if m:
            return Result(m.group(1), m.group(2) or "", m.group(3).strip())
    return None


def pytest_summary(output: str) -> str | None:
    """pytest's last summary line ("56 failed, 26 passed, 1722 deselected in 31.78s"),
    without the ``=`` around it, else ``None``."""
    for line in reversed(output.splitlines()):
        if _PYTEST.search(line):
            return line.strip().strip("=").strip()
    return None


def last_line(output: str, width: int = 160) -> str:
    """The last non-empty line of ``output``, cut to ``width`` characters."""
    lines = [s.strip() for s in output.splitlines() if s.strip()]
    if not lines:
        return "no output"
    line = lines[-1]
    return line if len(line) <= width else line[: width - 3] + "..."


def stopped(rc: int, seconds: int, limit: int) -> bool:
    """Whether ``timeout`` stopped the section: exit status 124, or 137 (killed after the
    grace period) once its limit had passed; a 137 before that is another kill (memory)."""
    return rc == 124 or (rc == 137 and seconds >= limit)


def judge(
    kind: str,
    rc: int,
    output: str,
    *,
    seconds: int = 0,
    limit: int = 0,
    by_budget: bool = False,
) -> tuple[str, str]:
    """``(status, measured)`` of a section of ``kind`` that exited with ``rc`` after
    printing ``output``; ``limit`` is the limit it ran under, cut by the check's budget where
    ``by_budget``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if stopped(rc, seconds, limit):
        why = (
            f"stopped after {limit} s: the check's budget ran out"
            if by_budget
            else f"stopped after {limit} s: over its limit"
        )
        return (FAIL if kind != "none" else STOPPED), why
    if kind == "none":
        return (NO_TARGET, "-") if rc == 0 else (ERROR, f"exit status {rc}: {last_line(output)}")
    if kind == "tests":
        summary = pytest_summary(output)
        if rc == 5:
            return FAIL, f"no tests ran ({summary or 'pytest exit status 5'})"
        if rc != 0:
            return FAIL, summary or f"exit status {rc}: {last_line(output)}"
        if summary is None or not re.search(r"\b[1-9]\d* passed\b", summary):
            return FAIL, f"no test passed ({summary or 'no pytest summary'})"
        return PASS, summary
    result = parse_result(output)
    if result is None:
        return FAIL, f"exit status {rc}, no RESULT line: {last_line(output)}"
    details = result.details or "-"
    if result.word == "SKIP" and rc in (0, NOT_JUDGED):
        return (f"SKIP ({result.reason})" if result.reason else "SKIP"), details
    if rc == 0 and result.word == "PASS":
        return PASS, details
    if rc == 0:
        return FAIL, f"RESULT {result.word} (exit status 0): {details}"
    if result.word == "FAIL":
        return FAIL, details
    return FAIL, f"exit status {rc} after RESULT {result.word}: {details}"


def cell(text: str) -> str:
    """``text`` as one markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|") or "-"


def table(verdicts: list[Verdict]) -> str:
    """The markdown table of the sections: section | target | measured | seconds | result."""
    rows = ["| section | target | measured | seconds | result |", "| --- | --- | --- | --- | --- |"]
    for v in verdicts:
        status = f"**{v.status}**" if v.judged and not v.passed else v.status
        rows.append(
            f"| {cell(v.name)} | {cell(v.target or 'no target')} | {cell(v.measured)} | "
            f"{v.seconds} | {status} |"
        )
    return "\n".join(rows)


def summary(verdicts: list[Verdict]) -> str:
    """One line: how many targets were met, and which sections were not."""
    judged = [v for v in verdicts if v.judged]
    missed = [v for v in judged if not v.passed]
    line = f"{len(judged) - len(missed)} of {len(judged)} targets met"
    if missed:
        line += "; not met: " + ", ".join(f"{v.name} ({v.status})" for v in missed)
    return line


def exit_status(verdicts: list[Verdict]) -> int:
    """1 when a section with a target did not pass (FAIL, SKIP or NOT RUN), else 0."""
    return int(any(v.judged and not v.passed for v in verdicts))


def read_records(path: Path) -> list[Verdict]:
    if not path.exists():
        return []
    return [Verdict(**json.loads(s)) for s in path.read_text().splitlines() if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("judge", help="judge one section, print its verdict, record it")
    one.add_argument("--records", type=Path, required=True)
    one.add_argument("--name", required=True)
    one.add_argument("--target", default="", help="empty: a section without a target")
    one.add_argument("--kind", choices=KINDS, default="result")
    one.add_argument("--log", type=Path, help="the section's output")
    one.add_argument("--rc", type=int, default=0)
    one.add_argument("--seconds", type=int, default=0)
    one.add_argument("--limit", type=int, default=0)
    one.add_argument("--by-budget", action="store_true", help="the budget cut its limit")
    one.add_argument("--not-run", metavar="REASON", help="the section did not run: why")
    end = sub.add_parser("table", help="the table of the recorded sections; exit 1 on a miss")
    end.add_argument("--records", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "table":
        verdicts = read_records(args.records)
        print(table(verdicts))
        print()
        print(f"gpu-check: {summary(verdicts)}")
        return exit_status(verdicts)
    kind = "none" if not args.target else args.kind
    if args.not_run is not None:
        status, measured = NOT_RUN, args.not_run
    else:
        output = args.log.read_text(errors="replace") if args.log and args.log.exists() else ""
        status, measured = judge(
            kind,
            args.rc,
            output,
            seconds=args.seconds,
            limit=args.limit,
            by_budget=args.by_budget,
        )
    verdict = Verdict(args.name, args.target, measured, status, args.seconds)
    with args.records.open("a") as f:
        f.write(json.dumps(asdict(verdict)) + "\n")
    print(f"{status}: {measured}" if measured != "-" else status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
