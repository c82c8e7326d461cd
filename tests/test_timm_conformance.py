"""timm's own model tests (``tests/test_models.py`` of the installed timm version, assertions
untouched) run on visattn's models.

The test file comes from timm's source distribution, fetched through the package registry with
``pip download timm==<installed> --no-deps --no-binary :all:`` and cached under ``.cache/timm-tests/``
(or ``$VISATTN_TIMM_TESTS_CACHE``); without it the test is skipped with the reason.
``tests/timm_conformance_plugin.py`` narrows its model lists to ``VISATTN_TIMM_MODELS``.

In ``make test`` this runs the two small ViT presets (about a minute on 2 cores);
``make timm-conformance`` sets ``VISATTN_TIMM_CONFORMANCE=full`` and runs every ``visattn_*`` model.
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import timm

REPO = Path(__file__).resolve().parent.parent
QUICK_MODELS = "visattn_vit_tiny_patch[24]_*"


def _cache_dir() -> Path:
    return Path(os.environ.get("VISATTN_TIMM_TESTS_CACHE", REPO / ".cache" / "timm-tests")) / timm.__version__


def timm_test_models_file() -> Path:
    """timm's tests/test_models.py for the installed version, downloaded once and cached; skips the
    calling test when the registry cannot provide it."""
    cache = _cache_dir()
    target = cache / "test_models.py"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"timm-{timm.__version__}.tar.gz"
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", f"timm=={timm.__version__}", "--no-deps",
               "--no-binary", ":all:", "-d", str(cache), "-q", "--timeout", "30", "--retries", "1"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"cannot download timm=={timm.__version__}'s source distribution: {err}")
        if done.returncode != 0 or not sdist.exists():
            pytest.skip(
                f"cannot download timm=={timm.__version__}'s source distribution (pip download: "
                f"{done.stderr.strip()[-300:]}); put it at {sdist} to run timm's model tests"
            )
    member = f"timm-{timm.__version__}/tests/test_models.py"
    with tarfile.open(sdist) as tar:
        try:
            data = tar.extractfile(member).read()
        except KeyError:
            pytest.skip(f"{sdist} has no {member}")
    target.write_bytes(data)
    return target


def run_timm_model_tests(models: str, timeout: int) -> subprocess.CompletedProcess:
    """Run timm's test_models.py narrowed to the fnmatch pattern ``models``."""
    test_file = timm_test_models_file()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        "VISATTN_TIMM_MODELS": models,
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-p", "timm_conformance_plugin", str(test_file), "-k", "visattn",
           "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore::pytest.PytestUnknownMarkWarning",
           "--rootdir", str(test_file.parent), "-o", "addopts="]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=test_file.parent)


def test_timm_model_tests_pass_for_visattn_models():
    full = os.environ.get("VISATTN_TIMM_CONFORMANCE") == "full"
    models = os.environ.get("VISATTN_TIMM_MODELS", "visattn_*" if full else QUICK_MODELS)
    done = run_timm_model_tests(models, timeout=3000 if full else 600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    print(f"timm {timm.__version__} tests/test_models.py on {models}: {summary}")
    assert done.returncode == 0, f"timm's model tests failed for {models}:\n{done.stdout[-6000:]}"
    assert " passed" in summary, summary
