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
- vLLM is installed without its dependency resolution (its wheel asks for ``torch==2.14.0+cpu``
  and a triton-cpu wheel from GitHub); its runtime requirements are installed beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
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
        """The compiler check lowered to the g++ that is here, and torch's CUDA CMake part
        replaced by an empty target (see the module's docstring)."""
        cmake = self.src / "cmake" / "cpu_extension.cmake"
        text = cmake.read_text()
        check = "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.{}"
        if check.format(3) in text:
            cmake.write_text(text.replace(check.format(3), check.format(2)))
        elif check.format(2) not in text:
            raise StageError(f"patch: {cmake.name} has no g++ 12.3 check to lower (vLLM changed)")
        config = torch_cmake_config(self.python)
        text = config.read_text()
        include = re.search(r'^\s*include\("\$\{CMAKE_CURRENT_LIST_DIR\}/public/cuda\.cmake"\)',
                            text, flags=re.MULTILINE)
        if include is None:
            if "tiderl: no CUDA" in text:
                return
            raise StageError(f"patch: {config} does not include public/cuda.cmake (torch changed)")
        config.write_text(text[:include.start()] + "\n  # tiderl: no CUDA on this machine; the CPU "
                          "extension links none of it\n  if(NOT TARGET torch::cudart)\n"
                          "    add_library(torch::cudart INTERFACE IMPORTED)\n  endif()"
                          + text[include.end():])

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
        self.pip("install", "--no-deps", "--force-reinstall", str(wheel))
        extra = RUNTIME_EXTRA if platform.machine() in ("x86_64", "AMD64") else RUNTIME_EXTRA[:1]
        self.pip("install", "-r", str(self.src / "requirements" / "common.txt"), *extra)

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
