"""What engines change in their process (platform/process.py) comes back as it was; the processes that only run the
engine end without the interpreter's teardown."""

import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import make_config
from tieredkv.engine.engine_core import EngineCore
from tieredkv.platform.process import ProcessSettings


def test_the_switch_interval_comes_back_when_the_last_holder_leaves_in_any_order():
    """Two engines compiling at once lower the GIL's switch interval: the process's own value is back only once
    both are done, whichever ends first (each saved and restored its own: the first to end put 5 ms back under
    the other's compile, and the last left the process at 0.5 ms)."""
    settings, before = ProcessSettings(), sys.getswitchinterval()
    first, second = settings.switch_interval(before / 10), settings.switch_interval(before / 100)
    first.__enter__()
    assert sys.getswitchinterval() == before / 10
    second.__enter__()
    assert sys.getswitchinterval() == before / 10 and settings.holders("switch interval") == 2
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == before / 10
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before and settings.holders("switch interval") == 0


def test_torch_threads_stay_the_first_holders_and_come_back_after_the_last(caplog):
    settings, before = ProcessSettings(), torch.get_num_threads()
    first = settings.threads(before + 1)
    second = settings.threads(before + 2)  # another engine in the process: the first one's count stays
    assert torch.get_num_threads() == before + 1 and "stays" in caplog.text
    first.release()
    first.release()  # once only
    assert torch.get_num_threads() == before + 1 and settings.holders("torch threads") == 1
    second.release()
    assert torch.get_num_threads() == before


def test_an_engine_gives_the_process_its_thread_count_back_at_close(llama_dir):
    before = torch.get_num_threads()
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=16, warm_bytes=0, num_threads=before + 1))
    assert torch.get_num_threads() == before + 1
    core.close()
    assert torch.get_num_threads() == before


def test_an_exit_without_teardown_keeps_the_status_the_atexit_handlers_and_the_output(tmp_path):
    """exit_without_teardown (the core process, tensor-parallel ranks, the command line): the status given, the
    atexit handlers run and buffered output written; what the interpreter's teardown would do (an object's
    __del__ as the module's globals go) does not happen."""
    script = textwrap.dedent(f"""
        import atexit, sys
        from tieredkv.platform.process import exit_without_teardown

        class Teardown:
            def __del__(self):
                sys.stderr.write("torn down")

        kept = Teardown()
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
        sys.stdout.write("buffered")  # no newline, into a pipe: still in the buffer
        exit_without_teardown(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered", "")
    assert (tmp_path / "atexit").read_text() == "ran"


@pytest.mark.parametrize("ends, status, stderr", [(None, 0, ""), (SystemExit(), 0, ""), (SystemExit(2), 2, ""),
                                                  (SystemExit("tieredkv generate: no model"), 1,
                                                   "tieredkv generate: no model\n")])
def test_the_command_line_exits_with_mains_status(monkeypatch, capsys, ends, status, stderr):
    """`tieredkv` (cli.run) ends as sys.exit would have ended main: a number is the status, a message goes to
    stderr with status 1."""
    import tieredkv.cli as cli
    import tieredkv.platform.process as process

    class Exited(Exception):
        pass

    def main():
        if ends is not None:
            raise ends

    def exit_without_teardown(code):
        raise Exited(code)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(process, "exit_without_teardown", exit_without_teardown)
    with pytest.raises(Exited) as exited:
        cli.run()
    assert exited.value.args == (status,) and capsys.readouterr().err == stderr
