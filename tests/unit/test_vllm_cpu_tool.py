"""`make vllm-cpu` (tools/vllm_cpu.py) without its build: its text patches, its stage
marks, and its one-line failure naming the stage, run as a process on the system Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.vllm_cpu import SOURCE_PATCHES, TORCH_CUDA_STUB, StageError, TextPatch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "vllm_cpu.py"


def patch_of(what: str) -> TextPatch:
    (patch,) = [p for _, p in SOURCE_PATCHES if p.what.startswith(what)]
    return patch


def test_a_patch_applies_once_and_a_changed_text_is_one_line(tmp_path):
    cmake = tmp_path / "cpu_extension.cmake"
    check = "if (CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3)\n  set(AVX512_BF16 ON)\n"
    cmake.write_text(check)
    lower = patch_of("g++ 12.3 check")
    lower.apply(cmake)
    assert cmake.read_text() == check.replace("12.3", "12.2")
    lower.apply(cmake)  # a second run leaves it as it is
    assert cmake.read_text() == check.replace("12.3", "12.2")
    cmake.write_text("if (CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 13.1)\n")
    with pytest.raises(StageError, match=r"^patch: cpu_extension\.cmake has no g\+\+ 12\.3 "
                                         r"check to lower \(its text changed\)$"):
        lower.apply(cmake)


def test_the_mla_constant_is_made_static_where_it_is_local(tmp_path):
    source = tmp_path / "flash_mla.cpp"
    body = "  using Vec = int;\n  constexpr int64_t kBLOCK_H_MAX = 16;\n  auto f = [&] {};\n"
    source.write_text(body * 2)
    patch_of("kBLOCK_H_MAX").apply(source)
    assert source.read_text() == body.replace("  constexpr", "  static constexpr") * 2


def test_torchs_cuda_include_becomes_an_empty_target(tmp_path):
    config = tmp_path / "Caffe2Config.cmake"
    config.write_text('if(@USE_CUDA@)\n  include("${CMAKE_CURRENT_LIST_DIR}/public/cuda.cmake")\n'
                      "endif()\n")
    TORCH_CUDA_STUB.apply(config)
    TORCH_CUDA_STUB.apply(config)
    text = config.read_text()
    assert "public/cuda.cmake" not in text and text.count("add_library(torch::cudart") == 1


def test_stages_marked_done_are_skipped_and_a_failure_is_one_line_naming_its_stage(tmp_path):
    for stage in ("system", "venv", "source", "onednn", "patch", "build", "install"):
        (tmp_path / f".{stage}.done").touch()
    out = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True,
                         env={**os.environ, "TIDERL_VLLM_CPU": str(tmp_path)}, timeout=60)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"vllm-cpu: {stage}: done before" for stage in
        ("system", "venv", "source", "onednn", "patch", "build", "install")] + [
        "vllm-cpu: check ..."]
    (line,) = out.stderr.splitlines()  # the check runs every time: no virtual environment here
    assert line.startswith("vllm-cpu: check: ") and "Traceback" not in out.stderr
    where = subprocess.run([sys.executable, str(TOOL), "--where"], capture_output=True,
                           text=True, env={**os.environ, "TIDERL_VLLM_CPU": str(tmp_path)},
                           timeout=60)
    assert where.stdout.strip() == str(tmp_path)


def test_the_runners_ops_join_both_x86_source_lists(tmp_path):
    cmake = tmp_path / "cpu_extension.cmake"
    lists = ('set(VLLM_EXT_SRC_{}\n        "csrc/cpu/utils.cpp"\n'
             '        "csrc/cpu/spec_decode_utils.cpp")\n')
    cmake.write_text(lists.format("AVX512") + lists.format("AVX2"))
    patch_of("x86 source list").apply(cmake)
    text = cmake.read_text()
    assert text.count('"csrc/cpu/block_table.cpp"') == 2
    assert text.count('"csrc/cpu/input_batch.cpp"') == 2
    patch_of("x86 source list").apply(cmake)
    assert cmake.read_text() == text
