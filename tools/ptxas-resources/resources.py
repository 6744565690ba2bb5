"""Registers and spill bytes of each kernel of kernels.cu: NVRTC (through its C API, with
the backend's options) makes the PTX, ptxas -v reports.

    python3 resources.py CACHE kernels.cu [NAME=VALUE ...]

CACHE holds the unpacked nvidia-cuda-nvrtc and nvidia-cuda-nvcc wheels (run.sh fetches
them). Prints one line a kernel: name, registers, spill stores / loads in bytes.
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


def main() -> None:
    cache, source, defines = sys.argv[1], sys.argv[2], sys.argv[3:]
    libs = glob.glob(os.path.join(cache, "nvidia", "*", "lib", "libnvrtc.so*"))
    libs = [l for l in libs if "builtins" not in l]
    ptxas = glob.glob(os.path.join(cache, "nvidia", "*", "bin", "ptxas"))
    if not libs or not ptxas:
        sys.exit(f"resources.py: no NVRTC or ptxas under {cache}")
    ptx = ptx_of(ctypes.CDLL(libs[0]), open(source, "rb").read(), defines)
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
    name, spill = None, ("0", "0")
    for line in out.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = m.groups()
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            print(f"{name:40s} regs {m.group(1):>4s} spill {spill[0]}/{spill[1]}")
            name = None


if __name__ == "__main__":
    main()
