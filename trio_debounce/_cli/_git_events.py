"""Turn a git repository's history into debounce events (``trio-debounce events git``)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

_HEADER = re.compile(r"\A([0-9a-f]{40,64})\t(-?\d+)\Z")

# Every option that decides what `git log` prints is passed explicitly, so the user's
# git configuration (diff.renames, log.showRoot, log.diffMerges, diff.relative, colour,
# signatures, external diff drivers, ...) cannot change the result.
_GIT_LOG = (
    "-c",
    "log.showRoot=true",
    "-c",
    "core.quotePath=false",
    "--no-replace-objects",
    "log",
    "--no-color",
    "--no-show-signature",
    "--no-ext-diff",
    "--no-textconv",
    "--no-relative",
    "--ignore-submodules=none",
    "--diff-merges=off",  # merge commits list no paths, as plain `git log --name-only`
    "--find-renames",  # rename detection on: a rename lists only the new path
    "-l1000",
    "--name-only",
    "-z",
    "--format=tformat:%x00%H%x09%ct",
    "HEAD",
    "--",
)


class GitEventsError(Exception):
    """The path is not a git repository, git failed, or the history is empty."""


@dataclass(frozen=True, slots=True, order=True)
class GitEvent:
    """One commit and one top-level path it touched."""

    ts: int
    key: str
    id: str

    def to_json(self) -> dict[str, object]:
        return {"ts": self.ts, "key": self.key, "id": self.id}


def parse_git_log(output: bytes) -> list[GitEvent]:
    """Parse the NUL-separated output of ``git log`` run with the options above.

    Each commit is ``\\0<sha>\\t<committer time>\\0``, then (for a commit with paths)
    a newline and its paths, each ending in ``\\0``. File names cannot be empty, so an
    empty field always announces a commit header.
    """
    fields = output.split(b"\0")
    events: set[GitEvent] = set()
    sha: str | None = None
    ts = 0
    expect_header = False
    first_path = False
    for raw in fields:
        if not raw:
            expect_header = True
            continue
        if expect_header:
            match = _HEADER.match(raw.decode("ascii", "replace"))
            if match is None:
                raise GitEventsError(f"unexpected git log output near {raw[:80]!r}")
            sha, ts = match.group(1), int(match.group(2))
            expect_header = False
            first_path = True
            continue
        if sha is None:
            raise GitEventsError(f"unexpected git log output near {raw[:80]!r}")
        if first_path and raw.startswith(b"\n"):
            raw = raw[1:]
        first_path = False
        path = os.fsdecode(raw)
        top = path.split("/", 1)[0]
        events.add(GitEvent(ts, top, sha[:12]))
    return sorted(events)


def git_events(path: str | os.PathLike[str] = ".") -> list[GitEvent]:
    """Return the events of the repository at ``path``, sorted by (ts, key, id).

    One event per commit reachable from ``HEAD`` and per top-level path that the
    commit touched: ``ts`` is the committer time (epoch seconds), ``key`` the
    top-level path, ``id`` the first 12 hex digits of the commit's sha. Merge commits
    contribute no paths; rename detection is on.

    Raises:
      GitEventsError: ``path`` is not a git repository (or git is missing), the
        repository has no commits, or its history touches no paths.
    """
    if not os.path.isdir(path):
        raise GitEventsError(f"{os.fspath(path)!r} is not a directory")
    where = os.fspath(path)
    check = _git(where, "rev-parse", "--git-dir")
    if check.returncode != 0:
        message = check.stderr.decode("utf-8", "replace").strip()
        raise GitEventsError(f"{where!r} is not a git repository: {message}")
    if _git(where, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").returncode != 0:
        raise GitEventsError(f"{where!r}: the repository has no commits")
    proc = _git(where, *_GIT_LOG)
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip()
        raise GitEventsError(f"git log failed in {where!r}: {message}")
    events = parse_git_log(proc.stdout)
    if not events:
        raise GitEventsError(f"{where!r}: the history touches no paths")
    return events


# Variables that point git at another repository than PATH (set inside git hooks, say).
_REPOSITORY_VARIABLES = frozenset(
    {
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "GIT_OBJECT_DIRECTORY",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES",
        "GIT_COMMON_DIR",
        "GIT_NAMESPACE",
        "GIT_REPLACE_REF_BASE",
        "GIT_GRAFT_FILE",
        "GIT_SHALLOW_FILE",
    }
)


def _git(where: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in _REPOSITORY_VARIABLES}
    try:
        return subprocess.run(
            ["git", "-C", where, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            env=env,
        )
    except FileNotFoundError:
        raise GitEventsError("git is not installed (no 'git' on PATH)") from None
