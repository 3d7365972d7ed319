"""The async engine does all its torch work on one worker thread (loading, steps, closing).

On CPU, a second thread starting torch parallel work gives libgomp a second thread pool and makes it
stop spin-waiting, which slows every step; see AsyncEngine.
"""

import threading

import torch

from helpers import make_config
from tieredkv import SamplingParams
from tieredkv.engine.engine_core import EngineCore


async def test_load_steps_and_close_run_on_the_worker_thread(engines, llama_dir, monkeypatch):
    seen: dict[str, set[int]] = {"init": set(), "step": set(), "close": set()}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            seen[name].add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(EngineCore, "__init__", recording("init", EngineCore.__init__))
    monkeypatch.setattr(EngineCore, "step", recording("step", EngineCore.step))
    monkeypatch.setattr(EngineCore, "close", recording("close", EngineCore.close))

    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=64))
    out = await engine.generate(list(range(3, 40)), SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5
    worker = await engine.run_in_worker(threading.get_ident)
    total = await engine.run_in_worker(lambda a, b: (a @ b).sum().item(), torch.ones(4, 3), torch.ones(3, 2))
    await engine.close()

    assert total == 24.0
    assert worker != threading.get_ident()
    assert seen == {"init": {worker}, "step": {worker}, "close": {worker}}


async def test_run_in_worker_raises_what_fn_raises_and_the_engine_keeps_serving(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64)) as engine:
        def boom():
            raise KeyError("nope")

        try:
            await engine.run_in_worker(boom)
        except KeyError as e:
            assert "nope" in str(e)
        else:
            raise AssertionError("no error")
        out = await engine.generate(list(range(3, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3



async def test_close_leaves_no_engine_thread_running(engines, llama_dir):
    import asyncio

    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=32))
    await engine.generate("Paged attention", SamplingParams(max_tokens=2))  # the tokenizer thread ran too
    await engine.close()
    assert not engine._worker.thread.is_alive()  # an engine thread alive at exit aborts the interpreter
    await asyncio.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name.startswith("tieredkv-") and t.is_alive()
                and not t.name.startswith("tieredkv-tokenize")]
