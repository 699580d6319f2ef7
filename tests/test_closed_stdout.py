"""A script whose reader closes its output early (`python eval.py --list | head -n 1`) ends as a Unix
tool that SIGPIPE ends: no traceback, nothing on stderr, and exit status 141, what a shell reports for
such a tool (128 + SIGPIPE's 13; `set -o pipefail` reads it as it reads `yes | head`'s). Its files are
left as a kill at that point leaves them. configurator.run_main does it for every script's __main__,
whether Python buffers stdout (a pipe's default: the closed pipe is met when run_main flushes) or not
(PYTHONUNBUFFERED: met at the first print)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lib.training import configurator

REPO = Path(__file__).resolve().parents[1]
SIGPIPE_STATUS = 128 + signal.SIGPIPE  # 141

# Every script with a __main__, each ending in sys.exit(run_main(main))
SCRIPTS = ["train.py", "sample.py", "eval.py", "analyze.py", "prepare_data.py", "export_hf.py",
           "tools/bench.py", "tools/quant_frontier.py", "tools/plan.py", "tools/loss_table.py"]


def into_finished_head(command, buffered=True):
    """Run `python command` in the repository, its stdout piped into a `head -n 1` that has read its
    line and exited, as head has by the time a script that imports torch first prints: (what head
    printed, the command's exit status, its stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    head = subprocess.Popen(["head", "-n", "1"], stdin=read_end, stdout=subprocess.PIPE)
    os.close(read_end)  # head holds the only read end: when it exits, the pipe has no reader
    try:
        os.write(write_end, b"first line\n")
        printed = head.communicate()[0]
        result = subprocess.run([sys.executable, *command], stdout=write_end, stderr=subprocess.PIPE,
                                cwd=REPO, env=env, text=True)
    finally:
        os.close(write_end)
    return printed, result.returncode, result.stderr


def test_eval_list_into_head_ends_quietly():
    """The issue's case, a whole process: `python eval.py --list | head -n 1`."""
    assert into_finished_head(["eval.py", "--list"]) == (b"first line\n", SIGPIPE_STATUS, "")


@pytest.mark.parametrize("buffered", [True, False])
def test_a_main_printing_into_a_pipe_with_no_reader_ends_with_141(buffered, monkeypatch):
    """In the process, both ways Python meets the closed pipe: at run_main's flush (a pipe's default
    buffering) or at the print itself (line by line, as PYTHONUNBUFFERED)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader
    stream = os.fdopen(write_end, "w", buffering=-1 if buffered else 1)
    monkeypatch.setattr(sys, "stdout", stream)
    reached = []

    def main():
        print("a table's first line")
        reached.append("after the print")
        return 0

    try:
        assert configurator.run_main(main) == SIGPIPE_STATUS
        assert reached == (["after the print"] if buffered else [])
    finally:
        stream.close()  # its fd now /dev/null's (run_main): nothing left to break


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_ends_through_run_main(script):
    """The others print as these do (a progress line, a table, a sample): each goes through run_main."""
    assert (REPO / script).read_text().endswith('if __name__ == "__main__":\n    sys.exit(run_main(main))\n')


def test_a_broken_pipe_elsewhere_is_raised_as_it_is(monkeypatch):
    """Only stdout's reader gone is a quiet end: a pipe of main's own that breaks is its error."""
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w"))  # a pipe whose reader is there

    def main():
        raise BrokenPipeError(32, "Broken pipe")

    try:
        with pytest.raises(BrokenPipeError):
            configurator.run_main(main)
        assert configurator.run_main(lambda: 3) == 3
    finally:
        sys.stdout.close()
        os.close(read_end)
