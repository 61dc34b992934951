"""The per-kernel roofline's pieces on the CPU: bytes of a kernel's buffers, the Triton name a
profiler shows, FLOPs of extern calls from recorded shapes, the table, and explain's
``profile=True`` (per-kernel times need CUDA; on the CPU it says so)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.backends import roofline
from kiln.backends.roofline import KernelTime, extern_flops, function_name, kernel_bytes

pytest.importorskip("triton")
from kiln.codegen.triton import generate_triton
from tests.codegen.triton_kernels import _softmax_kernel


def test_kernel_bytes_count_every_buffer_once() -> None:
    kernel = _softmax_kernel(8, 100, torch.float16)
    # one fp16 input of 8x100 read, one fp16 output of 8x100 written
    assert kernel_bytes(kernel) == 2 * 8 * 100 * 2


def test_function_name_is_the_triton_function_name() -> None:
    kernel = _softmax_kernel(8, 100, torch.float32)
    for name in ("k3_softmax", "3_div", "k7.sum-exp"):
        kernel.name = name
        assert function_name(name) == generate_triton(kernel, interpret=True).name


def test_extern_flops() -> None:
    assert extern_flops("aten::mm", [[64, 32], [32, 16]], []) == 2 * 64 * 32 * 16
    assert extern_flops("aten::addmm", [[16], [64, 32], [32, 16]], []) == 2 * 64 * 32 * 16
    assert extern_flops("aten::bmm", [[4, 64, 32], [4, 32, 16]], []) == 2 * 4 * 64 * 32 * 16
    # cudnn_convolution(input, weight, padding, stride, dilation, groups, ...)
    conv = extern_flops("aten::cudnn_convolution", [[2, 8, 16, 16], [4, 8, 3, 3]], [
        [], [], [1, 1], [2, 2], [1, 1], 1
    ])  # fmt: skip
    assert conv == 2 * 2 * 4 * (8 * 8) * (8 * 3 * 3)
    # convolution(input, weight, bias, stride, padding, dilation, ...)
    same = extern_flops("aten::convolution", [[2, 8, 16, 16], [4, 8, 3, 3], [4]], [
        [], [], [], [2, 2], [1, 1], [1, 1]
    ])  # fmt: skip
    assert same == conv
    assert extern_flops("aten::cudnn_convolution", [[2, 8, 16, 16], [4, 8, 3, 3]], []) is None
    # flash attention: q (batch, length, heads, dim), k (batch, keys, heads, dim)
    q, k = [2, 128, 4, 64], [2, 256, 4, 64]
    assert (
        extern_flops("aten::_flash_attention_forward", [q, k, k], []) == 4 * 2 * 4 * 128 * 256 * 64
    )
    assert extern_flops("aten::add", [[3], [3]], []) is None


def test_report_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda device: 1e12)  # 1 TB/s
    monkeypatch.setattr(roofline, "matmul_flops", lambda device, dtype: 1e15)
    times = [
        KernelTime("k1_add", calls=1, microseconds=10.0, bytes=5_000_000),
        KernelTime("sm90_gemm", calls=2, microseconds=20.0, flops=5e9),
        KernelTime("memcpy", calls=1, microseconds=1.0),
    ]
    lines = roofline.report(times, torch.device("cuda"))
    assert "3, 31.0 us" in lines[0]
    assert "5.0 MB" in lines[2] and "50% of copy" in lines[2]  # 5 MB in 10 us = 0.5 TB/s
    assert "50% of matmul" in lines[3]  # 5 GFLOP in 10 us a call = 0.5 PFLOP/s
    assert lines[4].split()[0] == "memcpy" and "%" not in lines[4]


def test_explain_profile_on_the_cpu_says_cuda_only() -> None:
    x = torch.randn(16, 16)
    report = kiln.explain(lambda t: (t.sin() + 1).sum(dim=1), x, profile=True)
    assert report.graph_count == 1
    assert report.profile == [
        "per-kernel times are measured on CUDA devices only (this call ran on the CPU)"
    ]
    assert "profile:" in str(report)
    assert kiln.explain(lambda t: t.sin(), x).profile == []
