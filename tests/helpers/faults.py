"""Fault injection for the reliability tests: damaged files, a full disk, the command line in a child."""

import os
import resource
import signal
import subprocess
import sys


def flip_byte(path, offset: int = -1) -> None:
    """Invert one byte of ``path`` in place (size kept; ``offset`` from the end when negative)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def _file_size_limit(max_bytes: int):
    """For ``preexec_fn``: files may not grow past ``max_bytes`` (a full disk, as a write sees it:
    EFBIG instead of the SIGXFSZ that would kill the process)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply


def run(argv: list, max_file_bytes: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``argv`` in a child process, optionally with its files limited to ``max_file_bytes``; output as text."""
    preexec = _file_size_limit(max_file_bytes) if max_file_bytes is not None else None
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)


def xlnet_fast(*args, max_file_bytes: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m xlnet_fast ARGS`` in a child process (see ``run``)."""
    return run([sys.executable, "-m", "xlnet_fast", *args], max_file_bytes, timeout)


def error_line(stderr: str) -> str:
    """The one line of a failed command on stderr (asserts there is one, no traceback)."""
    lines = [line for line in stderr.strip().splitlines() if line.startswith("xlnet-fast: error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]
