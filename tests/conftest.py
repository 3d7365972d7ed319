import os
import platform
import sys
import tempfile
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one of `make test`'s workers (one per core): one compute thread each, here and in the processes the
    # tests start, so the workers never oversubscribe the cores (OpenMP threads spin while they wait)
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton


def _patch_interpreter_once_per_launch() -> None:
    """Triton's interpreter (where the tests run the Triton kernels on CPU) patches triton.language into its
    interpreted self at every call of a device function, tl.sum and tl.max among them: a scan of the language's
    modules, ~2 ms a call, half of an int4 store's time. Within one launch the second such patch of the same
    modules changes nothing (what the first set stays set until the launch's end restores the language), so it
    is skipped until then. Where Triton's internals differ (another version), the interpreter runs as it is."""
    try:
        from triton.runtime import interpreter as ti

        patch, scope_type, lang = ti._patch_lang, ti._LangPatchScope, (ti.tl, ti.tl.core)
    except (ImportError, AttributeError):
        return
    patched: dict[tuple, object] = {}  # the language modules a function sees -> the scope that patched them
    restore = scope_type.restore

    def patch_once(fn):
        key = tuple(id(v) for v in fn.__globals__.values() if isinstance(v, type(os)) and v in lang)
        if key not in patched:
            patched[key] = patch(fn)
        return patched[key]

    def restore_all(self):
        patched.clear()  # a launch's end: the next patch is done again
        restore(self)

    ti._patch_lang, scope_type.restore = patch_once, restore_all


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_once_per_launch()

# helpers.py, memory_tier.py, and every layer's folder: a test module may import another's fixtures and workloads
# (tests/engine/test_fault_isolation.py the server thread of tests/serve/test_serve_hardening.py), whichever of them
# pytest collects first
for folder in (".", "cache", "kernels", "engine", "serve"):
    sys.path.insert(0, str(Path(__file__).parent / folder))

from helpers import make_checkpoint  # noqa: E402
from tieredkv.kernels.quant_cpu import NATIVE  # noqa: E402
from tieredkv.platform.cpu_features import cpu_info  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The command-line tools the tests start (`tieredkv serve`, `generate`) run the eager forward unless a test asks
# for the compiled path: they read it from the environment (EngineConfig.from_env). The tests' own engines take
# their defaults from helpers.make_config.
os.environ.setdefault("TIEREDKV_COMPILE_DECODE", "0")
# the cold tier's key file lives under XDG_CONFIG_HOME: keep the tests' key out of the user's home
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tieredkv-test-config-")


# builds of the CPU kernels (kernels/quant_cpu.py) the kernel tests run on
CPU_KERNEL_BUILDS = {"native": NATIVE}
if platform.machine() in ("x86_64", "AMD64"):
    if cpu_info().has("avx512f"):  # native runs the 512-bit paths; the 256-bit ones are what AVX2 runs
        CPU_KERNEL_BUILDS["avx2"] = ("-march=haswell",)
    CPU_KERNEL_BUILDS["no-avx2"] = ("-march=x86-64",)  # the plain-C branches every other processor runs


# The files that take longest, longest first: `make test` hands files to its workers in collection order
# (--no-loadscope-reorder; pytest-xdist's own order puts files with few tests last, and the Triton targets' single
# test, 50 s with empty caches, then ran alone at the end). Measured on 2 cores with empty caches (AMD EPYC Zen 4,
# seconds: 60, 53, 45, 38, 35, 31, 24, 22; the builds of the CPU kernels, Triton's and inductor's compiles among
# them); the other files follow in collection order, the short ones filling the workers' ends.
LONGEST_FIRST = ("kernels/test_quant.py", "kernels/test_kernel_resources.py", "kernels/test_compiled_decode.py",
                 "engine/test_default_model.py", "engine/test_core_process.py", "serve/test_tools.py",
                 "engine/test_engine_matches_hf.py", "engine/test_lora.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).parent
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(tests).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def kernel_cache() -> Path:
    """The cache the run's CPU kernel builds live in: the default one, where the engines the tests start build
    and find theirs (helpers.fresh_cache links it into the fresh caches some tests use). Each build is compiled
    once, by whichever of the run's processes asks first (the others wait on the build's lock, then load it)."""
    from tieredkv.cache_dir import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="module", params=list(CPU_KERNEL_BUILDS))
def lib(request, kernel_cache):
    """One build of the CPU kernels serving the module's tests (kernels/quant.py's ops and the C++ operators)."""
    from tieredkv.kernels.quant_cpu import CPU
    from tieredkv.kernels.quant_cpu import library_path, load

    built = load(kernel_cache, CPU_KERNEL_BUILDS[request.param])
    assert built is not None and library_path(kernel_cache, CPU_KERNEL_BUILDS[request.param]).exists()
    before = CPU.lib
    CPU.serve_with(built, kernel_cache)  # the C++ operators run this build's kernels too
    assert CPU.operators_bound
    yield request.param
    CPU.serve_with(before, kernel_cache)


@pytest.fixture(scope="session")
def engines():
    """The run's engine factory (helpers.Engines): new engines over weights each worker loads once per form."""
    from helpers import Engines

    factory = Engines()
    yield factory
    factory.weights.clear()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def llama2_dir(tmp_path_factory) -> Path:
    """Two layers, for the engine tests that run the Triton kernels under the interpreter (seconds a layer):
    every layer runs the same kernels, and a second one still checks each reads its own layer's cache."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama-2"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory):
    """One Valkey server for the session's remote-tier tests (each uses a namespace of its own: another
    model fingerprint). 64 MiB, least recently used keys evicted when full, as a cache server runs."""
    from tieredkv.tools.local_valkey import LocalValkey

    server = LocalValkey(tmp_path_factory.mktemp("valkey"), maxmemory="64mb",
                         maxmemory_policy="allkeys-lru").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory):
    """A one-node Valkey cluster (every hash slot on one node): the cluster client's path, on one machine."""
    import time

    import valkey

    from tieredkv.tools.local_valkey import LocalValkey

    folder = tmp_path_factory.mktemp("valkey-cluster")
    server = LocalValkey(folder, cluster_enabled="yes", cluster_config_file=folder / "nodes.conf", maxmemory="64mb",
                         maxmemory_policy="allkeys-lru").start()
    with valkey.Valkey.from_url(server.url) as client:
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 30
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.05)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fleet_key(tmp_path_factory):
    """The secret every engine of the session's remote-tier tests shares, as a fleet's replicas do."""
    return tmp_path_factory.mktemp("fleet") / "fleet.key"
