"""Rewrites the CUDA backend's kernels into C++ that shim.h runs on the CPU.

    python3 prepare.py program.cu kernels_host.cpp

program.cu's includes are read in its place (the program the backend compiles), then
four rewrites, each failing loudly when the source no longer has what it expects:
the definitions of the helpers written in inline PTX are dropped (shim.h defines them);
`extern __shared__ T name[];` becomes a pointer into the block's dynamic shared memory;
`__shared__` arrays become function statics, one per kernel, which is what the
threads of a block share when blocks run one after another; and the host's empty
PDL_WAIT becomes shim::pdl_wait.
"""

import os
import re
import sys

# Helpers whose bodies are inline PTX; shim.h has a C++ definition of each.
PTX_HELPERS = [
    "pack_f16x2",
    "unpack_f16x2",
    "mma_f16",
    "mma_f16_first",
    "sub_f16x2",
    "copy16_async",
    "copy4_async",
    "copies_commit",
    "copies_wait",
    "half_bits",
    "prefetch_l1",
    "f16_bits",
    "wait_count",
]


def drop_definition(src: str, name: str) -> str:
    """Removes `__device__ __forceinline__ <type> name(...) { ... }`."""
    m = re.search(r"__device__ __forceinline__ [\w:<> ]+?\b" + name + r"\(", src)
    if not m:
        sys.exit(f"prepare.py: no definition of {name} in the kernels")
    i = src.index("{", m.end())
    depth = 0
    for j in range(i, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if depth == 0:
                return src[: m.start()] + f"// {name}: shim.h" + src[j + 1 :]
    sys.exit(f"prepare.py: unbalanced braces after {name}")


def main() -> None:
    here = os.path.dirname(sys.argv[1])
    src = re.sub(
        r'#include "([^"]+)"\n',
        lambda m: open(os.path.join(here, m.group(1))).read(),
        open(sys.argv[1]).read(),
    )
    for name in PTX_HELPERS:
        src = drop_definition(src, name)
    dynamic = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];")
    if not dynamic.search(src):
        sys.exit("prepare.py: no dynamic shared memory in the kernels")
    src = dynamic.sub(
        r"\1* \2 = reinterpret_cast<\1*>(shim::block_shared());", src
    )
    src = src.replace("__shared__ ", "static ")
    # The programmatic-launch wait of a kernel compiled for the host: shim::pdl_wait,
    # where a check can stand in for the kernel before it.
    wait = "#define PDL_WAIT()\n#endif"
    if wait not in src:
        sys.exit("prepare.py: no host definition of PDL_WAIT in the kernels")
    src = src.replace(wait, "#define PDL_WAIT() shim::pdl_wait()\n#endif")
    with open(sys.argv[2], "w") as out:
        out.write('#include "shim.h"\n')
        out.write(src)


if __name__ == "__main__":
    main()
