import pytest

from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, dtype='fp32') -> directory of a synthetic checkpoint, built once per session."""
    built = {}

    def make(arch: str = "qwen3_moe", dtype: str = "fp32", **overrides) -> str:
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}") / "model"
            synthesize(str(out), {**preset_config("tiny", arch), **overrides}, dtype=dtype, seed=1)
            built[key] = str(out)
        return built[key]

    return make


@pytest.fixture(scope="module")
def no_proactive_reclaim():
    """For tests that count pages in the page cache or bytes read from disk: the kernel's idle-page reclaim
    (DAMON pageout, on these VMs) would evict pages, or the interpreter's own code, behind their back."""
    from weightstream.bench.reclaim import paused_proactive_reclaim

    with paused_proactive_reclaim():
        yield
