"""Registers and spill bytes of each kernel of the CUDA backend: NVRTC (through its C API,
with the backend's options) makes the PTX of program.cu, its includes read in its place
as the backend joins them, and ptxas -v reports.

    python3 resources.py CACHE program.cu [--check SPILLS] [NAME=VALUE ...]

CACHE holds the unpacked nvidia-cuda-nvrtc and nvidia-cuda-nvcc wheels (run.sh fetches
them). Prints one line a kernel: name, registers, spill stores / loads in bytes. With
--check, exits 1 when a kernel spills more bytes than SPILLS allows it (a line
`name stores/loads` a kernel; a kernel not listed may not spill at all): a change that
makes ptxas spill a decode kernel's registers fails here, before any GPU sees it.
"""

import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile


def ptx_of(nvrtc: ctypes.CDLL, source: bytes, defines: list[str]) -> bytes:
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernels.cu", 0, None, None):
        sys.exit("resources.py: nvrtcCreateProgram failed")
    # The options of the backend's ptx_for: the architecture, C++17, the constants.
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17"]
    opts += [b"-D" + d.encode() for d in defines]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit("resources.py: NVRTC failed:\n" + log.value.decode())
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value


def allowed_spills(path: str) -> dict[str, tuple[int, int]]:
    allowed = {}
    for n, line in enumerate(open(path), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        try:
            name, bytes_ = line.split()
            stores, loads = (int(v) for v in bytes_.split("/"))
        except ValueError:
            sys.exit(f"{path}:{n}: want `kernel stores/loads`, got {line!r}")
        allowed[name] = (stores, loads)
    return allowed


def main() -> None:
    cache, source, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    check = None
    if args[:1] == ["--check"]:
        if len(args) < 2:
            sys.exit("resources.py: --check wants a file of allowed spills")
        check, args = allowed_spills(args[1]), args[2:]
    defines = args
    libs = glob.glob(os.path.join(cache, "nvidia", "*", "lib", "libnvrtc.so*"))
    libs = [l for l in libs if "builtins" not in l]
    ptxas = glob.glob(os.path.join(cache, "nvidia", "*", "bin", "ptxas"))
    if not libs or not ptxas:
        sys.exit(f"resources.py: no NVRTC or ptxas under {cache}")
    here = os.path.dirname(source)
    program = re.sub(
        rb'#include "([^"]+)"\n',
        lambda m: open(os.path.join(here, m.group(1).decode()), "rb").read(),
        open(source, "rb").read(),
    )
    ptx = ptx_of(ctypes.CDLL(libs[0]), program, defines)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernels.ptx")
        with open(path, "wb") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas[0], "-arch=sm_90", "-v", path, "-o", os.path.join(d, "kernels.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    name, spill, over, seen = None, (0, 0), [], 0
    for line in out.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            print(f"{name:40s} regs {m.group(1):>4s} spill {spill[0]}/{spill[1]}")
            seen += 1
            if check is not None:
                limit = check.get(name, (0, 0))
                if spill[0] > limit[0] or spill[1] > limit[1]:
                    over.append(f"{name}: spills {spill[0]}/{spill[1]} bytes, allowed {limit[0]}/{limit[1]}")
            name = None
    if seen == 0:
        sys.exit("resources.py: ptxas reported no kernels")
    if over:
        sys.exit("kernels spilling more than allowed:\n  " + "\n  ".join(over))
    if check is not None:
        print(f"ptxas: {seen} kernels, none spills more than allowed")


if __name__ == "__main__":
    main()
