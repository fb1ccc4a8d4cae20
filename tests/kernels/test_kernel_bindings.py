"""The kernels' C interface (tessera_kernels.h) and its Python mirror (tessera.kernels.bindings) agree.

ctypes trusts whatever argument list it is given: a prototype changed on one side only passes a
pointer where an integer belongs, or shifts every argument after it, and nothing fails until a
kernel reads garbage. So the header and every source are parsed here (a small parser for the
plain declarations they hold, no preprocessor) and compared with the binding table, the shared
constants and the ctypes Structures; none of it needs the library built.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Optional

import pytest

from tessera.kernels import bindings, library, toolchain

KERNELS = Path(bindings.__file__).parent
HEADER = "tessera_kernels.h"
SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint16_t": ctypes.c_uint16,
           "float": ctypes.c_float, "double": ctypes.c_double}


class CFunction(NamedTuple):
    restype: str
    params: tuple[tuple[str, str], ...]  # (type, name), the type normalized ("const float *")

    def declaration(self, name: str) -> str:
        params = ", ".join(f"{t} {n}".replace("* ", "*") for t, n in self.params) or "void"
        return f"{self.restype} {name}({params})"


def _code(text: str) -> str:
    """C text without comments (their line breaks kept, so declarations still start lines)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n") or " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _ctype(text: str) -> str:
    return " ".join(text.replace("*", " * ").split())


def _params(text: str) -> tuple[tuple[str, str], ...]:
    if _ctype(text) in ("", "void"):
        return ()
    out = []
    for param in text.split(","):
        m = re.fullmatch(r"\s*(.*?)\s*\b(\w+)\s*", param, flags=re.S)
        if not m or not m.group(1):
            raise ValueError(f"cannot read parameter {param.strip()!r}")
        out.append((_ctype(m.group(1)), m.group(2)))
    return tuple(out)


def _functions(text: str, end: str) -> dict[str, CFunction]:
    """Top-level functions that are not static: prototypes (`end` ";") or definitions ("{")."""
    found = {}
    pattern = r"^([A-Za-z_][\w \t*]*?)\s*\b(\w+)\s*\(([^()]*)\)\s*" + re.escape(end)
    for m in re.finditer(pattern, _code(text), flags=re.M):
        restype = _ctype(m.group(1))
        if restype.split()[0] in ("static", "typedef", "return", "else"):
            continue
        found[m.group(2)] = CFunction(restype, _params(m.group(3)))
    return found


def parse_prototypes(header: str) -> dict[str, CFunction]:
    return _functions(header, ";")


def parse_definitions(source: str) -> dict[str, CFunction]:
    return _functions(source, "{")


def parse_constants(header: str) -> dict[str, int]:
    """Integer #defines and enum members."""
    code = _code(header)
    found = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*#define\s+(\w+)\s+\(?(-?\d+)\)?\s*$", code,
                                                              flags=re.M)}
    for body in re.findall(r"\benum\s*\w*\s*\{(.*?)\}", code, flags=re.S):
        value = -1
        for item in filter(None, (i.strip() for i in body.split(","))):
            name, _, given = (s.strip() for s in item.partition("="))
            value = int(given, 0) if given else value + 1
            found[name] = value
    return found


def parse_structs(header: str) -> dict[str, list[tuple[str, str]]]:
    """typedef struct { ... } name; -> its fields in order, (type, name), one per declarator."""
    found = {}
    for body, name in re.findall(r"typedef\s+struct\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", _code(header), flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            first, *rest = decl.split(",")
            m = re.fullmatch(r"(.*?)\s*(\**)\s*(\w+)", first.strip(), flags=re.S)
            base = m.group(1)
            fields.append((_ctype(base + m.group(2)), m.group(3)))
            for more in rest:
                m2 = re.fullmatch(r"\s*(\**)\s*(\w+)\s*", more)
                fields.append((_ctype(base + m2.group(1)), m2.group(2)))
        found[name] = fields
    return found


def expected_ctype(ctype: str, structs: dict[str, type]) -> Optional[type]:
    """The ctypes type a C type is passed or stored as here: every pointer as c_void_p, but a string
    returned (const char *) as c_char_p."""
    if ctype == "const char *":
        return ctypes.c_char_p
    if "*" in ctype:
        return ctypes.c_void_p
    base = " ".join(w for w in ctype.split() if w not in ("const", "volatile"))
    if base == "void":
        return None
    if base in structs:
        return structs[base]
    if base in SCALARS:
        return SCALARS[base]
    raise KeyError(f"no ctypes type for C type {ctype!r}")


def _type_name(t: Optional[type]) -> str:
    """As bindings.py spells it (ctypes' own names call c_int64 c_long here)."""
    names = {ctypes.c_int64: "c_int64", ctypes.c_int: "c_int", ctypes.c_uint16: "c_uint16"}
    return "void" if t is None else names.get(t, t.__name__)


def check_signatures(prototypes: dict[str, CFunction], table: dict[str, bindings.Signature],
                     structs: dict[str, type]) -> list[str]:
    problems = [f"{n}: declared in the header, no row in bindings.SIGNATURES" for n in prototypes if n not in table]
    problems += [f"{n}: a row in bindings.SIGNATURES, not declared in the header" for n in table if n not in prototypes]
    for name in prototypes.keys() & table.keys():
        c, row = prototypes[name], table[name]
        if expected_ctype(c.restype, structs) is not row.restype:
            problems.append(f"{name}: returns {c.restype}, bound as {_type_name(row.restype)}")
        if len(c.params) != len(row.args):
            problems.append(f"{name}: {len(c.params)} parameters in C, {len(row.args)} in the binding")
        for i, ((ctype, cname), (pname, ptype)) in enumerate(zip(c.params, row.args)):
            if cname != pname:
                problems.append(f"{name}: argument {i} is {cname!r} in C, {pname!r} in the binding")
            want = expected_ctype(ctype, structs)
            if want is not ptype:
                problems.append(f"{name}: argument {i} ({cname}) is {ctype} in C, bound as {_type_name(ptype)} "
                                f"(want {_type_name(want)})")
    return problems


def check_definitions(prototypes: dict[str, CFunction], sources: dict[str, str]) -> list[str]:
    """Every exported definition is declared in the header, with the same parameter names (the
    compiler checks the types: each source includes the header)."""
    problems = []
    for file, text in sources.items():
        for name, fn in parse_definitions(text).items():
            if name not in prototypes:
                problems.append(f"{file}: {name} is exported but not declared in {HEADER} (or make it static)")
            elif fn != prototypes[name]:
                problems.append(f"{file}: defines {fn.declaration(name)}, the header declares "
                                f"{prototypes[name].declaration(name)}")
    return problems


def mirrored_constants(module: ModuleType) -> dict[str, int]:
    return {n: v for n, v in vars(module).items() if n.isupper() and type(v) is int}


def check_constants(header: dict[str, int], python: dict[str, int]) -> list[str]:
    problems = [f"{n} = {v} in the header, missing from bindings" for n, v in header.items() if n not in python]
    problems += [f"{n} = {v} in bindings, missing from the header" for n, v in python.items() if n not in header]
    problems += [f"{n} = {header[n]} in the header, {python[n]} in bindings"
                 for n in header.keys() & python.keys() if header[n] != python[n]]
    return problems


def check_structs(header: dict[str, list[tuple[str, str]]], mirrors: dict[str, type]) -> list[str]:
    problems = [f"struct {n}: no ctypes mirror in bindings.STRUCTS" for n in header if n not in mirrors]
    problems += [f"struct {n}: in bindings.STRUCTS, not in the header" for n in mirrors if n not in header]
    for name in header.keys() & mirrors.keys():
        mirror = mirrors[name].__name__
        c_fields, py_fields = header[name], mirrors[name]._fields_
        if len(c_fields) != len(py_fields):
            problems.append(f"struct {name}: {len(c_fields)} fields in C, {len(py_fields)} in {mirror}")
        for i, ((ctype, cname), (pname, ptype)) in enumerate(zip(c_fields, py_fields)):
            want = expected_ctype(ctype, mirrors)
            if (cname, want) != (pname, ptype):
                problems.append(f"struct {name}: field {i} is {ctype} {cname} in C, {pname}: {_type_name(ptype)} "
                                f"in {mirror}")
    return problems


def check_interface(header: str, sources: dict[str, str]) -> list[str]:
    """Everything on which the header and bindings.py (and the sources' definitions) disagree."""
    prototypes = parse_prototypes(header)
    return (check_signatures(prototypes, bindings.SIGNATURES, bindings.STRUCTS)
            + check_definitions(prototypes, sources)
            + check_constants(parse_constants(header), mirrored_constants(bindings))
            + check_structs(parse_structs(header), bindings.STRUCTS))


def _header() -> str:
    return (KERNELS / HEADER).read_text()


def _sources() -> dict[str, str]:
    """The library's sources (the CPU probe is built on its own, with no instruction-set flag)."""
    return {p.name: p.read_text() for p in sorted(KERNELS.glob("*.c")) if p.name != toolchain.PROBE}


def test_header_and_bindings_agree():
    assert check_interface(_header(), _sources()) == []


def test_the_parser_sees_the_whole_interface():
    """A parser that found nothing would agree with everything."""
    prototypes = parse_prototypes(_header())
    assert len(prototypes) == len(bindings.SIGNATURES) >= 28
    assert len(prototypes["paged_decode_attention_int8"].params) == 28
    assert prototypes["tessera_avx2_fma"] == CFunction("int", ())
    exported = {n for text in _sources().values() for n in parse_definitions(text)}
    assert exported == set(prototypes)
    assert parse_constants(_header())["LINEAR_Q6K"] == 5
    assert [f for _, f in parse_structs(_header())["layer_t"]] == [
        "attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm", "qkv", "o", "gate_up", "down",
        "kv_cache", "rope", "window", "group", "moe", "sinks"]


def test_the_built_library_exports_the_header():
    """The symbols the compiled library exports, read by nm: what the parser of definitions must find."""
    nm = shutil.which("nm")
    if nm is None or library.available() is not None:
        pytest.skip("no nm, or no kernel library here")
    out = subprocess.run([nm, "-D", "--defined-only", str(library.build())], check=True, capture_output=True,
                         text=True).stdout
    exported = {line.split()[2] for line in out.splitlines() if len(line.split()) == 3 and line.split()[1] == "T"}
    assert exported == set(parse_prototypes(_header()))


def test_every_source_includes_the_header_and_the_build_hashes_it():
    """Each source is checked against the prototypes by the compiler, and an edit to any header
    changes the library's name (so it is rebuilt)."""
    sources = _sources()
    assert set(sources) == set(library.SOURCES)
    for name, text in sources.items():
        assert f'#include "{HEADER}"' in text, name
    included = {inc for p in KERNELS.glob("*.[ch]") for inc in re.findall(r'#include "([^"]+)"', p.read_text())}
    assert included <= set(library.HEADERS) and HEADER in library.HEADERS


def test_a_mismatched_prototype_is_reported():
    header, sources = _header(), _sources()
    swapped = header.replace("int64_t K, int64_t G, int is_bf16, float *xf);",
                             "int64_t K, int is_bf16, int64_t G, float *xf);")
    assert swapped != header
    problems = check_interface(swapped, sources)
    assert "int8_gemv: argument 8 is 'is_bf16' in C, 'G' in the binding" in problems
    assert any(p.startswith("int8_gemv: argument 8 (is_bf16) is int in C, bound as c_int64") for p in problems)
    assert any(p.startswith("int8_gemv.c: defines int int8_gemv(const void *x,") and
               p.endswith("int64_t K, int is_bf16, int64_t G, float *xf)") for p in problems)

    dropped = header.replace("const float *kb_basis, const float *kb_step);", "const float *kb_basis);")
    assert "paged_decode_attention_int8: 27 parameters in C, 28 in the binding" in check_interface(dropped, sources)
    retyped = header.replace("int64_t hidden, float eps);", "int64_t hidden, double eps);", 1)
    assert "rms_norm_bf16: argument 6 (eps) is double in C, bound as c_float (want c_double)" in check_interface(
        retyped, sources)
    returns = header.replace("int64_t kquant_scratch_bytes(", "int kquant_scratch_bytes(")
    assert "kquant_scratch_bytes: returns int, bound as c_int64" in check_interface(returns, sources)


def test_undeclared_functions_and_missing_rows_are_reported():
    header, sources = _header(), _sources()
    added = header.replace("int tessera_avx2_fma(void);",
                           "int tessera_avx2_fma(void);\nint tessera_new_kernel(int64_t n);")
    assert ("tessera_new_kernel: declared in the header, no row in bindings.SIGNATURES"
            in check_interface(added, sources))
    removed = header.replace("int tessera_avx2_fma(void);", "")
    problems = check_interface(removed, sources)
    assert "tessera_avx2_fma: a row in bindings.SIGNATURES, not declared in the header" in problems
    assert ("int4_avx2.c: tessera_avx2_fma is exported but not declared in tessera_kernels.h (or make it static)"
            in problems)
    helper = dict(sources, **{"extra.c": "static int hidden(int a) { return a; }\n"
                                         "int visible(int a) { return a; }\n"})
    assert check_interface(header, helper) == [
        "extra.c: visible is exported but not declared in tessera_kernels.h (or make it static)"]


def test_a_mismatched_constant_or_struct_is_reported():
    header, sources = _header(), _sources()
    assert "KQUANT_MAX_ROWS = 16 in the header, 8 in bindings" in check_interface(
        header.replace("#define KQUANT_MAX_ROWS 8", "#define KQUANT_MAX_ROWS 16"), sources)
    assert "LINEAR_INT8 = 7 in the header, 2 in bindings" in check_interface(
        header.replace("LINEAR_INT8 = 2", "LINEAR_INT8 = 7"), sources)
    assert "MAX_SOMETHING = 3 in the header, missing from bindings" in check_interface(
        header + "\n#define MAX_SOMETHING 3\n", sources)
    swapped = header.replace("int64_t n_pad, n, k;", "int64_t n, n_pad, k;")
    assert check_interface(swapped, sources) == [
        "struct linear_t: field 5 is int64_t n in C, n_pad: c_int64 in LinearOperand",
        "struct linear_t: field 6 is int64_t n_pad in C, n: c_int64 in LinearOperand"]
    narrowed = header.replace("double eps, scale;", "double eps;\n    float scale;")
    assert check_interface(narrowed, sources) == [
        "struct dims_t: field 9 is float scale in C, scale: c_double in DecodeDims"]
    grown = header.replace("const float *sinks;  /*", "const float *sinks, *extra; /*")
    assert check_interface(grown, sources) == ["struct layer_t: 17 fields in C, 16 in DecodeLayer"]


def test_struct_layouts_match_the_compiler(tmp_path):
    """Offsets and sizes as the C compiler lays the structs out, against ctypes'."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = [f'#include "{KERNELS / HEADER}"', "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for cname, mirror in bindings.STRUCTS.items():
        lines.append(f'    printf("{cname} size %zu\\n", sizeof({cname}));')
        lines += [f'    printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));' for f, _ in mirror._fields_]
    lines.append("    return 0;\n}\n")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    subprocess.run([cc, "-std=c11", str(src), "-o", str(src.with_suffix(""))], check=True, capture_output=True)
    out = subprocess.run([str(src.with_suffix(""))], check=True, capture_output=True, text=True).stdout
    want = []
    for cname, mirror in bindings.STRUCTS.items():
        want.append(f"{cname} size {ctypes.sizeof(mirror)}")
        want += [f"{cname} {f} {getattr(mirror, f).offset}" for f, _ in mirror._fields_]
    assert out.split("\n")[:-1] == want


def test_keyword_calls_take_the_header_names():
    """The wrappers kernels.calls() builds: every argument by its name, none left out or misspelled."""
    calls: dict = {}

    def fake(*args):
        calls["args"] = args
        return 0

    f = bindings.keyword_call(fake, "int4_i8_scratch_bytes")
    assert f(M=3, K=64) == 0 and calls["args"] == (3, 64)
    with pytest.raises(TypeError):
        f(3, 64)
    with pytest.raises(TypeError):
        f(M=3, k=64)
    assert bindings.keyword_call(fake, "tessera_int4_i8")() == 0 and calls["args"] == ()
