"""Run a command that gets SIGTERM when the process that started it dies (PR_SET_PDEATHSIG).

    python -I die_with_parent.py LAUNCHER_PID -- COMMAND [ARGS...]

The launcher used to set this in ``subprocess.Popen(preexec_fn=...)``, which runs Python in the
child between fork and exec. Python's docs warn that this can deadlock when the parent has threads
(a lock another thread held at fork time is never released in the child), and the launcher's
callers do (the e2e tests' client and observer threads): CI once saw a restarted encoder that
wrote not one line in 600 s. Here the setting is made after exec, in a plain process, which then
execs the command itself (same pid, same process group; the setting survives exec).

Standalone on purpose (stdlib only, run by path with ``-I``): nothing to import before the exec.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: die_with_parent.py LAUNCHER_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    launcher = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0:
        print(f"die_with_parent: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}",
              file=sys.stderr)
        return 1
    if os.getppid() != launcher:  # the launcher died before the setting was made: no signal will come
        print(f"die_with_parent: launcher {launcher} is gone, not starting {argv[2]}", file=sys.stderr)
        return 1
    os.execvp(argv[2], argv[2:])
    return 127  # not reached: execvp raises OSError on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
