"""async_save and CheckpointManager in one process: snapshot semantics, staging reuse, retention, errors."""

from __future__ import annotations

import uuid

import pytest
import torch

import checkpoint
from checkpoint import CheckpointError, _async, _save


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "opt": {"m": torch.randn(100, generator=g)},
            "ints": torch.arange(7), "step": seed, "hist": [1, 2]}


def _empty() -> dict:
    return {"w": torch.zeros(64, 32), "opt": {"m": torch.zeros(100)}, "ints": torch.zeros(7, dtype=torch.long),
            "step": None, "hist": None}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_async_save_snapshot_ignores_later_updates(tmp_path, where):
    path = str(tmp_path / "ck") if where == "local" else f"memory://async-{uuid.uuid4().hex}/ck"
    state = _state(1)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items() if k != "opt"}
    expected_m = state["opt"]["m"].clone()
    handle = checkpoint.async_save(state, path)
    state["w"].add_(1.0)  # an optimizer step right after the call
    state["opt"]["m"].mul_(-3.0)
    state["ints"].add_(5)
    state["hist"].append(3)
    handle.result(timeout=60)
    assert handle.done()
    loaded = checkpoint.load(_empty(), path)
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["opt"]["m"], expected_m)
    assert torch.equal(loaded["ints"], expected["ints"])
    assert loaded["step"] == 1 and loaded["hist"] == [1, 2]


def test_staging_buffers_are_reused_and_bounded(tmp_path):
    state = _state(2)
    local_bytes = sum(t.numel() * t.element_size() for t in (state["w"], state["opt"]["m"], state["ints"]))
    checkpoint.async_save(state, tmp_path / "a").result()
    first = {k: v.data_ptr() for k, v in _async._staging.buffers.items()}
    assert _async._staging_bytes() == local_bytes
    for i in range(3):
        checkpoint.async_save(state, tmp_path / f"b{i}").result()
        assert _async._staging_bytes() == local_bytes
        assert {k: v.data_ptr() for k, v in _async._staging.buffers.items()} == first
    # A smaller state_dict drops the buffers it no longer needs.
    checkpoint.async_save({"w": state["w"]}, tmp_path / "c").result()
    assert _async._staging_bytes() == state["w"].numel() * 4


def test_error_surfaces_from_result_and_next_call(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    handle = checkpoint.async_save(_state(3), blocker)  # a file where the folder should go
    with pytest.raises(FileExistsError, match="existing file"):
        handle.result(timeout=60)
    # Not retrieved: the next call raises it and does not start.
    checkpoint.async_save(_state(3), blocker)
    with pytest.raises(CheckpointError, match="previous async_save .* failed"):
        checkpoint.async_save(_state(3), tmp_path / "ok")
    assert not (tmp_path / "ok").exists()
    checkpoint.async_save(_state(3), tmp_path / "ok").result()  # reported once, then saving works
    assert checkpoint.read_metadata(tmp_path / "ok").values["step"] == 3


class _Uncopyable(torch.Tensor):
    """A tensor whose copy fails, as a device copy can: staging it raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.Tensor.copy_:
            raise RuntimeError("copy failed (simulated)")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_failed_staging_raises_at_the_call_and_commits_nothing(tmp_path):
    # The writer has started (its prepare phase runs while the training thread stages); it must
    # stop, leave no file behind (nor the folder it created), and not report the error a second time.
    state = {"a": torch.ones(1024), "b": torch.ones(8).as_subclass(_Uncopyable)}
    with pytest.raises(RuntimeError, match="simulated"):
        checkpoint.async_save(state, tmp_path / "ck")
    checkpoint.async_save({"a": torch.ones(1024)}, tmp_path / "ok").result(timeout=60)  # waits for it
    with pytest.raises(FileNotFoundError):
        checkpoint.read_metadata(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_bad_input_raises_at_the_call(tmp_path):
    with pytest.raises(TypeError):
        checkpoint.async_save({"x": object()}, tmp_path / "bad")
    with pytest.raises(ValueError, match="if_busy='later'"):
        checkpoint.async_save({}, tmp_path / "bad", if_busy="later")


def test_if_busy_error_rejects_and_wait_serializes(tmp_path):
    gate = __import__("threading").Event()
    _save._test_hook = lambda phase: gate.wait(30) if phase == "planned" else None
    try:
        first = checkpoint.async_save(_state(4), tmp_path / "one")
        with pytest.raises(RuntimeError, match="still being written"):
            checkpoint.async_save(_state(5), tmp_path / "two", if_busy="error")
        assert not first.done()
        gate.set()
        second = checkpoint.async_save(_state(5), tmp_path / "two")  # waits for the first
        assert first.done()
        second.result()
    finally:
        _save._test_hook = None
    assert checkpoint.read_metadata(tmp_path / "one").values["step"] == 4
    assert checkpoint.read_metadata(tmp_path / "two").values["step"] == 5


@pytest.mark.parametrize("where", ["local", "memory"])
def test_manager_retention_and_latest(tmp_path, where):
    root = str(tmp_path / "run") if where == "local" else f"memory://mgr-{uuid.uuid4().hex}/run"
    manager = checkpoint.CheckpointManager(root, keep_last=2, keep_every=4)
    assert manager.steps() == [] and manager.latest_step() is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        manager.load(_empty())
    states = {}
    for step in range(1, 10):
        states[step] = _state(step)
        manager.save(step, states[step], async_=step % 2 == 0)
    manager.wait()
    assert manager.steps() == [4, 8, 9]
    assert manager.latest_step() == 9
    for step in (4, 8, 9):
        loaded = manager.load(_empty(), step=step)
        assert torch.equal(loaded["w"], states[step]["w"]) and loaded["step"] == step
    assert manager.load(_empty())["step"] == 9
    with pytest.raises(CheckpointError, match="step=5 is not a committed"):
        manager.load(_empty(), step=5)


def test_manager_removes_abandoned_step_and_resumes(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=3)
    manager.save(10, _state(10))
    partial = tmp_path / "step-0000000020"  # what a save killed midway leaves: data, no metadata
    partial.mkdir()
    (partial / "data-deadbeef-r00000.safetensors").write_bytes(b"\0" * 64)
    assert manager.steps() == [10]
    restarted = checkpoint.CheckpointManager(tmp_path, keep_last=3)
    assert not partial.exists()
    assert restarted.latest_step() == 10
    assert torch.equal(restarted.load(_empty())["w"], _state(10)["w"])


def test_manager_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0 must be a positive int"):
        checkpoint.CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="step=-1 must be a non-negative int"):
        checkpoint.CheckpointManager(tmp_path).save(-1, {})


@pytest.mark.parametrize("cap", [4096, 8192, 8192 + 400], ids=["one-region-per-wave", "w-alone", "w-and-m"])
def test_staging_cap_writes_in_waves(tmp_path, cap):
    state = _state(6)  # w: 8192 bytes, m: 400 bytes, ints: 56 bytes
    expected = {"w": state["w"].clone(), "m": state["opt"]["m"].clone(), "ints": state["ints"].clone()}
    if cap < 8192:
        with pytest.raises(ValueError, match="max_staging_bytes=4096 is smaller than the largest region .* 8192"):
            checkpoint.async_save(state, tmp_path / "ck", max_staging_bytes=cap)
        return
    handle = checkpoint.async_save(state, tmp_path / "ck", max_staging_bytes=cap)
    assert _async._staging_bytes() <= cap
    state["w"].add_(1.0)
    state["opt"]["m"].add_(1.0)
    state["ints"].add_(1)
    handle.result(timeout=60)
    loaded = checkpoint.load(_empty(), tmp_path / "ck")
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["opt"]["m"], expected["m"])
    assert torch.equal(loaded["ints"], expected["ints"])
    with pytest.raises(ValueError, match="max_staging_bytes=0 must be a positive int"):
        checkpoint.async_save(state, tmp_path / "ck2", max_staging_bytes=0)


def test_manager_keeps_best_by_metric(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1, keep_best=2, best_mode="min")
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.8, 6: 0.7}
    for step, loss in losses.items():
        manager.save(step, {"x": torch.full((3,), float(step))}, async_=step % 2 == 0, metric=loss)
    manager.wait()
    assert manager.steps() == [2, 4, 6]  # the two lowest losses, and the latest
    assert sorted(p.name for p in tmp_path.glob("*.metric.json")) == [f"step-{s:010d}.metric.json" for s in (2, 4, 6)]
    with pytest.raises(ValueError, match="metric=nan must be a number"):
        manager.save(7, {}, metric=float("nan"))
    with pytest.raises(ValueError, match="best_mode='best' is not an option"):
        checkpoint.CheckpointManager(tmp_path, best_mode="best")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_manager_keeps_exactly_the_last_n_steps(tmp_path, where):
    root = str(tmp_path / "run") if where == "local" else f"memory://mgr-{uuid.uuid4().hex}/run"
    manager = checkpoint.CheckpointManager(root, keep_last=3)
    for step in range(1, 8):
        manager.save(step, _state(step), async_=step % 2 == 1)
        manager.wait()
        assert manager.steps() == list(range(max(1, step - 2), step + 1))
    for step in (5, 6, 7):
        assert torch.equal(manager.load(_empty(), step=step)["w"], _state(step)["w"])


class _PausingDict(dict):
    """A state_dict that stops ``load`` when it sets ``"step"`` (values are set before tensors are read)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        import threading
        self.paused, self.resume = threading.Event(), threading.Event()

    def __setitem__(self, key, value) -> None:  # type: ignore[no-untyped-def]
        if key == "step":
            self.paused.set()
            assert self.resume.wait(60)
        super().__setitem__(key, value)


def test_manager_never_prunes_the_step_it_is_loading(tmp_path):
    """A save's retention while another thread loads step 1 from the same manager keeps step 1 until it is read."""
    import threading

    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, _state(1))
    target = _PausingDict(_empty())
    outcome: dict = {}

    def load() -> None:
        try:
            outcome["loaded"] = manager.load(target, step=1)
        except BaseException as exc:  # noqa: BLE001 - examined below
            outcome["error"] = exc

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert target.paused.wait(60)
        manager.save(2, _state(2))  # keep_last=1 would prune step 1, which is being read
    finally:
        target.resume.set()
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert torch.equal(target["w"], _state(1)["w"]) and target["step"] == 1
    manager.save(3, _state(3))  # no longer being read: pruned like any other
    assert manager.steps() == [3]


def test_manager_ignores_a_checkpoint_whose_name_is_not_exactly_a_steps(tmp_path):
    """A committed checkpoint in "step-00000000042" (one zero too many) is not step 42: never listed,
    loaded or pruned."""
    foreign = tmp_path / "step-00000000042"
    checkpoint.save(_state(42), foreign, quiet=True)
    before = sorted(p.name for p in foreign.iterdir())
    manager = checkpoint.CheckpointManager(tmp_path, keep_last=1)
    assert manager.steps() == [] and manager.latest_step() is None
    for step in (1, 2):
        manager.save(step, _state(step))
        assert manager.steps() == [step] and manager.load(_empty())["step"] == step
    assert sorted(p.name for p in foreign.iterdir()) == before
    assert torch.equal(checkpoint.load(_empty(), foreign)["w"], _state(42)["w"])
