"""The Triton generator's source text, block heuristics and runtime (module cache, errors,
launch paths), and compiles of GPU sources with Triton's bundled ptxas (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kiln  # noqa: F401  (registers the op rows)
from kiln.codegen.triton import (
    Blocks,
    Form,
    TritonSource,
    UnsupportedKernel,
    choose_blocks,
    generate_triton,
)
from kiln.config import config
from kiln.errors import BackendError
from kiln.ir.op import Op, Tag, registered_ops
from kiln.schedule.index import var
from kiln.schedule.loops import (
    Kernel,
    Rand,
    Reduce,
    ReduceKind,
    Store,
)

triton = pytest.importorskip("triton")
from kiln.runtime import triton_build, triton_launch  # noqa: E402  (needs triton)
from tests.codegen.ir_builders import BF16, BOOL, CPU, F16, F32, F64, I8, I32, I64, U8  # noqa: E402

ELEMENTWISE = [row for row in registered_ops() if Tag.ELEMENTWISE in row.tags]

from tests.codegen.triton_kernels import (  # noqa: E402, F401  (_cache_dir: an autouse fixture)
    _cache_dir,
    _gelu_kernel,
    _layer_norm_kernel,
    _scalar,
    _softmax_kernel,
    apply,
    assert_close,
    buffer,
    const,
    load,
    outputs,
    pointwise,
    run,
)

# ---------------------------------------------------------------------------------------------
# source text, heuristics and the runtime


def test_source_is_readable_and_names_what_it_fuses() -> None:
    source = generate_triton(_gelu_kernel(4096, BF16), interpret=False)
    text = source.source
    assert "def gelu_4096(out_ptr, y_ptr, b_ptr, a_ptr, XBLOCK: tl.constexpr):" in text
    assert "# fused:\n#   add  model.py:3\n#   gelu  model.py:4" in text
    assert "xmask" not in text  # 4096 % 1024 == 0: no predication
    assert ".to(tl.float32)" in text and ".to(tl.bfloat16)" in text
    assert source.arguments == ("out", "y", "b", "a") and source.grid == (4, 1, 1)
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 1024}, 4)
    compile(text, "gelu.py", "exec")  # valid Python


def test_module_docstring_example_is_what_the_generator_prints() -> None:
    import kiln.codegen.triton as module

    doc = module.__doc__ or ""
    example = doc[doc.index("    @triton.jit") : doc.index("with ``XBLOCK")].rstrip()
    expected = "\n".join(line.removeprefix("    ") for line in example.splitlines())
    source = generate_triton(_softmax_kernel(4096, 1000, BF16), interpret=False)
    assert expected in source.source
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 4, "RBLOCK": 1024}, 8)


def test_libdevice_only_outside_the_interpreter() -> None:
    n = 8
    x = var("x", n)
    a = load(buffer("a", (n,), F32), x)
    kernel = pointwise("tanh_erfinv", x, {"t": apply(Op.TANH, a), "e": apply(Op.ERFINV, a)})
    compiled = generate_triton(kernel, interpret=False).source
    interpreted = generate_triton(kernel, interpret=True).source
    assert "from triton.language.extra import libdevice" in compiled
    assert "libdevice.tanh(" in compiled and "libdevice.erfinv(" in compiled
    assert "libdevice" not in interpreted and "_kiln_tanh(" in interpreted


def test_block_heuristics() -> None:
    softmax = choose_blocks(_softmax_kernel(16384, 4096, BF16), interpret=False)
    assert softmax == Blocks(Form.PERSISTENT, 1, 4096, 8)
    small_rows = choose_blocks(_softmax_kernel(4096, 100, F32), interpret=False)
    assert (small_rows.form, small_rows.rblock, small_rows.xblock) == (Form.PERSISTENT, 128, 32)
    long_rows = choose_blocks(_softmax_kernel(64, 50000, F32), interpret=False)
    assert long_rows.form is Form.LOOPED and long_rows.xblock == 1
    pointwise = choose_blocks(_gelu_kernel(10**6, F32), interpret=False)
    assert pointwise == Blocks(Form.POINTWISE, 1024, 1, 4)
    assert choose_blocks(_gelu_kernel(5, F32), interpret=False) == Blocks(Form.POINTWISE, 8, 1, 1)


def test_64_bit_indexing_when_offsets_reach_2_to_the_31() -> None:
    big = _gelu_kernel(2**31 + 8, F32)
    assert "tl.program_id(0).to(tl.int64)" in generate_triton(big, interpret=False).source
    assert "to(tl.int64)" not in generate_triton(_gelu_kernel(2**20, F32), interpret=False).source
    rows = _softmax_kernel(70000, 40000, F32)
    text = generate_triton(rows, interpret=False).source
    assert "tl.program_id(0).to(tl.int64)" in text and "[None, :].to(tl.int64)" in text


def test_unsupported_dtypes_are_reported() -> None:
    n = 4
    x = var("x", n)
    kernel = Kernel(
        "complex",
        n,
        1,
        [Store(buffer("o", (n,), torch.complex64), x, load(buffer("a", (n,), torch.complex64), x))],
    )
    with pytest.raises(UnsupportedKernel, match="complex64"):
        generate_triton(kernel, interpret=True)


def test_modules_are_cached_by_source_hash_and_dumped(tmp_path: Path) -> None:
    source = generate_triton(_gelu_kernel(16, F32), interpret=True)
    previous = config.debug_dir
    config.debug_dir = str(tmp_path)
    try:
        triton_build.build_triton(source)
    finally:
        config.debug_dir = previous
    path = triton_build.module_path(source)
    assert path.read_text() == source.source and path.stem == triton_build.source_digest(source)
    assert (tmp_path / "triton" / "gelu_16_interpret.py").read_text() == source.source


def test_a_broken_kernel_names_its_source_file() -> None:
    good = generate_triton(_gelu_kernel(16, F32), interpret=True)
    broken = dataclasses.replace(
        good, source=good.source.replace("tl.erf(", "tl.no_such_function(")
    )
    launch = triton_build.build_triton(broken)
    tensors = [torch.zeros(16) for _ in range(4)]
    with pytest.raises(BackendError, match=str(triton_build.module_path(broken))):
        launch(*tensors)
    with pytest.raises(TypeError, match="takes 4 tensors"):
        launch(*tensors[:3])


def test_availability_precompile_and_interpret_mode_restore_state() -> None:
    assert triton_build.triton_available("cpu", interpret=True) is None
    reason = triton_build.triton_available("cpu")
    assert reason is not None and "CUDA" in reason
    triton_build.precompile([generate_triton(_gelu_kernel(16, F32), interpret=True)], [CPU])
    import triton.language as tl

    before = (os.environ.get("TRITON_INTERPRET"), tl.sum, tl.rand)
    with triton_build.interpret_mode(), triton_build.interpret_mode():
        assert os.environ["TRITON_INTERPRET"] == "1" and tl.sum is not before[1]
    assert (os.environ.get("TRITON_INTERPRET"), tl.sum, tl.rand) == before


def test_precompile_without_a_gpu_driver_reports_instead_of_raising() -> None:
    """Taking Triton's specialization needs its GPU driver: without one the pool path gives
    an error line per kernel and compiles nothing (the first launch compiles and raises)."""
    if torch.cuda.is_available():
        pytest.skip("the machine has a GPU")
    source = generate_triton(_gelu_kernel(16, F32), interpret=False)
    errors = triton_build._compile_in_pool([triton_build._job(source, 0) for _ in range(2)])
    assert len(errors) == 4 and "specialization" in errors[0], errors


def test_precompiles_seeded_kernels_under_the_key_of_their_launches() -> None:
    """Precompile warms a kernel up with dtypes for its tensors and ``SEED_EXAMPLE`` for the
    seed's pointer: Triton's binder must specialize those as it does a launch's tensors, the
    seed's tensor at any address included (else the first launch compiles again)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    source = generate_triton(_rand_kernel(), interpret=False)
    function = getattr(triton_build._import(triton_build.write_module(source), False), source.name)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(function.signature, function.params, backend)
    options = {**triton_build.OPTIONS, "num_warps": source.num_warps, **source.constexprs}

    def specialization(*arguments: Any) -> list[Any]:
        return binder(*arguments, **options)[1]

    examples = [*source.argument_dtypes, triton_build.SEED_EXAMPLE]
    warmed = specialization(*map(MockTensor.wrap_dtype, examples))
    tensors = [torch.empty(4096, dtype=d) for d in source.argument_dtypes]
    seeds = torch.tensor([1, 2])
    for seed in (seeds[0], seeds[1], torch.tensor(3)):
        assert specialization(*tensors, seed) == warmed
    assert warmed[len(tensors)][0] == "*i64"


def _specialization(source: TritonSource) -> str:
    """What Triton's JIT cache hook would hand over for ``source`` on an H100 (the format of
    ``triton.runtime.jit.serialize_specialization_data``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    function = getattr(triton_build._import(triton_build.write_module(source), False), source.name)
    names = function.arg_names
    signature = {
        n: POINTER_TYPES[d]
        for n, d in zip(names[: len(source.arguments)], source.argument_dtypes, strict=True)
    }
    signature.update({name: "constexpr" for name in source.constexprs})
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options(
        {**triton_build.OPTIONS, "num_warps": source.num_warps}
    )
    return json.dumps(
        {
            "name": source.name,
            "signature": signature,
            "constant_keys": [[names.index(k)] for k in source.constexprs],
            "constant_vals": list(source.constexprs.values()),
            "attrs_keys": [[i] for i in range(len(source.arguments))],
            "attrs_vals": [[["tt.divisibility", 16]] for _ in source.arguments],
            "options": options.__dict__,
            "key": "unused",
            "target": vars(target),
        }
    )


def test_compile_worker_fills_the_cache_the_launch_reads(gpu_compiler: None) -> None:
    """``triton_worker.py --serve`` (a process without torch) compiles a kernel from Triton's
    serialized specialization into the disk cache, under the key an in-process compile of
    the same launch uses, and answers each job with one JSON line (a broken job's carries
    the error)."""
    source = generate_triton(_softmax_kernel(4, 64, F32), interpret=False)
    job = {"path": str(triton_build.write_module(source)), "name": source.name}
    job["specialization"] = _specialization(source)
    job["env"] = {"TRITON_CACHE_DIR": os.environ["TRITON_CACHE_DIR"]}
    target = json.loads(job["specialization"])["target"]  # the worker warms up for it
    broken = {**job, "path": "/nonexistent/kernel.py"}
    worker = Path(triton_build.__file__).with_name("triton_worker.py")
    code = (
        f"import runpy, sys; sys.argv[1:] = ['--serve', '0', {json.dumps(target)!r}]; "
        f"runpy.run_path({str(worker)!r}, run_name='__main__'); print('torch' in sys.modules)"
    )
    stdin = json.dumps(job) + "\n" + json.dumps(broken) + "\n"
    done = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout + done.stderr
    assert "error" not in json.loads(lines[0]) and json.loads(lines[0])["seconds"] > 0
    assert "/nonexistent/kernel.py" in json.loads(lines[1])["error"]
    assert lines[2] == "False"  # the worker never imported torch
    before = set(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))
    compile_for_gpu(source)  # in-process: must find the worker's binary, not make another
    assert set(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")) == before
    assert any(source.name in path.name for path in before)
    assert any("kiln_worker_warm_up" in path.name for path in before)


class _FakeCompiled:
    """A compiled kernel: ``[grid]`` gives the low-level runner, which records fast launches."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.fail = False

    def __getitem__(self, grid: Any) -> Any:
        def runner(*args: Any) -> None:
            if self.fail:
                raise TypeError("the launcher's signature changed")
            self.log.append(("fast", grid, args))

        return runner


class _FakeJit:
    """A JITFunction: ``fn[grid](*args, **options)`` records the launch, returns the kernel."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compiled = _FakeCompiled(self.log)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **options: Any) -> _FakeCompiled:
            self.log.append(("slow", grid, args, options))
            return self.compiled

        return launch


def test_compiled_launches_take_the_fast_path_while_the_specialization_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first launch goes through ``kernel[grid]`` (constexprs and options by keyword);
    later ones call the compiled kernel's runner with the bound arguments (tensors, the seed's
    tensor, constexprs) until the alignment changes or the runner fails."""
    misaligned = lambda tensors: (tuple(t.data_ptr() % 16 for t in tensors), 0)
    monkeypatch.setattr(triton_launch, "_specialization", misaligned)
    monkeypatch.setattr(triton_launch, "_fast_launch_supported", lambda: True)
    source = generate_triton(_rand_kernel(), interpret=False)
    fake = _FakeJit()
    launch = triton_build.TritonLauncher(source, Path("dropout.py"), fake)
    tensors = [torch.empty(4096, dtype=d) for d in source.argument_dtypes]
    seed = torch.tensor(7)
    launch(*tensors, seed=seed)
    launch(*tensors, seed)  # the wrapper passes the seed positionally
    options = {"XBLOCK": 1024, "enable_fp_fusion": True, "num_warps": 4}
    assert fake.log == [
        ("slow", (4, 1, 1), (*tensors, seed), options),
        ("fast", (4, 1, 1), (*tensors, seed, 1024)),
    ]
    launch(tensors[0][1:], *tensors[1:], seed=seed)  # misaligned: another specialization
    assert [entry[0] for entry in fake.log] == ["slow", "fast", "slow"]
    with pytest.raises(TypeError, match="reads its seed through a pointer"):
        launch(*tensors, 7)
    fake.compiled.fail = True
    launch(*tensors, seed=torch.tensor(8))
    assert [entry[0] for entry in fake.log] == [
        "slow",
        "fast",
        "slow",
        "slow",
    ] and not launch.fast_ok


def test_seeded_kernels_take_the_direct_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed is one more tensor argument: a seeded kernel's all-aligned launches take the
    direct path, and a seed at an address 16 bytes do not divide (its pointer is never
    specialized on) runs the same compiled kernel, found by the alignment of the others."""
    monkeypatch.setattr(triton_launch, "_fast_launch_supported", lambda: True)
    monkeypatch.setattr(triton_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    keys: list[tuple[Any, ...]] = []
    real = triton_launch._specialization
    monkeypatch.setattr(
        triton_launch, "_specialization", lambda t: keys.append(real(t)) or keys[-1]
    )
    source = generate_triton(_rand_kernel(), interpret=False)
    assert '@triton.jit(do_not_specialize=["seed_ptr"])' in source.source
    fake = _FakeJit()
    launch = triton_build.TritonLauncher(source, Path("dropout.py"), fake)
    tensors = [torch.empty(4096, dtype=d) for d in source.argument_dtypes]
    seeds = torch.tensor([1, 2])
    assert seeds[0].data_ptr() % 16 == 0 and seeds[1].data_ptr() % 16 == 8
    launch(*tensors, seeds[0])  # kernel[grid]
    assert launch.aligned is not None and len(keys) == 1
    launch(*tensors, seeds[0])  # direct: no specialization key computed
    launch(*tensors, seeds[1])  # the compiled path, the same specialization
    assert [entry[0] for entry in fake.log] == ["slow", "fast", "fast"]
    assert len(keys) == 2 and keys[0] == keys[1] == ((True, True, True), 0)


class _FakeCudaLauncher:
    """Triton's Python ``CudaLauncher`` (``compiled.run``) around a C launch function
    (``self.launch``), in the argument layout of Triton 3.6 (``spread``: the kernel's arguments
    last, spread) or 3.9 (a tuple last, after two signature descriptions)."""

    def __init__(self, layout: str, c_log: list[tuple[Any, ...]], scratch: int = 0) -> None:
        self.layout = layout
        self.python_calls = 0
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch = lambda *c_args: c_log.append(c_args)

    def __call__(self, gx: int, gy: int, gz: int, stream: int, function: Any, metadata: Any,
                 launch_metadata: Any, enter: Any, exit_: Any, *args: Any) -> None:  # fmt: skip
        self.python_calls += 1
        scratch = torch.empty(self.global_scratch_size) if self.global_scratch_size else None
        if self.layout == "spread":
            self.launch(gx, gy, gz, stream, function, False, False, scratch, None, metadata,
                        launch_metadata, enter, exit_, *args)  # fmt: skip
        else:
            self.launch(gx, gy, gz, stream, function, False, False, metadata, launch_metadata,
                        enter, exit_, scratch, None, "annotations", "signature", args)  # fmt: skip


class _FakeLaunchable:
    """A compiled kernel with the attributes the direct path reads."""

    def __init__(self, launcher: _FakeCudaLauncher) -> None:
        self.run = launcher
        self.function = object()
        self.packed_metadata = ("metadata",)

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args: self.run(*grid, 0, self.function, self.packed_metadata, None,
                                      None, None, *args)  # fmt: skip


class _FakeJitOf(_FakeJit):
    def __init__(self, compiled: Any) -> None:
        super().__init__()
        self.compiled = compiled


@pytest.mark.parametrize("layout", ["spread", "packed"])
def test_aligned_launches_call_the_recorded_c_launch(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """After the first launch (``kernel[grid]``) and one through Triton's Python launcher
    (recording its C call), aligned launches call the C launch function directly: same
    arguments but the stream and the tensors. A misaligned view takes the compiled path."""
    stream = [11]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: stream[0], raising=False)
    monkeypatch.setattr(triton_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_fast_launch_supported", lambda: True)
    monkeypatch.setattr(triton_launch, "_specialization", lambda t: (
        tuple(x.data_ptr() % 16 == 0 for x in t), 0))  # fmt: skip
    hooks = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(triton_launch, "_hook_holder", lambda: hooks)
    source = generate_triton(_gelu_kernel(4096, F32), interpret=False)
    c_log: list[tuple[Any, ...]] = []
    python = _FakeCudaLauncher(layout, c_log)
    fake = _FakeJitOf(_FakeLaunchable(python))
    launch = triton_launch.TritonLauncher(source, Path("gelu.py"), fake)
    first, *rest = [torch.empty(4096) for _ in source.arguments]
    launch(first, *rest)  # kernel[grid]
    assert [entry[0] for entry in fake.log] == ["slow"] and python.python_calls == 0
    launch(first, *rest)  # the Python launcher, recorded
    assert python.python_calls == 1 and len(c_log) == 1
    stream[0] = 12
    other = torch.empty(4096)
    launch(other, *rest)
    assert python.python_calls == 1 and len(c_log) == 2  # straight to the C function
    recorded, direct = c_log
    constexprs = tuple(source.constexprs.values())
    assert direct[:3] == recorded[:3] and recorded[3] == 11 and direct[3] == 12
    arguments = (other, *rest, *constexprs)
    count = len(arguments) if layout == "spread" else 1
    assert direct[4:-count] == recorded[4:-count]  # handle, flags, metadata, no scratch
    tail = direct[-count:] if layout == "spread" else direct[-1]
    assert len(tail) == len(arguments) and all(a is b for a, b in zip(tail, arguments, strict=True))
    base = torch.empty(4097)
    launch(base[1:], *rest)  # misaligned: another specialization, through kernel[grid]
    assert [entry[0] for entry in fake.log] == ["slow", "slow"] and len(c_log) == 2
    hooks.launch_enter_hook = lambda *args: None  # a profiler: Triton's own launcher again
    launch(first, *rest)
    assert python.python_calls == 2 and len(c_log) == 3


def test_launches_with_scratch_buffers_keep_tritons_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel whose launcher allocates scratch memory per launch is never replayed."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 5, raising=False)
    monkeypatch.setattr(triton_launch, "_get_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_fast_launch_supported", lambda: True)
    monkeypatch.setattr(triton_launch, "_specialization", lambda t: ((True,) * len(t), 0))
    source = generate_triton(_gelu_kernel(4096, F32), interpret=False)
    c_log: list[tuple[Any, ...]] = []
    python = _FakeCudaLauncher("spread", c_log, scratch=64)
    fake = _FakeJitOf(_FakeLaunchable(python))
    launch = triton_launch.TritonLauncher(source, Path("gelu.py"), fake)
    tensors = [torch.empty(4096) for _ in source.arguments]
    for _ in range(4):
        launch(*tensors)
    assert python.python_calls == 3 and len(c_log) == 3  # all but the first through run()


def test_load_triton_kernels_gives_the_backend_interface() -> None:
    kernels = [_gelu_kernel(10, F32), _softmax_kernel(3, 4, F32)]
    sources = [generate_triton(kernel, interpret=True) for kernel in kernels]
    launchers = triton_build.load_triton_kernels(sources, CPU)
    assert set(launchers) == {"gelu_10", "softmax_0"}
    data = torch.randn(3, 4)
    out = torch.empty(3, 4)
    launchers["softmax_0"](out, data)
    assert_close(out, torch.softmax(data, 1), 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# GPU sources compile (to sm_90 PTX and cubin, with Triton's bundled ptxas; no GPU needed)

POINTER_TYPES = {
    F32: "*fp32", F64: "*fp64", F16: "*fp16", BF16: "*bf16", I8: "*i8", U8: "*u8",
    I32: "*i32", I64: "*i64", BOOL: "*i1",
}  # fmt: skip


def compile_for_gpu(source: TritonSource) -> Any:
    """``source`` compiled as the first launch would on an H100 (16-byte aligned pointers)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    function = getattr(triton_build._import(triton_build.write_module(source), False), source.name)
    names = function.arg_names
    pointers = names[: len(source.arguments)]
    signature = {n: POINTER_TYPES[d] for n, d in zip(pointers, source.argument_dtypes, strict=True)}
    if source.has_seed:
        signature["seed_ptr"] = "*i64"
    signature.update({name: "constexpr" for name in source.constexprs})
    constexprs = {(names.index(k),): v for k, v in source.constexprs.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(source.arguments))}
    ast = ASTSource(function, signature, constexprs=constexprs, attrs=attrs)
    options = {**triton_build.OPTIONS, "num_warps": source.num_warps}
    return triton_compile(ast, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.fixture(scope="module")
def gpu_compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    try:
        compile_for_gpu(generate_triton(_gelu_kernel(16, F32), interpret=False))
    except Exception as error:  # no nvidia backend or ptxas here
        pytest.skip(f"cannot compile for sm_90 here: {type(error).__name__}: {error}")
    yield
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous


def _every_op_kernel(dtype: torch.dtype) -> Kernel:
    """One pointwise kernel applying every elementwise op that takes ``dtype`` (libdevice
    spellings included), plus conversions to every dtype."""
    n = 128  # one element per thread keeps the compile short
    x = var("x", n)
    a, b = load(buffer("a", (n,), dtype), x), load(buffer("b", (n,), dtype), x)
    flag = load(buffer("flag", (n,), BOOL), x)
    stores = []
    for row in ELEMENTWISE:
        if dtype not in row.dtypes and not (dtype == F64 and F32 in row.dtypes):
            continue
        if row.op is Op.CONVERT:
            values = [
                apply(Op.CONVERT, a, dtype=t) for t in (F32, F64, F16, BF16, I8, U8, I32, I64, BOOL)
            ]
        elif row.op is Op.WHERE:
            values = [
                apply(Op.WHERE, flag, a, b),
                apply(Op.WHERE, flag, const(True if dtype == BOOL else 2, dtype), b),
            ]
        else:
            arity = 1 if Tag.UNARY in row.tags else 2
            out = row.impl(None, *[torch.ones(1, dtype=dtype)] * arity).dtype
            operands = (a,) if Tag.UNARY in row.tags else (a, b)
            values = [apply(row.op, *operands, dtype=out)]
            if Tag.BINARY in row.tags:
                values.append(apply(row.op, a, const(_scalar(row.op, dtype), dtype), dtype=out))
        for value in values:
            stores.append(Store(buffer(f"o{len(stores)}", (n,), value.dtype), x, value))
    return Kernel(f"every_op_{str(dtype)[6:]}", n, 1, stores)


def _every_reduction_kernel(dtype: torch.dtype) -> Kernel:
    rows, cols = 33, 300
    x, r = var("x", rows), var("r", cols)
    v = load(buffer("a", (rows, cols), dtype), x * cols + r)
    stores = []
    for kind in ReduceKind:
        out = I64 if kind in (ReduceKind.ARGMAX, ReduceKind.ARGMIN) else dtype
        stores.append(Store(buffer(f"o{len(stores)}", (rows,), out), x, Reduce(out, kind, v)))
    return Kernel(f"every_reduction_{str(dtype)[6:]}", rows, cols, stores)


def _rand_kernel() -> Kernel:
    n = 4096
    x = var("x", n)
    seed = buffer("seed", (), I64)
    keep = apply(Op.LT, Rand(F32, seed, x), const(0.9), dtype=BOOL)
    value = apply(
        Op.WHERE,
        keep,
        apply(Op.MUL, load(buffer("a", (n,), BF16), x), const(1 / 0.9, BF16)),
        const(0.0, BF16),
    )
    stores = [
        Store(buffer("o", (n,), BF16), x, value),
        Store(buffer("z", (n,), F32), x, Rand(F32, seed, x, normal=True)),
    ]
    return Kernel("dropout", n, 1, stores)


GPU_KERNELS = {
    **{
        f"every_op_{str(d)[6:]}": (lambda d=d: _every_op_kernel(d))
        for d in (F32, BF16, F16, F64, I32, I64, BOOL)
    },
    **{
        f"every_reduction_{str(d)[6:]}": (lambda d=d: _every_reduction_kernel(d))
        for d in (F32, BF16, I32)
    },
    "layer_norm": lambda: _layer_norm_kernel(4096, 4096, BF16),
    "softmax_long_rows": lambda: _softmax_kernel(64, 50000, BF16),
    "dropout": _rand_kernel,
    "int64_indices": lambda: _gelu_kernel(2**31 + 8, BF16),
}


@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_sources_compile(name: str, gpu_compiler: None) -> None:
    kernel = GPU_KERNELS[name]()
    source = generate_triton(kernel, interpret=False)
    assert "cubin" in compile_for_gpu(source).asm
    if name.startswith("every_reduction"):
        looped = dataclasses.replace(
            choose_blocks(kernel, False), form=Form.LOOPED, xblock=2, rblock=64
        )
        assert (
            "cubin" in compile_for_gpu(generate_triton(kernel, interpret=False, blocks=looped)).asm
        )


def test_persistent_softmax_reads_once_and_exps_once_per_element(gpu_compiler: None) -> None:
    """bf16 [16384, 4096]: one row per program, 8 warps, 16 elements per thread: the PTX has
    two 16-byte loads, 16 ex2 (one exp per element) and two 16-byte stores per thread."""
    source = generate_triton(_softmax_kernel(16384, 4096, BF16), interpret=False)
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 1, "RBLOCK": 4096}, 8)
    ptx = compile_for_gpu(source).asm["ptx"]
    assert ptx.count("ex2.approx") == 16
    assert ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 2


def test_compile_pool_answers_every_job_even_after_its_worker_dies() -> None:
    """Each job's callback runs with the worker's error (here: no such module), and once the
    worker is gone the callbacks still run (the parent then compiles those kernels itself)."""
    from kiln.runtime import compile_pool

    pool = compile_pool.Pool(1)
    job = {"path": "/nonexistent/kernel.py", "name": "k", "specialization": "{}"}
    try:
        first = pool.submit(job, lambda error: "then: " + error)
        assert first.result(timeout=120).startswith("then: /nonexistent/kernel.py")
        pool.processes[0].kill()
        pool.processes[0].wait()
        later = [pool.submit(job, lambda error: "then: " + error) for _ in range(2)]
        for future in later:
            assert future.result(timeout=120).startswith("then: the compile worker"), later
        assert "1 jobs" in compile_pool.timings(pool)
    finally:
        pool.close()


def test_a_forked_child_gets_its_own_compile_pool(monkeypatch: Any) -> None:
    """A child forked after the pool started must not share the parent's worker pipes."""
    from kiln.runtime import compile_pool

    monkeypatch.setattr(compile_pool, "_pool", None)
    monkeypatch.setattr(compile_pool, "size", lambda: 1)
    parent = compile_pool.start()
    try:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (runs in the child)
            ok = compile_pool.start() is not parent and compile_pool.start().pid == os.getpid()
            compile_pool.start().close()
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.waitpid(child, 0)
        assert os.read(read, 1) == b"1"
        assert compile_pool.start() is parent
    finally:
        parent.close()


def test_parent_warm_up_fills_tritons_cache_key_once_per_process() -> None:
    """The warm-up thread computes Triton's cache key (and imports its compiler) ahead of the
    first kernel load; the join waits for it, and a second start reuses the same thread."""
    from triton.runtime.cache import triton_key

    triton_build._start_parent_warm_up()
    first = triton_build._warm_up
    triton_build._start_parent_warm_up()
    assert triton_build._warm_up is first and first is not None
    triton_build._join_parent_warm_up()
    assert all(event.is_set() for event in first.done.values())
    first.thread.join(timeout=5)
    assert not first.thread.is_alive()
    assert triton_key.cache_info().currsize == 1


def test_a_join_waits_only_for_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking specializations waits for the driver and imports; loading waits for the key."""
    warm_up = triton_build._WarmUp.__new__(triton_build._WarmUp)
    warm_up.pid = os.getpid()
    warm_up.done = {step: threading.Event() for step in triton_build._WarmUp.STEPS}
    warm_up.key_wanted = threading.Event()
    for step in ("driver", "compiler", "gluon"):
        warm_up.done[step].set()
    monkeypatch.setattr(triton_build, "_warm_up", warm_up)
    triton_build._join_parent_warm_up("gluon")  # returns: its steps are done
    assert not warm_up.key_wanted.is_set()  # (kernels from the binary index need no key)
    waiter = threading.Thread(target=triton_build._join_parent_warm_up)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # still waiting for the cache key
    assert warm_up.key_wanted.is_set()  # which it asked the warm-up thread for
    warm_up.done["cache key"].set()
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_a_kernel_triton_cannot_compile_runs_as_pytorch_ops() -> None:
    """A GPU compile failure (a Triton compiler bug: 3.6's layout pass rejected a backward
    BatchNorm kernel of RepVGG and a DenseNet kernel) warns once and runs the launcher's
    fallback, on that call and every later one; without a fallback it still raises."""
    from kiln.runtime.triton_launch import TritonLauncher

    class Failing:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*arguments: Any, **kwargs: Any) -> None:
                raise RuntimeError("PassManager::run failed")

            return launch

    source = SimpleNamespace(
        arguments=["a0", "a1"],
        grid=(4, 1, 1),
        constexprs={},
        interpret=False,
        kernel_name="k0_broken",
        has_seed=False,
        num_warps=4,
        num_stages=0,
    )
    calls: list[tuple[Any, ...]] = []
    launcher = TritonLauncher(source, Path("k0_broken.py"), Failing())  # type: ignore[arg-type]
    launcher.fallback = lambda *arguments: calls.append(arguments)
    x, y = torch.randn(4), torch.randn(4)
    with pytest.warns(UserWarning, match="k0_broken failed to compile or launch"):
        launcher(x, y)
    launcher(y, x)
    assert calls == [(x, y), (y, x)]
    bare = TritonLauncher(source, Path("k0_broken.py"), Failing())  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="PassManager"):
        bare(x, y)


@pytest.mark.parametrize("looped", [False, True])
def test_the_second_form_reshapes_reductions_and_computes_the_same(looped: bool) -> None:
    """The form a kernel is compiled in again when Triton's layout pass fails on its first
    (Triton 3.6 on a BatchNorm backward): every row result ``[XBLOCK, 1]`` by ``tl.reshape``,
    the same values (layer norm, persistent and looped, in the interpreter)."""
    from kiln.codegen.sources import Form
    from kiln.codegen.triton import Blocks
    from kiln.schedule.program import kernel_arguments

    kernel = _layer_norm_kernel(6, 40, F32)
    blocks = Blocks(Form.LOOPED, 2, 16, 4) if looped else None
    tensors = {"a": torch.randn(6, 40), "w": torch.randn(40), "b": torch.randn(40)}
    expected = dict(tensors, **outputs(kernel))
    run(kernel, expected, blocks=blocks)
    source = generate_triton(kernel, interpret=True, blocks=blocks, reshaped=True)
    assert "tl.reshape(tl.sum(" in source.source and "1)[:, None]" not in source.source
    got = dict(tensors, **outputs(kernel))
    launch = triton_build.build_triton(source)
    launch(*[got[b.name] for b in kernel_arguments(kernel)])
    for name in ("y", "mean", "rstd"):
        torch.testing.assert_close(got[name], expected[name])


def test_a_kernel_whose_first_form_fails_runs_in_its_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``SecondForm``: the launcher's fallback generates the kernel reshaped, once, launches it
    on every later call, and gives that launcher PyTorch ops as its own fallback."""
    from kiln.backends import kernels

    built: list[Any] = []

    class Recording:
        fallback: Any = None

        def __init__(self, source: Any) -> None:
            self.source, self.calls = source, []

        def __call__(self, *arguments: Any) -> None:
            self.calls.append(arguments)

    def build(sources: list[Any], device: torch.device) -> list[Any]:
        built.extend(Recording(s) for s in sources)
        return built[-len(sources) :]

    monkeypatch.setattr(kernels, "build_triton_kernels", build)
    kernel = _layer_norm_kernel(6, 40, F32)
    second = kernels.SecondForm(kernel, torch.device("cpu"))
    a, b = torch.randn(2), torch.randn(2)
    second(a, b)
    second(b, a)
    (launcher,) = built
    assert "tl.reshape(" in launcher.source.source and not launcher.source.interpret
    assert launcher.calls == [(a, b), (b, a)] and launcher.fallback is not None


def test_pytorch_ops_run_a_kernel_without_copying_from_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The PyTorch-ops fallback makes its constants on the kernel's device: a host tensor
    copied in would break a CUDA graph's capture (ResNet-50's backward recorded none)."""
    from kiln.schedule import evaluate
    from kiln.schedule.program import kernel_arguments

    kernel = _layer_norm_kernel(6, 40, F32)
    tensors = {"a": torch.randn(6, 40), "w": torch.randn(40), "b": torch.randn(40)}
    expected = dict(tensors, **outputs(kernel))
    run(kernel, expected)
    got = dict(tensors, **outputs(kernel))

    def no_host_tensors(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("torch.tensor: a host value copied to the device")

    monkeypatch.setattr(torch, "tensor", no_host_tensors)
    evaluate.evaluate_kernel(kernel, [got[b.name] for b in kernel_arguments(kernel)])
    monkeypatch.undo()
    for name in ("y", "mean", "rstd"):
        torch.testing.assert_close(got[name], expected[name])


def test_a_kernel_that_failed_to_precompile_starts_in_its_second_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel whose first form failed in the compile workers gets its second form compiled
    with the rest, before the first launch (not a failing compile, then another, one by one
    at launch: MobileNet-V3 has 24 such kernels under Triton 3.6), with a warning naming it;
    a kernel that precompiled runs as it is."""
    from kiln.backends import kernels

    class Fake:
        def __init__(self, source: Any, error: str | None = None) -> None:
            self.source, self.precompile_error = source, error
            self.fallback: Any = None
            self.failed: str | None = None

    broken = _layer_norm_kernel(6, 40, F32)
    fine = _softmax_kernel(4, 16, F32)

    def load(sources: list[Any], device: torch.device) -> dict[str, Any]:
        error = "k.py: RuntimeError: PassManager::run failed"
        return {
            s.kernel_name: Fake(s, error if s.kernel_name == broken.name else None) for s in sources
        }

    seconds: list[Any] = []

    def build(sources: list[Any], device: torch.device) -> list[Any]:
        seconds.extend(Fake(s) for s in sources)
        return seconds[-len(sources) :]

    monkeypatch.setattr(kernels, "load_triton_kernels", load)
    monkeypatch.setattr(kernels, "build_triton_kernels", build)
    with pytest.warns(UserWarning, match="layer_norm_0 failed to compile: .*PassManager"):
        launchers = kernels._triton([broken, fine], torch.device("cpu"))
    (second,) = seconds
    assert "tl.reshape(" in second.source.source and second.fallback is not None
    assert launchers[broken.name].failed and launchers[broken.name].fallback.launcher is second
    assert launchers[fine.name].failed is None and launchers[fine.name].fallback.launcher is None


def test_a_kernel_the_compiler_failed_on_in_a_worker_is_not_compiled_again_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's compiler failure would repeat in this process (serially, about 0.2 s a
    kernel): it is reported as the kernel's, and precompile names its path; a worker that
    died still has its kernel compiled here."""
    compiled: list[Any] = []
    monkeypatch.setattr(triton_build, "_warm_kernel", lambda job: compiled.append(job) or "")
    job = {"path": "/cache/k7.py"}
    error = "/cache/k7.py: RuntimeError: PassManager::run failed"
    assert triton_build._loaded(job, error) == error and not compiled
    assert triton_build.compiler_failed(error)
    assert triton_build._loaded(job, "the compile worker exited") == "the compile worker exited"
    assert compiled == [job] and not triton_build.compiler_failed("the compile worker exited")
