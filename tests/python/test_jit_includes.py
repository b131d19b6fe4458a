"""The include rule for untrusted CUDA (stitchcuda.jit.check_includes, compile(confined=True), and the
process-wide confine_includes() the Verifier's worker calls): no file outside the CUDA toolkit's headers
is read, whatever the directive spells; honest includes still compile. NVRTC runs without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stitchcuda import jit
from stitchcuda.errors import InvalidArgumentError

KERNEL = 'extern "C" __global__ void k(float* y) { y[0] = 1.0f; }\n'
SECRET = "sk-planted-0123456789abcdef"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / ".env"
    path.write_text(f'OPENAI_API_KEY="{SECRET}"\n')
    return path


def escapes(secret_file: Path) -> list[tuple[str, dict, str]]:
    """(source, options, what the error must name) for every way to reach a file outside the toolkit."""
    rel = os.path.relpath(secret_file, Path.cwd())
    return [
        (f'#include "{secret_file}"\n' + KERNEL, {}, "absolute paths"),
        ('#include "/proc/self/environ"\n' + KERNEL, {}, "absolute paths"),
        (f'#include "{rel}"\n' + KERNEL, {}, "'..'" if ".." in rel else "not a header of the CUDA toolkit"),
        ('#include <../../../etc/passwd>\n' + KERNEL, {}, "'..'"),
        ('#include ".env"\n' + KERNEL, {}, "not a header of the CUDA toolkit"),
        ('#define F "/etc/passwd"\n#include F\n' + KERNEL, {}, "computed #include"),
        ('#   include \\\n "/etc/passwd"\n' + KERNEL, {}, "absolute paths"),  # a continued line
        ('#include_next <cuda_fp16.h>\n' + KERNEL, {}, "#include_next is not allowed"),
        ('#include "helper.h"\n' + KERNEL, {"headers": {"helper.h": '#include "/etc/passwd"\n'}}, "helper.h:1"),
        (KERNEL, {"include_paths": [str(secret_file.parent)]}, "outside the CUDA toolkit's headers"),
        (KERNEL, {"extra_flags": [f"--pre-include={secret_file}"]}, "NVRTC flag '--pre-include"),
        (KERNEL, {"extra_flags": ["-I/etc"]}, "NVRTC flag '-I/etc'"),
    ]


def bypasses(secret_file: Path) -> list[tuple[str, dict, str]]:
    """(source, options, what the error must name): spellings that a line-by-line scan of the text misses
    and NVRTC's preprocessor reads as an include of the planted file."""
    f = str(secret_file)
    return [
        (f'%:include "{f}"\n' + KERNEL, {}, "absolute paths"),  # a digraph
        (f'%: include "{f}"\n' + KERNEL, {}, "absolute paths"),
        (f'const char* a = "/*";\n#include "{f}"\nconst char* b = "*/";\n' + KERNEL, {}, "absolute paths"),
        (f'#include \\\r\n"{f}"\n' + KERNEL, {}, "absolute paths"),  # backslash, CR, LF
        (f'int x;\r#include "{f}"\r' + KERNEL, {}, "absolute paths"),  # old Mac line ends
        (f'\f#include "{f}"\n' + KERNEL, {}, "absolute paths"),  # form feed before #
        (f'\v#include "{f}"\n' + KERNEL, {}, "absolute paths"),  # vertical tab before #
        (f'/* a comment */ # /* and another */ include "{f}"\n' + KERNEL, {}, "absolute paths"),
        (f'#include "a/*b"\n#include "{f}"\n// */\n' + KERNEL, {}, "'a/*b'"),
        (f'// a comment \\ \n#include "{f}"\n' + KERNEL, {}, "absolute paths"),  # read either way
        (f'??=include "{f}"\n' + KERNEL, {}, "absolute paths"),  # a trigraph
        (f'#if __has_include("{f}")\n#endif\n' + KERNEL, {}, "__has_include"),
        ('#if __has_include(__FILE__)\n#endif\n' + KERNEL, {}, "computed __has_include"),
        ('#\\u0069nclude "x"\n' + KERNEL, {}, "universal character name"),
        (KERNEL, {"name_expressions": [f'k\n#include "{f}"\n']}, "name expression"),
        (KERNEL, {"defines": {"X": f'1\n#include "{f}"'}}, "control character"),
        (KERNEL, {"extra_flags": [f'-DX=1\n#include "{f}"']}, "control character"),
    ]


def test_every_bypass_of_a_textual_scan_is_refused(secret_file):
    for source, options, named in bypasses(secret_file):
        with pytest.raises(InvalidArgumentError) as caught:
            jit.check_includes(source, **options)
        assert named in caught.value.message, (source, caught.value.message)
        assert SECRET not in caught.value.message
        with pytest.raises(InvalidArgumentError) as caught:
            jit.compile_module(source, arch="sm_90a", confined=True, **options)
        assert SECRET not in str(caught.value) and SECRET not in caught.value.log


def test_a_same_named_header_in_the_working_or_program_folder_is_refused(tmp_path, monkeypatch):
    """NVRTC looks for a quoted include in the working folder (the bare program name's folder) before the
    toolkit: a planted cuda_fp16.h there would be read in its place."""
    (tmp_path / "cuda_fp16.h").write_text(f'#error "{SECRET}"\n')
    source = '#include "cuda_fp16.h"\n' + KERNEL
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="working folder") as caught:
        jit.compile_module(source, arch="sm_90a", confined=True)
    assert SECRET not in str(caught.value) and SECRET not in caught.value.log
    with pytest.raises(InvalidArgumentError, match="bare file name"):
        jit.compile_module(source, arch="sm_90a", confined=True, program_name=str(tmp_path / "kernel.cu"))
    jit.compile_module('#include <cuda_fp16.h>\n' + KERNEL, arch="sm_90a", confined=True)  # the angle form


def test_text_that_only_looks_like_a_directive_still_compiles():
    """The tokenizer is no stricter than the language: strings, raw strings, digit separators, comments
    and __has_include of toolkit headers (present or not) are ordinary code."""
    honest = (
        '#if __has_include(<cuda_fp16.h>) && !__has_include(<no_such_header_anywhere.h>)\n#include <cuda_fp16.h>\n'
        '#endif\n'
        'constexpr int big = 1\'000\'000;\n'
        'constexpr const char* note = "#include \\"/etc/passwd\\" /* is text */";\n'
        'constexpr const char* raw = R"x(a "/*" in a raw string)x";\n'
        'constexpr char quote = \'"\';\n'
        '#define HALF_T __half  // a macro, \\\n   continued in a comment\n' + KERNEL)
    jit.check_includes(honest, name_expressions=["scale<float, 4>"], defines={"N": 4, "S": '"text"'})
    assert jit.compile(honest, "k", arch="sm_90a", confined=True).name == "k"


def test_every_escape_is_refused_with_the_rule_named(secret_file):
    for source, options, named in escapes(secret_file):
        with pytest.raises(InvalidArgumentError) as caught:
            jit.check_includes(source, **options)
        assert named in caught.value.message, (source, caught.value.message)
        assert SECRET not in caught.value.message and "untrusted CUDA" in caught.value.message or "NVRTC flag" in \
            caught.value.message


def test_a_confined_compile_refuses_them_and_reads_nothing(secret_file):
    for source, options, named in escapes(secret_file):
        with pytest.raises(InvalidArgumentError) as caught:
            jit.compile_module(source, arch="sm_90a", confined=True, **options)
        assert named in caught.value.message and SECRET not in str(caught.value)


def test_honest_includes_pass_and_compile():
    honest = ("#include <cuda_fp16.h>\n#include <cuda/std/cstdint>\n#include <cooperative_groups.h>\n"
              '#include "tile.h"\n// #include "/etc/passwd" in a comment is no directive\n'
              "/* #include </etc/shadow> */\n" + KERNEL)
    headers = {"tile.h": "#include <cuda_bf16.h>\nconstexpr int TILE = 32;\n"}
    jit.check_includes(honest, headers=headers, extra_flags=["--use_fast_math", "-DTILE2=64", "--ftz=true"])
    assert jit.compile(honest, "k", arch="sm_90a", headers=headers, confined=True).name == "k"


def test_a_cached_module_is_no_way_around_the_rule(secret_file):
    source = f'#include "{secret_file}"\n' + KERNEL.replace("1.0f", "2.0f")
    with pytest.raises(Exception):
        jit.compile_module(source, arch="sm_90a")  # unconfined: NVRTC reads the file and fails to parse it
    with pytest.raises(InvalidArgumentError, match="absolute paths"):
        jit.compile_module(source, arch="sm_90a", confined=True)


def test_confine_includes_holds_for_the_rest_of_the_process(tmp_path, secret_file):
    script = tmp_path / "confined.py"
    script.write_text(textwrap.dedent(f'''
        import json
        from stitchcuda import jit
        from stitchcuda.errors import InvalidArgumentError
        out = {{"before": jit.includes_confined()}}
        jit.confine_includes()
        out["after"] = jit.includes_confined()
        try:
            jit.compile_module('#include "{secret_file}"\\n{KERNEL.strip()}', arch="sm_90a")  # confined=False asked
            out["compiled"] = True
        except InvalidArgumentError as exc:
            out["error"] = exc.message
        print(json.dumps(out))
    '''))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(jit.__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] is False and out["after"] is True
    assert "absolute paths" in out["error"] and SECRET not in out["error"]


REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return x * 2

    def get_inputs():
        return [torch.randn(64)]

    def get_init_inputs():
        return []
''')


def candidate(include: str, directive: str = "#include") -> str:
    return textwrap.dedent(f'''
        import torch
        import torch.nn as nn
        from stitchcuda import jit

        SRC = r"""
        {directive} "{include}"
        extern "C" __global__ void twice(const float* x, float* y, int n) {{
          int i = blockIdx.x * blockDim.x + threadIdx.x;
          if (i < n) y[i] = 2.0f * x[i];
        }}
        """
        _k = jit.compile(SRC, "twice")

        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                _k((x.numel() + 255) // 256, 256, x, y, x.numel())
                return y
    ''')


@pytest.mark.parametrize("directive", ["#include", "%:include"], ids=["plain", "digraph"])
@pytest.mark.parametrize("static_only", [True, False], ids=["static-only", "in-the-worker"])
def test_the_verifier_never_lets_a_candidate_include_a_file(secret_file, static_only, directive):
    from stitchcuda.verify import Task, VerifyConfig, check

    task = Task.from_source(REFERENCE, "twice")
    if static_only:
        report = check(task, candidate(str(secret_file), directive), static_only=True)
    else:
        report = check(task, candidate(str(secret_file), directive), config=VerifyConfig(device="cpu", timing_iters=0))
    text = report.to_json()
    assert not report.correct and SECRET not in text and "sk-planted" not in text
    assert "absolute paths" in text and "untrusted CUDA" in text, text[:2000]


def test_a_stitch_artifact_whose_kernel_uses_a_bypass_is_refused_on_load(tmp_path, secret_file):
    """A `.stitch` file is data: its kernel sources go through the same reading of the text as untrusted
    CUDA, so a digraph or a string-hidden include that the native scan misses is refused when loading."""
    from stitchcuda.program import Program, ProgramBuilder

    for spelled in (f'%:include "{secret_file}"\n', f'const char* a = "/*";\n#include "{secret_file}"\n// */\n'):
        b = ProgramBuilder()
        k = b.kernel(spelled + 'extern "C" __global__ void k(const float* x, float* y) { y[0] = x[0]; }', "k")
        x, y = b.input([4], name="x"), b.output([4], name="y")
        b.launch(k, 1, 1, [("in", x), ("out", y)])
        path = tmp_path / "planted.stitch"
        b.build().save(path)
        with pytest.raises(InvalidArgumentError, match="kernel 0 \\('k'\\).*absolute paths") as caught:
            Program.load(path)
        assert str(path) in caught.value.message and SECRET not in caught.value.message
        with pytest.raises(InvalidArgumentError, match="absolute paths"):
            Program.deserialize(path.read_bytes())
