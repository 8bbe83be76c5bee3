"""``trio-debounce events git``: events from a real git repository made by the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.env import ROOT
from trio_debounce._cli import main
from trio_debounce._cli._git_events import GitEventsError, git_events, parse_git_log

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(
    repo: Path, *args: str, when: int = 1_700_000_000, env: dict[str, str] | None = None
) -> str:
    full_env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "GIT_AUTHOR_DATE": f"@{when} +0000",
        "GIT_COMMITTER_DATE": f"@{when} +0000",
        **(env or {}),
    }
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=full_env
    ).stdout


def commit(repo: Path, message: str, when: int) -> str:
    git(repo, "add", "-A", when=when)
    git(repo, "commit", "-q", "--no-verify", "-m", message, when=when)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "src").mkdir()
    (repo / "src" / "a.py").write_text("a = 1\n" * 20)
    (repo / "README").write_text("hi\n")
    shas = {"root": commit(repo, "root", 1000)}
    # a rename (src -> lib) plus a change: the rename lists only the new path
    (repo / "lib").mkdir()
    (repo / "src" / "a.py").rename(repo / "lib" / "a.py")
    (repo / "README").write_text("hi there\n")
    shas["rename"] = commit(repo, "rename", 2000)
    git(repo, "checkout", "-q", "-b", "side")
    (repo / "odd name\nwith newline").write_text("x\n")
    (repo / "docs dir").mkdir()
    (repo / "docs dir" / "ünï.txt").write_text("x\n")
    shas["side"] = commit(repo, "side", 3000)
    git(repo, "checkout", "-q", "main")
    (repo / "main.txt").write_text("x\n")
    shas["main"] = commit(repo, "main", 3000)
    git(repo, "merge", "-q", "--no-ff", "-m", "merge", "side", when=4000)
    shas["merge"] = git(repo, "rev-parse", "HEAD").strip()
    return repo, {k: v[:12] for k, v in shas.items()}


def test_events_from_a_repository(repo: tuple[Path, dict[str, str]]) -> None:
    path, sha = repo
    events = [e.to_json() for e in git_events(path)]
    expected = [
        {"ts": 1000, "key": "README", "id": sha["root"]},
        {"ts": 1000, "key": "src", "id": sha["root"]},
        {"ts": 2000, "key": "README", "id": sha["rename"]},
        {"ts": 2000, "key": "lib", "id": sha["rename"]},
        {"ts": 3000, "key": "docs dir", "id": sha["side"]},
        {"ts": 3000, "key": "main.txt", "id": sha["main"]},
        {"ts": 3000, "key": "odd name\nwith newline", "id": sha["side"]},
    ]
    assert events == sorted(expected, key=lambda e: (e["ts"], e["key"], e["id"]))
    assert all(e["id"] != sha["merge"] for e in events)  # merges contribute no paths


def test_user_git_configuration_does_not_change_the_result(
    repo: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = repo
    baseline = git_events(path)
    config = tmp_path / "gitconfig"
    config.write_text(
        "[diff]\n\trenames = false\n\trelative = true\n\tnoprefix = true\n"
        "[log]\n\tshowRoot = false\n\tdiffMerges = first-parent\n\tshowSignature = false\n"
        "[color]\n\tui = always\n[core]\n\tquotePath = true\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    assert git_events(path) == baseline
    # and run from a subdirectory, where diff.relative would otherwise apply
    assert git_events(path / "lib") == baseline


def test_cli_prints_json_lines(
    repo: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = repo
    with pytest.raises(SystemExit) as info:
        main(["events", "git", str(path)])
    out, err = capsys.readouterr()
    assert (info.value.code, err) == (0, "")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [e.to_json() for e in git_events(path)] == lines


def test_not_a_repository_and_empty_history_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    plain = tmp_path / "plain"
    plain.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    for path, message in (
        (plain, "is not a git repository"),
        (empty, "has no commits"),
        (tmp_path / "missing", "is not a directory"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["events", "git", str(path)])
        out, err = capsys.readouterr()
        assert (info.value.code, out) == (2, "")
        assert message in err


def test_parse_rejects_garbage() -> None:
    with pytest.raises(GitEventsError):
        parse_git_log(b"\0not a header\0")
    with pytest.raises(GitEventsError):
        parse_git_log(b"path-before-any-header\0")


@pytest.mark.slow
def test_readme_main_job_on_this_clone() -> None:
    """The README's main-job pipeline, on the project's own history."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git clone")
    exe = [sys.executable, "-m", "trio_debounce"]
    events = subprocess.run(
        [*exe, "events", "git", str(ROOT)], check=True, capture_output=True
    ).stdout
    result = subprocess.run(
        [*exe, "replay", "-", "--delay", "3600", "--max-delay", "7200", "--format", "summary"],
        input=events,
        check=True,
        capture_output=True,
    )
    summary = json.loads(result.stdout)
    assert summary["events"] == len(events.splitlines()) > 0
    assert 1 <= summary["fires"] <= summary["events"]
    assert 0 <= summary["latency_max"] <= 7200


def test_git_dir_in_the_environment_does_not_redirect(
    repo: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = repo
    baseline = git_events(path)
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "x").write_text("x")
    commit(other, "other", 5000)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))  # as inside a git hook
    assert git_events(path) == baseline
