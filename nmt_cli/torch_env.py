"""Settings PyTorch and oneDNN read once per process, at their first use: the kernel cache, huge pages and the
memory allocator."""

import ctypes.util
import glob
import os
import sys
from pathlib import Path

# oneDNN (bf16 matmuls on CPU) compiles and caches one kernel per matrix shape, 1024 by default, and reads
# the cache size once, at its first kernel, so the first workload in a process decides it.
TRAINING_KERNEL_CACHE = 128  # variable (batch x length) shapes: 256 held ~190 MB more at the same speed
DECODING_KERNEL_CACHE = 4096  # beam search's shrinking row counts cycle through ~500 shapes; 256 thrashes (-15%)
# A server meets many more (batch x length x beam) shapes than a file, so it keeps fewer, for bfloat16 (its
# float32 products do not use oneDNN: ops.serving_products); docs/benchmarks.md, "Serving soak".
SERVING_KERNEL_CACHE = 1024


def size_kernel_cache(capacity: int) -> None:
    """Ask oneDNN to cache `capacity` kernels, unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def use_huge_pages_for_tensors() -> bool:
    """Ask PyTorch's CPU allocator to back tensors of 2 MB and more with transparent huge pages, for training.

    A training update allocates and frees many large tensors; glibc hands freed ones back to the kernel and each
    new one is faulted in again, 4 KB at a time (docs/benchmarks.md, "Training speed"). PyTorch reads
    THP_MEM_ALLOC_ENABLE once, at its first allocation, so this must run before torch is imported; returns
    whether huge pages are on (a user's own THP_MEM_ALLOC_ENABLE wins)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


# glibc's heap fragments under a training run's stream of large aligned tensors: `_int_malloc` takes 6% of a
# CPU run's time at the start and 15% after half an hour, and tokens/s falls with it (docs/benchmarks.md,
# "Speed over a long run"). tcmalloc keeps per-size pools and was the fastest measured; PyTorch's own CPU
# launcher (torch.backends.xeon.run_cpu) preloads it too. jemalloc, with its defaults, was slower than glibc's
# malloc on the Multi30k recipe's model, so auto does not choose it.
ALLOCATOR_LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
ALLOCATOR_CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
ALLOCATOR_HELP = ("Memory allocator on a CPU: auto (tcmalloc where installed, else the system's), tcmalloc, jemalloc "
                  "or system (glibc's malloc: slower, and slower still as a process goes on).")
ALLOCATOR_INSTALL = {"tcmalloc": "Debian/Ubuntu: apt install libtcmalloc-minimal4; conda: conda install gperftools",
                     "jemalloc": "Debian/Ubuntu: apt install libjemalloc2; conda: conda install jemalloc"}
PRELOAD_TRIED = "NMT_ALLOCATOR_PRELOADED"  # set on the re-executed process: never try twice


def loaded_allocator() -> str | None:
    """The tcmalloc or jemalloc library this process runs on, or None for the C library's malloc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, file (when mapped from one)
        if len(fields) == 6 and Path(fields[5]).name.startswith(("libjemalloc", "libtcmalloc")):
            return fields[5].strip()
    return None


def cuda_expected(device: str | None) -> bool:
    """Whether `nmt train --device DEVICE` will run on a GPU, told without importing torch (None: a GPU's
    device file is present)."""
    if device is not None:
        return device.startswith("cuda")
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def find_allocator(name: str) -> str | None:
    """The shared library of `name` (tcmalloc or jemalloc) on this machine, or None: the dynamic linker's
    cache first, then the lib folder of the active conda environment or virtualenv."""
    for library in ALLOCATOR_LIBRARIES[name]:
        found = ctypes.util.find_library(library)
        if found:
            return found
        for prefix in (os.environ.get("CONDA_PREFIX"), os.environ.get("VIRTUAL_ENV"), sys.prefix):
            matches = sorted(glob.glob(f"{prefix}/lib/lib{library}.so*")) if prefix else []
            if matches:
                return matches[0]
    return None


def preload_allocator(choice: str, command: list[str]) -> None:
    """Make this process run on tcmalloc or jemalloc (`choice`; auto: tcmalloc where installed, else the C
    library's malloc) by executing `command`, its own, again with the library in LD_PRELOAD. Returns when there
    is nothing to do (one is loaded already, `choice` is system, or auto found none); a named allocator that
    is missing or cannot be loaded is an NmtError."""
    from nmt_cli.errors import NmtError

    if choice not in ALLOCATOR_CHOICES:
        raise NmtError(f"unknown --cpu-allocator {choice!r} (use {', '.join(ALLOCATOR_CHOICES)})")
    if not sys.platform.startswith("linux"):  # LD_PRELOAD and /proc/self/maps are Linux's
        if choice in ("auto", "system"):
            return
        raise NmtError(f"--cpu-allocator {choice} works on Linux only (use auto or system)")
    loaded = loaded_allocator()
    if choice == "system" or (loaded and (choice == "auto" or Path(loaded).name.startswith(f"lib{choice}"))):
        return  # (system with one preloaded by the user's own LD_PRELOAD: theirs stays)
    if loaded:
        raise NmtError(f"--cpu-allocator {choice}: this process runs on {loaded} already (LD_PRELOAD)")
    if os.environ.get(PRELOAD_TRIED):
        if choice == "auto":
            return
        raise NmtError(f"--cpu-allocator {choice}: {os.environ[PRELOAD_TRIED]} did not load (see the dynamic "
                       "linker's message above)")
    env = allocator_environment(choice)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(command[0], command, env)


def allocator_environment(choice: str) -> dict[str, str] | None:
    """This process's environment with `choice`'s allocator (tcmalloc or jemalloc; auto: tcmalloc) first in
    LD_PRELOAD, for a new process to run on; None for system, or when auto finds no tcmalloc. A named one that
    is missing is an NmtError."""
    from nmt_cli.errors import NmtError

    if choice == "system":
        return None
    library = find_allocator("tcmalloc" if choice == "auto" else choice)
    if library is None:
        if choice == "auto":
            return None
        raise NmtError(f"--cpu-allocator {choice}: lib{choice} not found on this machine ({ALLOCATOR_INSTALL[choice]})")
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (library, os.environ.get("LD_PRELOAD")) if p))
    env[PRELOAD_TRIED] = library
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))  # tcmalloc warns on each big tensor
    return env
