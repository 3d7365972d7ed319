"""What engines change in their process (platform/process.py) comes back as it was."""

import sys

import torch

from tieredkv import EngineConfig
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
    core = EngineCore(EngineConfig(model=str(llama_dir), num_blocks=16, warm_bytes=0, num_threads=before + 1))
    assert torch.get_num_threads() == before + 1
    core.close()
    assert torch.get_num_threads() == before
