"""The architecture, checked: every ``kiln.*`` import (module level or inside a function) read
with ``ast`` follows the pipeline's order, no packages import each other in a cycle, and the
code stays within its line budget (the count is printed at the end of every test run).

The layers, bottom to top; a module may import its own layer and the layers below it only:

    config, errors, recording,  foundations (environment, error types, explain's events, the
    collector, checked_files,   garbage-collector pause, damage-checked cache files, compiled
    code_cache                  code on disk)
    options, random_state   per-compile choices; the RNG state capture and compiles preserve
    ir                      the graph IR
    ops                     registry rows, translations, externs
    frontends               proxy tensors, kiln.trace
    capture                 bytecode capture
    passes, autodiff, schedule, codegen, runtime, backends   the stages, in order
    pipeline                the stages after capture, in one sequence
    api, kiln, dynamo,      the public entry points (dynamo: torch.compile's backend; lazy:
    lazy, exported          the lazy-tensor frontend; exported: kiln.export and kiln.load)
    testing                 the conformance kit (kiln.testing: runs backends through the api)
    bench, demo, cli        the tools (the ``kiln`` command)
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

KILN = Path(__file__).resolve().parent.parent / "kiln"

LAYERS: list[set[str]] = [
    {"config", "errors", "recording", "collector", "code_cache", "checked_files"},
    {"options", "random_state"},
    {"ir"},
    {"ops"},
    {"frontends"},
    {"capture"},
    {"passes"},
    {"autodiff"},
    {"schedule"},
    {"codegen"},
    {"runtime"},
    {"backends"},
    {"pipeline"},
    {"api", "kiln", "dynamo", "lazy", "exported"},
    {"testing"},
    {"bench"},
    {"demo"},
    {"cli", "__main__"},
]
# Earlier stages a stage may still not import: the runtime builds, loads and launches what
# codegen produced (the plain data of kiln/codegen/sources.py), never generating code itself.
FORBIDDEN = {("runtime", "codegen"), ("runtime", "schedule")}
PRODUCTS = {"kiln.codegen.sources"}  # what a forbidden stage's product may still be read as

# Code lines of kiln/ (no blanks, comments, docstrings) after all features. 32,000 until
# 2026-11-27; +50 for passes/pointwise_conv.py (squeeze-excitation convolutions as matmuls),
# the first new pass since the budget was set, after freeing what duplicates and dead code
# offered (the lane evaluator's rewrite gave back 8). +110 the same day for CUDA attention's
# own backward kernels (ops/attention.py's flash, memory-efficient and cuDNN calls and the
# pass that picks them), which replace re-running the forward in every training step. +30
# on 2026-11-27 (after removing two dead helpers) for the partitioner's and the scheduler's
# limits on recomputing a value from many stored ones (MaxViT's backward summed its residual
# stream from 23 saved tensors in one kernel: a 1.1 MB Triton source), and for storing a
# convolution's operand, and the stream it is copied from, channels-last. +55 on 2026-11-28
# for ir/ranges.py (a branch on ``torch.rand(...) < 0.0``, LayerDrop's, decided without a
# break) and for the guards a head that breaks at a call keeps from its callee's capture (the
# artifact cache served one model's break to another). +35 the same day for writing a
# pointwise kernel's store over a buffer that dies in it (schedule/buffers.py; inference
# peaks were above torch.compile's on every vision row); +6 for checking those kept guards
# only when the artifact cache loads a head, not on every call; +10 for cuDNN attention with
# a float mask and for giving cuDNN's backward the output's layout (PyTorch 2.11 returned wrong
# gradients otherwise: ops/attention.py, laid_out_as); +13 for judging a bench row's first
# (compiling) call against eager too (bench/worker.py), as a later one; +21 for building a
# large program's C++ kernels as one translation unit per core at once (backends/kernels.py);
# +13 for handing cuDNN's attention backward the output laid out as eager's (ops/attention.py);
# +10 for a kernel's later member keeping its source's dim order (schedule/scheduler.py);
# +6 for the memory-efficient attention kernel's mask gradient (T5's learned position bias);
# +4 for probing CPU attention's layouts with the inputs' requires_grad (T5 and ViT rebuilt
# their programs at the second call); +5 for printing only the operand a select on a
# segment's constant mask takes (codegen/cpp_segments.py: DenseNet's C++ was 13 MB); +7 for
# lane segments in split column reductions (DenseNet's per-image sums over a channel cat);
# +2 for whole rows of channels as their lanes (CAT_COLUMN_BLOCK: the cat block 4-7x faster).
# +93 on 2026-11-28 for symbolic sizes on inputs dense in any dim order (a key-value cache a
# program returned transposed made generate() recompile at every token), for stride queries
# answered as eager's or by a graph break (they answered contiguous strides, silently wrong),
# and for an index_put written into the input it mutates (a static cache's update copied the
# whole cache twice a layer and token). +97 the same day for schedule/eager_layouts.py
# (results come back with eager's strides: a conv net's output was channels-last, a cat
# followed its producer's order, ``out.view()`` raised where eager's worked) and for lazy
# tensors reading their strides off their data (the wrapper answered contiguous). +49 for
# checking that written inputs share no storage in the native guard plan (C++ source: 159
# written BatchNorm buffers among 640 inputs cost 235 us a call in Python, 15 natively).
# +569 on 2026-11-28 for programs in symbolic sizes (issue 19): the backend compiles a graph
# with symbols once for a range of sizes, guarded by what it decided on them (backends/kiln.py,
# pipeline.py), kernels take their sizes as arguments (Triton's not specialized, C++'s int64;
# the index algebra, lowering, views and layouts carry symbolic sizes; codegen/cpp_reductions.py
# split out of cpp.py to keep it under 800 lines), and the host program binds the sizes,
# sizes its externs per call and launches a recorded kernel at a new size without Triton's
# slow path; a size served 64 times gets its own program (constant sizes run faster); C++
# kernels divide by a runtime size as a multiply and a shift (vectorized); memos keyed by
# sizes start over past SIZE_MEMO entries. GPT-2's
# first generate() of 128 tokens compiled 129 programs (92 s on the H200); now 7 (19 s).
# +194 on 2026-11-28 (issue 19, and wrong results found on the way): reading a dict, set,
# deque or container module guards its contents (a Sequential that gained a layer ran the old
# graph); long C++ float sums add chunks into partials (a BatchNorm over a symbolic batch was
# ten times farther from float64 than eager); PyTorch's CPU 1x1 stride-2 weight gradient on
# channels-last input (a crash) computed another way; PyTorch's view rule on symbolic sizes;
# reductions split and chunked, and C++ lane splits, with symbolic sizes (guarded); memos of
# the index algebra per ShapeEnv (a dynamic ResNet-18 training step compiled in 67 s).
# +15: CPU attention's kernel choice probed at the hints, and broadcast inputs (a sum's
# gradient) as a layout pattern, so dynamic training stops compiling once per size.
# +47: checks on sizes (decisions only code can test) in ShapeEnv, PerSize and programs; CUDA
# attention's kernel asked at the hints and checked per size, its result types as formulas.
# +6: index_copy's put runs as index_copy (eager raises outside [0, size); index_put wrapped).
# +73: programs in symbolic sizes kept on disk with their relations, read back rehinted.
# +61: reduce-overhead keeps symbols: one program for a range of sizes, a recording per size.
# +84: max pool gradients by window positions; the partitioner saves what reads a window.
# +11: extern layouts learned at run time keep the shape they were seen at; unsqueeze strides.
# +10: the benchmark reports reserved memory too (CUDA-graph pools count for every compiler).
# +73: reduce-overhead lends a backward's gradients (uncopied) once the loop releases them;
# the pool's copies in and out in a module of their own.
# +28: in-place writes to a leaf that requires grad refused as eager refuses them (guarded on
# is_leaf); a write under no_grad leaves the tensor requiring grad (an untracked write).
# +10: the recompile-limit warning says what to do when a Python number keeps changing.
# +8: on 3.13 a break at TO_BOOL before a jump resumes per branch (as 3.11/3.12 do).
# +11: in-place writes in a module of their own (frontends/writes.py: its imports); the
# leafness guard of written inputs a method of its own.
# +687: max-autotune's matmul and convolution templates: which products pair with their
# reading kernel (schedule/templates.py), the fused kernel's Triton (codegen/triton_matmul.py:
# tiled products, implicit-GEMM and depthwise convolutions), the measured choice against the
# library (backends/templates.py), num_stages through the launcher, the debug directory's
# host program the one that runs.
# +2: explain lists every measured alternative of an autotune choice.
# +29: F.embedding's max_norm renormalizes the weight in the graph (an untracked assignment of
# a translation), not by a graph break.
# +1: a matmul pair's cached choice names PyTorch's and cuDNN's versions (the library's speed).
# +36: under max-autotune, explain says why a product has no template.
# +4: the bench notes how many products max-autotune ran as templates.
# -4: a template helper nobody called, removed.
# -7: the template printer names its operand pointers with codegen's _identifier and prints
# its dot once.
# +299: a split variance reads its values once on the GPU (Chan's update over shifted values,
# matched down to which mean each element meets); a kernel recomputes a stored value from what
# it loads anyway (schedule/recompute.py); per-channel factors broadcast into flat GPU kernels
# are stored (those of graph inputs ahead of everything, in one launch); a kernel never loads
# what a later step stores; Triton's second form for a kernel whose first fails to compile;
# PyTorch-op fallbacks make constants on the device.
# +19: a kernel that failed to precompile gets its second form compiled before its launch.
# +4: a compiler failure in a compile worker is not compiled again in-process.
# +5: the second forms' start in a helper of its own.
# -4: reduction_split uses the IR's own same_size/same_shape and translations' size_scalar.
# +7: a split variance's groups sum values and squares shifted by their own first value.
# +2: an index's magnitude counts a quotient at its operand's value bound.
# +5: the layout walk passes over values broadcast in memory.
# +7: a broadcast graph input still ends the layout walk; inlining's kept sinks and
# recompute's order are the same every run.
# +39: index keys computed once per atom and index; a memo scope for static index arithmetic
# while a program is scheduled (ResNet-50's training step: 0.88 s against 1.26).
# +48: a variance's own mean gets no cotangent from its squares in the reverse sweep; a mean
# is found past shape-only steps on either side of its division.
# +57: unused outputs' zero cotangents made, kept and not copied again by a CUDA-graph
# replay; dense transposed results copied out in one batch (GPT-2's 53 copies a step: 5).
# +20: a differentiated frozen BatchNorm is centred, (x - mean) * scale + bias (the weight's
# gradient no longer cancels when the mean dwarfs the spread).
# +5: the CUDA-graph runner's copy batches planned in cudagraph_copies.plan_batches (the runner
# module back under 800 lines).
# +9: a graph input broadcast per channel (a BatchNorm's bias) no longer decides the dim order
# a kernel walks (a differentiated frozen BatchNorm's ReLU walked channels-last data as NCHW).
# +5: an index_put scatters in place into a temporary only it reads (an embedding's gradient
# into its zeros), whose memory no later temporary takes over while the result lives.
# +1: the partitioner's window rule saves a pooled sum whole, not its partial sum.
# -5: layout_choice._orderless tests a broadcast once (its stored-factor twin folded in).
# +10: every CUDA-graph result may be lent (inference too, a gapped one too); the recorder in
# a module of its own drops cuBLAS's warm-up workspaces and leaves its own in the pool.
# +30: a replay's plan made once in groups (saved, lent, the rest; what held() checks), so a
# training step's two replays loop over each output once, not four times, in Python.
# +7: a training graph calls autograd's C++ apply (Function.apply's Python pass: ~30 us).
# +28: a backward borrows its forward's static copy of an input it reads (static_input).
# +9: SizedRunners in a module of its own (cudagraph_sizes.py: cudagraphs.py under 800).
# +5: the head hoists its inputs' shared module paths (Binder.hoist, shared with guards).
# +13: lending resumes after a kept result (KEPT_LIMIT, a replay judges a recording once); the
# bench's loop drops the result of its timing probe and of its first call.
# +101: a copied input's buffer donated to its recording (made in the pool, dropped by the host
# program after its last reader: Donated, recorded_run, unowned; the forward flag).
# +105: a BatchNorm with batch statistics differentiated in closed form (ops/batch_norm_backward.py,
# a marker the partitioner may recompute).
# +15: `kiln bench --json` rewrites its file after every row (a run cut off keeps its rows).
# +13: a program key hashes a constant's viewed stretch of storage, once (backends/programs.py).
# +16: the capture artifact's pickler decides plain and Kiln data by type, names once.
# +35: capture probes user objects without their __getattr__ (capture/guards/probing.py); a
# container written back unchanged is not replayed (T5's and BART's captures now stored).
# +6: guard names and builtins' owners asked without a user __getattr__ either.
# +2: routing and the artifact's stable names too.
# +7: vars(obj) reads obj.__dict__ and f.__call__(x) calls f, without a graph break.
# +24: a logger's call below its level costs no graph break (calls/dispatch.py _log_disabled).
# +10: probe asks classes without a fallback of their own (nn.Module's) directly: routed calls.
# -5: probing moved under capture/guards, so a guard's name uses it rather than a twin.
LINE_BUDGET = 35_525


def _module_name(path: Path) -> str:
    parts = path.relative_to(KILN.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, int]]]:
    """Each kiln module -> the kiln modules it imports (with the line), at any depth."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(KILN.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: list[tuple[str, int]] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges += [(a.name, node.lineno) for a in node.names if a.name.startswith("kiln")]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the package
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if base == "kiln" or base.startswith("kiln."):
                    edges.append((base, node.lineno))
        found[name] = edges
    return found


def _layer_name(module: str) -> str:
    """``kiln.capture.cache`` -> ``capture``; ``kiln`` -> ``kiln``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kiln"


def _rank(name: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if name in layer:
            return rank
    raise AssertionError(f"kiln/{name} belongs to no layer: add it to LAYERS in {__file__}")


def test_imports_follow_the_pipeline() -> None:
    wrong = []
    for module, edges in _imports().items():
        mine = _layer_name(module)
        for imported, line in edges:
            theirs = _layer_name(imported)
            if theirs == mine:
                continue
            forbidden = (mine, theirs) in FORBIDDEN and imported not in PRODUCTS
            if _rank(theirs) > _rank(mine) or forbidden:
                wrong.append(f"{module}:{line} imports {imported} ({mine} -> {theirs})")
    assert not wrong, "imports against the pipeline order:\n" + "\n".join(wrong)


def _package_of(module: str, depth: int) -> str:
    return ".".join(module.split(".")[: depth + 1])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_package_cycles() -> None:
    """At every depth (``kiln.capture`` vs ``kiln.ops``, ``kiln.capture.calls`` vs
    ``kiln.capture.handlers``), packages never import each other both ways."""
    imports = _imports()
    packages = {_module_name(p) for p in KILN.rglob("__init__.py")}
    cycles = []
    for depth in range(1, 4):
        graph: dict[str, set[str]] = defaultdict(set)
        for module, edges in imports.items():
            here = _package_of(module, depth)
            for imported, _ in edges:
                there = _package_of(imported, depth)
                same_parent = here.rpartition(".")[0] == there.rpartition(".")[0]
                if here != there and same_parent and (here in packages or there in packages):
                    graph[here].add(there)
        cycles += _cycles(graph)
    assert not cycles, f"packages importing each other: {cycles}"


def code_lines(source: str) -> int:
    """Lines holding code: no blank lines, comments or docstrings."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped and token.type != tokenize.ENDMARKER:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def kiln_code_lines() -> int:
    return sum(code_lines(path.read_text()) for path in KILN.rglob("*.py"))


def test_code_lines_within_budget() -> None:
    sample = '"""doc"""\n\n# note\nx = 1  # why\n\n\ndef f():\n    """doc"""\n    return x\n'
    assert code_lines(sample) == 3
    count = kiln_code_lines()
    assert count <= LINE_BUDGET, f"kiln/ has {count} code lines, over the budget of {LINE_BUDGET}"
