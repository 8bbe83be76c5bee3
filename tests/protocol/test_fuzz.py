"""The short run of the fuzz targets (``tests/protocol/fuzz.py``), and regressions it found."""

from __future__ import annotations

import pytest

from tests.protocol.fuzz import DECODERS, check_decoder, run_target, targets


@pytest.mark.parametrize("name", sorted(targets()))
def test_fuzz_target_short_run(name: str) -> None:
    run_target(name, 60, derandomize=True)


# Documents that escaped the decoders with RecursionError or OverflowError (a crash of
# whatever task read them) before they were refused as unreadable.
REGRESSIONS = [
    b"[" * 100_000,
    b'{"v":' * 100_000,
    b'{"v":1,"owner":"p","epoch":"e","workflow":"w","key":"k","run":"r","payload":null,'
    b'"count":1,"first":0.0,"at":1' + b"0" * 400 + b',"attempt":1}',
    b'{"v":1,"count":1e999,"attempt":Infinity}',
    b'{"v":1,"id":"r","wf":"w","payload":"1","at":1' + b"0" * 400 + b',"exp":null}',
    b'{"v":1,"pid":"p","epoch":1' + b"0" * 400 + b',"exp":1,"released":false}',
    b'{"v":2,"owner":"p","epoch":"e","run":"r","mode":"trailing","delay":1,"first":0,'
    b'"last":0,"at":1,"armed":1,"count":1,"write":"w","open":"w","payload":"[1]",'
    b'"policy":"collect","max_items":3,"ranks":[[1' + b"0" * 400 + b",0]]}",
]


@pytest.mark.parametrize("raw", REGRESSIONS, ids=range(len(REGRESSIONS)))
@pytest.mark.parametrize("decoder", DECODERS, ids=lambda d: d.name)
def test_decoder_regressions(decoder: object, raw: bytes) -> None:
    check_decoder(decoder, raw)  # type: ignore[arg-type]
