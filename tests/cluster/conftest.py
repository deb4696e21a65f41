"""One local Ray runtime per test session, shared by every cluster test.

Ray workers import the tiny-engine builder by module name, so the test helper
folders go on their PYTHONPATH as well as this process's sys.path.
"""

import os
import sys
from pathlib import Path

import pytest

HELPERS = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "engine"),
           str(Path(__file__).parent.parent / "server")]
sys.path[:0] = [p for p in HELPERS if p not in sys.path]


@pytest.fixture(scope="session")
def ray_runtime():
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        HELPERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local test runtime, no token file
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()
