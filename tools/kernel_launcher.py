"""Start the notebooks' IPython kernel, also on a machine that has no IP sockets.

tools/run_notebooks.py starts every kernel with this file in place of `-m
ipykernel_launcher` (same arguments, the kernelspec's interpreter). Whatever the transport,
ipykernel's IOPub thread binds a tcp://127.0.0.1 port for the output of forked
subprocesses. On a machine where socket(AF_INET) fails (the lent TPU's: EAFNOSUPPORT, and
getifaddrs with it), libzmq does not raise but aborts the kernel ("Address family not
supported by protocol (src/ip_resolver.cpp:542)") before it answers, and every notebook
fails with "Kernel died before replying to kernel_info". There this launcher skips that
bind and leaves ipykernel as it is when the bind fails, a case it handles: a forked
subprocess's prints are not relayed to the notebook (the notebooks' child processes are
spawned, not forked, and write to the kernel's own stderr). Elsewhere it changes nothing.
"""

from __future__ import annotations

import socket
import sys


def has_ip_sockets() -> bool:
    """Whether this machine lets a process open an IPv4 socket."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def _no_subprocess_pipe(thread) -> None:
    """`IOPubThread._setup_pipe_in` as ipykernel leaves it when its bind fails."""
    thread._pipe_flag = False


def main() -> None:
    from ipykernel import iostream, kernelapp

    if not has_ip_sockets():
        iostream.IOPubThread._setup_pipe_in = _no_subprocess_pipe
    kernelapp.launch_new_instance()


if __name__ == "__main__":
    # Like ipykernel_launcher: the kernel's imports must not see this script's folder
    # (tools/ holds modules, such as pins and mutate, that a notebook never imports).
    del sys.path[0]
    main()
