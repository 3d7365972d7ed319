"""The capacity planner's arithmetic (against hand-computed values) and the command line's tools."""

import json

import pytest

from helpers import make_config
from tieredkv.cli import main
from tieredkv.tools.plan import parse_bytes, plan, profile_activations


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9 and parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_plan_arithmetic_by_hand(llama_dir):
    # tiny llama: vocab 448, hidden 64, intermediate 128, 3 layers, 4 heads, 2 KV heads, head_dim 16, untied
    # weights: 2 * 448 * 64 (embedding, head) + 3 * (64*64*2 + 32*64*2 + 128*64*3 + 2*64) + 64 = 168,384 x 4 B
    p = plan(str(llama_dir), device="cuda", device_memory_bytes=100 << 20, memory_utilization=0.5, dtype="float32",
             activation_bytes=1 << 20, warm_bytes=10 << 20, cold_bytes=50 << 20, seq_len=100, shared_prompt_len=64)
    assert p.weight_bytes == 673_536
    assert p.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4 == 768 and p.kv_bytes_per_block == 12_288
    # on CUDA far blocks are staged a layer at a time, the next layer's read ahead: 4 layers' worth of the pool
    # stays free beside it
    assert p.hot_blocks == (52_428_800 - 673_536 - 1_048_576) * 3 // (3 + 4) // 12_288 == 1768
    assert p.staging_bytes == 4 * 1768 * 12_288 // 3
    assert p.warm_blocks == 10_485_760 // 12_288 == 853
    assert p.cold_blocks == 52_428_800 // 16_384 == 3200  # 12.3 KB entries take 4 pages on disk
    assert p.seqs_before_preemption == 1768 // 7 == 252  # 100 tokens: 7 blocks
    assert p.seqs_with_offload == (1768 + 853) // 7 == 374  # older blocks offloaded to warm
    assert p.longest_sequence == 2048  # max_model_len: hot + warm hold (1768 + 853) * 16 tokens
    no_warm = plan(str(llama_dir), device="cuda", device_memory_bytes=100 << 20, memory_utilization=0.5,
                   dtype="float32", activation_bytes=1 << 20, warm_bytes=0)
    assert no_warm.hot_blocks == (52_428_800 - 673_536 - 1_048_576) // 12_288 == 4126 and no_warm.staging_bytes == 0
    small = plan(str(llama_dir), device="cuda", device_memory_bytes=1 << 20, memory_utilization=1.0, dtype="float32",
                 activation_bytes=0, warm_bytes=20 * 12_288)
    assert (small.hot_blocks, small.longest_sequence) == (13, (13 + 20) * 16)  # (1 MiB - 673,536 B) * 3 / 7: 13
    assert p.shared_prompts == {"hot": 442, "warm": 213, "cold": 800}  # 64 tokens: 4 blocks
    assert p.tokens == {"hot": 1768 * 16, "warm": 853 * 16, "cold": 3200 * 16}


def test_plan_and_the_engine_agree_on_cpu(llama_dir):
    """One capacity function: what `plan` says for a CPU deployment is what the engine builds."""
    from tieredkv.engine.engine_core import EngineCore

    p = plan(str(llama_dir), device="cpu", cpu_kv_cache_bytes=3 << 20, warm_bytes=2 << 20)
    core = EngineCore(make_config(model=str(llama_dir), cpu_kv_cache_bytes=3 << 20, warm_bytes=2 << 20))
    assert (p.dtype, p.hot_blocks, p.warm_blocks) == ("float32", core.num_blocks, core.tiers.warm.capacity)
    assert p.hot_blocks == (3 << 20) // 12_288 == 256


def test_plan_cli_json_and_a_measured_dry_run(llama_dir, capsys):
    main(["plan", "--model", str(llama_dir), "--device", "cpu", "--device-memory", "100MiB", "--memory-utilization",
          "0.5", "--dtype", "float32", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes"] == 673_536 and out["measured"] is False
    main(["plan", "--model", str(llama_dir), "--device", "cpu", "--device-memory", "100MiB", "--dtype", "float32"])
    text = capsys.readouterr().out
    assert "sequences of 4,096 tokens" in text and "hot" in text and "estimated" in text
    assert profile_activations(str(llama_dir), "cpu", "float32", 512) > 0


def test_explain_cli(llama_dir, capsys):
    main(["explain", "The quick brown fox jumps over the lazy dog. " * 3, "--model", str(llama_dir), "--raw"])
    out = capsys.readouterr().out
    assert "never computed" in out and "prompt tokens would be served from the cache" in out


def test_cache_cli_export_import_inspect_clear(llama_dir, tmp_path, capsys):
    import asyncio

    from tieredkv import AsyncEngine, SamplingParams

    cold = str(tmp_path / "cold")

    async def fill():
        cfg = make_config(model=str(llama_dir), cold_path=cold, warm_bytes=0, num_blocks=64)
        async with await AsyncEngine.start(cfg) as engine:
            await engine.generate(list(range(3, 70)), SamplingParams(max_tokens=1))

    asyncio.run(fill())
    main(["cache", "inspect", "--cold-path", cold, "--model", str(llama_dir)])
    assert "fingerprints stored here: 1" in capsys.readouterr().out
    snap = str(tmp_path / "snap.tkv")
    main(["cache", "export", "--cold-path", cold, "--model", str(llama_dir), snap])  # options before FILE
    assert "exported 4 blocks" in capsys.readouterr().out
    main(["cache", "--cold-path", cold, "--model", str(llama_dir), "clear"])  # or before the action
    assert "removed 4 blocks" in capsys.readouterr().out
    main(["cache", "import", snap, "--cold-path", cold, "--model", str(llama_dir)])
    assert "imported 4 blocks (0 damaged skipped)" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["inspect", "clear", "export"])
def test_cache_cli_on_a_missing_folder_says_so_and_creates_nothing(tmp_path, action):
    missing = tmp_path / "no-such-folder"
    argv = ["cache", action, "--cold-path", str(missing)] + ([str(tmp_path / "out.tkv")] if action == "export" else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value) == f"cache {action}: there is no cold folder at {missing}"
    assert list(tmp_path.iterdir()) == []


def test_cache_cli_without_a_cold_path(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["cache", "inspect"])
    assert str(e.value) == "cache inspect: --cold-path is required"


def test_chat_cli_reports_cached_tokens_per_turn(llama_dir, monkeypatch, capsys):
    lines = iter(["Paged attention keeps keys", "and values in blocks"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    main(["chat", "--model", str(llama_dir), "--max-tokens", "4", "--system", "You are brief. " * 10])
    turns = [line for line in capsys.readouterr().out.splitlines() if "prompt tokens, cached" in line]
    assert len(turns) == 2 and "cached: none" in turns[0] and "hot" in turns[1]


def test_bench_plots(tmp_path):
    from tieredkv.tools.cli_tools import plot_results

    results = {"engine_tok_s": 100.0, "hf_static16_tok_s": 40.0, "hf_single_tok_s": 25.0, "ttft_cold_s": 1.2,
               "ttft_warm_s": 0.09}
    (path,) = plot_results(results, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_command_has_help(capsys):
    for command in ("demo", "generate", "chat", "serve", "plan", "explain", "cache", "bench"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
    assert "plan" in capsys.readouterr().out


def test_the_cpu_pool_is_sized_from_max_num_seqs_and_max_model_len(llama_dir):
    """Without cpu_kv_cache_bytes the CPU pool holds max_num_seqs sequences of max_model_len tokens (below
    the caps), in the plan and in the engine alike."""
    from tieredkv.engine.engine_core import EngineCore

    p = plan(str(llama_dir), device="cpu", max_num_seqs=4, max_len=256, warm_bytes=0)
    core = EngineCore(make_config(model=str(llama_dir), max_num_seqs=4, max_model_len=256, warm_bytes=0))
    assert p.hot_blocks == core.num_blocks == 4 * 256 // 16


def test_explain_and_the_cache_commands_never_compile_a_decode_graph(llama_dir, tmp_path, monkeypatch, capsys):
    """They never decode: a first start would otherwise compile the graph (minutes) only to close."""
    from tieredkv import AsyncEngine

    monkeypatch.setenv("TIEREDKV_COMPILE_DECODE", "1")  # as a user's environment may ask for every engine
    started = []
    real_start = AsyncEngine.start.__func__

    async def recording(cls, config=None, **kwargs):
        started.append(config.compile_decode)
        return await real_start(cls, config, **kwargs)

    monkeypatch.setattr(AsyncEngine, "start", classmethod(recording))
    cold = str(tmp_path / "cold")
    (tmp_path / "cold").mkdir()
    main(["cache", "inspect", "--cold-path", cold, "--model", str(llama_dir)])
    main(["explain", "--model", str(llama_dir), "--raw", "hello there"])
    assert started == [False, False]
    assert "prompt tokens would be served from the cache" in capsys.readouterr().out
