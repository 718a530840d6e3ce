"""Leaving a process quickly.

Python's finalisation tears down every module and ends with garbage collections over every object
still alive: after importing torch, megatron-core and transformers that is millions of objects, and it
took 1.1 s (torch alone) to 2-5 s (a GRPO rank, an engine process) on a shared 2-core machine, time a
run's ranks, its engine processes and torchrun wait for one another at the end of every run. (Freezing
the heap instead, ``gc.freeze``, leaves triton's nanobind objects alive, and nanobind then prints a page
of "leaked instance" lines.)

:func:`exit_now` is what a process's ``__main__`` block calls with the code its main function
returned: as at a normal exit, it waits for the threads that are not daemons, then the ``atexit``
handlers run (logging's flush, multiprocessing's and weakref finalizers' clean-up, inductor's worker
pool), then standard output and error are flushed, then ``os._exit``.
Nothing is lost: this project closes its files, pipes, shared memory, engines and process groups
explicitly before its main functions return, and a main function that raises still exits the usual way
(with its traceback). Never call it from library code or in a process that may have more to do.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None = 0) -> NoReturn:
    """Wait for the non-daemon threads, run the ``atexit`` handlers, flush stdout and stderr, and end the
    process with ``code`` (None: 0) without the interpreter's finalisation (see the module docstring)."""
    try:
        main = threading.main_thread()
        for t in threading.enumerate():  # what the interpreter waits for before its atexit handlers
            if t is not main and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed or replaced
                pass
        os._exit(0 if code is None else int(code))


__all__ = ["exit_now"]
