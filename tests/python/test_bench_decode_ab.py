"""bench/decode_ab.py: the decode step's A/B of the settings that stay off until measured. Its arithmetic and
arguments on the CPU; the whole bench on a tiny Llama on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from stitchcuda.bench import decode_ab


def test_each_variant_turns_its_settings_on_and_every_other_off():
    assert decode_ab.variant_settings("off") == {"fuse_cache_write": False, "merge_launches": False, "gemv": False}
    assert decode_ab.variant_settings("gemv") == {"fuse_cache_write": False, "merge_launches": False, "gemv": True}
    assert all(decode_ab.variant_settings("all").values())


def test_rows_give_the_off_steps_time_over_each_variants_and_tokens_per_second():
    times = {"off": [2.0, 2.2, 2.1], "gemv": [1.6, 1.5, 1.5], "all": [1.05, 1.0, 1.1]}
    identity = {"off": {"identical": 8, "compared": 8, "first_difference": None},
                "gemv": {"identical": 6, "compared": 8, "first_difference": 3}}
    rows = {r["variant"]: r for r in decode_ab.summarize(8, times, {"off": 120, "gemv": 100, "all": 70}, identity,
                                                          {"off": "optimized", "gemv": "optimized"})}
    assert rows["off"]["off_over"] == 1.0 and rows["off"]["tokens_s"] == pytest.approx(8000 / 2.1, abs=0.1)
    assert rows["gemv"]["off_over"] == pytest.approx(2.1 / 1.5, abs=1e-3) and rows["gemv"]["launches"] == 100
    assert rows["gemv"]["tokens_first_difference"] == 3 and rows["gemv"]["tokens_identical"] == 6
    assert rows["all"]["off_over"] == pytest.approx(2.0, abs=1e-3) and rows["all"]["status"] is None
    # without the baseline there is no ratio to give
    assert decode_ab.summarize(1, {"all": [1.0]}, {}, {}, {})[0]["off_over"] is None


def test_the_launches_counted_are_kernels_matmuls_and_aten_steps_but_views():
    class Program:
        steps = [{"kind": "kernel"}, {"kind": "matmul"}, {"kind": "aten", "op": "aten::index_copy_"},
                 {"kind": "aten", "op": "aten::view"}, {"kind": "view"}]
    assert decode_ab.launches(Program()) == 3


@pytest.mark.parametrize("argv, message", [(["--only", "gemv,fast"], "unknown variant"),
                                           (["--batches", "0"], "positive integers"),
                                           (["--batches", "a"], "positive integers")])
def test_bad_arguments_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode_ab.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_says_so_and_measures_nothing(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run")
    assert decode_ab.main(["--small"]) == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_bench_times_every_variant_in_one_run(capsys):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("transformers")
    assert decode_ab.main(["--small", "--batches", "1", "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == set(decode_ab.VARIANTS)
    assert all(r["status"] == "optimized" and r["decode_ms"] > 0 for r in rows.values())
    assert rows["all"]["launches"] < rows["off"]["launches"]
    assert rows["off"]["tokens_first_difference"] is None
