"""The native decoder's int4 kernels compute the same bits on every machine: decoder.c's
q4_gemm on random weights and activations (tests/c/q4_kernels.c), built for this machine
(-march=native: AVX-512 VNNI where the CPU has it, else AVX2), for AVX2 alone, as portable
C, and for 64-bit Arm with and without dot products, run under qemu where a cross compiler
and qemu-aarch64 are installed (apt: gcc-aarch64-linux-gnu qemu-user; .ci/run installs them
where it can). A package's outputs then do not depend on the machine that decodes it, and
the Arm kernel
(Jetson Orin, Raspberry Pi 5), which no machine here runs natively, is checked bit for bit
against the x86 ones."""

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "c" / "q4_kernels.c"
QEMU_ROOT = "/usr/aarch64-linux-gnu"


def _run(cc: str, flags: list[str], out: Path, runner: list[str] = ()) -> tuple[int, str]:
    build = subprocess.run([cc, "-O2", "-ffp-contract=off", *flags, str(SOURCE), "-lm", "-o",
                            str(out)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    head, _, body = run.stdout.partition("\n")
    n = (11 + 1 + 2 + 4) * 3 * 16
    assert head.startswith("kernel ") and len(body.split()) == 5 * n
    words = body.split()
    # rows 0, 0-1 and 0-3
    for part in (words[:n], words[2 * n:3 * n], words[3 * n:4 * n], words[4 * n:]):
        # alone: the same bits as in 11 rows
        assert part[11 * 48:12 * 48] == part[:48] and part[12 * 48:14 * 48] == part[:96]
        assert part[14 * 48:n] == part[:192]
        assert len(set(part)) > n // 2  # not a constant
    assert words[n:2 * n] == words[:n], "half-precision scales give other bits than floats"
    # Q4_1 blocks: no zero points, offsets added
    assert sum(a != b for a, b in zip(words[2 * n:3 * n], words[:n])) > n // 2
    # 8 bits (one plane of bytes), zero point 128 and the columns' own
    assert sum(a != b for a, b in zip(words[3 * n:4 * n], words[:n])) > n // 2
    assert sum(a != b for a, b in zip(words[4 * n:], words[3 * n:4 * n])) > n // 2
    return int(head.split()[1]), body


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return _run(cc, [], tmp_path_factory.mktemp("q4") / "portable")


def test_this_machines_kernel_matches_portable_c(reference, tmp_path):
    kernel, body = _run(shutil.which("cc") or "gcc", ["-march=native"], tmp_path / "native")
    assert reference[0] == 0
    assert body == reference[1], f"kernel {kernel} differs from the portable C one"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                     if ln.startswith("flags")), []))


def test_avx2_kernel_matches_portable_c(reference, tmp_path):
    # the kernel for x86 CPUs without AVX-512 VNNI (AMD Zen 2/3, Intel before Ice Lake),
    # checked on every x86 machine that can run it, VNNI or not
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    kernel, body = _run(shutil.which("cc") or "gcc", ["-mavx2", "-mfma", "-mf16c"],
                        tmp_path / "avx2")
    assert kernel == 3
    assert body == reference[1], "the AVX2 kernel differs from the portable C one"


def test_arm_dot_product_kernel_matches_x86(reference, tmp_path):
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None or not Path(QEMU_ROOT).is_dir():
        pytest.skip("no aarch64 cross compiler or qemu-aarch64 (apt install "
                    "gcc-aarch64-linux-gnu qemu-user)")
    runner = [qemu, "-L", QEMU_ROOT]
    sdot = _run(cc, ["-march=armv8.2-a+dotprod"], tmp_path / "sdot", runner)
    plain = _run(cc, ["-march=armv8-a"], tmp_path / "a64", runner)
    assert sdot[0] == 2 and plain[0] == 0  # the dot-product kernel did run
    assert sdot[1] == reference[1] and plain[1] == reference[1]
