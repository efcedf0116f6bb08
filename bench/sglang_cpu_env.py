"""The environment `make sglang-cpu-smoke` runs the real SGLang engine from, prepared outside the repository.

Everything lives under one cache folder (default /work/cache/sglang-cpu, `--cache`), kept between runs:

- `venv/`: a virtualenv with PyPI's torch 2.14.1 (the build sglang 0.5.23 pins; it runs on the CPU), sglang 0.5.23
  installed `--no-deps` and the pure-Python dependencies that suffice (../shared/reference/sglang-cpu.md, step 2);
- `kernel-build/`: a setuptools project written here that compiles SGLang's CPU kernels (`csrc/cpu`) from the
  sources it is given into a `sgl_kernel` wheel; `wheels/` keeps the built wheel, so only the first run pays the
  ~10 minutes of C++;
- `model/`: the tiny random Qwen3 and its locally trained tokenizer (bench/sglang_cpu_model.py).

No SGLang code is copied into the repository: the kernel sources are read from `--kernel-src`, a folder holding
SGLang's `python/sglang/kernels/aot` tree (csrc/, include/, python/sgl_kernel/). With a session's `fetch` tool:

    fetch github:ZailiWang/sglang            -> /work/.mirror/ZailiWang+sglang/repo (a fork that fits fetch's limit)
    mkdir -p /work/cache/sglang-cpu/src && git --git-dir=/work/.mirror/ZailiWang+sglang/repo archive HEAD \\
        python/sglang/kernels/aot | tar -x -C /work/cache/sglang-cpu/src
    # then: --kernel-src /work/cache/sglang-cpu/src/python/sglang/kernels/aot

or give a wheel built before with `--kernel-wheel`. Every build and install runs under `nice -n 19`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CACHE = Path("/work/cache/sglang-cpu")
SGLANG_VERSION = "0.5.23"
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
# The pure-Python dependencies that sufficed for `--device cpu` (sglang's own metadata also asks for CUDA-only
# packages: flashinfer, flash-attn, deep-gemm... none is needed here).
SGLANG_DEPS = (
    "aiohttp anthropic blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict einops fastapi "
    "gguf interegular IPython llguidance mistral_common msgspec ninja numpy openai==2.8.0 openai-harmony==0.0.4 "
    "orjson outlines==0.1.11 packaging partial_json_parser pillow prometheus-client psutil pybase64 pydantic "
    "python-dateutil python-multipart pyzmq regex requests scipy sentencepiece==0.2.1 setproctitle "
    "soundfile==0.13.1 tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 uvicorn uvloop watchfiles "
    "xgrammar==0.2.7 xxhash zstandard safetensors setuptools wheel"
).split()
APT = ["libnuma-dev", "numactl"]
NICE = ["nice", "-n", "19"]
# Compilers in parallel (MAX_JOBS overrides). More than the 2 cores: at nice 19 on a machine others keep busy each
# job gets only idle time, ~13% of a core measured, so 2 jobs took ~100 min; memory allows ~1.5 GB a job.
KERNEL_JOBS = 6

# Written into the cache (never the repository): a torch CppExtension over SGLang's CPU kernel sources. SGLang's
# own CMake build refuses the CUDA torch that sglang pins ("Your installed Caffe2 version uses CUDA but I cannot
# find the CUDA libraries"); C++17 fails ("C++20 or later compatible compiler is required to use ATen").
KERNEL_SETUP = '''\
import glob, os
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

SRC = os.environ["SGL_KERNEL_SRC"]
cpu = os.path.join(SRC, "csrc", "cpu")
sources = sorted(glob.glob(os.path.join(cpu, "*.cpp")) + glob.glob(os.path.join(cpu, "mamba", "*.cpp"))
                 + glob.glob(os.path.join(cpu, "model", "*.cpp")) + glob.glob(os.path.join(cpu, "x86_64", "*.cpp")))
setup(
    name="sgl-kernel", version=os.environ.get("SGL_KERNEL_VERSION", "0.0.0+cpu"),
    packages=find_packages(include=["sgl_kernel", "sgl_kernel.*"]),  # the tree's python/sgl_kernel, copied beside
    ext_modules=[CppExtension(
        "sgl_kernel.common_ops", sources,
        include_dirs=[cpu, os.path.join(SRC, "csrc"), os.path.join(SRC, "include")], libraries=["numa"],
        extra_compile_args=["-O3", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                            "-mamx-int8", "-fopenmp", "-DSGLANG_CPU_FP8_CVT_FTZ", "-std=c++20"],
        extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": BuildExtension},
)
'''


class EnvError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[sglang-cpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw: object) -> None:
    log("$ " + " ".join(cmd))
    done = subprocess.run(cmd, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise EnvError(f"exit {done.returncode}: {' '.join(cmd)}")


class Env:
    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.venv = cache / "venv"
        self.python = self.venv / "bin" / "python"
        self.wheels = cache / "wheels"
        self.timings: dict[str, float] = {}

    def _stamp(self, name: str) -> Path:
        return self.venv / f".budgetq-{name}.done"

    def _timed(self, name: str, start: float) -> None:
        self.timings[name] = time.monotonic() - start
        log(f"{name}: {self.timings[name]:.1f} s")

    def apt(self) -> None:
        missing = [p for p in APT if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
        if missing:
            start = time.monotonic()
            run(["apt-get", "update", "-qq"])
            run(NICE + ["apt-get", "install", "-y", "-qq", *missing])
            self._timed("apt", start)

    def venv_ready(self) -> None:
        if not self.python.exists():
            run([sys.executable, "-m", "venv", str(self.venv)])
        pip = NICE + [str(self.python), "-m", "pip", "install", "-q"]
        if not self._stamp("torch").exists():
            start = time.monotonic()
            run(pip + TORCH)
            self._stamp("torch").touch()
            self._timed("pip torch", start)
        if not self._stamp("sglang").exists():
            start = time.monotonic()
            run(pip + ["--no-deps", f"sglang=={SGLANG_VERSION}"])
            run(pip + SGLANG_DEPS)
            self._stamp("sglang").touch()
            self._timed("pip sglang", start)

    def kernel_wheel(self, kernel_src: Path | None, given_wheel: Path | None) -> Path:
        if given_wheel is not None:
            return given_wheel
        built = sorted(self.wheels.glob("sgl_kernel-*.whl"))
        if built:
            return built[-1]
        if kernel_src is None:
            raise EnvError("no kernel wheel cached: give --kernel-src (SGLang's python/sglang/kernels/aot tree; "
                           "see bench/sglang_cpu_env.py for how to bring it in with fetch) or --kernel-wheel")
        if not (kernel_src / "csrc" / "cpu").is_dir() or not (kernel_src / "python" / "sgl_kernel").is_dir():
            raise EnvError(f"{kernel_src} has no csrc/cpu or python/sgl_kernel: not SGLang's kernels/aot tree")
        build = self.cache / "kernel-build"
        # Kept between attempts: ninja resumes an interrupted build from the objects it has (same sources, flags).
        build.mkdir(parents=True, exist_ok=True)
        (build / "setup.py").write_text(KERNEL_SETUP)
        shutil.rmtree(build / "sgl_kernel", ignore_errors=True)
        shutil.copytree(kernel_src / "python" / "sgl_kernel", build / "sgl_kernel")
        version = "0.0.0+cpu"
        vfile = kernel_src / "python" / "sgl_kernel" / "version.py"
        if vfile.exists():
            for line in vfile.read_text().splitlines():
                if line.startswith("__version__"):
                    version = line.split("=", 1)[1].strip().strip("\"'") + "+cpu"
        env = dict(os.environ, SGL_KERNEL_SRC=str(kernel_src.resolve()), SGL_KERNEL_VERSION=version,
                   MAX_JOBS=os.environ.get("MAX_JOBS", str(KERNEL_JOBS)))
        start = time.monotonic()
        self.wheels.mkdir(parents=True, exist_ok=True)
        run(NICE + [str(self.python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w",
                    str(self.wheels), str(build)], env=env, cwd=build)
        self._timed("kernel build", start)
        built = sorted(self.wheels.glob("sgl_kernel-*.whl"))
        if not built:
            raise EnvError(f"pip wheel left no sgl_kernel wheel in {self.wheels}")
        return built[-1]

    def kernel_installed(self, wheel: Path) -> None:
        stamp = self._stamp("kernel-" + wheel.name)
        if not stamp.exists():
            run(NICE + [str(self.python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        str(wheel)])
            stamp.touch()

    def prepare(self, kernel_src: Path | None, kernel_wheel: Path | None) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        self.apt()
        self.venv_ready()
        self.kernel_installed(self.kernel_wheel(kernel_src, kernel_wheel))

    def disk_bytes(self) -> int:
        out = subprocess.run(["du", "-sb", str(self.cache)], capture_output=True, text=True).stdout
        return int(out.split()[0]) if out else 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="prepare the sglang CPU environment only")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--kernel-src", type=Path)
    ap.add_argument("--kernel-wheel", type=Path)
    a = ap.parse_args()
    e = Env(a.cache)
    e.prepare(a.kernel_src, a.kernel_wheel)
    log(f"ready: {e.timings}, {e.disk_bytes() / 2**30:.2f} GiB")
