"""A matrix product or convolution with its pointwise epilogue as one Triton kernel
(``mode="max-autotune"``).

For a :class:`~kiln.schedule.templates.MatmulPair` (``mm``/``addmm``/``bmm`` and the kernel
reading its result) :func:`generate_matmul` prints a tiled product: each program computes a
``BLOCK_M x BLOCK_N`` tile of the result (programs grouped ``GROUP_M`` rows of tiles at a time,
so neighbouring programs share operand tiles in L2), accumulating ``tl.dot`` over ``K`` in
float32, adding ``beta * bias`` for ``addmm``, and rounding the tile to the result's dtype as
the library's stored result would be. Then the epilogue kernel's own expressions run on the
tile, printed by the pointwise printer with ``xindex`` a ``[BLOCK_M, BLOCK_N]`` block of the
result's flat positions, so loads of other buffers (a bias at ``xindex % N``, a residual at
``xindex``) and the stores index as in the kernel; a load of the result is the tile itself.
The result is stored too when later steps read it.

A 2-d convolution with a channels-last result is the product of its output pixels (rows) by
its output channels (columns): one loop over (window position, block of input channels) loads
the input through its strides, masked where the window hangs over the padding. A depthwise
convolution has no product to share: its tiles of pixels by channels sum the window directly.
Its bias is added after the rounding, as eager adds it to the library's result.

:func:`matmul_configs` lists the tile shapes tried, clipped to the problem; the runtime times
them against the library and the unfused kernel (``kiln/backends/templates.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen import triton_math as tm
from kiln.codegen.sources import Form, TritonSource
from kiln.codegen.triton import (
    Blocks,
    UnsupportedKernel,
    _identifier,
    _Printer,
    next_power_of_2,
    unsupported_reason,
)
from kiln.ir.op import Op
from kiln.schedule.loops import Load, walk
from kiln.schedule.program import View, kernel_arguments
from kiln.schedule.templates import MatmulPair

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): tile shapes that serve Hopper and
# Ampere well for 16-bit products (large square tiles for large products, thin ones for few
# rows, as a decoder's tokens)
GPU_CONFIGS = (
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 64, 64, 4, 3),
    (32, 128, 64, 4, 4),
    (16, 128, 128, 4, 3),
)
INTERPRET_CONFIGS = ((32, 32, 32, 4, 1),)
# implicit-GEMM convolutions: (BLOCK_M pixels, BLOCK_N channels, BLOCK_K input channels, ...)
CONV_CONFIGS = (
    (128, 128, 32, 8, 3),
    (128, 64, 32, 4, 3),
    (64, 128, 32, 4, 3),
    (64, 64, 32, 4, 3),
    (256, 64, 32, 8, 3),
    (128, 128, 64, 8, 3),
    (64, 64, 64, 4, 4),
)
# depthwise convolutions, direct sums: (BLOCK_M pixels, BLOCK_N channels, -, warps, -)
DEPTHWISE_CONFIGS = (
    (32, 64, 0, 4, 1),
    (64, 64, 0, 4, 1),
    (16, 128, 0, 4, 1),
    (128, 32, 0, 4, 1),
    (64, 32, 0, 2, 1),
    (8, 256, 0, 4, 1),
)
INTERPRET_DEPTHWISE = ((32, 32, 0, 4, 1),)
MIN_BLOCK = 16  # tl.dot's smallest tile side
GROUP_M = 8


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = GROUP_M

    @property
    def label(self) -> str:
        """As explain prints it and the cache stores it: ``template 128x128x64 w8 s3``
        (a depthwise convolution's: ``template 32x64 w4``)."""
        if not self.block_k:
            return f"template {self.block_m}x{self.block_n} w{self.num_warps}"
        tile = f"{self.block_m}x{self.block_n}x{self.block_k}"
        return f"template {tile} w{self.num_warps} s{self.num_stages}"


def matmul_configs(pair: MatmulPair, interpret: bool) -> list[MatmulConfig]:
    """The tile shapes to try: each side clipped to the problem's (at least ``MIN_BLOCK``),
    duplicates dropped, in the table's order."""
    problem = pair.problem
    table = {
        "mm": INTERPRET_CONFIGS if interpret else GPU_CONFIGS,
        "conv": INTERPRET_CONFIGS if interpret else CONV_CONFIGS,
        "depthwise": INTERPRET_DEPTHWISE if interpret else DEPTHWISE_CONFIGS,
    }[problem.kind]
    channels = problem.k if problem.kind == "mm" else int(pair.operands[1].shape[1])
    found = []
    for bm, bn, bk, warps, stages in table:
        bm = max(MIN_BLOCK if bk else 1, min(bm, next_power_of_2(problem.m)))
        bn = max(MIN_BLOCK, min(bn, next_power_of_2(problem.n)))
        bk = max(MIN_BLOCK, min(bk, next_power_of_2(channels))) if bk else 0
        warps = min(warps, max(1, bm * bn // 256))  # (tiny tiles: fewer warps)
        found.append(MatmulConfig(bm, bn, bk, warps, stages))
    return list(dict.fromkeys(found))


def generate_matmul(pair: MatmulPair, config: MatmulConfig, interpret: bool) -> TritonSource:
    """The Triton module of ``pair`` with ``config``'s tiles."""
    reason = unsupported_reason(pair.head)
    if reason is not None:
        raise UnsupportedKernel(f"kernel {pair.head.name}: {reason}")
    printer = _MatmulPrinter(pair.head, Blocks(Form.POINTWISE, 1), interpret)
    printer.configure(pair, config)
    if printer.int64:
        raise UnsupportedKernel(f"kernel {pair.head.name}: indices need 64 bits")
    source = printer.module_source()
    problem = pair.problem
    tiles = -(-problem.m // config.block_m) * -(-problem.n // config.block_n)
    arguments = kernel_arguments(pair.head)
    names = [b.name for b in arguments] + [f"operand{i}" for i in range(len(pair.operands))]
    dtypes = [b.dtype for b in arguments] + [v.buffer.dtype for v in pair.operands]
    return TritonSource(
        name=printer.function_name,
        kernel_name=pair.head.name,
        source=source,
        arguments=tuple(names),
        argument_dtypes=tuple(dtypes),
        has_seed=pair.head.seed() is not None,
        constexprs={
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": config.block_k,
            "GROUP_M": config.group_m,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        grid=(tiles, problem.batch, 1),
        form=Form.TEMPLATE,
        interpret=interpret,
    )


class _MatmulPrinter(_Printer):
    """The pointwise printer with the product's tiles in front (see the module docstring)."""

    def configure(self, pair: MatmulPair, config: MatmulConfig) -> None:
        self.pair = pair
        self.config = config
        problem = pair.problem
        self.kind = problem.kind
        self.m, self.n, self.k = problem.m, problem.n, problem.k
        self.batched = len(pair.result.shape) == 3  # (bmm; one program column per batch)
        self.xmask = self.m % config.block_m != 0 or self.n % config.block_n != 0
        taken = set(self.pointers.values())
        names = {
            Op.MM: ("a_ptr", "b_ptr"),
            Op.BMM: ("a_ptr", "b_ptr"),
            Op.ADDMM: ("bias_ptr", "a_ptr", "b_ptr"),
            Op.CONVOLUTION: ("x_ptr", "w_ptr", "bias_ptr")[: len(pair.operands)],
        }[pair.extern.node.op]
        self.operand_pointers = [_identifier(name, taken) for name in names]
        self.function_name = f"{self.function_name}_mm"

    def _shape(self, dims: frozenset[str]) -> str:
        return "[BLOCK_M, BLOCK_N]" if dims else "[]"

    def constexpr_params(self) -> list[str]:
        return [f"{name}: tl.constexpr" for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")]

    def function(self, body: str, name: str = "", extra: tuple[str, ...] = ()) -> str:
        params = [self.pointers[id(b)] for b in kernel_arguments(self.kernel)]
        params += self.operand_pointers
        if self.kernel.seed() is not None:
            params.append("seed_ptr")
        params += self.constexpr_params()
        jit = "@triton.jit"
        if "seed_ptr" in params:
            jit += '(do_not_specialize=["seed_ptr"])'
        return f"{jit}\ndef {self.function_name}({', '.join(params)}):\n{body}"

    @property
    def _has_bias(self) -> bool:
        return self.pair.extern.node.op is Op.ADDMM

    def header(self) -> list[str]:
        pair, config = self.pair, self.config
        op = pair.extern.node.op.printed_name
        batch = f"{pair.result.shape[0]} x " if self.batched else ""
        if self.kind != "mm":
            op = f"{self.kind} {op} (as {self.m} pixels x {self.n} channels, {self.k} terms each)"
        mode = "TRITON_INTERPRET=1" if self.interpret else "GPU"
        product = f"{batch}{self.m}x{self.k} @ {self.k}x{self.n}"
        stores = "stores" if pair.keeps_result else "does not store"
        lines = [
            f"# Kiln template {self.kernel.name}: {op} ({product}) with the kernel's epilogue",
            f"# {config.label}, GROUP_M={config.group_m}, for {mode}",
            f"# {stores} the product {pair.result.name}",
        ]
        if self.kernel.fused:
            lines.append("# fused:")
            lines += [f"#   {entry}" for entry in self.kernel.fused]
        return lines

    def emit_body(self) -> None:
        if self.kernel.seed() is not None:
            self.emit("seed = tl.load(seed_ptr)")
        self.emit_product()
        self.emit_exprs(walk([s.value for s in self.kernel.stores], left_to_right=True))
        self.emit_stores(self.kernel.stores)

    def emit_product(self) -> None:
        self.emit_tiles()
        if self.kind == "mm":
            self.emit_matmul()
        else:
            self.emit_convolution()
        self.emit_result()

    def emit_tiles(self) -> None:
        """``rm``/``rn``: this program's rows and columns of the result (``ram``/``rbn``: the
        same, wrapped into range for loads)."""
        m, n, config = self.m, self.n, self.config
        emit = self.emit
        emit("pid = tl.program_id(0)")
        emit(f"grid_m = {-(-m // config.block_m)}")
        emit(f"grid_n = {-(-n // config.block_n)}")
        emit("width = GROUP_M * grid_n")
        emit("first_m = (pid // width) * GROUP_M")
        emit("group_size = tl.minimum(grid_m - first_m, GROUP_M)")
        emit("pid_m = first_m + (pid % width) % group_size")
        emit("pid_n = (pid % width) // group_size")
        emit("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        emit("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        # Rows and columns past the edge read a valid one (their results are not stored).
        emit(f"ram = rm % {m}" if m % config.block_m else "ram = rm")
        emit(f"rbn = rn % {n}" if n % config.block_n else "rbn = rn")
        emit("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")

    def emit_matmul(self) -> None:
        k, config = self.k, self.config
        bias, a, b = self.pair.operands if self._has_bias else [None, *self.pair.operands]
        a_ptr, b_ptr = self.operand_pointers[-2:]
        assert a is not None and b is not None
        emit = self.emit
        emit("rk = tl.arange(0, BLOCK_K)")
        if self.batched:
            emit("batch = tl.program_id(1)")
        (sam, sak), (sbk, sbn) = _strides(a), _strides(b)
        a_base = _base(a, self.batched)
        b_base = _base(b, self.batched)
        emit(f"a_ptrs = {a_ptr} + {a_base}ram[:, None] * {sam} + rk[None, :] * {sak}")
        emit(f"b_ptrs = {b_ptr} + {b_base}rk[:, None] * {sbk} + rbn[None, :] * {sbn}")
        ragged = k % config.block_k != 0
        emit(f"for kk in range(0, {k}, BLOCK_K):")
        if ragged:
            emit(f"    a = tl.load(a_ptrs, mask=(kk + rk)[None, :] < {k}, other=0.0)")
            emit(f"    b = tl.load(b_ptrs, mask=(kk + rk)[:, None] < {k}, other=0.0)")
        else:
            emit("    a = tl.load(a_ptrs)")
            emit("    b = tl.load(b_ptrs)")
        self.emit_dot()
        emit(f"    a_ptrs += BLOCK_K * {sak}")
        emit(f"    b_ptrs += BLOCK_K * {sbk}")
        if bias is not None:
            self.emit_bias(bias)

    def emit_result(self) -> None:
        """The tile rounded as the library stores it, ``xindex`` (the result's flat
        positions of the tile) and ``xmask``; the result stored when kept."""
        m, n, emit = self.m, self.n, self.emit
        result = self.pair.result
        rounded = tm.convert("acc", tm.compute_dtype(result.dtype), result.dtype, self.interpret)
        emit(f"acc = {rounded}  # the product as the library would store it")
        if self.kind != "mm" and len(self.pair.operands) == 3:  # (eager adds it after)
            step = int(self.pair.operands[2].strides[0])
            load = f"tl.load({self.operand_pointers[2]} + rbn * {step})"
            added = tm.convert(
                f"(acc + {load}.to(tl.float32)[None, :])",
                torch.float32,
                result.dtype,
                self.interpret,
            )
            emit(f"acc = {added}")
        base = f"batch * {m * n} + " if self.batched else ""
        emit(f"xindex = {base}rm[:, None] * {n} + rn[None, :]")
        if self.xmask:
            emit(f"xmask = (rm[:, None] < {m}) & (rn[None, :] < {n})")
        if self.pair.keeps_result:
            stored = tm.narrow("acc", tm.compute_dtype(result.dtype), result.dtype, self.interpret)
            mask = ", xmask" if self.xmask else ""
            emit(f"tl.store({self.pointers[id(result)]} + xindex, {stored}{mask})")

    def emit_convolution(self) -> None:
        """An implicit matrix product over (window position, input channel block), or, for
        a depthwise convolution, a direct sum over the window (``_plain_convolution``)."""
        x, w = self.pair.operands[:2]
        attrs = self.pair.extern.node.attrs
        _, channels, height, width = (int(n) for n in x.shape)
        out_height, out_width = (int(n) for n in self.pair.result.shape[2:])
        kh_size, kw_size = (int(n) for n in w.shape[2:])
        (sh, sw), (ph, pw), (dh, dw) = attrs.stride, attrs.padding, attrs.dilation
        sxn, sxc, sxh, sxw = (int(s) for s in x.strides)
        swo, swi, swh, sww = (int(s) for s in w.strides)
        x_ptr, w_ptr = self.operand_pointers[:2]
        emit = self.emit
        emit(f"image = ram // {out_height * out_width}")
        emit(f"oh = (ram // {out_width}) % {out_height}")
        emit(f"ow = ram % {out_width}")
        if self.kind == "depthwise":
            emit(f"for step in range(0, {kh_size * kw_size}):")
            emit(f"    kh = step // {kw_size}")
            emit(f"    kw = step % {kw_size}")
        else:
            blocks = -(-channels // self.config.block_k)
            emit("rk = tl.arange(0, BLOCK_K)")
            emit(f"for step in range(0, {kh_size * kw_size * blocks}):")
            emit(f"    kh = step // {kw_size * blocks}")
            emit(f"    kw = (step // {blocks}) % {kw_size}")
            emit(f"    c = (step % {blocks}) * BLOCK_K + rk")
        emit(f"    ih = oh * {sh} - {ph} + kh * {dh}")
        emit(f"    iw = ow * {sw} - {pw} + kw * {dw}")
        inside = f"(ih >= 0) & (ih < {height}) & (iw >= 0) & (iw < {width})"
        emit(f"    x_row = image * {sxn} + ih * {sxh} + iw * {sxw}")
        if self.kind == "depthwise":
            mask = f", mask=({inside})[:, None], other=0.0" if (ph or pw) else ""
            emit(f"    a = tl.load({x_ptr} + x_row[:, None] + rbn[None, :] * {sxc}{mask})")
            emit(f"    b = tl.load({w_ptr} + rbn * {swo} + kh * {swh} + kw * {sww})")
            emit("    acc += a.to(tl.float32) * b.to(tl.float32)[None, :]")
            return
        masks = [f"({inside})[:, None]"] if (ph or pw) else []
        ragged = channels % self.config.block_k != 0
        if ragged:
            masks.append(f"(c < {channels})[None, :]")
        a_mask = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        b_mask = f", mask=(c < {channels})[:, None], other=0.0" if ragged else ""
        emit(f"    a = tl.load({x_ptr} + x_row[:, None] + c[None, :] * {sxc}{a_mask})")
        weights = f"rbn[None, :] * {swo} + c[:, None] * {swi} + kh * {swh} + kw * {sww}"
        emit(f"    b = tl.load({w_ptr} + {weights}{b_mask})")
        self.emit_dot()

    def emit_dot(self) -> None:
        """The loop body's ``acc += a @ b`` (16-bit operands, a float32 accumulator)."""
        if self.interpret:  # (its bf16 dot multiplies the bits: the exact fp32 product)
            self.emit("    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)")
        else:
            self.emit("    acc = tl.dot(a, b, acc)")

    def emit_bias(self, bias: View) -> None:
        """``acc = alpha * acc + beta * bias`` (``beta == 0`` reads no bias: eager ignores
        its NaN then)."""
        attrs = self.pair.extern.node.attrs
        beta, alpha = (attrs.beta, attrs.alpha) if attrs is not None else (1, 1)
        if alpha != 1:
            self.emit(f"acc = acc * {tm.literal(float(alpha))}")
        if beta == 0:
            return
        # (a bias of one or two dims, broadcast: a missing or size-1 dim steps by 0)
        pairs = zip(bias.shape, bias.strides, strict=True)
        steps = [0, 0] + [int(s) if int(n) != 1 else 0 for n, s in pairs]
        scm, scn = steps[-2:]
        offsets = f"ram[:, None] * {scm} + rbn[None, :] * {scn}"
        load = f"tl.load({self.operand_pointers[0]} + {offsets}).to(tl.float32)"
        scaled = load if beta == 1 else f"{load} * {tm.literal(float(beta))}"
        self.emit(f"acc = acc + {scaled}")

    def emit_load(self, expr: Load) -> None:
        if expr.buffer is self.pair.result:
            self.scopes[-1][id(expr)] = "acc"  # (a float32 value of the stored dtype)
            return
        super().emit_load(expr)


def _strides(view: View) -> tuple[int, int]:
    *_, rows, columns = view.strides
    return int(rows), int(columns)


def _base(view: View, batched: bool) -> str:
    """``batch * stride + ``: where this program's batch of the operand starts (its view's
    offset is in the pointer the host passes), or "" (one batch, or a broadcast operand)."""
    step = int(view.strides[0])
    return f"batch * {step} + " if batched and step else ""
