"""Static anti-hacking analysis of a program-mode candidate (a Python file defining ``ModelNew``):
reads its Python with ``ast`` and the CUDA it compiles with a comment- and string-aware scanner.

Nothing here executes the candidate. Rules and their severities are listed in docs/verify.md.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = ["Finding", "analyze", "Analysis", "Reference", "MAJOR", "MINOR"]

MAJOR = "major"  # the result cannot be trusted
MINOR = "minor"  # suspicious; worth a look or a rubric penalty, not a rejection


@dataclass(frozen=True)
class Finding:
    """One rule that fired: its stable id, severity, a one-sentence reason, where, and the code."""

    rule: str
    severity: str  # MAJOR or MINOR
    message: str
    line: int | None  # 1-based line in the candidate, None when the finding is about the whole file
    evidence: str  # the code excerpt that triggered it ("" when there is none)


# Operators whose work a solution is meant to do itself. GEMM/convolution ones are "library" ops:
# calling cuBLAS/cuDNN for them beside a real custom kernel is a legitimate engineering choice.
_LIBRARY_OPS = {
    "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "einsum", "tensordot",
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "cudnn_convolution",
}
_HEAVY_OPS = _LIBRARY_OPS | {
    "softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm",
    "scaled_dot_product_attention", "multi_head_attention_forward", "lstm", "gru", "rnn_tanh",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
    "cross_entropy", "nll_loss", "cumsum", "cumprod", "sort", "topk", "cdist",
}
# Tensor methods that do the same heavy work (x.matmul(w), x.softmax(-1)).
_HEAVY_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "softmax", "log_softmax", "einsum"}
_LIBRARY_MODULES = {"Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d",
                    "ConvTranspose2d", "ConvTranspose3d"}
_HEAVY_MODULES = _LIBRARY_MODULES | {
    "LSTM", "GRU", "RNN", "MultiheadAttention", "Transformer", "TransformerEncoder",
    "TransformerDecoder", "TransformerEncoderLayer", "TransformerDecoderLayer", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
    "InstanceNorm3d", "RMSNorm", "Softmax", "LogSoftmax", "MaxPool1d", "MaxPool2d", "MaxPool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool2d", "Embedding",
}
# torch calls that never count as doing the problem's work, even when the reference uses them.
_BOOKKEEPING = {
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "arange", "tensor", "as_tensor", "from_numpy", "view", "view_as", "reshape",
    "contiguous", "size", "dim", "numel", "permute", "transpose", "t", "flatten", "unflatten",
    "unsqueeze", "squeeze", "expand", "expand_as", "to", "cuda", "cpu", "float", "double", "half",
    "is_contiguous", "stride", "data_ptr", "clone", "chunk", "split", "narrow", "select", "item",
    "tolist", "no_grad", "manual_seed", "device", "get_device", "current_stream", "synchronize",
    "is_available", "type", "new_empty", "new_zeros", "Module", "Parameter", "randn", "rand",
}
_ALLOCATORS = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
               "full", "full_like", "new_empty", "new_zeros", "new_ones", "new_full"}
# Names through which a candidate could reach the timing protocol: patching them is never legitimate.
_PATCHABLE_ROOTS = {"torch", "time", "timeit", "triton", "stitchcuda", "gc", "builtins", "cupy",
                    "numpy", "threading"}
_PERSISTING_L2 = ("cudaStreamSetAttribute", "cuStreamSetAttribute", "accessPolicyWindow",
                  "cudaLimitPersistingL2CacheSize", "CU_LIMIT_PERSISTING_L2_CACHE_SIZE",
                  "cudaAccessPropertyPersisting", "CU_ACCESS_PROPERTY_PERSISTING",
                  "cudaStreamAttributeAccessPolicyWindow", "persistingL2CacheMaxSize",
                  "cudaKernelNodeAttributeAccessPolicyWindow")
# Methods that return a view (or the same tensor) of their receiver: the storage stays the same.
_VIEWS = {"contiguous", "view", "reshape", "flatten", "squeeze", "unsqueeze", "t", "transpose", "permute",
          "expand", "narrow", "select", "to", "cuda", "detach", "view_as", "as_strided", "unflatten"}
# In-place fills: a buffer they write still holds a constant.
_FILLS = {"zero_", "fill_", "fill_diagonal_"}
_METADATA_IN_PLACE = {"requires_grad_", "share_memory_", "retain_grad_", "rename_"}
_LOW_PRECISION = {"float16", "half", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
# Code made at run time: nothing static can say what it does.
_RUNTIME_CODE = {"exec", "eval", "compile", "__import__", "importlib.import_module", "importlib.__import__",
                 "importlib.util.spec_from_file_location", "importlib.util.module_from_spec",
                 "importlib.util.spec_from_loader", "runpy.run_path", "runpy.run_module",
                 "types.FunctionType", "types.CodeType", "marshal.loads", "pickle.loads", "dill.loads"}
# Reaching objects the candidate did not create.
_INTROSPECTION = {"inspect.stack", "inspect.currentframe", "inspect.getouterframes", "inspect.getmembers",
                  "inspect.getmodule", "inspect.trace", "sys._getframe", "traceback.extract_stack",
                  "traceback.walk_stack"}
_FRAME_ATTRS = {"f_back", "f_locals", "f_globals", "gi_frame", "tb_frame", "__globals__", "__closure__"}
_DECODERS = {"base64.b64decode", "base64.b32decode", "base64.b85decode", "base64.a85decode",
             "base64.decodebytes", "codecs.decode", "zlib.decompress", "bz2.decompress", "lzma.decompress",
             "binascii.unhexlify", "binascii.a2b_base64"}
# numpy names that only describe or hold data on the host (a dtype, an array made from Python values).
_HOST_OK = {"float32", "float16", "float64", "int32", "int64", "dtype", "prod", "iinfo", "finfo", "ceil",
            "sqrt", "log2", "array", "asarray", "integer", "floating"}
# ATen from C++: at::matmul(, torch::softmax(, at::native::..., x.mm( inside the extension's sources.
_ATEN_CALL = re.compile(r"(?:\b(?:at|torch)(?:::native)?::|\.)(?P<op>[a-z_][a-z0-9_]*)\s*\(")


def analyze(source: str, reference_source: str | None = None) -> list[Finding]:
    """Returns the findings for a candidate's source, sorted by line; ``reference_source`` (the
    KernelBench problem file) sharpens the rules on heavy operators, shapes and precision."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [Finding("syntax-error", MAJOR, f"the candidate is not valid Python: {exc.msg}.",
                        exc.lineno, _clip((exc.text or "").strip()))]
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; absurd nesting
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return [Finding("syntax-error", MAJOR, f"the candidate cannot be parsed ({detail}).", None, "")]
    try:
        reference = Reference.parse(reference_source)
        findings = Analysis(source, tree, reference).run()
    except RecursionError:
        # Nesting deep enough to exhaust the stack is itself a reason not to trust the file.
        return [Finding("analysis-incomplete", MAJOR, "the candidate is nested too deeply to analyze.",
                        None, "")]
    # Every field in the key: a set iterates in hash order, which differs between processes (two findings of
    # one rule on one line would otherwise change places, and the feedback text with them).
    unique = sorted(set(findings), key=lambda f: (f.line or 0, f.rule, f.evidence, f.severity, f.message))
    return unique


def _clip(text: str, limit: int = 200) -> str:
    # Evidence goes into reports and prompts; a generated one-line monster must not flood them.
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# CUDA source scanning


def strip_cuda(text: str) -> str:
    """Blanks out comments, string and character literals (raw strings included), keeping every
    newline and the length, so offsets and line numbers in the result match the original."""
    out = list(text)
    i, n = 0, len(text)

    def blank(start: int, end: int) -> None:
        for k in range(start, min(end, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = i
            while end < n and text[end] != "\n":
                # A backslash-newline continues a // comment onto the next line.
                end += 2 if text[end] == "\\" and end + 1 < n else 1
            blank(i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank(i, end)
            i = end
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum()
                                                                      or text[i - 1] == "_")):
            paren = text.find("(", i + 2)
            delim = text[i + 2:paren] if paren >= 0 else ""
            end = text.find(")" + delim + '"', paren + 1) if paren >= 0 else -1
            end = n if end < 0 else end + len(delim) + 2
            blank(i + 1, end)
            i = end
        elif c in "\"'":
            # A quote inside a number (C++14 digit separators: 1'000) is not a literal.
            if c == "'" and i > 0 and text[i - 1].isalnum():
                i += 1
                continue
            end = i + 1
            while end < n and text[end] != c and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            blank(i + 1, end)
            i = end + 1
        else:
            i += 1
    return "".join(out)


@dataclass
class _CudaKernel:
    name: str
    start: int  # offset of the name
    body_start: int  # offset of the opening brace
    body_end: int  # offset of the closing brace


@dataclass
class _CudaSource:
    text: str  # as written
    clean: str  # comments and literals blanked
    first_line: int  # candidate line of the text's first line
    exact_lines: bool  # False when the literal's lines do not map one to one (escapes, concatenation)

    def line_at(self, offset: int) -> int:
        if not self.exact_lines:
            return self.first_line
        return self.first_line + self.text.count("\n", 0, offset)

    def excerpt(self, offset: int) -> str:
        start = self.text.rfind("\n", 0, offset) + 1
        end = self.text.find("\n", offset)
        return self.text[start:end if end >= 0 else len(self.text)].strip()

    def kernels(self) -> list[_CudaKernel]:
        found = []
        for m in re.finditer(r"\b__global__\b", self.clean):
            pos = m.end()
            # Skip qualifiers and __launch_bounds__(...) to reach "name(".
            name_match = None
            for cand in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", self.clean[pos:]):
                if cand.group(1) in ("__launch_bounds__", "__cluster_dims__", "__maxnreg__"):
                    continue
                name_match = cand
                break
            if name_match is None:
                continue
            paren = pos + name_match.end() - 1
            close = _matching(self.clean, paren, "(", ")")
            brace = self.clean.find("{", close)
            semi = self.clean.find(";", close)
            if close < 0 or brace < 0 or (0 <= semi < brace):
                continue  # a declaration, not a definition
            end = _matching(self.clean, brace, "{", "}")
            found.append(_CudaKernel(name_match.group(1), pos + name_match.start(1), brace,
                                     end if end >= 0 else len(self.clean)))
        return found


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for k in range(start, len(text)):
        if text[k] == open_ch:
            depth += 1
        elif text[k] == close_ch:
            depth -= 1
            if depth == 0:
                return k
    return -1


# --------------------------------------------------------------------------------------------
# The reference problem


@dataclass
class Reference:
    constants: dict[str, int]  # module-level integer sizes (batch_size = 128)
    ops: set[str]  # torch functions and tensor methods its Model.forward calls
    low_precision: bool  # the reference itself works in fp16/bf16

    @classmethod
    def parse(cls, source: str | None) -> "Reference":
        if not source:
            return cls({}, set(), False)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return cls({}, set(), False)
        constants = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) \
                    and type(stmt.value.value) is int:
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = stmt.value.value
        ops: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Model":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "forward":
                        for call in ast.walk(item):
                            # self.layer(x) names a submodule, not an operator.
                            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                                    and not (_dotted(call.func) or "").startswith("self."):
                                ops.add(call.func.attr)
        low = any(isinstance(n, ast.Attribute) and n.attr in _LOW_PRECISION for n in ast.walk(tree))
        return cls(constants, ops - _BOOKKEEPING, low)


# --------------------------------------------------------------------------------------------
# The candidate


def _dotted(node: ast.AST) -> str | None:
    """'torch.nn.functional.linear' for an attribute chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _names_in(node: ast.AST) -> set[str]:
    """Names and dotted self-attributes an expression reads ('x', 'self.weight')."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            dotted = _dotted(sub)
            if dotted and dotted.startswith("self."):
                names.add(dotted)
    return names


def _target_names(target: ast.AST) -> set[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, ast.Name):
        return {target.id}
    dotted = _dotted(target)
    return {dotted} if dotted else set()


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class Analysis:
    def __init__(self, source: str, tree: ast.Module, reference: Reference) -> None:
        self.lines = source.splitlines()
        self.tree = tree
        self.ref = reference
        self.findings: list[Finding] = []
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.aliases = self._import_aliases()
        self._value_aliases()
        self.functions = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
        self.classes = {s.name: s for s in tree.body if isinstance(s, ast.ClassDef)}
        self.model = self.classes.get("ModelNew")
        self.decorators = {d for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                           for d in n.decorator_list}
        self.strings: dict[str, ast.AST] = {}
        self.strings = self._module_strings()
        self.cuda_literals: set[int] = set()  # ids of string literals read as CUDA source

    # ---- helpers

    def add(self, rule: str, severity: str, message: str, node_or_line, evidence: str | None = None):
        line = node_or_line if isinstance(node_or_line, int) or node_or_line is None \
            else getattr(node_or_line, "lineno", None)
        if evidence is None:
            evidence = self.lines[line - 1].strip() if line and line <= len(self.lines) else ""
        self.findings.append(Finding(rule, severity, message, line, _clip(evidence)))

    def _import_aliases(self) -> dict[str, str]:
        """Local name -> full module path, so F.linear resolves to torch.nn.functional.linear."""
        aliases = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return aliases

    def _value_aliases(self) -> None:
        """Names bound to a module attribute (``mm = torch.matmul``, ``T = torch``, ``f = getattr(torch,
        "mm")``) resolve like the attribute itself, so a renamed operator is still that operator."""
        for _ in range(4):  # chains of aliases (a = torch; b = a.matmul)
            changed = False
            for node in ast.walk(self.tree):
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                full = self._attribute_path(node.value)
                if full is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and self.aliases.get(t.id) != full and t.id != full.split(".")[0]:
                        self.aliases[t.id] = full
                        changed = True
            if not changed:
                break

    def _attribute_path(self, node: ast.AST) -> str | None:
        """The module path an expression names when it is an imported module's attribute (also through
        getattr with a literal name, and operator.attrgetter's literal); None otherwise."""
        if isinstance(node, ast.Call) and _last_name(node.func) == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            base = self._attribute_path(node.args[0])
            return f"{base}.{node.args[1].value}" if base else None
        dotted = _dotted(node)
        if dotted is None or dotted.split(".")[0] not in self.aliases:
            return None
        return self.resolve(node)

    def resolve(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Call) and _last_name(node.func) == "getattr":
            return self._attribute_path(node)
        dotted = _dotted(node)
        if dotted is None:
            return None
        root, _, rest = dotted.partition(".")
        full = self.aliases.get(root, root)
        return f"{full}.{rest}" if rest else full

    def _module_strings(self) -> dict[str, ast.AST]:
        """Names bound anywhere to a string expression, for sources passed by variable."""
        strings = {}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                    and self._string_parts(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for name in _target_names(t):
                        strings[name.split(".")[-1]] = node.value
        return strings

    def _string_parts(self, node: ast.AST, depth: int = 0) -> list[ast.Constant]:
        """The string literals an expression is built from (concatenation, lists, variables)."""
        if depth > 8:
            return []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self._string_parts(node.left, depth + 1) + self._string_parts(node.right, depth + 1)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [p for e in node.elts for p in self._string_parts(e, depth + 1)]
        if isinstance(node, ast.JoinedStr):
            return [v for v in node.values if isinstance(v, ast.Constant)]
        name = _last_name(node)
        if name and name in self.strings and self.strings[name] is not node:
            return self._string_parts(self.strings[name], depth + 1)
        return []

    def _cuda_from(self, node: ast.AST) -> list[_CudaSource]:
        out = []
        for lit in self._string_parts(node):
            self.cuda_literals.add(id(lit))
            text = lit.value
            exact = lit.end_lineno - lit.lineno == text.count("\n")
            out.append(_CudaSource(text, strip_cuda(text), lit.lineno, exact))
        return out

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def statement_of(self, node: ast.AST) -> ast.AST:
        while node in self.parent and not isinstance(node, ast.stmt):
            node = self.parent[node]
        return node

    # ---- structure: compiles, handles, what forward reaches

    def find_compiles(self) -> None:
        self.compiles: list[ast.Call] = []
        self.cuda: list[_CudaSource] = []
        self.extension_sources: list[_CudaSource] = []
        self.kernel_names: set[str] = set()  # names Python asks a module for
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            full = self.resolve(node.func) or ""
            last = full.rsplit(".", 1)[-1]
            is_jit = last in ("compile", "compile_module") and ("jit" in full.split(".")
                                                               or full.startswith("stitchcuda"))
            is_inline = last in ("load_inline", "RawKernel", "RawModule", "SourceModule")
            if not (is_jit or is_inline):
                continue
            self.compiles.append(node)
            sources = list(node.args[:1]) if not last == "load_inline" else list(node.args[1:3])
            for kw in node.keywords:
                if kw.arg in ("source", "code", "cuda_sources", "cpp_sources"):
                    sources.append(kw.value)
            for s in sources:
                found = self._cuda_from(s)
                self.cuda.extend(found)
                if last == "load_inline":  # C++ that can include ATen (NVRTC's CUDA cannot)
                    self.extension_sources.extend(found)
            name_args = list(node.args[1:2]) if last == "compile" or last == "RawKernel" else []
            name_args += [kw.value for kw in node.keywords if kw.arg in ("name", "name_expressions",
                                                                         "functions")]
            for arg in name_args:
                for lit in self._string_parts(arg):
                    self.kernel_names.add(lit.value.split("<")[0].strip())
        # module.kernel("name") / get_function("name") picks a kernel out of a compiled module.
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("kernel", "get_function", "get_kernel") and node.args:
                for lit in self._string_parts(node.args[0]):
                    self.kernel_names.add(lit.value.split("<")[0].strip())

        # Handles: whatever a compile result is stored in, and functions that return one.
        self.handles: set[str] = set()
        self.producers: set[str] = set()
        for call in self.compiles:
            stmt = self.statement_of(call)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    self.handles |= {n.split(".")[-1] for n in _target_names(t)}
            elif isinstance(stmt, ast.Return):
                fn = self.enclosing_function(stmt)
                if fn is not None:
                    self.producers.add(fn.name)
        for fn in ast.walk(self.tree):
            # A lazy getter (global _k; if _k is None: _k = compile(...); return _k) produces too.
            if isinstance(fn, ast.FunctionDef):
                for r in ast.walk(fn):
                    if isinstance(r, ast.Return) and r.value is not None and self.is_handle(r.value):
                        self.producers.add(fn.name)
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign) and self.is_handle(node.value):
                    for t in node.targets:
                        for n in _target_names(t):
                            short = n.split(".")[-1]
                            if short not in self.handles:
                                self.handles.add(short)
                                changed = True

    def is_handle(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.handles
        if isinstance(node, ast.Attribute):
            return node.attr in self.handles or self.is_handle(node.value)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in self.producers:
                return True
            if _last_name(node.func) == "getattr" and node.args:  # getattr(module, name): a kernel by name
                return self.is_handle(node.args[0])
            return self.is_handle(node.func)
        if isinstance(node, ast.Subscript):
            return self.is_handle(node.value)
        # Kernels kept in a container: {n: mod.kernel(n) for n in NAMES}, [k1, k2], (k1, k2).
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return any(self.is_handle(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return any(v is not None and self.is_handle(v) for v in node.values)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.is_handle(node.elt)
        if isinstance(node, ast.DictComp):
            return self.is_handle(node.value)
        if isinstance(node, ast.IfExp):  # k = FAST if big else SMALL
            return self.is_handle(node.body) or self.is_handle(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(self.is_handle(v) for v in node.values)
        return False

    def is_launch(self, call: ast.Call) -> bool:
        if call in self.compiles:
            return False
        if isinstance(call.func, ast.Name) and call.func.id in self.producers:
            return False  # fetching the kernel, not running it
        return self.is_handle(call.func)

    def find_reachable(self) -> None:
        """ModelNew.forward and every function of this file it calls (methods, helpers,
        autograd Functions, submodules defined here)."""
        self.reachable: list[ast.FunctionDef] = []
        self.forward = None
        if self.model is None:
            return
        methods = {f.name: f for f in self.model.body if isinstance(f, ast.FunctionDef)}
        self.forward = methods.get("forward")
        if self.forward is None:
            return
        submodules = {}  # self.block = Block(...) -> Block
        init = methods.get("__init__")
        for node in ast.walk(init) if init else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                cls = _last_name(node.value.func)
                for t in node.targets:
                    for n in _target_names(t):
                        submodules[n] = cls
        seen, todo = set(), [(self.forward, methods, submodules)]
        while todo:
            fn, scope, subs = todo.pop()
            if fn in seen:
                continue
            seen.add(fn)
            self.reachable.append(fn)
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                dotted = _dotted(call.func) or ""
                targets = []
                if dotted.startswith("self.") and dotted.count(".") == 1:
                    attr = dotted[5:]
                    if attr in scope:
                        targets.append((scope[attr], scope, subs))
                    elif subs.get(dotted) in self.classes:
                        targets.append(self._class_method(subs[dotted], "forward"))
                elif dotted in self.functions:
                    targets.append((self.functions[dotted], {}, {}))
                elif dotted.endswith(".apply") and dotted[:-6] in self.classes:
                    targets.append(self._class_method(dotted[:-6], "forward"))
                elif dotted in self.classes:
                    targets.append(self._class_method(dotted, "__call__"))
                todo.extend(t for t in targets if t[0] is not None)

    def _class_method(self, cls_name: str, method: str):
        cls = self.classes[cls_name]
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        return methods.get(method), methods, {}

    def reachable_nodes(self, kind=ast.AST) -> Iterator[ast.AST]:
        for fn in self.reachable:
            for node in ast.walk(fn):
                if isinstance(node, kind):
                    yield node

    # ---- the rules

    def run(self) -> list[Finding]:
        self.find_compiles()
        self.find_reachable()
        if self.model is None:
            self.add("no-model-new", MAJOR, "the candidate defines no ModelNew class, so there is "
                     "nothing to verify.", None, "")
            return self.findings
        if self.forward is None:
            self.add("no-model-new", MAJOR, "ModelNew has no forward method of its own.", self.model)
            return self.findings
        self.launches = [c for c in self.reachable_nodes(ast.Call) if self.is_launch(c)]
        self.rule_reference()
        self.rule_kernels_launched()
        self.rule_heavy_work()
        self.rule_fallback()
        self.rule_output_reuse()
        self.rule_mutation()
        self.rule_streams_threads()
        self.rule_patching()
        self.rule_lazy_and_constant()
        self.rule_shapes()
        self.rule_downcast()
        self.rule_persisting_l2()
        self.rule_cuda()
        self.rule_opaque()
        self.rule_host_compute()
        self.rule_aten_in_extension()
        return self.findings

    def rule_opaque(self) -> None:
        """Code this analysis cannot read is not code it can vouch for: run-time code (exec, eval,
        compile, dynamic imports), attributes picked by a computed name, and reaching objects the
        candidate did not make (loaded modules, the caller's frames, globals)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                full = self.resolve(node.func) or _dotted(node.func) or ""
                last = full.rsplit(".", 1)[-1]
                if full in _RUNTIME_CODE or (isinstance(node.func, ast.Name) and node.func.id in _RUNTIME_CODE
                                             and node.func.id not in self.aliases):
                    self.add("opaque-code", MAJOR, f"the candidate runs code made at run time ({last}), which "
                             "static analysis cannot read: whatever it does is unchecked here.", node)
                elif _last_name(node.func) == "getattr" and len(node.args) >= 2 \
                        and not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)) \
                        and not self.is_handle(node.args[0]):
                    self.add("opaque-code", MAJOR, "getattr with a name computed at run time: the attribute "
                             "it reaches (a torch operator, say) cannot be known statically.", node)
                elif full in _INTROSPECTION or (isinstance(node.func, ast.Name)
                                                and node.func.id in ("globals", "vars", "locals")
                                                and node.func.id not in self.aliases):
                    self.add("introspection", MAJOR, f"the candidate inspects its interpreter ({last}): "
                             "loaded modules, the caller's frames and globals hold the reference and its "
                             "outputs.", node)
                elif full in _DECODERS:
                    self.add("encoded-payload", MINOR, f"the candidate decodes data at run time ({full}); "
                             "code hidden that way is not analyzed.", node)
            elif isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)) \
                    and _last_name(node.value) in self._native_libraries() \
                    and not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
                self.add("opaque-code", MAJOR, "a native library's function looked up by a name computed at "
                         "run time: which function it calls cannot be known statically.", node)
            elif isinstance(node, ast.Attribute):
                full = self.resolve(node) or ""
                if full in ("sys.modules", "sys._getframe", "builtins.__dict__") or node.attr in _FRAME_ATTRS:
                    self.add("introspection", MAJOR, f"the candidate reads {node.attr}, which reaches objects "
                             "it did not create (the reference, its outputs, the caller's variables).", node)
            elif isinstance(node, ast.Name) and node.id in ("__builtins__", "__loader__", "__spec__"):
                self.add("introspection", MAJOR, f"the candidate reads {node.id}, which reaches the "
                         "interpreter's own objects.", node)

    def _native_libraries(self) -> set[str]:
        """Names bound to a ctypes library (ctypes.CDLL(...), ctypes.cdll.LoadLibrary(...))."""
        if not hasattr(self, "_libs"):
            self._libs = set()
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    full = self.resolve(node.value.func) or ""
                    if full.startswith("ctypes.") and full.rsplit(".", 1)[-1] in ("CDLL", "WinDLL", "PyDLL",
                                                                                    "LoadLibrary"):
                        for t in node.targets:
                            self._libs |= {n.split(".")[-1] for n in _target_names(t)}
        return self._libs

    def rule_host_compute(self) -> None:
        """The work done on the host: numpy (or scipy) computing in forward, or a tensor copied out to
        the host and its data brought back as a tensor (a round trip a kernel's result never needs)."""
        for fn in self.reachable:
            calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
            full = {id(c): self.resolve(c.func) or "" for c in calls}
            host_math = [c for c in calls if full[id(c)].split(".")[0] in ("numpy", "scipy")
                         and full[id(c)].split(".")[-1] not in _HOST_OK]
            back = [c for c in calls if full[id(c)] in ("torch.from_numpy", "torch.tensor", "torch.as_tensor")]
            out = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in ("numpy", "tolist")
                   and full[id(c)].split(".")[0] not in ("numpy", "scipy")]
            for c in host_math:
                self.add("host-compute", MAJOR, f"forward computes with {full[id(c)]} on the host.", c)
            if out and back and not host_math:
                self.add("host-compute", MAJOR, f"forward copies a tensor to the host (.{out[0].func.attr}()) "
                         "and makes a tensor of host data again: the work between is done without the GPU.",
                         out[0])

    def rule_aten_in_extension(self) -> None:
        """C++ handed to load_inline that calls ATen's heavy operators: the extension is a wrapper
        around torch, whatever its Python spells."""
        # A kernel launched from the extension's own code (<<<...>>>) may be a real epilogue around a
        # library GEMM, as in Python; its data flow through C++ is not followed, so that is minor.
        launches_kernel = any("<<<" in src.clean for src in self.extension_sources)
        for src in self.extension_sources:
            for m in _ATEN_CALL.finditer(src.clean):
                op = m.group("op")
                if not (op in _HEAVY_OPS or (op in self.ref.ops and op not in _BOOKKEEPING)):
                    continue
                if launches_kernel:
                    self.add("library-does-heavy-work", MINOR, f"the compiled C++ calls ATen's {op} beside "
                             "a kernel of its own; legitimate if the kernel does real work.",
                             src.line_at(m.start()), src.excerpt(m.start()))
                else:
                    self.add("aten-in-extension", MAJOR, f"the compiled C++ calls ATen's {op} "
                             f"({m.group(0).strip()}) and launches no kernel of its own, so torch does the "
                             "work inside the extension.", src.line_at(m.start()), src.excerpt(m.start()))

    def rule_reference(self) -> None:
        for base in self.model.bases:
            if _last_name(base) == "Model":
                for call in self.reachable_nodes(ast.Call):
                    dotted = _dotted(call.func) or ""
                    if (isinstance(call.func, ast.Attribute) and call.func.attr == "forward"
                            and (isinstance(call.func.value, ast.Call) or dotted.startswith("Model."))):
                        self.add("calls-reference-model", MAJOR, "ModelNew inherits from the reference "
                                 "Model and runs its forward, so the reference does the work.", call)
        # Anywhere, not only in forward: a Model built in __init__ is run later through an attribute.
        for call in ast.walk(self.tree):
            if isinstance(call, ast.Call) and _last_name(call.func) == "Model":
                self.add("calls-reference-model", MAJOR, "the candidate builds the reference Model, "
                         "so the reference can do the work.", call)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Model" for a in node.names):
                self.add("calls-reference-model", MAJOR, "the candidate imports the reference Model.",
                         node)

    def rule_kernels_launched(self) -> None:
        if not self.compiles:
            self.add("no-custom-kernel", MAJOR, "the candidate compiles no CUDA (no stitchcuda.jit or "
                     "load_inline call), so no custom kernel can be doing the work.", None, "")
        elif not self.launches:
            self.add("kernel-not-launched", MAJOR, "CUDA is compiled but no compiled kernel is called "
                     "from ModelNew.forward, so the timed code runs none of it.", self.compiles[0])

    def heavy_op(self, call: ast.Call) -> tuple[str, bool] | None:
        """(op name, is a library GEMM/conv) when a call makes torch do a heavy operator."""
        if self.is_launch(call) or self.is_handle(call.func):
            return None
        full = self.resolve(call.func) or ""
        parts = full.split(".")
        if parts[0] == "operator" and parts[-1] in ("matmul", "imatmul"):
            return "operator.matmul", True
        if parts[0] == "torch":
            op = parts[-1]
            if op.startswith("__") and op.endswith("__"):  # torch.Tensor.__matmul__(x, w)
                op = {"matmul": "matmul", "rmatmul": "matmul"}.get(op.strip("_"), op)
            if parts[1:3] == ["ops", "aten"] and len(parts) > 3:
                op = parts[3]
            if op in _HEAVY_OPS or (op in self.ref.ops and op not in _BOOKKEEPING):
                return op, op in _LIBRARY_OPS
            return None
        if isinstance(call.func, ast.Attribute):
            op = call.func.attr
            dotted = _dotted(call.func) or ""
            root = dotted.split(".")[0]
            if root in self.aliases and not dotted.startswith("self."):
                return None  # some other module's function (math.sqrt, np.dot)
            if op in _HEAVY_METHODS or (op in self.ref.ops and op not in _BOOKKEEPING):
                return op, op in _LIBRARY_OPS
        if isinstance(call.func, ast.Attribute) and _dotted(call.func) in self.heavy_submodules:
            kind = self.heavy_submodules[_dotted(call.func)]
            return f"nn.{kind}", kind in _LIBRARY_MODULES
        return None

    def rule_heavy_work(self) -> None:
        self.heavy_submodules = {}
        for node in ast.walk(self.model):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                full = self.resolve(node.value.func) or ""
                if full.startswith("torch.nn.") and full.split(".")[-1] in _HEAVY_MODULES:
                    for t in node.targets:
                        for n in _target_names(t):
                            self.heavy_submodules[n] = full.split(".")[-1]
        # Compilers that generate the kernels for it: the candidate then writes no CUDA of its own.
        for node in ast.walk(self.tree):
            target = node.func if isinstance(node, ast.Call) else node
            if isinstance(target, (ast.Attribute, ast.Name)) and (self.resolve(target) or "") in (
                    "torch.compile", "torch.jit.script", "torch.jit.trace", "torch._dynamo.optimize"):
                if isinstance(node, ast.Call) or node in self.decorators:
                    self.add("torch-does-heavy-work", MAJOR, "the candidate hands its model to a torch "
                             "compiler, which generates the kernels instead of the candidate.", node)
        for fn in self.reachable:
            flow = _DataFlow(fn, self)
            for node in ast.walk(fn):
                op = None
                if isinstance(node, ast.Call):
                    found = self.heavy_op(node)
                    if found:
                        op, library = found
                elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                    op, library = "@ (matmul)", True
                if op is None:
                    continue
                if not self.launches:
                    combined = False
                elif flow.has_launch:
                    combined = flow.feeds_kernel(node)
                else:
                    combined = True  # a helper without kernels: its data flow is not tracked across calls
                if combined and library:
                    self.add("library-does-heavy-work", MINOR, f"torch runs {op} (a library call) and a "
                             "custom kernel works on its data; legitimate if the kernel does real work.",
                             node)
                elif combined:
                    self.add("library-does-heavy-work", MINOR, f"torch runs {op} beside a custom kernel "
                             "that works on its data; the kernel covers only part of the problem.", node)
                else:
                    self.add("torch-does-heavy-work", MAJOR, f"forward calls torch's {op} and no custom "
                             "kernel uses its input or output, so torch, not the candidate, does this "
                             "work.", node)

    def rule_fallback(self) -> None:
        # Anywhere in the file: a module-level try around the compile counts as much as one in forward.
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Try):
                continue
            body_calls = [c for s in node.body for c in ast.walk(s) if isinstance(c, ast.Call)]
            guards_kernel = any(c in self.compiles or self.is_launch(c) for c in body_calls)
            if not guards_kernel:
                continue
            for handler in node.handlers:
                calls = [c for s in handler.body for c in ast.walk(s) if isinstance(c, ast.Call)]
                reraises = any(isinstance(n, ast.Raise) for s in handler.body for n in ast.walk(s))
                torch_calls = [c for c in calls if (self.resolve(c.func) or "").startswith("torch.")
                               and (self.resolve(c.func) or "").split(".")[-1] not in _BOOKKEEPING
                               or self.heavy_op(c) or _last_name(c.func) == "Model"]
                if torch_calls or (not reraises and self._returns_value(handler)):
                    self.add("torch-fallback", MAJOR, "an exception around the custom kernel falls "
                             "back to other code, so a failing kernel still yields a torch result.",
                             handler)
                elif not reraises:
                    self.add("swallowed-error", MINOR, "an exception from compiling or launching the "
                             "kernel is caught and not raised again.", handler)

    @staticmethod
    def _returns_value(handler: ast.ExceptHandler) -> bool:
        return any(isinstance(n, ast.Return) and n.value is not None
                   for s in handler.body for n in ast.walk(s))

    def rule_output_reuse(self) -> None:
        for node in ast.walk(self.tree):
            full = self.resolve(node) if isinstance(node, ast.Attribute) else None
            if full in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
                self.add("gc-object-scan", MAJOR, "the candidate scans the garbage collector's objects, "
                         "which finds the reference's output tensors to return.", node)
        for fn in self.reachable:
            for dec in fn.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if (self.resolve(target) or "").split(".")[-1] in ("lru_cache", "cache", "memoize",
                                                                   "cached"):
                    self.add("memoized-forward", MAJOR, f"{fn.name} is memoized, so repeated timed calls "
                             "return a stored result instead of computing.", dec)
            # Values derived from an input's identity or address, then used as a lookup key.
            keys = set()
            for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)),
                               key=lambda n: n.lineno):
                if self._identity_expr(node.value, keys):
                    for t in node.targets:
                        keys |= _target_names(t)
            for node in ast.walk(fn):
                probes = []
                if isinstance(node, ast.Subscript):
                    probes = [node.slice]
                elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn))
                                                           for o in node.ops):
                    probes = [node.left]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("get", "setdefault", "pop", "__contains__"):
                    probes = node.args[:1]
                if any(self._identity_expr(p, keys) for p in probes):
                    self.add("input-keyed-cache", MAJOR, "a lookup keyed on an input's address or id() "
                             "lets repeated timed calls return a stored output.", node)
            # A global holding a compiled kernel (a lazy getter) is fine; one holding a result is not.
            globals_ = {n for g in ast.walk(fn) if isinstance(g, ast.Global) for n in g.names
                        if n not in self.handles}
            for ret in ast.walk(fn):
                if isinstance(ret, ast.Return) and ret.value is not None \
                        and _names_in(ret.value) & globals_:
                    self.add("output-in-global", MAJOR, "forward returns a module-level global it also "
                             "assigns, which can carry an output across timed calls.", ret)

    def _identity_expr(self, node: ast.AST, keys: set[str]) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                if isinstance(sub.func, ast.Attribute) and sub.func.attr in ("data_ptr",
                                                                             "untyped_storage"):
                    return True
                if isinstance(sub.func, ast.Name) and sub.func.id in ("id", "hash"):
                    return True
            if isinstance(sub, ast.Name) and sub.id in keys:
                return True
        return False

    def rule_mutation(self) -> None:
        fn = self.forward
        # Arguments annotated as Python scalars (dim: int) are not tensors; `dim += 1` is fine.
        params = {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs
                  if _last_name(a.annotation) not in ("int", "float", "bool", "str")}
        if fn.args.vararg:
            params.add(fn.args.vararg.arg)
        # Which names still refer to an input's storage at a given line: a view keeps the alias,
        # any other assignment (clone, arithmetic, allocation) ends it.
        events: list[tuple[int, str, bool]] = []
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
            value = node.value
            alias = False
            base = value
            while True:
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) \
                        and base.func.attr in _VIEWS:
                    base = base.func.value
                elif isinstance(base, ast.Subscript):
                    base = base.value
                else:
                    break
            if isinstance(base, ast.Name):
                alias = self._alias_at(base.id, node.lineno, params, events)
            for t in node.targets:
                for name in _target_names(t):
                    events.append((node.lineno, name, alias))

        def is_input(expr: ast.AST, line: int) -> bool:
            while isinstance(expr, ast.Subscript) or (isinstance(expr, ast.Attribute)
                                                      and expr.attr == "data"):
                expr = expr.value
            return isinstance(expr, ast.Name) and self._alias_at(expr.id, line, params, events)

        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                # requires_grad_ and friends change metadata, not data.
                if attr.endswith("_") and not attr.startswith("_") and attr not in _METADATA_IN_PLACE \
                        and is_input(node.func.value, node.lineno):
                    self.add("mutates-input", MAJOR, f"forward changes an input in place ({attr}), so the "
                             "next trial or the reference sees altered data.", node)
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "out" and is_input(kw.value, node.lineno):
                        self.add("mutates-input", MAJOR, "an out= argument writes into an input tensor.",
                                 node)
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Subscript) or isinstance(node, ast.AugAssign)) \
                            and is_input(t, node.lineno):
                        self.add("mutates-input", MAJOR, "forward assigns into an input tensor, so the "
                                 "next trial or the reference sees altered data.", node)

    @staticmethod
    def _alias_at(name: str, line: int, params: set[str], events) -> bool:
        state = name in params
        for ev_line, ev_name, alias in events:
            if ev_line < line and ev_name == name:
                state = alias
        return state

    def rule_streams_threads(self) -> None:
        creates_stream = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)
                          and (self.resolve(n.func) or "").endswith("cuda.Stream")]
        # Event.wait() makes the current stream wait for the event: a join like wait_event.
        joins = any(isinstance(n, ast.Call) and _last_name(n.func) in ("synchronize", "wait_stream",
                                                                      "wait_event", "record_stream", "wait")
                    for n in self.reachable_nodes(ast.Call))
        if creates_stream and not joins:
            self.add("side-stream", MAJOR, "a side CUDA stream is created and forward never joins it back "
                     "(synchronize / wait_stream), so its work can escape the timer.", creates_stream[0])
        reachable_calls = set(self.reachable_nodes(ast.Call))
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            full = self.resolve(node.func) or ""
            if full.split(".")[0] in ("threading", "concurrent", "multiprocessing", "_thread", "asyncio") \
                    and full.split(".")[-1] in ("Thread", "ThreadPoolExecutor", "ProcessPoolExecutor",
                                                 "Process", "Pool", "start_new_thread", "Timer",
                                                 "run", "create_task", "submit"):
                self.add("background-thread", MAJOR if node in reachable_calls else MINOR,
                         "work is handed to another thread or process, which the timer may not wait "
                         "for.", node)

    def rule_patching(self) -> None:
        for node in ast.walk(self.tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and _last_name(node.func) in ("setattr", "delattr") \
                    and node.args:
                targets = [node.args[0]]
            for t in targets:
                dotted = _dotted(t)
                if not dotted or (not isinstance(node, ast.Call) and "." not in dotted):
                    continue  # a plain variable, not an attribute of a module
                module = self.aliases.get(dotted.split(".")[0])
                if module is None or module.split(".")[0] not in _PATCHABLE_ROOTS:
                    continue
                if (self.resolve(t) or "").startswith("torch.backends."):
                    continue  # precision switches: rule silent-downcast
                self.add("patches-timing", MAJOR, f"the candidate replaces {dotted} (a library function "
                         "or attribute), which can fake timing or synchronization.", node)

    def rule_lazy_and_constant(self) -> None:
        fn = self.forward
        nested = {n.name for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.Lambda))
                  and n is not fn and hasattr(n, "name")}
        lambdas = set()
        allocated: dict[str, ast.AST] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                names = set().union(*(_target_names(t) for t in node.targets))
                if isinstance(node.value, ast.Lambda):
                    lambdas |= names
                if isinstance(node.value, ast.Call) and self._is_allocation(node.value):
                    for n in names:
                        allocated[n] = node
        # Names a kernel, a library call or a computing in-place op could write; fills, views and
        # size queries leave a buffer constant.
        written = set()
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call) or self._is_allocation(call):
                continue
            name = _last_name(call.func)
            if name in _BOOKKEEPING or name in _FILLS or name in _VIEWS:
                continue
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                written |= _names_in(arg)
            if isinstance(call.func, ast.Attribute) and name and name.endswith("_"):
                written |= _names_in(call.func.value)
        for cls in self.classes.values():
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("__torch_function__",
                                                                       "__torch_dispatch__"):
                    self.add("lazy-output", MAJOR, f"class {cls.name} intercepts torch operations "
                             "(a tensor subclass), which can defer or fake the work.", item)
        own_classes = {name for name, cls in self.classes.items()
                       if not any("Module" in (_dotted(b) or "") or "Function" in (_dotted(b) or "")
                                  for b in cls.bases)}
        for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
            if self.enclosing_function(ret) is not fn:
                continue
            values = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
            for value in values:
                while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                        and value.func.attr in _VIEWS:
                    value = value.func.value  # return y.view(shape) returns y's data
                if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name)
                                                     and value.id in nested | lambdas):
                    self.add("lazy-output", MAJOR, "forward returns a function instead of a tensor, so "
                             "the work can run after the timer stops.", ret)
                elif isinstance(value, ast.Call) and _last_name(value.func) in own_classes:
                    self.add("lazy-output", MAJOR, f"forward returns a {_last_name(value.func)} object "
                             "instead of a tensor, so the work can be deferred.", ret)
                elif isinstance(value, ast.Call) and self._is_allocation(value):
                    self.add("constant-output", MAJOR, "forward returns a freshly allocated tensor that "
                             "nothing computes, a constant output.", ret)
                elif isinstance(value, ast.Name) and value.id in allocated \
                        and value.id not in written:
                    self.add("constant-output", MAJOR, f"forward returns {value.id}, allocated at line "
                             f"{allocated[value.id].lineno} and never written by a kernel.", ret)

    def _is_allocation(self, call: ast.Call) -> bool:
        full = self.resolve(call.func) or ""
        name = _last_name(call.func)
        return (full.startswith("torch.") and full.split(".")[-1] in _ALLOCATORS) or \
            (isinstance(call.func, ast.Attribute) and name in ("new_empty", "new_zeros", "new_ones",
                                                               "new_full"))

    def rule_shapes(self) -> None:
        sizes = {v: k for k, v in self.ref.constants.items() if v >= 8}
        if not sizes:
            return
        # Grid and block extents are tuning, not problem sizes.
        launch_geometry = {id(sub) for call in self.launches for arg in call.args[:2]
                           for sub in ast.walk(arg)}
        for node in self.reachable_nodes(ast.Constant):
            if type(node.value) is int and node.value in sizes and id(node) not in launch_geometry:
                self.add("hard-coded-shape", MINOR, f"the literal {node.value} equals the reference's "
                         f"{sizes[node.value]}; read sizes from the inputs so other shapes work.", node)
        for src in self.cuda:
            for m in re.finditer(r"(?<![\w.])(\d+)(?:[uUlL]*)(?![\w.])", src.clean):
                value = int(m.group(1))
                if value in sizes and value & (value - 1) != 0:  # powers of two are usually tile sizes
                    self.add("hard-coded-shape", MINOR, f"the CUDA literal {value} equals the reference's "
                             f"{sizes[value]}; pass sizes as kernel arguments.", src.line_at(m.start()),
                             src.excerpt(m.start()))

    def rule_downcast(self) -> None:
        if self.ref.low_precision:
            return
        for node in self.reachable_nodes(ast.Call):
            attr = _last_name(node.func)
            hit = isinstance(node.func, ast.Attribute) and attr in ("half", "bfloat16")
            if attr in ("to", "type") or (self.resolve(node.func) or "").endswith("autocast"):
                hit = hit or any(isinstance(n, ast.Attribute) and n.attr in _LOW_PRECISION
                                 for a in [*node.args, *(k.value for k in node.keywords)]
                                 for n in ast.walk(a))
            if hit:
                self.add("silent-downcast", MINOR, "forward converts data to a lower precision than the "
                         "fp32 reference, trading accuracy for speed.", node)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (self.resolve(t) or "").startswith("torch.backends.") and \
                            isinstance(node.value, ast.Constant) and node.value.value is True:
                        self.add("silent-downcast", MINOR, "the candidate turns on a reduced-precision "
                                 "mode for the whole process.", node)
            elif isinstance(node, ast.Call) and _last_name(node.func) == "set_float32_matmul_precision":
                self.add("silent-downcast", MINOR, "the candidate lowers fp32 matmul precision for the "
                         "whole process.", node)

    def rule_persisting_l2(self) -> None:
        pattern = re.compile(r"\b(" + "|".join(_PERSISTING_L2) + r")\b")
        for src in self.cuda:
            for m in pattern.finditer(src.clean):
                self.add("persisting-l2", MAJOR, f"the CUDA uses {m.group(1)}, a persisting-L2 reservation "
                         "that survives the cache flush between trials.", src.line_at(m.start()),
                         src.excerpt(m.start()))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in self.cuda_literals:
                name = node.value  # e.g. a ctypes symbol looked up by name
            else:
                continue
            if pattern.search(name):
                self.add("persisting-l2", MAJOR, "the Python side sets up a persisting-L2 reservation, "
                         "which survives the cache flush between trials.", node)

    def rule_cuda(self) -> None:
        all_clean = "\n".join(s.clean for s in self.cuda)
        for src in self.cuda:
            for kernel in src.kernels():
                others = len(re.findall(r"\b" + re.escape(kernel.name) + r"\b", all_clean)) - 1
                if others <= 0 and kernel.name not in self.kernel_names:
                    self.add("cuda-kernel-never-launched", MINOR, f"kernel {kernel.name} is defined but "
                             "never launched or looked up.", src.line_at(kernel.start),
                             src.excerpt(kernel.start))
                body = src.clean[kernel.body_start:kernel.body_end]
                for m in re.finditer(r"\bprintf\s*\(", body):
                    at = kernel.body_start + m.start()
                    self.add("printf-in-kernel", MINOR, f"kernel {kernel.name} calls printf, which "
                             "serializes output and distorts timing.", src.line_at(at), src.excerpt(at))
                self._uninitialized_shared(src, kernel, body)

    def _uninitialized_shared(self, src: _CudaSource, kernel: _CudaKernel, body: str) -> None:
        for decl in re.finditer(r"__shared__[^;]*?\b([A-Za-z_]\w*)\s*\[[^;]*;", body):
            name = decl.group(1)
            for use in re.finditer(r"(&\s*)?\b" + re.escape(name) + r"\b", body[decl.end():]):
                tail = body[decl.end() + use.end():]
                if use.group(1) or not tail.lstrip().startswith("["):
                    # Its address is passed on (cp.async, memcpy_async, a cast): assume written.
                    break
                # Skip the index expressions: s[i][j] = ... is a write.
                k = 0
                while tail[k:].lstrip().startswith("["):
                    k += len(tail[k:]) - len(tail[k:].lstrip())
                    close = _matching(tail, k, "[", "]")
                    if close < 0:
                        break
                    k = close + 1
                after = tail[k:].lstrip()
                if after.startswith("=") and not after.startswith("=="):
                    break
                at = kernel.body_start + decl.end() + use.start()
                self.add("uninitialized-shared-read", MINOR, f"shared array {name} in kernel "
                         f"{kernel.name} is read before anything writes it.", src.line_at(at),
                         src.excerpt(at))
                break


class _DataFlow:
    """Within one function: does a heavy torch call feed a custom kernel, or consume a kernel's output?
    Names are plain variables and self-attributes; assignments give edges from what is read to what
    is written, so the check follows values through reshapes and temporaries."""

    def __init__(self, fn: ast.FunctionDef, analysis: Analysis) -> None:
        self.a = analysis
        self.edges: dict[str, set[str]] = {}
        self.launch_args: set[str] = set()
        self.kernel_outputs: set[str] = set()
        self.launch_nodes: set[int] = set()
        launches = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and analysis.is_launch(c)]
        self.has_launch = bool(launches)
        for c in launches:
            for sub in ast.walk(c):
                self.launch_nodes.add(id(sub))
            args = set().union(set(), *(_names_in(x) for x in [*c.args, *(k.value for k in c.keywords)]))
            self.launch_args |= args
        # Buffers a launch may write: arguments the function allocated itself (inputs and weights are
        # read-only by contract), plus whatever a launch returns (load_inline style).
        allocated = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and analysis._is_allocation(node.value):
                allocated |= set().union(set(), *(_target_names(t) for t in node.targets))
        self.kernel_outputs |= self.launch_args & allocated
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                written = set().union(set(), *(_target_names(t) for t in targets))
                for src in _names_in(node.value):
                    self.edges.setdefault(src, set()).update(written)
                if id(node.value) in self.launch_nodes:
                    self.kernel_outputs |= written
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "out":
                        for src in set().union(set(), *(_names_in(x) for x in node.args)):
                            self.edges.setdefault(src, set()).update(_names_in(kw.value))

    def reach(self, starts: Iterable[str]) -> set[str]:
        seen, todo = set(), list(starts)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(self.edges.get(n, ()))
        return seen

    def feeds_kernel(self, heavy: ast.AST) -> bool:
        if id(heavy) in self.launch_nodes:
            return True  # the heavy call is itself a kernel argument
        stmt = self.a.statement_of(heavy)
        results: set[str] = set()
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            results = set().union(set(), *(_target_names(t) for t in targets))
        if isinstance(heavy, ast.Call):
            for kw in heavy.keywords:
                if kw.arg == "out":
                    results |= _names_in(kw.value)
        if self.reach(results) & self.launch_args:
            return True  # epilogue: the kernel consumes what the library produced
        inputs = _names_in(heavy) - {"torch", "F", "nn", "self"}
        # Producer: the library consumes what a kernel wrote.
        return bool(inputs & self.reach(self.kernel_outputs))
