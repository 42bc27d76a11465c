"""tools/profile_train.py: kernel categories, interval arithmetic, segments per recipe, and a CPU run (no GPU plane)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import profile_train as pt  # noqa: E402

MS = 1_000_000  # ns


def test_categories_of_kernel_names():
    assert pt.category("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT") == "gemm"
    assert pt.category("gemm_fusion_dot_general_19") == "gemm"
    assert pt.category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert pt.category("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert pt.category("void jax_fp4::quantize::QuantizeKernel<__nv_bfloat16, 2, 2, false, true>") == "jax_fp4 kernel"
    assert pt.category("MemcpyD2D") == "memcpy/memset"
    assert pt.category("loop_add_fusion_4") == "xla fusion/other"


def test_union_and_overlap():
    assert pt.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [[0, 3], [5, 8]]
    assert pt.overlap([[0, 3], [5, 8]], [[2, 6]]) == 2
    assert pt.overlap([[0, 1]], [[1, 2]]) == 0


def test_segments_and_per_execution_summary():
    """Two recipes' runs 2 s apart; in each execution a 10 ms GEMM, then a 4 ms collective that overlaps a 2 ms
    fusion: 2 ms of it exposed."""
    kernels = []
    for base in (0, 3000 * MS):  # the second recipe starts after a 2.9 s compile gap
        for i in range(4):
            t = base + i * 20 * MS
            kernels += [(t, t + 10 * MS, "nvjet_gemm", "jit_train"),
                        (t + 10 * MS, t + 14 * MS, "ncclDevKernel_AllGather", "jit_train"),
                        (t + 10 * MS, t + 12 * MS, "loop_add_fusion", "jit_train")]
    kernels.append((9000 * MS, 9001 * MS, "MemcpyD2H", "jit_other"))  # a later segment without the step
    segs = pt.segments(kernels)
    assert [len(s) for s in segs] == [12, 12, 1]
    s = pt.summarize(segs[0], executions=4)
    assert s["kernel_ms"]["gemm"] == pytest.approx(10) and s["kernel_ms"]["nccl"] == pytest.approx(4)
    assert s["kernel_ms"]["xla fusion/other"] == pytest.approx(2)
    assert s["busy_ms"] == pytest.approx(12) and s["nccl_exposed_ms"] == pytest.approx(2)
    assert s["span_ms"] == pytest.approx(74 / 4)
    assert s["top_kernels"][0] == {"category": "gemm", "kernel": "nvjet_gemm", "ms": pytest.approx(10)}


def test_executions_follow_train_lm_arguments():
    assert pt.executions_of(["--preset", "tiny", "--steps", "16", "--eval-every", "16", "--eval-batches", "1"]) == 17
    # tiny: 80 steps, evaluations of 4 batches at 20, 40, 60, 80
    assert pt.executions_of(["--preset", "tiny"]) == 80 + 4 * 4
    assert pt.executions_of(["--preset", "tiny", "--steps", "30"]) == 30 + 4 * 2  # at 20 and at the end
    # small: 8 batches at step 250, the last evaluation over 2^20 tokens (128 batches of 32 x 256)
    assert pt.executions_of(["--preset", "small", "--steps", "500"]) == 500 + 8 + 128


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        pt.main([])
    with pytest.raises(SystemExit):
        pt.main(["--trace", "x.xplane.pb"])  # how many executions?


@pytest.mark.slow  # trains two tiny steps under the profiler
def test_cpu_run_has_no_gpu_plane(tmp_path, capsys):
    out = tmp_path / "profile.json"
    res = pt.main(["--out", str(out), "--", "--preset", "tiny", "--recipes", "bf16", "--steps", "2",
                   "--no-progress", "--out", str(tmp_path / "run")])
    assert res["gpu_plane"] is False and res["segments"] == []
    assert json.loads(out.read_text())["segments"] == []
    assert "no GPU kernels" in capsys.readouterr().out
