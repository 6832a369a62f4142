"""Build vLLM's CPU backend once, into a cache outside the repository (`make vllm-cpu`).

The tests and jobs that need a real vLLM server run ``<cache>/venv/bin/vllm serve``; see
docs/engine.md. Each stage leaves a mark in the cache and is skipped when its mark is there, so a
second run only checks the result. One line per stage; a failure is one line naming the stage
and the log that holds its details. Standard library only: it runs on the system Python.

What the CPU build needs here (the facts behind each stage):
- vLLM's source distribution says version ``X+cpu`` in its metadata, so pip refuses it by name;
  it is taken by its file address on the index.
- The only torch of vLLM's pin on these machines is a CUDA build (torch 2.14.1). Its CMake
  package stops the configure when the CUDA libraries are missing; the CPU extension needs none,
  so the CUDA part of that package is replaced by an empty ``torch::cudart`` target, in this
  cache's copy of torch only.
- The build fetches oneDNN from GitHub; the source is taken from a local tarball instead
  (``TIDERL_ONEDNN_SRC``, by default ``../shared/vendor/onednn-v3.13.tar.gz`` beside the repo).
- vLLM asks for g++ >= 12.3 for its AVX-512 BF16/VNNI flags; Debian 12 has 12.2, which builds
  and runs them, so the check is lowered to 12.2.
- g++ 12.2 stops with an internal compiler error on 0.34's sparse-MLA decode kernel
  (``csrc/cpu/sgl-kernels/flash_mla.cpp``: a local ``constexpr`` array bound used inside a lambda
  of a template); made ``static constexpr``, it compiles to the same code.
- vLLM is installed without its dependency resolution (its wheel asks for ``torch==2.14.0+cpu``
  and a triton-cpu wheel from GitHub); its runtime requirements are installed beside it.
- On x86, vLLM 0.34 refuses to start without triton-cpu, whose only wheels are on GitHub. vLLM
  has a runner without Triton (the standalone CPU model runner, torch and its own C++ ops), which
  it builds and picks on the other CPUs only: its ops (``block_table.cpp``, ``input_batch.cpp``
  and their bindings) are built into the x86 modules too, and the installed platform check
  picks that runner wherever Triton has no CPU backend. The API server, the scheduler, the KV
  cache manager and the routes are vLLM's own either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.34.0"
TORCH = "torch==2.14.1"  # vLLM 0.34 pins 2.14.0; the build on these machines' disk
ONEDNN_TARBALL = "onednn-v3.13.tar.gz"  # the tag vLLM 0.34's cpu_extension.cmake fetches
INDEX = "https://pypi.org/simple/vllm/"
BUILD_REQUIREMENTS = ["cmake>=3.26.1", "ninja", "packaging>=24.2", "setuptools==78.1.1",
                      "setuptools-scm>=8", "setuptools-rust>=1.9.0", "wheel", "jinja2>=3.1.6",
                      "regex"]
RUNTIME_EXTRA = ["numba==0.65.0", "intel-openmp==2024.2.1"]  # from requirements/cpu.txt
REPO = Path(__file__).resolve().parents[1]


class StageError(Exception):
    """A stage failed: the message is the one line the user sees."""


@dataclass(frozen=True)
class TextPatch:
    """One replacement in a file, applied once: a file that has ``new`` already is left as it
    is, one that has neither is a one-line failure (the upstream text changed)."""

    what: str
    old: str
    new: str

    def __post_init__(self) -> None:
        assert self.new not in self.old, "a patched text must not be in the one it replaces"

    def apply(self, path: Path) -> None:
        text = path.read_text()
        if self.new in text:
            return
        if self.old not in text:
            raise StageError(f"patch: {path.name} has no {self.what} (its text changed)")
        path.write_text(text.replace(self.old, self.new))


_GXX = "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.{}"
_MLA = "constexpr int64_t kBLOCK_H_MAX = 16;"
_UTILS = '"csrc/cpu/utils.cpp"\n        "csrc/cpu/spec_decode_utils.cpp"'
SOURCE_PATCHES = [
    ("cmake/cpu_extension.cmake", TextPatch("g++ 12.3 check to lower", _GXX.format(3),
                                            _GXX.format(2))),
    ("csrc/cpu/sgl-kernels/flash_mla.cpp", TextPatch("kBLOCK_H_MAX to make static",
                                                     f"\n  {_MLA}", f"\n  static {_MLA}")),
    # the standalone runner's ops, which vLLM builds for the CPUs other than x86 only
    ("cmake/cpu_extension.cmake", TextPatch(
        "x86 source list to add the runner's ops to", _UTILS,
        _UTILS.replace("\n", '\n        "csrc/cpu/block_table.cpp"\n'
                       '        "csrc/cpu/input_batch.cpp"\n', 1))),
    ("csrc/cpu/torch_bindings.cpp", TextPatch(
        "first include", "#include <torch/all.h>\n",
        "#define VLLM_STANDALONE_CPU_MRV2  // tiderl: the runner's ops on x86 too\n"
        "#include <torch/all.h>\n")),
]
_X86_NEEDS_TRITON = "cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON"
_STANDALONE = "return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86"
INSTALLED_PATCHES = [  # in the installed package: x86 without triton-cpu takes that runner
    ("vllm/platforms/cpu.py", TextPatch("x86 Triton check", f"if {_X86_NEEDS_TRITON}:",
                                        f"if False and {_X86_NEEDS_TRITON}:")),
    ("vllm/platforms/cpu.py", TextPatch("standalone runner choice", _STANDALONE,
                                        "return not HAS_TRITON  # tiderl: on x86 too")),
]
TORCH_CUDA_STUB = TextPatch(
    "include of public/cuda.cmake", 'include("${CMAKE_CURRENT_LIST_DIR}/public/cuda.cmake")',
    "# tiderl: no CUDA on this machine; the CPU extension links none of it\n"
    "  if(NOT TARGET torch::cudart)\n    add_library(torch::cudart INTERFACE IMPORTED)\n"
    "  endif()")


def cache_root() -> Path:
    """Where the build lives: ``TIDERL_VLLM_CPU`` or ``~/.cache/tiderl/vllm-cpu-<version>``."""
    default = Path.home() / ".cache" / "tiderl" / f"vllm-cpu-{VLLM_VERSION}"
    return Path(os.environ.get("TIDERL_VLLM_CPU", default)).expanduser()


def run(stage: str, argv: list[str], log: Path, *, env: dict | None = None,
        cwd: Path | None = None) -> None:
    """Run ``argv`` with its output appended to ``log``; a non-zero exit fails ``stage``."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                               env={**os.environ, **(env or {})})
    if code != 0:
        raise StageError(f"{stage}: `{Path(argv[0]).name} {' '.join(argv[1:3])} ...` exited "
                         f"{code}; see {log}")


class Build:
    """The stages, in order, over one cache folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.src = root / "src" / f"vllm-{VLLM_VERSION}"
        self.onednn = root / "src" / "onednn"
        self.wheels = root / "wheels"
        self.logs = root / "logs"

    def stages(self):
        return [("system", self.system), ("venv", self.make_venv), ("source", self.source),
                ("onednn", self.unpack_onednn), ("patch", self.patch), ("build", self.build),
                ("install", self.install), ("check", self.check)]

    def pip(self, stage: str, *args: str) -> None:
        run(stage, [str(self.python), "-m", "pip", "--disable-pip-version-check", "-q",
                    *args], self.logs / f"{stage}.log")

    # -- stages ---------------------------------------------------------------------------

    def system(self) -> None:
        """g++ 12.2 or newer and libnuma's headers (installed by apt when missing, as root)."""
        version = gxx_version()
        if version < (12, 2):
            raise StageError(f"system: g++ {'.'.join(map(str, version))} is older than 12.2")
        if Path("/usr/include/numa.h").exists():
            return
        if os.geteuid() != 0:
            raise StageError("system: libnuma-dev is missing (apt-get install libnuma-dev)")
        log = self.logs / "system.log"
        run("system", ["apt-get", "update", "-qq"], log)
        run("system", ["apt-get", "install", "-y", "-qq", "libnuma-dev"], log,
            env={"DEBIAN_FRONTEND": "noninteractive"})

    def make_venv(self) -> None:
        """A virtual environment of its own, with torch and vLLM's build requirements."""
        run("venv", [sys.executable, "-m", "venv", str(self.venv)], self.logs / "venv.log")
        self.pip("venv", "install", TORCH, *BUILD_REQUIREMENTS)

    def source(self) -> None:
        """The source distribution, by its file address on the index, its sha256 checked."""
        url, sha256 = sdist_address(VLLM_VERSION)
        archive = self.root / "src" / Path(urllib.parse.urlparse(url).path).name
        archive.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=120) as answer:
            data = answer.read()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise StageError(f"source: {archive.name} does not match the index's sha256")
        archive.write_bytes(data)
        shutil.rmtree(self.src, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(archive.parent, filter="data")

    def unpack_onednn(self) -> None:
        tarball = onednn_tarball()
        shutil.rmtree(self.onednn, ignore_errors=True)
        with tarfile.open(tarball) as tar:
            top = {name.split("/", 1)[0] for name in tar.getnames()}
            tar.extractall(self.onednn.parent, filter="data")
        if len(top) != 1:
            raise StageError(f"onednn: {tarball} does not hold one top folder")
        (self.onednn.parent / top.pop()).rename(self.onednn)

    def patch(self) -> None:
        """The source and the cache's torch as this machine builds them (``SOURCE_PATCHES``,
        ``TORCH_CUDA_STUB``)."""
        for relative, change in SOURCE_PATCHES:
            change.apply(self.src / relative)
        TORCH_CUDA_STUB.apply(torch_cmake_config(self.python))

    def build(self) -> None:
        """The wheel, its three extension modules (AMX/AVX-512 BF16, AVX-512, AVX2)."""
        self.wheels.mkdir(parents=True, exist_ok=True)
        for old in self.wheels.glob("vllm-*.whl"):
            old.unlink()
        env = {"VLLM_TARGET_DEVICE": "cpu", "MAX_JOBS": str(os.cpu_count() or 2),
               "FETCHCONTENT_SOURCE_DIR_ONEDNN": str(self.onednn),
               "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        run("build", [str(self.python), "-m", "pip", "--disable-pip-version-check", "wheel",
                      "-v", "--no-deps", "--no-build-isolation", "-w", str(self.wheels),
                      str(self.src)], self.logs / "build.log", env=env)
        if not list(self.wheels.glob("vllm-*.whl")):
            raise StageError(f"build: no wheel in {self.wheels}; see {self.logs / 'build.log'}")

    def install(self) -> None:
        """The wheel without its dependency pins, then vLLM's runtime requirements."""
        wheel = next(self.wheels.glob("vllm-*.whl"))
        self.pip("install", "install", "--no-deps", "--force-reinstall", str(wheel))
        site = next(self.venv.glob("lib/python3*/site-packages"))
        for relative, change in INSTALLED_PATCHES:
            change.apply(site / relative)
        extra = RUNTIME_EXTRA if platform.machine() in ("x86_64", "AMD64") else RUNTIME_EXTRA[:1]
        self.pip("install", "install", "-r", str(self.src / "requirements" / "common.txt"), *extra)

    def check(self) -> None:
        """vLLM imports, with the extension module this CPU picks, and its CLI answers."""
        probe = ("import vllm, vllm.platforms as p; print(vllm.__version__, "
                 "p.current_platform.device_type)")
        log = self.logs / "check.log"
        run("check", [str(self.python), "-c", probe], log)
        run("check", [str(self.venv / "bin" / "vllm"), "--version"], log)


def gxx_version() -> tuple[int, ...]:
    try:
        out = subprocess.run(["g++", "-dumpfullversion"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise StageError(f"system: no working g++ ({exc})") from None
    return tuple(int(part) for part in out.strip().split("."))


def sdist_address(version: str) -> tuple[str, str]:
    """The address and sha256 of vLLM's source distribution, from the index's JSON page."""
    request = urllib.request.Request(INDEX, headers={
        "Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        page = json.load(answer)
    name = f"vllm-{version}.tar.gz"
    for file in page.get("files", []):
        if file.get("filename") == name:
            return urllib.parse.urljoin(INDEX, file["url"]), file["hashes"]["sha256"]
    raise StageError(f"source: {name} is not on {INDEX}")


def onednn_tarball() -> Path:
    given = os.environ.get("TIDERL_ONEDNN_SRC")
    candidates = [Path(given)] if given else [REPO.parent / "shared" / "vendor" / ONEDNN_TARBALL]
    for path in candidates:
        if path.is_file():
            return path
    raise StageError(f"onednn: no {ONEDNN_TARBALL} at {candidates[0]} (set TIDERL_ONEDNN_SRC to "
                     "oneDNN v3.13's source tarball; the build cannot fetch it from GitHub here)")


def torch_cmake_config(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import torch, os; print(os.path.dirname("
                          "torch.__file__))"], capture_output=True, text=True)
    if out.returncode != 0:
        raise StageError("patch: torch does not import in the build's environment")
    return Path(out.stdout.strip()) / "share" / "cmake" / "Caffe2" / "Caffe2Config.cmake"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="run every stage again")
    parser.add_argument("--where", action="store_true",
                        help="print the cache folder (its venv/bin/vllm serves) and exit")
    args = parser.parse_args(argv)
    root = cache_root()
    if args.where:
        print(root)
        return 0
    build = Build(root)
    build.logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for name, stage in build.stages():
        mark = root / f".{name}.done"
        if mark.exists() and not args.force and name != "check":
            print(f"vllm-cpu: {name}: done before", flush=True)
            continue
        t0 = time.monotonic()
        print(f"vllm-cpu: {name} ...", flush=True)
        try:
            stage()
        except StageError as exc:
            print(f"vllm-cpu: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"vllm-cpu: {name}: {exc}", file=sys.stderr)
            return 1
        mark.touch()
        print(f"vllm-cpu: {name}: {time.monotonic() - t0:.0f} s", flush=True)
    print(f"vllm-cpu: vLLM {VLLM_VERSION} (CPU) ready in {root / 'venv'} "
          f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
