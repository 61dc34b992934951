"""Layout choice: values computed through pooling windows and crops keep their input's dim
order, as eager's results do (a max pool of channels-last activations is channels-last)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import Op

CHANNELS_LAST = torch.channels_last
CONTIGUOUS = torch.contiguous_format


def _relu_max_pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(torch.relu(x), 3, 2, 1)


def _avg_pool(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x * 2.0, 2)


def _crop(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, 1:-1, 2:].sigmoid()


@pytest.mark.parametrize("fn", [_relu_max_pool, _avg_pool, _crop])
@pytest.mark.parametrize("memory_format", [CHANNELS_LAST, CONTIGUOUS])
def test_windows_and_crops_keep_the_input_dim_order(
    fn: Callable[[torch.Tensor], torch.Tensor], memory_format: torch.memory_format
) -> None:
    kiln.counters.reset()
    compiled = kiln.compile(fn)
    for size in (16, 16, 11):
        x = torch.randn(2, 8, size, size).to(memory_format=memory_format).requires_grad_()
        want = fn(x)
        grad = torch.randn_like(want)
        (want_grad,) = torch.autograd.grad(want, x, grad)
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got, x, grad)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
        assert got.is_contiguous(memory_format=memory_format)
        assert got.stride() == want.stride()
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks


def test_a_convolution_operand_is_channels_last_beside_a_contiguous_store() -> None:
    # The kernel storing the residual stream (contiguous, like the input it is computed from)
    # also stores the convolution's operand: that one is still channels-last, cuDNN's fast
    # layout (an NCHW depthwise convolution is PyTorch's generic kernel on the GPU).
    from kiln.ir import Op
    from kiln.schedule.program import ExternCall
    from tests.schedule.test_fusion import scheduled

    def block(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stream = x + a
        return stream, F.conv2d(stream * 2.0, w, padding=1, groups=8)

    x, a, w = torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6), torch.randn(8, 1, 3, 3)
    program = scheduled(block, x, a, w)
    (convolution,) = [
        s for s in program.steps if isinstance(s, ExternCall) and s.node.op is Op.CONVOLUTION
    ]
    operand = convolution.operands[0]
    assert operand.strides == (288, 1, 48, 8), operand
    stream = program.outputs[0]
    assert stream.strides == (288, 36, 6, 1)
    assert kiln.compile(block)(x, a, w)[1].allclose(block(x, a, w)[1], atol=1e-5)


class _RepeatedKeyAttention(torch.nn.Module):
    """Llama-style attention: a rotary embedding on q and k, k and v repeated to q's heads (as
    transformers does when a mask is given), a float mask."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, size: int = 16) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.size = heads, kv_heads, size
        self.q = torch.nn.Linear(64, heads * size, bias=False)
        self.k = torch.nn.Linear(64, kv_heads * size, bias=False)
        self.v = torch.nn.Linear(64, kv_heads * size, bias=False)
        self.o = torch.nn.Linear(heads * size, 64, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [B, 1, L, E]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        def repeat(t: torch.Tensor) -> torch.Tensor:
            t = t[:, :, None].expand(b, self.kv_heads, self.heads // self.kv_heads, length, -1)
            return t.reshape(b, self.heads, length, self.size)

        q = rotate(self.q(x).view(b, length, self.heads, self.size).transpose(1, 2))
        k = rotate(self.k(x).view(b, length, self.kv_heads, self.size).transpose(1, 2))
        v = self.v(x).view(b, length, self.kv_heads, self.size).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, length, -1))


def test_a_recomputed_query_keeps_its_forward_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward recomputes q (its rotary embedding) in the kernel that repeats k, which
    walks [B, H, L, E]; q keeps the [B, L, H, E] order of its projection, as in the forward,
    so the attention kernel's backward reads q laid out as the output it saved (on CUDA,
    cuDNN's backward otherwise copies the output and its gradient: ``ops/attention.py``).
    Every parameter's gradient matches eager's."""
    from torch._subclasses.fake_tensor import is_fake

    seen: dict[str, list[tuple[int, ...]]] = {"forward": [], "backward": []}
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def seen_forward(q: torch.Tensor, *rest: object, **kw: object) -> object:
        if not is_fake(q):
            seen["forward"].append(tuple(q.stride()))
        return forward(q, *rest, **kw)

    def seen_backward(grad: torch.Tensor, q: torch.Tensor, *rest: object, **kw: object) -> object:
        if not is_fake(q):
            seen["backward"].append(tuple(q.stride()))
        return backward(grad, q, *rest, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", seen_forward)
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", seen_backward
    )
    torch.manual_seed(0)
    model = _RepeatedKeyAttention()
    compiled = kiln.compile(model)
    kiln.counters.reset()
    for _ in range(2):  # fresh values each call
        x = torch.randn(2, 32, 64)
        angles = torch.rand(2, 32, 16) * 6
        mask = torch.randn(2, 1, 32, 32)
        grads = []
        for run in (model, compiled):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run(x, angles, mask).float().square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert seen["forward"] and seen["backward"], seen  # (the kernel's own backward ran)
    # (eager's q: the projection viewed as heads, [B, L, H, E] in memory)
    eager_q = model.q(x).view(2, 32, model.heads, model.size).transpose(1, 2)
    assert set(seen["backward"]) == set(seen["forward"]) == {eager_q.stride()}, seen
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks


def _conv_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(F.conv2d(x, w, padding=1))


def _conv_only(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(torch.relu(x), w, padding=1)  # (the result is the extern's own)


def _transposed_double(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 3) * 2


def _cat_with_transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.sigmoid(), x.transpose(2, 3).exp()], 1)


def _view_of_result(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1).permute(0, 2, 3, 1)[:, 1:]


@pytest.mark.parametrize(
    "fn", [_conv_relu, _conv_only, _transposed_double, _cat_with_transposed, _view_of_result]
)
@pytest.mark.parametrize("memory_format", [CHANNELS_LAST, CONTIGUOUS])
@pytest.mark.parametrize("training", [False, True])
def test_results_come_back_with_eager_strides(
    fn: Callable[..., torch.Tensor], memory_format: torch.memory_format, training: bool
) -> None:
    # Kiln lays values out for its kernels (channels-last around convolutions); a result the
    # caller receives has eager's strides all the same, so ``out.view(...)`` works as in eager.
    kiln.counters.reset()
    compiled = kiln.compile(fn)
    w = torch.randn(6, 8, 3, 3, requires_grad=training)
    for size in (8, 8, 7):
        x = torch.randn(2, 8, size, size).to(memory_format=memory_format)
        with torch.set_grad_enabled(training):
            got, want = compiled(x, w), fn(x, w)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if fn is _view_of_result:  # (eager's is a slice of a view: a copy has its dim order)
            order = sorted(range(4), key=lambda d: -got.stride(d))
            assert order == sorted(range(4), key=lambda d: -want.stride(d)), got.stride()
        else:
            assert got.stride() == want.stride(), (got.stride(), want.stride())
        if want.requires_grad:
            (got_grad,) = torch.autograd.grad(got.sum(), w)
            (want_grad,) = torch.autograd.grad(want.sum(), w)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks


def test_a_stored_factor_broadcast_does_not_set_the_walk_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BatchNorm then ReLU over channels-last input, scheduled as on the GPU (statistics in
    chunks, the per-channel scale and shift stored): the ReLU's kernel walks the input in its
    memory order. It had taken its order from the first value in memory it met, the stored
    scale broadcast, and read channels-last data across its channels (1.09 ms against 0.21 on
    an H200 at 64x64x112x112)."""
    from kiln.passes import reduction_split
    from kiln.schedule import inlining
    from kiln.schedule.index import Var
    from kiln.schedule.loops import Apply, Load, walk
    from tests.schedule.test_fusion import scheduled

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    monkeypatch.setattr(reduction_split, "MIN_ELEMENTS", 1 << 10)
    monkeypatch.setattr(inlining, "BROADCAST_STORE_COST", (2, 2))
    weight, bias = torch.rand(8) + 0.5, torch.randn(8)

    def bn_relu(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.batch_norm(x, None, None, weight, bias, training=True))

    x = torch.randn(8, 8, 16, 16).to(memory_format=CHANNELS_LAST)
    program = scheduled(bn_relu, x)
    (flat,) = [k for k in program.kernels() if k.rnumel == 1 and k.xnumel == x.numel()]
    exprs = list(walk([s.value for s in flat.stores]))
    assert not any(isinstance(e, Apply) and e.op is Op.RSQRT for e in exprs)  # (stored)
    loads = [e for e in exprs if isinstance(e, Load) and e.buffer.numel == x.numel()]
    assert loads and all(len(e.offset.terms) == 1 and not e.offset.const for e in loads)
    assert all(isinstance(a, Var) and c == 1 for e in loads for a, c in e.offset.terms)
    compiled = kiln.compile(bn_relu)
    for _ in range(2):
        x = torch.randn(8, 8, 16, 16).to(memory_format=CHANNELS_LAST)
        got, want = compiled(x), bn_relu(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.stride() == want.stride()


def test_a_per_channel_input_broadcast_does_not_set_the_walk_order() -> None:
    """``relu((x - m) * s + b)`` over channels-last ``x`` with per-channel graph inputs ``m``,
    ``s`` and ``b`` (a centred BatchNorm's form): the kernel walks ``x`` in its memory order.
    The bias, broadcast over every dim but the channels, had ended the order search with no
    order, so the kernel walked NCHW and read and wrote channels-last data across its
    channels. A bias dense in the trailing dims (a LayerNorm's) still leaves the result
    contiguous."""
    from kiln.schedule.index import Var
    from kiln.schedule.loops import Load, walk
    from tests.schedule.test_fusion import scheduled

    m, s, b = torch.randn(8), torch.rand(8) + 0.5, torch.randn(8)

    def centred(x: torch.Tensor) -> torch.Tensor:
        per_channel = [v[:, None, None] for v in (m, s, b)]
        return torch.relu((x - per_channel[0]) * per_channel[1] + per_channel[2])

    x = torch.randn(4, 8, 6, 6).to(memory_format=CHANNELS_LAST)
    (kernel,) = scheduled(centred, x).kernels()
    loads = [e for e in walk([s.value for s in kernel.stores]) if isinstance(e, Load)]
    full = [e.offset for e in loads if e.buffer.numel == x.numel()]
    offsets = [*full, *(store.offset for store in kernel.stores)]
    assert full and all(len(o.terms) == 1 and not o.const for o in offsets), offsets
    assert all(isinstance(a, Var) and c == 1 for o in offsets for a, c in o.terms), offsets
    got, want = kiln.compile(centred)(x), centred(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()

    w, c = torch.rand(8) + 0.5, torch.randn(8)

    def layer_norm_like(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1) * w + c  # (a sequence-first stream, a trailing bias)

    t = torch.randn(5, 3, 8)
    (kernel,) = scheduled(layer_norm_like, t).kernels()
    (store,) = kernel.stores
    assert store.buffer.strides == (40, 8, 1)  # (contiguous; the stream's order: 8, 24, 1)
