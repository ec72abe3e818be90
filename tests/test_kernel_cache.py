"""The cache of compiled CPU kernels (kernels/clib.py) when $FASTGEN_CACHE is shared between machines: a build is
keyed by the CPU and the compiler it was made for, and a library recorded as built for another CPU is rebuilt,
never loaded (it may hold instructions this CPU lacks: SIGILL).

A stand-in compiler (a shell script, set as $CC) "builds" by copying this machine's real library, so the tests count
builds without compiling; /proc/cpuinfo is replaced by files describing made-up CPUs.

Loading a library runs its code, and converted weights are what a replica serves: a cache that others may write, or
a file that does not match the sha256 recorded when it was made, is never used. The GGUF conversion is stood in for
by one that writes two small files."""

import ctypes
import stat
from pathlib import Path

import pytest

from fastgen.kernels import clib
from fastgen.replica import weights

CPU_A = "processor\t: 0\nmodel name\t: Made-up CPU A\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n\n"
CPU_B = "processor\t: 0\nmodel name\t: Made-up CPU B\nflags\t\t: fpu sse2 avx2\n\n"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fresh $FASTGEN_CACHE, a stand-in compiler, and `machine.cpu(text)` to choose what /proc/cpuinfo says.
    machine.builds() counts the builds; machine.loads lists (path, what its record says) for every library loaded."""
    real = clib.get_library()
    if real is None:
        pytest.skip("no C compiler on this machine")
    real_path = clib.library_path(clib.build_target(clib.find_compiler()))  # what get_library() loaded
    log = tmp_path / "builds.log"
    compiler = tmp_path / "fakecc"
    compiler.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi\n'
        'prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f'echo build >> "{log}"\n'
        f'cp "{real_path}" "$out"\n'
    )
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(clib, "CPUINFO", cpuinfo, raising=False)

    class Machine:
        loads: list = []

        @staticmethod
        def cpu(text: str) -> None:
            cpuinfo.write_text(text)

        @staticmethod
        def builds() -> int:
            return len(log.read_text().splitlines()) if log.exists() else 0

        @staticmethod
        def target() -> clib.BuildTarget:
            return clib.build_target(str(compiler))

    real_cdll = ctypes.CDLL

    def spy(path, *args, **kwargs):
        Machine.loads.append((Path(path), clib.built_for(Path(path))))
        return real_cdll(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", spy)
    return Machine


def test_a_library_recorded_as_built_for_another_cpu_is_rebuilt_never_loaded(machine):
    machine.cpu(CPU_A)
    assert clib.load_library() is not None and machine.builds() == 1
    assert clib.load_library() is not None and machine.builds() == 1  # a good build is reused
    path = machine.loads[-1][0]
    other = clib.BuildTarget("Made-up CPU B", ("avx2", "fpu", "sse2"), machine.target().compiler, "fakecc 1.0")
    clib.record_path(path).write_text(other.to_json())  # as if another machine had put its build there
    machine.loads.clear()
    assert clib.load_library() is not None
    assert machine.builds() == 2, "the library built for another CPU was not rebuilt"
    assert machine.loads == [(path, machine.target())], "a library was loaded on a CPU it was not built for"
    clib.record_path(path).unlink()  # no record: what it was built for is unknown
    assert clib.load_library() is not None and machine.builds() == 3


def test_a_cache_shared_by_two_cpus_holds_a_build_for_each(machine):
    machine.cpu(CPU_A)
    clib.load_library()
    built_on_a = machine.loads[-1][0]
    machine.cpu(CPU_B)
    machine.loads.clear()
    assert clib.load_library() is not None and machine.builds() == 2
    assert [path for path, _ in machine.loads] != [built_on_a], "CPU B loaded CPU A's build"
    assert machine.loads[-1][1].cpu_model == "Made-up CPU B"
    machine.cpu(CPU_A)
    clib.load_library()  # both builds stay usable, each on its own CPU
    assert machine.builds() == 2 and machine.loads[-1][0] == built_on_a


def test_the_cache_key_holds_the_cpu_flags_and_the_compiler_version():
    target = clib.BuildTarget("CPU", ("avx2", "avx512f"), "cc", "cc 13.3")
    assert clib.library_path(target) != clib.library_path(clib.BuildTarget("CPU", ("avx2",), "cc", "cc 13.3"))
    assert clib.library_path(target) != clib.library_path(clib.BuildTarget("CPU", target.cpu_flags, "cc", "cc 14.1"))
    assert clib.library_path(target) == clib.library_path(clib.BuildTarget.from_json(target.to_json()))


def test_cpu_identity_reads_the_model_and_flags_of_the_first_cpu(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPU_A + CPU_B.replace("processor\t: 0", "processor\t: 1"))
    monkeypatch.setattr(clib, "CPUINFO", cpuinfo)
    assert clib.cpu_identity() == ("Made-up CPU A", ("amx_tile", "avx2", "avx512_bf16", "avx512f", "fpu", "sse2"))


# ---- who may write the cache (loading a library runs its code) ----
def tamper(path: Path, data: bytes) -> None:
    """Replaces the file as a writer would (never in place: this process has the old one mapped)."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(data)
    fresh.replace(path)


def test_the_normal_path_loads_the_c_kernels_from_a_private_folder_with_their_sha256_recorded(machine):
    machine.cpu(CPU_A)
    assert clib.load_library() is not None and machine.builds() == 1
    path = machine.loads[-1][0]
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700, "the kernels' folder was not created private"
    assert clib.recorded_sha256(path) == clib.file_sha256(path)


def test_a_cache_folder_that_others_may_write_is_refused_and_nothing_is_loaded(machine, caplog):
    machine.cpu(CPU_A)
    assert clib.load_library() is not None
    clib.cache_dir().chmod(0o777)  # a shared folder: anyone could have put a library there
    machine.loads.clear()
    assert clib.load_library() is None, "a library was taken from a world-writable folder"
    assert machine.loads == [] and machine.builds() == 1
    assert "writable by its group or by others" in caplog.text and "fall back to torch" in caplog.text


def test_a_cache_folder_of_another_user_is_refused(machine, monkeypatch):
    machine.cpu(CPU_A)
    assert clib.load_library() is not None
    me = clib.os.geteuid()
    monkeypatch.setattr(clib.os, "geteuid", lambda: me + 1)  # as if another user had made the cache
    machine.loads.clear()
    assert clib.load_library() is None and machine.loads == []


def test_a_library_that_does_not_match_its_recorded_sha256_is_rebuilt_never_loaded(machine, tmp_path):
    machine.cpu(CPU_A)
    assert clib.load_library() is not None
    path = machine.loads[-1][0]
    built = path.read_bytes()
    tamper(path, built + b"\0")  # changed after its build: still a loadable library, not the one built
    machine.loads.clear()
    assert clib.load_library() is not None and machine.builds() == 2, "the changed library was not rebuilt"
    assert path.read_bytes() == built
    tamper(path, built + b"\0")
    compiler = tmp_path / "fakecc"  # the same compiler (the same target, the same path), now failing every build
    compiler.write_text(compiler.read_text().replace("echo build", "exit 1; echo build"))
    machine.loads.clear()
    assert clib.load_library() is None and machine.loads == [], "a library that fails its sha256 was loaded"


# ---- converted weights (replica/weights.py) ----
@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """A fresh $FASTGEN_CACHE, a .gguf file, and a stand-in conversion; returns (gguf, the folders converted into)."""
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    made: list[Path] = []

    def convert(source: Path, folder: Path) -> None:
        made.append(folder)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"the weights")

    monkeypatch.setattr(weights, "write_conversion", convert)
    return gguf, made


def test_converted_weights_that_do_not_match_their_sha256_are_converted_again(conversions):
    gguf, made = conversions
    folder = weights.convert_gguf(gguf)
    assert weights.convert_gguf(gguf) == folder and len(made) == 1  # a good conversion is reused
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700, "the models folder was not created private"
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert weights.convert_gguf(gguf) == folder and len(made) == 2, "changed weights were used"
    assert (folder / "model.safetensors").read_bytes() == b"the weights"
    (folder / "extra.safetensors").write_bytes(b"more weights")  # iter_safetensors would read it too
    assert weights.convert_gguf(gguf) == folder and len(made) == 3
    (folder / weights.MANIFEST).unlink()  # no record: what it held is unknown
    assert weights.convert_gguf(gguf) == folder and len(made) == 4


def test_a_converted_weights_cache_that_others_may_write_is_refused(conversions):
    gguf, made = conversions
    folder = weights.convert_gguf(gguf)
    folder.parent.chmod(0o777)
    with pytest.raises(ValueError, match="writable by its group or by others"):
        weights.convert_gguf(gguf)
