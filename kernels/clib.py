"""The boundary to the compiled C kernels (csrc/): building them, the cache of builds, and `CLibrary`, one typed table
of every entry point the library exports, bound with its ctypes signature.

Each field of `CLibrary` names an exported C function and lists its parameters, in order, with the ctypes type of
each C type; tests/test_kernel_boundary.py parses the prototypes in csrc/*.c and fails on any difference. Python
calls the kernels only through a `CLibrary` value, never by looking a name up.

The library is built with -march=native, so a build is only good on the CPU it was made on: the cache key holds the
CPU model and its feature flags and the compiler's version as well as the flags and sources, and a JSON record beside
each library says what it was built for. A library whose record does not match this machine is rebuilt, never
loaded: a cache shared between machines (an NFS home, a container volume, a CI cache) would otherwise hand one CPU
instructions that another lacks, and the process would die of SIGILL.

Loading a library runs its code, so the cache is trusted only where nobody else can write to it: the kernels' folder is
created 0700, and a folder that another user owns or that group or others may write is refused: the kernels fall back
to torch with a warning that says how to fix it. (Not a rebuild in a private temporary folder: that would compile
again in every replica and rank at every start and leave the shared folder's problem unseen.) The record beside each
library also holds the library's sha256, taken when it was built; a library that does not match it, or that is not
this user's alone, is rebuilt, never loaded."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("fastgen.kernels")
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "decode_attention.c",
        "prefill_attention.c",
        "prefill_attention_avx512.c",
        "elementwise.c",
        "linear.c",
        "linear_dpbf16.c",
        "linear_f32.c",
        "elementwise_f32.c",
        "linear_quant.c",
        "linear_quant_panels.c",
        "linear_q8.c",
        "linear_amx_q8.c",
        "decode_layer.c",
        "moe.c",
        "moe_bf16.c",
        "moe_quant.c",
        "lora.c",
    )
]
HEADERS = [
    CSRC / name
    for name in (
        "vector_math.h",
        "paged_cache.h",
        "amx.h",
        "amx_linear.h",
        "parallel.h",
        "linear_f32.h",
        "entry_points.h",
        "bf16.h",
        "moe_groups.h",
        "q8_block.h",
        "linear_q8_avx2.h",
        "ggml_blocks.h",
    )
]
# Reassociation lets the compiler vectorise the portable loops' reductions; no finite-math assumptions (the
# softmax starts from -inf).
FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# OpenMP splits the kernels over the process's torch threads. The library needs libgomp.so.1 by name, which the
# dynamic loader finds already loaded with torch, so both share one thread pool. Where the compiler has no OpenMP the
# kernels are built without it and run on one thread.
OPENMP = ["-fopenmp"]
CPUINFO = Path("/proc/cpuinfo")

# ctypes types of the C parameter types the entry points use. Every pointer passes as an address (data_ptr()).
POINTER, INT, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def entry(**params: type) -> Any:
    """A field of CLibrary: the C function of the field's name, taking `params` (C name -> ctypes type, in order)
    and returning int (0 on success, -1 where the kernel declines). Typed Any, as dataclasses.field() is, so that the
    field keeps its declared type."""
    return field(metadata={"params": params})


# The elementwise kernels take the same parameters in every dtype.
ADD_RMS_NORM = dict(
    x=POINTER,
    residual=POINTER,
    weight=POINTER,
    out=POINTER,
    residual_out=POINTER,
    rows=INT,
    hidden=INT,
    x_stride=INT64,
    eps=FLOAT,
    threads=INT,
)
SILU_MUL = dict(gate_up=POINTER, out=POINTER, rows=INT, inter=INT, in_stride=INT64, threads=INT)
ROTARY_WRITE_KV = dict(
    q=POINTER,
    k=POINTER,
    v=POINTER,
    row_stride=INT64,
    cos_sin=POINTER,
    positions=POINTER,
    slots=POINTER,
    q_out=POINTER,
    k_cache=POINTER,
    v_cache=POINTER,
    tokens=INT,
    heads=INT,
    kv_heads=INT,
    head_dim=INT,
    rotary_dim=INT,
    threads=INT,
)

# The linear kernels on a packed bfloat16 weight (AMX tiles, vdpbf16ps) and on GGUF blocks take one parameter list each.
PACKED_LINEAR = dict(
    x=POINTER, x_stride=INT64, packed=POINTER, bias=POINTER, y=POINTER, y_stride=INT64, m=INT, n=INT, k=INT, threads=INT
)
QUANT_LINEAR = dict(
    x=POINTER,
    x_stride=INT64,
    w=POINTER,
    w_stride=INT64,
    bias=POINTER,
    y=POINTER,
    y_stride=INT64,
    m=INT,
    n=INT,
    k=INT,
    type=INT,
    threads=INT,
)
# decode_layer.c's layer in either element type.
DECODE_LAYER = dict(
    x=POINTER,
    residual=POINTER,
    out=POINTER,
    residual_out=POINTER,
    m=INT,
    hidden=INT,
    input_norm=POINTER,
    post_norm=POINTER,
    eps=FLOAT,
    qkv=POINTER,
    qkv_stride=INT64,
    qkv_type=INT,
    qkv_rows=INT,
    qkv_rest=POINTER,
    qkv_rest_stride=INT64,
    qkv_rest_type=INT,
    o=POINTER,
    o_stride=INT64,
    o_type=INT,
    gate_up=POINTER,
    gate_up_stride=INT64,
    gate_up_type=INT,
    down=POINTER,
    down_stride=INT64,
    down_type=INT,
    intermediate=INT,
    heads=INT,
    kv_heads=INT,
    head_dim=INT,
    scale=FLOAT,
    cos_sin=POINTER,
    positions=POINTER,
    slots=POINTER,
    k_cache=POINTER,
    v_cache=POINTER,
    tables=POINTER,
    seq_lens=POINTER,
    block_size=INT,
    table_width=INT,
    amx_rows=INT,
    threads=INT,
)
# The mixture-of-experts kernels, float32 (moe.c) and bfloat16 (moe_bf16.c: AMX, vdpbf16ps).
MOE = dict(
    x=POINTER,
    x_stride=INT64,
    w13=POINTER,
    w2=POINTER,
    ids=POINTER,
    weights=POINTER,
    y=POINTER,
    tokens=INT,
    k=INT,
    experts=INT,
    hidden=INT,
    inter=INT,
    threads=INT,
)


@dataclass(frozen=True)
class CLibrary:
    """Every entry point of the compiled kernels, callable with the arguments listed (in that order)."""

    decode_attention_bf16: Callable[..., int] = entry(
        q=POINTER,
        k_cache=POINTER,
        v_cache=POINTER,
        tables=POINTER,
        seq_lens=POINTER,
        starts=POINTER,
        out=POINTER,
        seqs=INT,
        heads=INT,
        kv_heads=INT,
        head_dim=INT,
        block_size=INT,
        table_width=INT,
        scale=FLOAT,
        softcap=FLOAT,
        threads=INT,
    )
    decode_attention_f32: Callable[..., int] = entry(
        q=POINTER,
        k_cache=POINTER,
        v_cache=POINTER,
        tables=POINTER,
        seq_lens=POINTER,
        starts=POINTER,
        out=POINTER,
        seqs=INT,
        heads=INT,
        kv_heads=INT,
        head_dim=INT,
        block_size=INT,
        table_width=INT,
        scale=FLOAT,
        softcap=FLOAT,
        threads=INT,
    )
    prefill_attention_available: Callable[[], int] = entry()
    prefill_attention_bf16: Callable[..., int] = entry(
        q=POINTER,
        k_cache=POINTER,
        v_cache=POINTER,
        table=POINTER,
        out=POINTER,
        q_stride=INT64,
        len=INT,
        chunk=INT,
        heads=INT,
        kv_heads=INT,
        head_dim=INT,
        block_size=INT,
        scale=FLOAT,
        window=INT,
        threads=INT,
    )
    prefill_attention_avx512_bf16: Callable[..., int] = entry(
        q=POINTER,
        k_cache=POINTER,
        v_cache=POINTER,
        tables=POINTER,
        query_start=POINTER,
        seq_lens=POINTER,
        out=POINTER,
        seqs=INT,
        heads=INT,
        kv_heads=INT,
        head_dim=INT,
        block_size=INT,
        table_width=INT,
        scale=FLOAT,
        window=INT,
        threads=INT,
    )
    prefill_attention_avx512_f32: Callable[..., int] = entry(
        q=POINTER,
        k_cache=POINTER,
        v_cache=POINTER,
        tables=POINTER,
        query_start=POINTER,
        seq_lens=POINTER,
        out=POINTER,
        seqs=INT,
        heads=INT,
        kv_heads=INT,
        head_dim=INT,
        block_size=INT,
        table_width=INT,
        scale=FLOAT,
        window=INT,
        threads=INT,
    )
    elementwise_available: Callable[[], int] = entry()
    add_rms_norm_bf16: Callable[..., int] = entry(**ADD_RMS_NORM)
    silu_mul_bf16: Callable[..., int] = entry(**SILU_MUL)
    gelu_tanh_mul_bf16: Callable[..., int] = entry(**SILU_MUL)
    rotary_write_kv_bf16: Callable[..., int] = entry(**ROTARY_WRITE_KV)
    argmax_bf16: Callable[..., int] = entry(x=POINTER, rows=INT, vocab=INT, stride=INT64, out=POINTER, threads=INT)
    linear_bf16: Callable[..., int] = entry(**PACKED_LINEAR)
    linear_dpbf16_available: Callable[[], int] = entry()
    linear_dpbf16: Callable[..., int] = entry(**PACKED_LINEAR)
    elementwise_f32_available: Callable[[], int] = entry()
    add_rms_norm_f32: Callable[..., int] = entry(**ADD_RMS_NORM)
    silu_mul_f32: Callable[..., int] = entry(**SILU_MUL)
    gelu_tanh_mul_f32: Callable[..., int] = entry(**SILU_MUL)
    rotary_write_kv_f32: Callable[..., int] = entry(**ROTARY_WRITE_KV)
    linear_f32_available: Callable[[], int] = entry()
    linear_f32: Callable[..., int] = entry(**PACKED_LINEAR)
    linear_quant_isa: Callable[[], int] = entry()
    linear_quant_row_bytes: Callable[..., int] = entry(type=INT, k=INT)
    linear_quant_f32: Callable[..., int] = entry(**QUANT_LINEAR)
    dequantize_rows_f32: Callable[..., int] = entry(w=POINTER, w_stride=INT64, out=POINTER, n=INT, k=INT, type=INT)
    dequantize_rows_bf16: Callable[..., int] = entry(
        w=POINTER, w_stride=INT64, out=POINTER, n=INT, k=INT, type=INT, threads=INT
    )
    linear_quant_dpbf16: Callable[..., int] = entry(**QUANT_LINEAR)
    linear_quant_amx_bf16: Callable[..., int] = entry(**QUANT_LINEAR)
    linear_quant_panels_f32: Callable[..., int] = entry(**QUANT_LINEAR)
    linear_q8_available: Callable[[], int] = entry()
    linear_q8_types: Callable[[], int] = entry()
    linear_q8_f32: Callable[..., int] = entry(**QUANT_LINEAR)
    linear_q8_bf16: Callable[..., int] = entry(**QUANT_LINEAR)
    linear_amx_q8_available: Callable[[], int] = entry()
    linear_amx_q8_bf16: Callable[..., int] = entry(**QUANT_LINEAR)
    decode_layer_q8_bf16: Callable[..., int] = entry(**DECODE_LAYER)
    decode_layer_q8_f32: Callable[..., int] = entry(**DECODE_LAYER)
    linear_f32_silu_mul_available: Callable[[], int] = entry()
    linear_f32_silu_mul: Callable[..., int] = entry(
        x=POINTER, x_stride=INT64, packed=POINTER, h=POINTER, h_stride=INT64, m=INT, inter=INT, k=INT, threads=INT
    )
    moe_f32_available: Callable[[], int] = entry()
    moe_f32: Callable[..., int] = entry(**MOE)
    moe_dpbf16_available: Callable[[], int] = entry()
    moe_dpbf16: Callable[..., int] = entry(**MOE)
    moe_amx_bf16_available: Callable[[], int] = entry()
    moe_amx_bf16: Callable[..., int] = entry(**MOE)
    moe_quant_available: Callable[..., int] = entry(bf16=INT)
    moe_quant: Callable[..., int] = entry(
        x=POINTER,
        bf16=INT,
        x_stride=INT64,
        table=POINTER,
        ids=POINTER,
        weights=POINTER,
        y=POINTER,
        tokens=INT,
        k=INT,
        experts=INT,
        hidden=INT,
        inter=INT,
        gemm_rows=INT,
        threads=INT,
    )
    lora_sgmv: Callable[..., int] = entry(
        y=POINTER,
        y_stride=INT64,
        x=POINTER,
        x_stride=INT64,
        a=POINTER,
        b=POINTER,
        rows=POINTER,
        table=POINTER,
        ranks=POINTER,
        total=INT,
        segments=INT,
        slots=INT,
        fan_in=INT,
        fan_out=INT,
        max_rank=INT,
        dtype=INT,
        threads=INT,
    )

    @classmethod
    def bind(cls, library: ctypes.CDLL) -> CLibrary:
        """Each entry point of the loaded library with its argument and return types set."""
        functions = {}
        for f in dataclasses.fields(cls):
            fn = getattr(library, f.name)
            fn.restype, fn.argtypes = ctypes.c_int, list(f.metadata["params"].values())
            functions[f.name] = fn
        return cls(**functions)


def signatures() -> dict[str, dict[str, type]]:
    """Entry point name -> its parameters (C name -> ctypes type), as CLibrary declares them."""
    return {f.name: dict(f.metadata["params"]) for f in dataclasses.fields(CLibrary)}


@dataclass(frozen=True)
class BuildTarget:
    """What a build depends on besides its sources and flags: the CPU -march=native compiles for, and the compiler."""

    cpu_model: str
    cpu_flags: tuple[str, ...]
    compiler: str
    compiler_version: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BuildTarget:
        record = json.loads(text)
        return cls(record["cpu_model"], tuple(record["cpu_flags"]), record["compiler"], record["compiler_version"])


def cpu_identity() -> tuple[str, tuple[str, ...]]:
    """(model, sorted feature flags) of this machine's first CPU, from /proc/cpuinfo ("model name"/"flags" on x86,
    "CPU part"/"Features" on ARM); platform's description where that file cannot be read."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".strip(), ()
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("CPU part") or platform.machine()
    flags = fields.get("flags") or fields.get("Features") or ""
    return model, tuple(sorted(flags.split()))


def build_target(compiler: str) -> BuildTarget:
    model, flags = cpu_identity()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = ""
    return BuildTarget(model, flags, compiler, version)


def cache_root() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def ownership_problem(path: Path) -> str | None:
    """Why code or weights under `path` (not followed if a link) could be someone else's: it belongs to another user,
    or group or others may write it. None where only this user can have put it there."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be inspected: {exc}"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def private_dir(path: Path) -> str | None:
    """Creates `path` (and a missing $FASTGEN_CACHE above it) mode 0700; the problem that makes it untrustworthy,
    if any (ownership_problem, or it is not a folder)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"{path} cannot be created: {exc}"
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        return f"{path} is not a folder"
    return ownership_problem(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def library_path(target: BuildTarget) -> Path:
    """Where the build for `target` of the current sources and flags lives in the cache."""
    digest = hashlib.sha256("\0".join([*FLAGS, *OPENMP, target.to_json()]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return cache_dir() / f"fastgen_cpu-{digest.hexdigest()[:16]}.so"


def record_path(library: Path) -> Path:
    """The JSON record of what `library` was built for."""
    return library.with_suffix(".json")


def built_for(library: Path) -> BuildTarget | None:
    """The target recorded beside a cached library; None where there is no library or no readable record."""
    try:
        return BuildTarget.from_json(record_path(library).read_text()) if library.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorded_sha256(library: Path) -> str | None:
    try:
        return json.loads(record_path(library).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None


def unusable(library: Path, target: BuildTarget) -> str | None:
    """Why the cached `library` must not be loaded for `target` (and is rebuilt); None where it may be."""
    if built_for(library) != target:
        return "it is missing or was built for another CPU or compiler" if library.exists() else "it is missing"
    problem = ownership_problem(library)
    if problem is not None:
        return problem
    if recorded_sha256(library) != file_sha256(library):
        return "it does not match the sha256 recorded when it was built"
    return None


def compile_library(target: BuildTarget, path: Path) -> bool:
    """Builds the library into `path` with its record beside it; False where the compiler fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        for openmp in (OPENMP, []):
            command = [target.compiler, *FLAGS, *openmp, "-o", str(built), *map(str, SOURCES), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                break
            if openmp:
                log.warning("building the CPU kernels with OpenMP failed; they will run on one thread")
        else:
            log.warning("building the CPU kernels failed, torch serves instead:\n%s", result.stderr[-2000:])
            return False
        record = Path(tmp) / record_path(path).name
        record.write_text(json.dumps({**dataclasses.asdict(target), "sha256": file_sha256(built)}, indent=1))
        # Atomic replaces, library first: a process that sees the new record sees the new library. One that sees a
        # new library with the old record (or none) finds it unusable and rebuilds, which is safe.
        os.replace(built, path)
        os.replace(record, record_path(path))
    return True


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load_library() -> CLibrary | None:
    """The compiled kernels for this machine, building them where the cache holds no build recorded for it; None
    where no C compiler is available or the build fails."""
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels fall back to torch")
        return None
    target = build_target(compiler)
    path = library_path(target)
    problem = private_dir(path.parent)
    if problem is not None:
        log.warning(
            "refusing the CPU kernels' cache: %s. Anyone who can write there could run code in this process, so the "
            "CPU kernels fall back to torch. Make it yours and private (chown $USER, chmod 700) or point "
            "$FASTGEN_CACHE at a folder only this user can write.",
            problem,
        )
        return None
    reason = unusable(path, target)
    if reason is not None:
        if path.exists():
            log.warning("not loading the cached CPU kernels %s: %s; rebuilding", path, reason)
        if not compile_library(target, path):
            return None
        reason = unusable(path, target)
        if reason is not None:  # changed between its build and now
            log.warning("not loading the CPU kernels just built in %s: %s; torch serves instead", path, reason)
            return None
    return CLibrary.bind(ctypes.CDLL(str(path)))


@functools.cache
def get_library() -> CLibrary | None:
    """The process's library, loaded once (the one cached handle)."""
    return load_library()
