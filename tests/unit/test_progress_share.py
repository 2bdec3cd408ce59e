"""A bar sized for every rank's bytes, advanced by this rank's share (``progress(..., share=)``)."""

from __future__ import annotations

import io

import pytest

from checkpoint import _progress


@pytest.mark.parametrize(("total", "share", "steps", "shown"), [
    pytest.param(400 << 20, 100 << 20, [50 << 20], "200M/400M", id="quarter-share-half-done"),
    pytest.param(400 << 20, 100 << 20, [100 << 20], "400M/400M", id="share-done-bar-full"),
    pytest.param(300 << 20, 100 << 20, [1, (100 << 20) - 1], "300M/300M", id="uneven-updates-end-exact"),
    pytest.param(100 << 20, 100 << 20, [60 << 20], "60.0M/100M", id="whole-share"),
])
def test_share_scales_the_bar(monkeypatch: pytest.MonkeyPatch, total: int, share: int, steps: list[int],
                              shown: str) -> None:
    monkeypatch.setenv("SHARDKIT_PROGRESS", "1")
    monkeypatch.delenv("SHARDKIT_QUIET", raising=False)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    with _progress.progress(total, "save", share=share) as bar:
        for n in steps:
            bar.update(n)
        bar.refresh()  # type: ignore[attr-defined]
    assert shown in stream.getvalue().replace("\r", "\n"), stream.getvalue()


def test_global_total_decides_whether_a_bar_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_PROGRESS", "1")
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    with _progress.progress(128 << 20, "save", share=32 << 20) as bar:  # rank 0 alone would be too small
        bar.update(32 << 20)
    assert "save" in stream.getvalue()
    with _progress.progress(128 << 20, "save", share=0) as bar:  # rank 0 writes nothing: no bar
        bar.update(0)
    assert isinstance(bar, _progress._NoBar)
