"""The per-CPU choices of models/calibrate.py: from how many rows q8+fp16's fp16 copy serves
a shape, and whether an LM head takes int8 blocks on a CPU without VNNI; measured once per
CPU and kept in the cache dir."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.kernels.cpu import cpu_kernels
from kvserve.models import calibrate
from kvserve.models.quant import fbgemm_available


@pytest.fixture(autouse=True)
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache dir of the test's own, and no answer kept in the process before or after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calibrate.fp16_small.cache_clear()
    calibrate.i8_wins.cache_clear()
    yield tmp_path / "kvserve" / "calibration.json"
    calibrate.fp16_small.cache_clear()
    calibrate.i8_wins.cache_clear()


def test_fp16_takes_every_step_above_the_last_count_where_it_does_not_win() -> None:
    win, lose, close = (1.0, 0.5), (1.0, 1.0), (1.0, 0.95)
    assert calibrate.small_from({16: win, 32: win, 256: win}) == calibrate.MIN_SMALL
    assert calibrate.small_from({16: lose, 32: win, 256: win}) == 16
    assert calibrate.small_from({16: win, 32: lose, 256: win}) == 32
    assert calibrate.small_from({16: win, 32: win, 256: lose}) is None
    assert calibrate.small_from({16: win, 32: win, 256: close}) is None  # within the margin
    assert calibrate.small_from({4: lose, 32: win}) == calibrate.MIN_SMALL  # never below it


def test_a_shape_is_measured_once_per_cpu_and_kept(fresh: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int, int]] = []

    def measure(n: int, k: int, row_counts: tuple[int, ...],
                large: str = "fp16") -> dict[int, tuple[float, float]]:
        assert large == "fp16"
        timed.extend((n, k, rows) for rows in row_counts)
        return {rows: (1.0, 0.5) if rows > 16 else (1.0, 1.0) for rows in row_counts}

    monkeypatch.setattr(calibrate, "measure", measure)
    assert calibrate.fp16_small(300, 640) == 16
    assert [r for *_, r in timed] == list(calibrate.ROWS)
    calibrate.fp16_small.cache_clear()  # a new process: the file answers
    assert calibrate.fp16_small(300, 640) == 16 and len(timed) == 3
    assert calibrate.fp16_small(640, 300) == 16 and len(timed) == 6  # another shape
    kept = json.loads(fresh.read_text())
    assert len(kept) == 2 and all(k.endswith(("300x640", "640x300")) for k in kept)
    # Another thread count is another machine as far as the timings go.
    threads = torch.get_num_threads() + 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calibrate.fp16_small.cache_clear()
    assert calibrate.fp16_small(300, 640) == 16 and len(timed) == 9
    # A damaged file is measured again, and rewritten whole; so is an answer that is no
    # row count (a hand edit), which would otherwise reach the layers' row comparisons.
    fresh.write_text("{not json")
    calibrate.fp16_small.cache_clear()
    assert calibrate.fp16_small(300, 640) == 16 and len(timed) == 12
    assert len(json.loads(fresh.read_text())) == 1
    fresh.write_text(json.dumps({k: "16" for k in json.loads(fresh.read_text())}))
    calibrate.fp16_small.cache_clear()
    assert calibrate.fp16_small(300, 640) == 16 and len(timed) == 15


def test_a_cache_that_cannot_be_written_costs_only_the_next_measurement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # kvserve/ cannot be made under it
    monkeypatch.setattr(calibrate, "measure",
                        lambda n, k, rows, large: dict.fromkeys(rows, (1.0, 2.0)))
    assert calibrate.fp16_small(300, 640) is None


@pytest.mark.skipif(cpu_kernels() is None or not fbgemm_available(),
                    reason="the two kernels timed need the C kernels and fbgemm")
def test_both_kernels_are_timed_on_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "SAMPLE_S", 0.001)
    for large in ("fp16", "i8"):
        times = calibrate.measure(64, 128, (16, 32), large)
        assert list(times) == [16, 32]
        assert all(0 < q8 < 1 and 0 < other < 1 for q8, other in times.values())


@pytest.mark.parametrize(("i8_time", "wins"), [(0.5, True), (0.95, False)])
def test_the_int8_head_is_measured_once_per_cpu_and_kept(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, i8_time: float, wins: bool) -> None:
    """Int8 blocks serve an LM head on a CPU without VNNI only where they ran its 32-row
    step faster by the margin; the answer is kept apart from fp16's for the same shape."""
    timed: list[tuple[int, int, tuple[int, ...], str]] = []

    def measure(n: int, k: int, rows: tuple[int, ...],
                large: str = "fp16") -> dict[int, tuple[float, float]]:
        timed.append((n, k, rows, large))
        return dict.fromkeys(rows, (1.0, i8_time if large == "i8" else 2.0))

    monkeypatch.setattr(calibrate, "measure", measure)
    assert calibrate.i8_wins() is wins
    assert timed == [(*calibrate.I8_SHAPE, (32,), "i8")]
    calibrate.i8_wins.cache_clear()  # a new process: the file answers
    assert calibrate.i8_wins() is wins and len(timed) == 1
    assert calibrate.fp16_small(*calibrate.I8_SHAPE) is None and len(timed) == 2
    assert len(json.loads(fresh.read_text())) == 2


def test_the_key_names_the_cpu_and_what_held_its_libraries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Zen 5 held to AVX2 and a real AVX2-only EPYC both read "AMD EPYC": family, model
    and stepping tell them apart, and a run whose fbgemm was held keeps its own answers."""
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS", raising=False)  # (CI's AVX2 pass sets it)
    plain = calibrate._key(300, 640)
    assert plain.startswith(calibrate.cpu_id())
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    assert calibrate._key(300, 640) != plain
