"""The arm64 NEON product kernel, checked from an x86 machine: built with the arm64 cross compiler
and run under qemu-aarch64 against the portable kernel (``neon_check.cpp``). On an arm64 machine
the extension runs the NEON kernel itself and ``test_products.py`` checks it with every other
instruction set; here the cross tools are optional (Debian's ``crossbuild-essential-arm64`` and
``qemu-user``) and the test says so when they are missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "engine" / "model" / "native"
COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")


@pytest.mark.skipif(
    shutil.which(COMPILER) is None or shutil.which(QEMU) is None,
    reason=f"{COMPILER} and {QEMU} (crossbuild-essential-arm64, qemu-user) are not installed",
)
def test_the_neon_kernel_agrees_with_the_portable_one(tmp_path: Path) -> None:
    binary = tmp_path / "neon_check"
    build = [
        COMPILER,
        "-O3",
        "-fno-fast-math",
        "-ffp-contract=off",  # the extension's own flags (CMakeLists.txt)
        "-std=c++20",
        f"-I{NATIVE}",
        str(Path(__file__).with_name("neon_check.cpp")),
        str(NATIVE / "kernel_neon.cpp"),
        str(NATIVE / "kernel_scalar.cpp"),
        "-o",
        str(binary),
    ]
    subprocess.run(build, check=True, capture_output=True, text=True)
    run = subprocess.run([QEMU, "-L", str(SYSROOT), str(binary)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.rstrip().endswith("0 failures")
