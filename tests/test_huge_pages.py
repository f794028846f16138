"""Weights read into 2 MiB pages (ouroboros_local/llama/huge_pages.py): what is advised, that the model
reads and decodes exactly as when mapped, and the switch."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model, huge_pages

LINUX_THP = huge_pages.available()


def private(size: int) -> mmap.mmap:
    """Private anonymous memory, as malloc's (MAP_SHARED memory is shmem: other rules)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def region_of(buffer: mmap.mmap) -> tuple[int, int]:
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return start, start + len(buffer)


def test_only_whole_huge_pages_inside_a_region_are_advised() -> None:
    assert huge_pages.advise(set()) == 0
    assert huge_pages.advise({(0x1000, 0x1000 + huge_pages.HUGE_PAGE)}) == 0   # no whole aligned page in it
    if not LINUX_THP:
        pytest.skip("no transparent huge pages here")
    buffer = private(4 * huge_pages.HUGE_PAGE)   # anonymous: at least 3 aligned huge pages inside
    try:
        start, end = region_of(buffer)
        assert any(a <= start < b for a, b in huge_pages.anonymous_regions())   # /proc/self/maps lists it
        advised = huge_pages.advise({(start, end)})
        assert advised % huge_pages.HUGE_PAGE == 0
        assert 3 * huge_pages.HUGE_PAGE <= advised <= 4 * huge_pages.HUGE_PAGE
    finally:
        buffer.close()


def test_the_first_progress_call_advises_what_was_allocated_since_the_load_began() -> None:
    if not LINUX_THP:
        pytest.skip("no transparent huge pages here")
    older = private(4 * huge_pages.HUGE_PAGE)        # there before the load: left alone
    advice = huge_pages.WeightAdvice(ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p))
    weights = private(4 * huge_pages.HUGE_PAGE)      # what llama.cpp allocates before reading
    try:
        assert advice.callback(0.0, None) is True          # never aborts the load
        assert 3 * huge_pages.HUGE_PAGE <= advice.advised <= 4 * huge_pages.HUGE_PAGE   # not ``older``
        later = private(4 * huge_pages.HUGE_PAGE)
        assert advice.callback(0.5, None) is True and advice.advised <= 4 * huge_pages.HUGE_PAGE   # once
        later.close()
    finally:
        older.close()
        weights.close()


def test_only_the_new_part_of_a_merged_region_is_new() -> None:
    before = {(100, 200), (300, 400)}
    assert huge_pages.new_parts({(100, 250), (300, 400), (500, 600)}, before) == [(200, 250), (500, 600)]
    assert huge_pages.new_parts({(50, 450)}, before) == [(50, 100), (200, 300), (400, 450)]
    assert huge_pages.new_parts(before, before) == []


def test_a_model_too_large_for_the_available_memory_is_mapped(monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.setattr(huge_pages, "memory_available", lambda: 10 * 2**30)
    assert huge_pages.worth_it(4 * 2**30)
    assert not huge_pages.worth_it(6 * 2**30)
    monkeypatch.setattr(huge_pages, "memory_available", lambda: None)
    assert not huge_pages.worth_it(1)


def test_a_model_read_into_huge_pages_decodes_as_the_mapped_one(tiny_target) -> None:
    mapped = Model(tiny_target)
    read = Model(tiny_target, huge_pages=True)
    assert mapped.huge_page_bytes == 0    # a tiny model's buffers hold no whole huge page: 0 either way
    config = EngineConfig(n_ctx=256, n_batch=32, n_seq_max=4, threads=1, calibration="off", learned=False)
    outputs = []
    for model in (mapped, read):
        engine = Engine(model, None, config)
        result = engine.generate("abc abd abc", max_tokens=24, method="vanilla")
        rows = engine.target_ctx.logits(1).copy()
        outputs.append((result.tokens, rows))
        engine.close()
    assert outputs[0][0] == outputs[1][0]
    np.testing.assert_array_equal(outputs[0][1], outputs[1][1])


@pytest.mark.slow
def test_smollm2_weights_go_into_huge_pages_and_the_switch_turns_it_off() -> None:
    if not LINUX_THP:
        pytest.skip("no transparent huge pages here")
    engine = Engine.load("smollm2-135m-instruct", progress=False, learned=False, calibration="off")
    assert engine.target.huge_page_bytes >= 64 * 2**20       # ~90 MiB of weights
    assert engine.calibration_settings()["huge_pages"] is True
    text = engine.generate("The capital of France is", max_tokens=16, method="vanilla").text
    engine.close()
    engine = Engine.load("smollm2-135m-instruct", progress=False, learned=False, calibration="off",
                         huge_pages=False)
    assert engine.target.huge_page_bytes == 0 and engine.calibration_settings()["huge_pages"] is False
    assert engine.generate("The capital of France is", max_tokens=16, method="vanilla").text == text
    engine.close()
