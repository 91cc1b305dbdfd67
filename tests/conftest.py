"""Test configuration: the ``gpu`` and ``slow`` markers, hypothesis profiles, and the Triton interpreter on CPU."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be set before triton.jit runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("BIASATTN_SPREAD_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    # Long GPU runs on a machine of several GPUs: xdist worker n uses GPU n mod count ("cuda" = that GPU).
    torch.cuda.set_device(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % torch.cuda.device_count())

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=20, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"))


# Marked ``slow``: whole modules whose tests run the Triton interpreter or torch.compile (minutes on a
# CPU), and elsewhere the tests of the Triton operators (``test_triton_*``, or an ``op`` parameter
# naming one). ``python -m pytest -q -n auto`` runs them; ``-m "not slow"`` is the quick run.
SLOW_MODULES = frozenset({"test_triton.py", "test_splitk.py", "test_plans.py", "test_compile.py"})


def _is_slow(item) -> bool:
    if item.path.name in SLOW_MODULES or getattr(item, "originalname", item.name).startswith("test_triton"):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(p, str) and p.startswith("triton") for p in params.values())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _same_draws_in_any_order():
    """Seed torch's global generator before every test: its random inputs then do not depend on the tests its
    process ran before (xdist shares them out differently on every run), and a failure reruns alone."""
    torch.manual_seed(0)


@pytest.fixture
def attention_spy(monkeypatch):
    """``install(module)`` wraps ``module.attention`` and returns the list of biases it receives."""

    def install(module):
        seen = []
        real = module.attention

        def spy(q, k, v, bias=None, **kw):
            seen.append(bias)
            return real(q, k, v, bias, **kw)

        monkeypatch.setattr(module, "attention", spy)
        return seen

    return install


@pytest.fixture
def triton_options(monkeypatch):
    """Change the Triton launch options for the rest of a test: ``triton_options(fused_delta=False)``."""
    import dataclasses

    from biasattn.ops.triton import options

    def change(**changes):
        monkeypatch.setattr(options, "_current", dataclasses.replace(options.current(), **changes))

    return change
