"""Shared fixtures. Services are started by the tests that need them and stopped after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage_servers import gcs_endpoint, s3_endpoint  # noqa: F401  (session fixtures: moto S3, fake GCS)

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    """Tests use repo-relative paths (configs/, data/)."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect API server (temporary sqlite database) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
