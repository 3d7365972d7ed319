"""What engines change in their process (platform/process.py) comes back as it was."""


def test_process_settings_come_back_when_the_last_holder_leaves_in_any_order():
    """Two engines compiling at once lower the GIL's switch interval: the process's own value is back only once
    both are done, whichever ends first (each saved and restored its own: the first to end put 5 ms back under
    the other's compile, and the last left the process at 0.5 ms)."""
    import sys

    from tieredkv.platform.process import ProcessSettings

    settings, before = ProcessSettings(), sys.getswitchinterval()
    first, second = settings.switch_interval(before / 10), settings.switch_interval(before / 100)
    first.__enter__()
    assert sys.getswitchinterval() == before / 10
    second.__enter__()
    assert sys.getswitchinterval() == before / 10 and settings.holders("switch_interval") == 2
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == before / 10
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before and settings.holders("switch_interval") == 0
