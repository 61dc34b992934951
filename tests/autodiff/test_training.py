"""Training through compiled graphs: the forward/backward pair inside eager autograd."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SmallResNet, tiny_bert_config, tiny_gpt2_config

import kiln
from kiln.autodiff.runtime import TrainingGraph
from kiln.capture.driver.convert import GraphRunner
from kiln.ir import Op
from kiln.ir.graph import Graph
from kiln.ir.op import Tag, op_def


def _training_graph(compiled: Any) -> TrainingGraph:
    """The TrainingGraph behind a compiled function's newest cache entry."""
    head = compiled._kiln_cache.entries[0].head
    runners = [v for v in head.__globals__.values() if isinstance(v, GraphRunner)]
    assert runners, "no graph in the entry"
    graph = runners[0].compiled
    assert isinstance(graph, TrainingGraph), f"ran {type(graph).__name__}, not a TrainingGraph"
    return graph


def _grads(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    fn(*leaves).sum().backward()
    return [t.grad for t in leaves if t.requires_grad]


def test_linear_gelu_gradients_and_minimal_saved_set() -> None:
    def layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ w + b)

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    compiled = kiln.compile(layer, options={"strict": True})
    for got, want in zip(_grads(compiled, x, w, b), _grads(layer, x, w, b), strict=True):
        torch.testing.assert_close(got, want)
    graph = _training_graph(compiled)
    saved = graph.saved_names
    inputs = {v.name for v in graph.plan.forward.inputs}
    computed = [name for name in saved if name not in inputs]
    # Only the matmul's output is kept: the bias add and gelu's chain are recomputed.
    assert len(computed) == 1, saved
    producer = next(n for n in graph.plan.forward.nodes if n.outputs[0].name == computed[0])
    assert producer.op.name in ("MM", "ADDMM"), producer.op


def _stem_backward(stem: Callable[..., torch.Tensor]) -> Graph:
    """``stem(x, w, v)`` compiled: its gradients checked against eager's on two fresh inputs
    (2x3x13x11, a 3x3 convolution of 4 channels, a 1x1 one of 5); its backward graph."""
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    v = torch.randn(5, 4, 1, 1, requires_grad=True)
    compiled = kiln.compile(stem, options={"strict": True})
    for _ in range(2):
        x = torch.randn(2, 3, 13, 11)
        for got, want in zip(_grads(compiled, x, w, v), _grads(stem, x, w, v), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return _training_graph(compiled).plan.backward


@pytest.mark.parametrize("padding", [0, 1])
def test_max_pool_saves_window_positions_and_never_recomputes_its_comparisons(
    padding: int,
) -> None:
    """A differentiated max pool keeps each window's winning position: the partitioner saves
    those positions (int32, one per output) and the pooled result, and the backward compares
    no values (before, it recomputed the BatchNorm, ReLU and the window's comparisons from the
    convolution output: ResNet's stem took 9 of a CPU step's 17 ms of kernels)."""

    def stem(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = F.relu(F.batch_norm(F.conv2d(x, w), None, None, training=True))
        return F.conv2d(F.max_pool2d(y, 3, 2, padding), v)

    backward = _stem_backward(stem)
    pooled = (2, 4, 5 + padding, 4 + padding)
    saved = {value.name: value.type for value in backward.inputs}
    positions = [t for t in saved.values() if t.dtype == torch.int32]
    assert [tuple(t.shape) for t in positions] == [pooled], saved
    assert any(t.dtype == torch.float32 and tuple(t.shape) == pooled for t in saved.values())
    compares = {Op.GT, Op.ISNAN}
    assert not [n for n in backward.nodes if n.op in compares], backward


def test_a_frozen_batch_norm_max_pool_saves_its_whole_pooled_value() -> None:
    """A fine-tuned stem over a frozen BatchNorm (centred when differentiated): the pooled
    value is a sum over window positions, ``partial + where(position == 8, x8, 0)``. The
    partitioner's window rule saved the partial sum, so the forward stored a second
    pooled-size tensor and the backward sliced the convolution output again for the last
    terms. It saves the pooled value whole, and the backward reads no window."""
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    scale, shift = torch.rand(4, requires_grad=True), torch.randn(4, requires_grad=True)

    def stem(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = F.relu(F.batch_norm(F.conv2d(x, w), mean, var, scale, shift, training=False))
        return F.conv2d(F.max_pool2d(y, 3, 2, 1), v)

    backward = _stem_backward(stem)
    pooled = [v for v in backward.inputs if tuple(v.type.shape) == (2, 4, 6, 5)]
    assert sorted(str(v.type.dtype) for v in pooled) == ["torch.float32", "torch.int32"]
    assert not [n for n in backward.nodes if n.op is Op.SLICE], backward


def test_a_tensor_leaked_from_a_finished_transform_trains_as_in_eager() -> None:
    """A training graph runs through autograd's C++ apply (not Function.apply's Python pass
    over every argument): a functorch wrapper that outlived its ``torch.func.grad`` still
    gives eager's output and the weight's gradient."""
    leaked: list[torch.Tensor] = []

    def keep(x: torch.Tensor) -> torch.Tensor:
        leaked.append(x)
        return x.sum()

    torch.func.grad(keep)(torch.randn(4, 3))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    layer = torch.nn.Linear(3, 2)
    reference = copy.deepcopy(layer)
    compiled = kiln.compile(layer)
    out = compiled(leaked[0])
    expected = reference(leaked[0])
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_gradient_accumulation_retain_graph_and_no_grad() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * w) * w

    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    compiled = kiln.compile(fn, options={"strict": True})
    out = compiled(x, w)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    got = w.grad.clone()
    w.grad = None
    expected_out = fn(x, w)
    expected_out.sum().backward(retain_graph=True)
    expected_out.sum().backward()
    torch.testing.assert_close(got, w.grad)
    with torch.no_grad():
        frozen = compiled(x, w)
    assert not frozen.requires_grad
    torch.testing.assert_close(frozen, expected_out.detach())


def test_eager_code_after_the_compiled_region_and_multiple_outputs() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        y = x.exp()
        return y * 2, y.detach() + 1, 3, (x > 0)

    x = torch.randn(4, requires_grad=True)
    a, b, n, mask = kiln.compile(fn, options={"strict": True})(x)
    assert n == 3 and not b.requires_grad and mask.dtype == torch.bool
    (a.sin().sum() + b.sum()).backward()  # eager ops after the compiled graph
    torch.testing.assert_close(x.grad, (2 * x.exp()).cos() * 2 * x.exp())


def test_double_backward_matches_eager() -> None:
    """create_graph=True (a gradient penalty, a Hessian-vector product) differentiates the
    gradient itself: the forward is re-run under eager autograd for it."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.sin() * w).square().sum()

    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    mine = [t.detach().clone().requires_grad_() for t in (x, w)]
    grads = [
        torch.autograd.grad(f(*args), args[0], create_graph=True)[0]
        for f, args in ((fn, (x, w)), (kiln.compile(fn, options={"strict": True}), mine))
    ]
    torch.testing.assert_close(grads[1], grads[0])
    penalties = [(g.norm() - 1) ** 2 for g in grads]
    penalties[0].backward()
    penalties[1].backward()
    for got, want in zip(mine, (x, w), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_double_backward_through_random_numbers_is_a_clear_error() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * x, p=0.5, training=True)

    x = torch.randn(3, requires_grad=True)
    out = kiln.compile(fn, options={"strict": True})(x)
    with pytest.raises(RuntimeError, match=r"double backward.*random numbers"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("codegen", ["", "triton"])  # C++ (seed as an int); Triton (a tensor)
def test_dropout_mask_is_shared_by_forward_and_backward(codegen: str) -> None:
    if codegen:
        pytest.importorskip("triton")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=0.5, training=True)

    x = torch.randn(1000, requires_grad=True)
    compiled = kiln.compile(fn, options={"strict": True, "codegen": codegen})
    torch.manual_seed(7)
    out = compiled(x)
    out.sum().backward()
    kept = out != 0
    torch.testing.assert_close(x.grad, kept.float() * 2.0)  # the same mask, scaled by 1/(1-p)
    assert 350 < int(kept.sum()) < 650
    torch.manual_seed(7)
    torch.testing.assert_close(compiled(x), out)  # reproducible under torch.manual_seed


def test_autocast_dtypes_and_fp32_master_gradients() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).relu()

    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    out = kiln.compile(fn, options={"strict": True})(x, w)
    expected = fn(x, w.detach().requires_grad_())
    assert out.dtype == expected.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def _tiny_bert() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.BertForMaskedLM(tiny_bert_config())


def _tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(tiny_gpt2_config())


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    output = model(batch)
    if isinstance(output, torch.Tensor):
        return output.square().mean()
    return output.logits.float().log_softmax(-1).mean()


@pytest.mark.parametrize(
    ("build", "make_batch"),
    [
        (SmallResNet, lambda: torch.randn(4, 3, 8, 8)),
        (_tiny_bert, lambda: torch.randint(0, 99, (2, 8))),
        (_tiny_gpt2, lambda: torch.randint(0, 99, (2, 8))),
    ],
    ids=["cnn_batchnorm", "tiny_bert", "tiny_gpt2"],
)
def test_ten_optimizer_steps_match_eager(build: Any, make_batch: Any) -> None:
    kiln.reset()  # the fallback count below is this test's own
    torch.manual_seed(0)
    eager = build().train()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine, options={"strict": True})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, mine)]
    for _ in range(10):
        batch = make_batch()
        losses = []
        for runner, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = _loss(runner, batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(eager.named_buffers(), mine.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert not kiln.counters.fallbacks
    _training_graph(compiled._kiln_call)  # the compiled pair ran, not eager autograd


def test_training_with_dropout_is_statistically_eager() -> None:
    """With dropout on, compiled and eager draw different masks; what must agree is the
    distribution: the drop rate, and the mean output and mean gradient over many draws."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 4)
    ).train()
    twin = copy.deepcopy(model)
    compiled = kiln.compile(model, options={"strict": True})
    x = torch.randn(32, 16)
    draws = 300
    means = []
    for runner, module in ((compiled, model), (twin, twin)):
        output_sum = torch.zeros(32, 4)
        grad_sum = torch.zeros_like(module[0].weight)
        for _ in range(draws):
            module.zero_grad()
            out = runner(x)
            out.square().mean().backward()
            output_sum += out.detach()
            grad_sum += module[0].weight.grad
        means.append((output_sum / draws, grad_sum / draws))
    _training_graph(compiled._kiln_call)
    (out_kiln, grad_kiln), (out_eager, grad_eager) = means
    assert (out_kiln - out_eager).norm() / out_eager.norm() < 0.1
    assert (grad_kiln - grad_eager).norm() / grad_eager.norm() < 0.1
    torch.manual_seed(1)
    masked = kiln.compile(lambda h: F.dropout(h, 0.3, training=True))(torch.ones(100_000))
    assert abs(float((masked == 0).float().mean()) - 0.3) < 0.01


def test_printed_backward_graph_with_externs_runs() -> None:
    """Backward graphs print as runnable Python too, extern nodes and their attrs included."""
    from kiln.ir import interpret, load_printed

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w).sum(dim=1) * torch.special.i0(x[:, 0, :2, :2])

    x = torch.randn(1, 2, 3, 3, requires_grad=True)
    w = torch.randn(2, 2, 2, 2, requires_grad=True)
    compiled = kiln.compile(fn, options={"strict": True})
    compiled(x, w).sum().backward()
    backward = _training_graph(compiled).plan.backward
    feeds = [torch.randn(v.type.shape if v.type.shape else ()) for v in backward.inputs]
    for got, want in zip(load_printed(backward)(*feeds), interpret(backward, feeds), strict=True):
        torch.testing.assert_close(got, want)


def test_explain_reports_saved_values() -> None:
    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    report = kiln.explain(layer, x, w)
    assert report.saved, str(report)
    assert "saved for the backward:" in str(report)
    with torch.no_grad():
        assert not kiln.explain(layer, x, w).saved  # inference keeps nothing


def test_attention_backward_asks_only_for_the_gradients_it_needs(monkeypatch: Any) -> None:
    """A mask that needs no gradient is not made a grad leaf in the backward's re-run (that
    would rule out PyTorch's flash and cuDNN kernels); q, k and v still get eager's grads.
    (The general rule: on the CPU the flash kernel's own backward is used where it applies,
    tested below, so it is turned off here.)"""
    import kiln.passes.attention_statistics as statistics
    from kiln.ops.attention import sdpa_backward

    monkeypatch.setattr(statistics, "_kernel", lambda node: None)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> Any:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 1, 5, 5)
    compiled = kiln.compile(attend, options={"strict": True})
    got = _grads(compiled, q, k, v, bias)
    for a, b in zip(got, _grads(attend, q, k, v, bias), strict=True):
        torch.testing.assert_close(a, b)
    backward = _training_graph(compiled).plan.backward
    calls = [n for n in backward.nodes if n.op.name == "EXTERN" and n.attrs.fn is sdpa_backward]
    assert len(calls) == 1 and len(calls[0].outputs) == 3
    # With the mask requiring grad, its gradient comes back too.
    bias.requires_grad_(True)
    for a, b in zip(
        _grads(kiln.compile(attend), q, k, v, bias), _grads(attend, q, k, v, bias), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_convolution_backward_skips_gradients_nobody_needs() -> None:
    """A first convolution's input needs no gradient: the backward asks aten for the weight
    and bias gradients only (as eager autograd does), and they match eager's."""
    from kiln.ops.externs import convolution_backward

    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    conv(x).square().sum().backward()
    expected = [p.grad.clone() for p in conv.parameters() if p.grad is not None]
    conv.zero_grad(set_to_none=True)
    compiled = kiln.compile(conv, options={"strict": True})
    compiled(x).square().sum().backward()
    got = [p.grad for p in conv.parameters() if p.grad is not None]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    backward = _training_graph(compiled._kiln_call).plan.backward
    (call,) = [
        n for n in backward.nodes if n.op.name == "EXTERN" and n.attrs.fn is convolution_backward
    ]
    assert call.attrs.args[4] == (False, True) and len(call.outputs) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_backward_is_the_flash_kernels_own(dtype: torch.dtype) -> None:
    """On the CPU the forward keeps the flash kernel's log-sum-exp and the backward is the
    kernel's backward: attention's forward runs once a step, not again in the backward; the
    gradients are eager's (the same kernels). q, k and v may be one tensor."""
    from kiln.ops.attention import sdpa_backward, sdpa_cpu_backward, sdpa_cpu_forward

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return causal + F.scaled_dot_product_attention(q, q, q, scale=0.3)

    q, k, v = (torch.randn(2, 3, 6, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    compiled = kiln.compile(attend, options={"strict": True})
    got = _grads(compiled, q, k, v)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for a, b in zip(got, _grads(attend, q, k, v), strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    graph = _training_graph(compiled)
    forward = [n for n in graph.plan.forward.nodes if n.op.name == "EXTERN"]
    backward = [n for n in graph.plan.backward.nodes if n.op.name == "EXTERN"]
    assert [n.attrs.fn for n in forward] == [sdpa_cpu_forward] * 2
    assert [n.attrs.fn for n in backward] == [sdpa_cpu_backward] * 2
    assert not any(n.attrs.fn is sdpa_backward for n in backward)
    # Inference keeps the plain SDPA: only attention that will be differentiated changes.
    from kiln.passes import optimize

    for tensors, externs in (((q, k, v), 2), ((q.detach(), k.detach(), v.detach()), 0)):
        graph_ = optimize(kiln.trace(attend, *tensors))
        assert len([n for n in graph_.nodes if n.op.name == "EXTERN"]) == externs
        assert len([n for n in graph_.nodes if n.op.name == "SDPA"]) == 2 - externs


def test_cudnn_attention_backward_gets_the_outputs_layout() -> None:
    """PyTorch 2.11's cuDNN attention backward caches its graph without the incoming
    gradient's strides, so Kiln always hands it a gradient laid out as the output (a copy
    when the layouts differ, the same tensor when they agree); values are unchanged."""
    from kiln.ops.attention import laid_out_as

    out = torch.randn(2, 6, 3, 8).transpose(1, 2)  # [B, H, L, E] over a [B, L, H, E] buffer
    grad = torch.randn(2, 3, 6, 8)
    given = laid_out_as(out, grad)
    assert given.stride() == out.stride() and given.data_ptr() != grad.data_ptr()
    torch.testing.assert_close(given, grad, rtol=0, atol=0)
    assert laid_out_as(out, given) is given


def test_cudnn_attention_backward_gets_the_output_layout_eager_gives_q() -> None:
    """PyTorch 2.11 caches cuDNN's attention backward graph without the output's strides, so
    Kiln hands it the output laid out as cuDNN's forward lays it out for that q (what eager
    passes): q's own strides when q is dense, a dense order of q's otherwise (q sliced from a
    fused projection); values unchanged, no copy when the layout already agrees."""
    from kiln.ops.attention import cudnn_output_layout

    blhd = torch.randn(2, 6, 3, 8).transpose(1, 2)  # [B, H, L, E] over a [B, L, H, E] buffer
    bhld = torch.randn(2, 3, 6, 8)
    given = cudnn_output_layout(bhld, blhd)
    assert given.stride() == bhld.stride() and given.data_ptr() != blhd.data_ptr()
    torch.testing.assert_close(given, blhd, rtol=0, atol=0)
    assert cudnn_output_layout(blhd, blhd) is blhd
    fused = torch.randn(2, 6, 3, 3, 8)[:, :, 0].transpose(1, 2)  # q of a qkv projection
    assert cudnn_output_layout(fused, bhld).stride() == blhd.stride()
    wider = torch.randn(2, 3, 6, 16)  # a v head size unlike q's: q's stride order
    out = torch.randn(2, 6, 3, 8).transpose(1, 2)
    assert cudnn_output_layout(wider, out).stride() == (144, 48, 8, 1)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_loss_backward_scatters_nothing_and_skips_the_max(autocast: bool) -> None:
    """A language model's loss (transformers' shifted labels, ``ignore_index``, fp32 upcast):
    the pick's adjoint is elementwise (no ``scatter_add`` into a zero [tokens, vocab] tensor,
    1.5 GiB for GPT-2's 8x1024 batch) and log_softmax's max gets no gradient (the result does
    not depend on the shift), so no amax adjoint is built. Every gradient equals eager's."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)

    def loss_of(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).float()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        flat = shifted.reshape(-1)
        return F.cross_entropy(logits.view(-1, 50), flat, ignore_index=-100, reduction="sum") / 7

    compiled = kiln.compile(loss_of, options={"strict": True})
    for step in range(3):  # fresh values each call
        hidden = torch.randn(3, 9, 16, requires_grad=True)
        labels = torch.randint(0, 50, (3, 9))
        labels[0, step] = -100
        grads = []
        for fn in (compiled, loss_of):
            head.zero_grad()
            hidden.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = fn(hidden, labels)
            loss.backward()
            grads.append((loss.detach(), hidden.grad, head.weight.grad, head.bias.grad))
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {}
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, **tolerance)
    plan = _training_graph(compiled).plan
    backward_ops = {node.op for node in plan.backward.nodes}
    assert Op.SCATTER_ADD not in backward_ops and Op.SCATTER not in backward_ops
    maxima = [node for node in plan.forward.nodes if node.op is Op.AMAX]
    assert maxima and not any(v.type.requires_grad for n in maxima for v in n.outputs)


def _recompute_reads(plan: Any) -> int:
    """The most full-size saved values one recomputation in the backward reads: a value the
    backward computes from saved values alone, through elementwise and movement nodes (not
    from cotangents or through externs and reductions: that is the gradient's own work)."""
    graph = plan.backward
    saved = set(graph.inputs[: len(plan.saved_inputs) + plan.saved_count])
    producer = {out: node for node in graph.nodes for out in node.outputs}
    followed = {Tag.ELEMENTWISE, Tag.MOVEMENT}
    most = 0
    for node in graph.nodes:
        value = node.outputs[0]
        numel, reads, stack, seen = value.type.numel(), set(), [value], {value}
        recomputed = True
        while stack and recomputed:
            current = stack.pop()
            source = producer.get(current)
            if source is None:
                recomputed = current in saved
                if current.type.numel() >= numel:
                    reads.add(current)
            elif op_def(source.op).tags & followed:
                fresh = [v for v in source.input_values() if v not in seen]
                seen.update(fresh)
                stack += fresh
            else:
                recomputed = False
        if recomputed:
            most = max(most, len(reads))
    return most


def test_a_residual_stream_is_not_summed_again_from_every_branch() -> None:
    """A float32 residual stream with bfloat16 branches (autocast's mixed precision): saving
    the branches is fewer bytes than saving the stream, but each LayerNorm backward would then
    sum the stream again from all the branches before it. The backward recomputes a stream
    value from at most three saved tensors; gradients match eager's."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.linear = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            branch = self.linear(self.norm(x).to(torch.bfloat16).float()).to(torch.bfloat16)
            return x + branch.transpose(0, 1).reshape(x.shape[1], x.shape[0], 16).transpose(0, 1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(12)])
    compiled = kiln.compile(model, options={"strict": True})
    for _ in range(2):
        x = torch.randn(4, 6, 16)
        model.zero_grad()
        compiled(x).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        for a, parameter in zip(got, model.parameters(), strict=True):
            torch.testing.assert_close(a, parameter.grad, rtol=2e-2, atol=2e-2)
    assert _recompute_reads(_training_graph(compiled._kiln_call).plan) <= 3


def _own_variance(x: torch.Tensor) -> torch.Tensor:
    return ((x - x.mean(1, keepdim=True)) ** 2).mean(1).sqrt()


def _part_of_the_dims(x: torch.Tensor) -> torch.Tensor:
    deviation = x - x.mean((0, 1), keepdim=True)
    return (deviation * deviation).sum(1).sin()  # summed over a part of the mean's dims


# Each case, with the reductions its backward needs: eager's closed forms' (batch norm: the
# sums of g and g*x per channel; layer and group norm: those per row, then the weight's and
# the bias's gradients), or, summed over a part of the mean's dims, the mean's own gradient.
_VARIANCES: dict[str, tuple[Callable[[], Any], tuple[int, ...], int]] = {
    "batch_norm": (
        lambda: torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU()),
        (3, 4, 5, 5),
        2,
    ),
    "layer_norm": (lambda: torch.nn.LayerNorm(8), (3, 5, 8), 4),
    "group_norm": (lambda: torch.nn.GroupNorm(2, 4), (3, 4, 5), 4),
    "var": (lambda: lambda x: x.var(1).sin(), (6, 7), 0),
    "own variance": (lambda: _own_variance, (6, 7), 0),
    "part of the dims": (lambda: _part_of_the_dims, (6, 7, 3), 1),
}


def _chained_sums(graph: Any) -> int:
    """How many of ``graph``'s sums read another sum's result (through any nodes)."""
    after_sum: set[Any] = set()
    chained = 0
    for node in graph.nodes:
        reads = any(v in after_sum for v in node.input_values())
        chained += node.op is Op.SUM and reads
        if reads or node.op is Op.SUM:
            after_sum.update(node.outputs)
    return chained


@pytest.mark.parametrize("name", list(_VARIANCES))
def test_a_variance_sends_its_own_mean_no_gradient(name: str) -> None:
    """``sum((x - mean(x))**2)`` sends the mean ``-2 g * sum(x - mean(x))``, zero in exact
    arithmetic; eager's closed-form backwards (batch norm, layer norm, var) leave it out, and so
    does the joint graph: the backward has their reductions, none waiting for another. Summed
    over only a part of the mean's dims, the term is not zero and stays. Every gradient matches
    eager's on fresh values, and a double backward still differentiates the full expression."""
    make, shape, reductions = _VARIANCES[name]
    torch.manual_seed(0)
    fn = make()
    compiled = kiln.compile(fn, options={"strict": True})
    parameters = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    for _ in range(2):
        x = torch.randn(*shape) * 3 + 5
        results = []
        for f in (compiled, fn):
            for p in parameters:
                p.grad = None
            results.append([*_grads(f, x.requires_grad_()), *(p.grad for p in parameters)])
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    backward = _training_graph(compiled._kiln_call if parameters else compiled).plan.backward
    assert sum(node.op is Op.SUM for node in backward.nodes) == reductions, backward
    assert _chained_sums(backward) == 0, backward
    x = torch.randn(*shape, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    grads = [
        torch.autograd.grad(f(v).sum(), v, create_graph=True)[0]
        for f, v in ((fn, x), (compiled, mine))
    ]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-4)
    (grads[0] ** 2).sum().backward()
    (grads[1] ** 2).sum().backward()
    torch.testing.assert_close(mine.grad, x.grad, rtol=1e-4, atol=1e-4)


def test_an_unused_outputs_zero_cotangent_handed_on_as_a_gradient_is_not_kept() -> None:
    """An output nothing used gets zeros as its cotangent, kept for the next step unless the
    backward hands that cotangent on as a gradient (``x + y``'s, for ``y``): whoever gets it
    (a hook) may write into it, so it is made afresh each step. An unused output's zeros that
    no gradient aliases are kept. (``y`` gets zeros where eager gives it no gradient: the
    compiled graph is one autograd node.)"""

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + y, (x * 2).sin(), x.exp()

    compiled = kiln.compile(f, options={"strict": True})
    grads: list[list[torch.Tensor]] = [[], []]
    seen: list[torch.Tensor] = []
    values = torch.randn(2, 4)
    for fn, found in zip((compiled, f), grads, strict=True):
        x, y = (v.clone().requires_grad_() for v in values)
        if fn is compiled:
            y.register_hook(seen.append)
        for step in range(4):
            total, other, _ = fn(x, y)
            ((total**2).sum() if step == 2 else (other**2).sum()).backward()
            found += [x.grad.clone(), y.grad.clone() if y.grad is not None else torch.zeros(4)]
            x.grad = y.grad = None
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)
    graph = _training_graph(compiled)
    assert graph.passed_on == {0} and sorted(graph.zeros) == [1, 2]
    zeros = [g for g in seen if not g.any()]
    assert len({g.untyped_storage().data_ptr() for g in zeros}) == len(zeros) == 3


@pytest.mark.parametrize(
    "training",
    [
        pytest.param(False, id="frozen"),
        pytest.param(True, id="batch statistics"),
    ],
)
def test_batch_norm_gradients_stay_accurate_when_the_mean_dwarfs_the_spread(
    training: bool,
) -> None:
    """A BatchNorm whose input's mean is 1000 times its spread, with frozen statistics
    (fine-tuning) or batch statistics: in the form ``x * scale + shift`` the weight's gradient
    sums ``g * x`` and subtracts ``mean * sum(g)``, which cancels (2500x farther from float64
    than eager's frozen, 8-9x with batch statistics). Differentiated, the frozen one is
    centred first, and batch statistics take eager's closed-form backward on the centred input
    (``ops/batch_norm_backward.py``): every gradient is within 4x of eager's distance."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(8).train(training)
    norm.running_mean.fill_(100.0)
    norm.running_var.fill_(0.01)
    x = torch.randn(8, 8, 16, 16) * 0.1 + 100.0
    g = torch.randn(8, 8, 16, 16)
    errors = {}
    reference = copy.deepcopy(norm).double()
    exact = x.double().requires_grad_()
    (reference(exact) * g.double()).sum().backward()
    compiled = kiln.compile(copy.deepcopy(norm), options={"strict": True})
    for name, fn in (("eager", copy.deepcopy(norm)), ("kiln", compiled)):
        inputs = x.clone().requires_grad_()
        (fn(inputs) * g).sum().backward()
        module = fn if name == "eager" else compiled._orig_mod
        got = (inputs.grad, module.weight.grad, module.bias.grad)
        want = (exact.grad, reference.weight.grad, reference.bias.grad)
        errors[name] = [
            ((a.double() - b).abs().max() / b.abs().max()).item()
            for a, b in zip(got, want, strict=True)
        ]
    for mine, theirs in zip(errors["kiln"], errors["eager"], strict=True):
        assert mine <= 4 * theirs + 1e-7, errors
