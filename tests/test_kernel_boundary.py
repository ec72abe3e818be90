"""The Python side of the C kernels' boundary (kernels/clib.py's CLibrary) against the C prototypes in
kernels/csrc/*.c: the same exported functions, the same parameters in the same order, each C type bound to its
ctypes type. A mismatch would pass wrong-sized arguments through ctypes without any error."""

import ctypes
import re

from fastgen.kernels import TORCH_KERNELS, clib

from .helpers import require_tool

# Every C parameter type the entry points may use, and the ctypes type that passes it.
C_TO_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "pointer": ctypes.c_void_p}
# A function definition at file scope that is not static: what the library exports. Entry points return int.
DEFINITION = re.compile(r"^int\s+(\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)


def parse_parameter(text: str) -> tuple[str, str]:
    """'const uint16_t *k_cache' -> ('k_cache', 'pointer'); 'int64_t x_stride' -> ('x_stride', 'int64_t')."""
    match = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)", " ".join(text.split()))
    assert match, f"cannot read the C parameter {text!r}"
    base, pointer, name = match.groups()
    return name, "pointer" if pointer else base


def c_prototypes(sources) -> dict[str, list[tuple[str, str]]]:
    """Exported function name -> [(parameter name, C type)], from every definition in the sources; a function
    defined twice (an #if branch and its fallback) must be defined alike."""
    prototypes: dict[str, list[tuple[str, str]]] = {}
    for source in sources:
        for name, params in DEFINITION.findall(source.read_text()):
            parsed = [parse_parameter(p) for p in params.split(",") if p.strip() not in ("", "void")]
            assert prototypes.setdefault(name, parsed) == parsed, f"{name} is defined twice, differently"
    return prototypes


def as_ctypes(prototypes) -> dict[str, dict[str, type]]:
    return {
        name: {param: C_TO_CTYPES.get(c_type, c_type) for param, c_type in params}
        for name, params in prototypes.items()
    }


def test_every_entry_point_is_bound_as_its_c_prototype_declares():
    prototypes = c_prototypes(clib.SOURCES)
    assert prototypes, "no exported function found in kernels/csrc"
    assert as_ctypes(prototypes) == clib.signatures()


def test_the_check_sees_a_changed_argument_type():
    """The comparison above is not vacuous: one argument's ctypes type changed is a mismatch."""
    declared = clib.signatures()
    declared["linear_bf16"]["x_stride"] = ctypes.c_int
    assert as_ctypes(c_prototypes(clib.SOURCES)) != declared


def test_prototype_parser_reads_c_parameters():
    assert parse_parameter("const uint16_t *k_cache") == ("k_cache", "pointer")
    assert parse_parameter("int64_t\n    x_stride") == ("x_stride", "int64_t")
    assert parse_parameter("float scale") == ("scale", "float")


def test_the_loaded_library_binds_every_entry_point():
    library = clib.get_library()
    if library is None:
        require_tool(False, "no C compiler on this machine")
    for name, params in clib.signatures().items():
        fn = getattr(library, name)
        assert fn.argtypes == list(params.values()) and fn.restype is ctypes.c_int, name


def test_torch_table_has_linear_and_argmax():
    import torch

    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert TORCH_KERNELS.pack_linear(w) is None
    assert torch.equal(TORCH_KERNELS.linear(x, w, b, None), torch.nn.functional.linear(x, w, b))
    logits = torch.tensor([[1.0, 3.0, 3.0], [-float("inf")] * 3])
    assert TORCH_KERNELS.argmax(logits) == [1, 0]
