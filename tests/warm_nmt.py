"""A warm `nmt` for the recipe rehearsals: one server process imports PyTorch and the toolkit once, then forks a
child per command, so that each of a rehearsal's `nmt` calls skips the ~4 s import (2 cores).

    python tests/warm_nmt.py serve SOCKET      # the server (tests start it: the `warm_nmt` fixture)
    python tests/warm_nmt.py SOCKET ARGS...    # an `nmt ARGS...` run by the server; what make's NMT= names

The client imports only the standard library. It hands the server its argument list, working directory,
environment and its stdin/stdout/stderr file descriptors, so the child reads and writes exactly where a real
`nmt` process would; the client exits with the child's exit code and passes SIGINT/SIGTERM on to it. The
server never runs an operator itself (forking a process whose OpenMP pool has started is unsafe), and a child
starts with the garbage collector off, as the console script does. The real console script is still what the
README's main recipe and the other tests run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!I")
STATUS = struct.Struct("!i")


def _receive_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
    return data


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: take over the client's stdio, directory and environment, run `nmt`, report the code."""
    import gc

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = open(0, encoding="utf-8", errors="strict", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1 if os.isatty(1) else -1)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
    sys.argv = ["nmt", *request["args"]]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conn.sendall(STATUS.pack(os.getpid()))
    from nmt_cli.cli.main import main

    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does in a real process: print it, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    try:
        conn.sendall(STATUS.pack(code))
    finally:
        os._exit(code)


def serve(path: str) -> None:
    """Import the toolkit, then fork a child for each request on the Unix socket at `path`, forever."""
    import gc

    import nmt_cli.cli.main  # noqa: F401
    import nmt_cli.data.prepare  # noqa: F401
    import nmt_cli.decode.score  # noqa: F401
    import nmt_cli.decode.search  # noqa: F401
    import nmt_cli.decode.translate  # noqa: F401
    import nmt_cli.model.checkpoint  # noqa: F401
    import nmt_cli.training.trainer  # noqa: F401

    gc.collect()
    gc.freeze()  # children share the imported objects' pages instead of copying them at their first collection
    gc.disable()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            (length,) = HEADER.unpack(header)
            request = json.loads(_receive_exactly(conn, length))
        except (ConnectionError, OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            server.close()
            _run_child(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def client(path: str, args: list[str]) -> int:
    """Run `nmt args` in the server at `path` with this process's stdio, directory and environment."""
    request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [HEADER.pack(len(request))], [0, 1, 2])
    conn.sendall(request)
    (pid,) = STATUS.unpack(_receive_exactly(conn, STATUS.size))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: os.kill(pid, number))
    try:
        (code,) = STATUS.unpack(_receive_exactly(conn, STATUS.size))
    except ConnectionError:  # killed by a signal before it could say
        return 1
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
