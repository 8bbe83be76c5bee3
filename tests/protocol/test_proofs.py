"""The at-most-once proof of a commit whose answer was lost (``SentCommits.proof``):
a document proves a sent write only by naming it (its tombstone, or an ``after``
entry). ``commit_landed``'s "in doubt" answer for a full ``after`` list (right for an
at-least-once re-run) never makes an at-most-once owner fire: in the chaos run
blocked-loop/at-most-once it made an owner whose loop was blocked fire a window a
peer had already taken over and fired."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest

from trio_debounce._kv import KvEntry
from trio_debounce._protocol import _rules
from trio_debounce._protocol._documents import AFTER_KEEP, WindowDoc
from trio_debounce._protocol._leases import ProcessLease
from trio_debounce._protocol._proofs import SentCommits
from trio_debounce._protocol._view import StoreView
from trio_debounce._types import Mode

_KV_KEY = "w.wf.k"


class _View:
    """What ``proof`` needs of a store view: the fencing token of a revision."""

    def token(self, revision: int) -> int:
        return 1000 + revision


def _window(run_id: str, write: str, **changes: object) -> WindowDoc:
    base = WindowDoc(
        "A", "epoch-a", run_id, Mode.TRAILING, 1.0, None, 10.0, 10.0, 11.0, None, 11.0, 1,
        write, "open-" + run_id, '"p"',
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _sent(write: str = "commit-1") -> tuple[SentCommits, WindowDoc]:
    commits = SentCommits(
        cast(StoreView, _View()),
        cast(ProcessLease, None),
        op_timeout=1.0,
        wall=lambda: 100.0,
    )
    window = _window("run-1", "w0")
    commits.add(_KV_KEY, "run-1", write, window, 11.0, base=5)
    return commits, window


def _entry(doc: WindowDoc, revision: int) -> KvEntry:
    return KvEntry(_KV_KEY, doc.encode(), revision)


def test_a_full_after_list_that_does_not_name_the_write_proves_nothing() -> None:
    commits, _ = _sent()
    # A peer took the window over and fired it, and AFTER_KEEP newer windows have
    # fired since: run-1 has dropped out of the list.
    after = tuple((f"run-{n}", f"peer-{n}") for n in range(10, 10 + AFTER_KEEP))
    doc = _window("run-20", "w20", owner="B", after=after)
    assert _rules.commit_landed(doc, "run-1", "commit-1") is True  # in doubt
    assert commits.proof(_KV_KEY, "run-1", _entry(doc, 40), doc) is None
    # The key has moved past the revision the write named: it can no longer land.
    assert not commits.pending(_KV_KEY, "run-1")


@pytest.mark.parametrize("where", ["tombstone", "after"])
def test_a_document_that_names_the_write_proves_it(where: str) -> None:
    commits, window = _sent()
    if where == "tombstone":
        doc = _window("run-1", "commit-1", fired=True)
        revision, token = 6, 1006
    else:
        newer = [(f"run-{n}", f"peer-{n}") for n in range(10, 9 + AFTER_KEEP)]
        after = (("run-1", "commit-1"), *newer)
        doc = _window("run-20", "w20", owner="B", after=after)
        revision, token = 40, 1006  # one above the revision the write named
    assert commits.proof(_KV_KEY, "run-1", _entry(doc, revision), doc) == (window, 11.0, token)
    assert not commits.pending(_KV_KEY, "run-1")


def test_another_writes_tombstone_rules_the_write_out() -> None:
    commits, _ = _sent()
    doc = _window("run-1", "peer-commit", owner="B", fired=True)
    assert commits.proof(_KV_KEY, "run-1", _entry(doc, 6), doc) is None
    assert not commits.pending(_KV_KEY, "run-1")


def test_a_lagging_read_keeps_the_write_pending() -> None:
    commits, _ = _sent()
    doc = _window("run-1", "w0")  # the open window, at the revision the write names
    assert commits.proof(_KV_KEY, "run-1", _entry(doc, 5), doc) is None
    assert commits.pending(_KV_KEY, "run-1")
