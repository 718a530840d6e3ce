"""``megatron_spec.exit.exit_now``: the exit code, the threads that are not daemons, the atexit handlers and
buffered output survive the skipped finalisation."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_now_keeps_the_code_the_atexit_handlers_and_buffered_output(tmp_path):
    marker = tmp_path / "atexit.txt"
    code = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from megatron_spec.exit import exit_now
        atexit.register(lambda: open({str(marker)!r}, "a").write("atexit"))
        def late():  # a thread that is not a daemon: the interpreter would wait for it, and so must exit_now
            time.sleep(0.5)
            open({str(marker)!r}, "a").write("thread,")
        threading.Thread(target=late).start()
        sys.stdout.write("buffered out")  # no newline, not flushed: a pipe is block-buffered
        sys.stderr.write("buffered err")
        exit_now(3)
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered out" and proc.stderr.endswith("buffered err")
    assert marker.read_text() == "thread,atexit"
